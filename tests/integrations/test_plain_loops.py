"""Plain PyTorch loops with AccumulatingOptimizer on a tiny GPT-2 vs the stock-AdamW loop (the
README's manual recipes). Patterns from real projects (nanoGPT, PEFT, gradient checkpointing,
Lightning manual optimization): test_real_projects.py.

The native reference is the textbook loop: ``(loss / N).backward()`` every micro-batch, then
``clip_grad_norm_``, ``step()``, scheduler, ``zero_grad()`` every N. The wrapper runs the same
loop body either Trainer-style (step only at boundaries) or Accelerate-style (``step()`` and
``zero_grad()`` every micro-batch; it steps when the window is full).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _integrations_common import (
    LR,
    MAX_GRAD_NORM,
    N_ACCUM,
    assert_moved,
    assert_same_params,
    linear_decay,
    loader,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer

MICRO_BATCH = 2


def batches(samples):
    return list(loader(samples, MICRO_BATCH))


def clip(model) -> float:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM).item()


def native_loop(model, micro_batches):
    """Stock AdamW, loss / N, step + clip + scheduler + zero_grad every N. Returns the norms."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(8))
    norms = []
    for i, batch in enumerate(micro_batches):
        (model(**batch).loss / N_ACCUM).backward()
        if (i + 1) % N_ACCUM == 0:
            norms.append(clip(model))
            opt.step()
            scheduler.step()
            opt.zero_grad()
    return norms


@pytest.mark.parametrize("style, accumulate_in_backward", [
    pytest.param("trainer", True, id="trainer-in_backward"),
    pytest.param("accelerate", True, id="accelerate-in_backward"),
    pytest.param("trainer", False, id="trainer-at_step"),
    # Fixed in 7f38bc6: p.grad used to hold only the N-th micro-batch's gradient here (the
    # earlier ones had been moved by the earlier step() calls), so the clip saw the wrong one.
    pytest.param("accelerate", False, id="accelerate-at_step"),
])
def test_plain_loop_matches_native(style, accumulate_in_backward):
    micro_batches = batches(token_batches(3 * N_ACCUM * MICRO_BATCH))
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_norms = native_loop(native, micro_batches)

    opt = AccumulatingOptimizer(torch.optim.AdamW(ours.parameters(), lr=LR),
                                accumulation_steps=N_ACCUM, reduction="sum",
                                accumulate_in_backward=accumulate_in_backward)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(8))
    norms = []
    for i, batch in enumerate(micro_batches):
        (ours(**batch).loss / N_ACCUM).backward()  # unchanged from the native loop
        if style == "trainer":
            if (i + 1) % N_ACCUM == 0:
                norms.append(clip(ours))
                opt.step()
                scheduler.step()
                opt.zero_grad()
        else:
            boundary = opt.sync_step  # True right after the N-th backward
            assert boundary == ((i + 1) % N_ACCUM == 0)
            if boundary:
                norms.append(clip(ours))
            opt.step()  # a no-op until the window is full
            opt.zero_grad()  # never clears the window
            if boundary:
                scheduler.step()

    assert all(n > MAX_GRAD_NORM for n in native_norms), native_norms  # clipping took effect
    assert norms == pytest.approx(native_norms, rel=1e-6)
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_moved(ours, start)
    assert_same_params(native, ours)


def test_plain_mean_reduction_short_last_window():
    """reduction="mean" on the raw loss (no / N), 10 micro-batches with N=4, flush() at the end:
    windows 4, 4, 2 normalised by 1/4, 1/4, 1/2 -- what a native loop gets only by dividing by
    the true window length (which ``loss / N`` gets wrong for the last one). The scales are
    powers of two, exact in fp32 wherever they are applied: tight tolerance."""
    micro_batches = batches(token_batches(10 * MICRO_BATCH))
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)

    opt = torch.optim.AdamW(native.parameters(), lr=LR)
    for w in range(0, 10, N_ACCUM):
        window = micro_batches[w:w + N_ACCUM]
        for batch in window:
            (native(**batch).loss / len(window)).backward()
        opt.step()
        opt.zero_grad()

    opt = AccumulatingOptimizer(torch.optim.AdamW(ours.parameters(), lr=LR),
                                accumulation_steps=N_ACCUM, reduction="mean")
    for batch in micro_batches:
        ours(**batch).loss.backward()
        opt.step()
        opt.zero_grad()  # kept mid-window (N given)
    assert opt.micro_steps == 2
    opt.flush()
    assert opt.micro_steps == 0
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_moved(ours, start)
    assert_same_params(native, ours)


def summed_token_loss(model, batch):
    """Sum (not mean) of the next-token cross-entropies, and how many tokens it sums over."""
    logits = model(input_ids=batch["input_ids"]).logits[:, :-1]
    labels = batch["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def test_plain_weighted_reduction_is_per_token_mean():
    """reduction="weighted" with summed losses and add_weight(n_tokens): the window's gradient is
    the exact per-token mean over all its micro-batches, whatever their token counts -- the
    native loop gets this only by knowing the window's token total up front (HF Trainer's
    num_items_in_batch), while the common ``mean_loss / N`` weights tokens unequally.

    Tolerance: the two runs round differently (native scales every micro-batch's backward by
    1/T, the wrapper sums unscaled gradients and multiplies by 1/T once): a few fp32 ulps of the
    largest contributions per gradient element, |dg| <~ 1e-8 here (gradients <= ~0.4), which is
    large *relative* to elements whose window sum cancels to near zero. AdamW's first update
    g/(|g|+eps) has slope <= 1/eps in g, so with the default eps=1e-8 such an element's update
    can change by up to lr (observed: 2e-5 after two steps). eps=1e-4 in both runs bounds it by
    lr * |dg| / eps <= 1e-2 * 1e-8 / 1e-4 = 1e-6 per step (observed 4e-7): the usual 1e-5 holds.
    """
    eps = 1e-4
    micro_batches = batches(token_batches(2 * N_ACCUM * MICRO_BATCH, pad_fraction=0.6))
    start = tiny_gpt2()
    native, ours, naive = copy.deepcopy(start), copy.deepcopy(start), copy.deepcopy(start)

    opt = torch.optim.AdamW(native.parameters(), lr=LR, eps=eps)
    naive_opt = torch.optim.AdamW(naive.parameters(), lr=LR, eps=eps)
    for w in range(0, len(micro_batches), N_ACCUM):
        window = micro_batches[w:w + N_ACCUM]
        counts = [summed_token_loss(native, b)[1] for b in window]
        assert len(set(counts)) > 1  # the token counts really differ
        for batch in window:
            loss, _ = summed_token_loss(native, batch)
            (loss / sum(counts)).backward()
            naive_loss, n = summed_token_loss(naive, batch)
            (naive_loss / n / N_ACCUM).backward()
        for o in (opt, naive_opt):
            o.step()
            o.zero_grad()

    opt = AccumulatingOptimizer(torch.optim.AdamW(ours.parameters(), lr=LR, eps=eps),
                                accumulation_steps=N_ACCUM, reduction="weighted")
    for batch in micro_batches:
        loss, n_tokens = summed_token_loss(ours, batch)
        loss.backward()
        opt.add_weight(n_tokens)
        opt.step()
        opt.zero_grad()  # kept mid-window (N given)

    assert_moved(ours, start)
    assert_same_params(native, ours)
    # The test can tell the per-token mean from the mean of per-micro-batch means.
    with pytest.raises(AssertionError):
        assert_same_params(naive, ours, atol=100 * 1e-5)
