"""Accelerate's gradient-accumulation loop with AccumulatingOptimizer.

What Accelerate (1.x) does, and why the recipe is ``accumulation_steps=None, reduction="sum"``:

* ``accelerator.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` itself, so
  the native fp32 ``.grad`` holds the mean of the N micro-batch losses' gradients: the wrapper
  must only sum, i.e. ``reduction="sum"``.
* ``accelerator.prepare(opt)`` wraps the optimizer in ``AcceleratedOptimizer``, whose ``step()``
  and ``zero_grad()`` only reach the wrapped optimizer when ``sync_gradients`` is set (it
  round-trips ``state_dict()``/``load_state_dict()`` once for device placement, too). So every
  ``step()`` the wrapper receives ends a window, the short one at the end of the dataloader
  included: ``accumulation_steps=None``. The wrapper reads none of Accelerate's state.
* ``accelerator.clip_grad_norm_(model.parameters(), ...)`` runs on the sync micro-batch before
  ``step()``; ``p.grad`` is the running fp32 window after every backward, so it sees the window.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _integration_common import (
    LR,
    MAX_GRAD_NORM,
    N_ACCUM,
    assert_moved,
    assert_same_params,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    linear_decay,
    loader,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer

pytest.importorskip("accelerate")
pytestmark = pytest.mark.usefixtures("fresh_accelerate_state")

MICRO_BATCH = 2


def train_with_accelerate(model, samples, *, wrap: bool, epochs: int = 1,
                          accumulation_steps: int | None = None):
    """The loop from Accelerate's gradient-accumulation guide. Returns (clip norms, optimizer)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=N_ACCUM, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, reduction="sum")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(8))
    model, prepared_opt, dataloader, scheduler = accelerator.prepare(
        model, opt, loader(samples, MICRO_BATCH), scheduler)
    norms = []
    model.train()
    for _ in range(epochs):
        for batch in dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                    norms.append(norm.item())
                prepared_opt.step()
                scheduler.step()
                prepared_opt.zero_grad()
    return norms, opt


def test_accelerate_matches_native():
    samples = token_batches(3 * N_ACCUM * MICRO_BATCH)  # 3 full windows
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)

    native_norms, _ = train_with_accelerate(native, samples, wrap=False)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True)

    assert len(native_norms) == 3
    assert all(n > MAX_GRAD_NORM for n in native_norms), native_norms  # clipping took effect
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert opt.micro_steps == 0 and opt.skipped_steps == 0
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_moved(ours, start)
    assert_same_params(native, ours)


@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_accelerate_short_last_window_matches_native(accumulation_steps):
    """10 micro-batches per epoch, N=4: windows 4, 4, 2 in each of two epochs; Accelerate syncs
    (clips and steps) the short one at the end of the dataloader, and so must the wrapper.
    (Fixed in 7f38bc6: the step() used to be a no-op and the next epoch's backward raised.)"""
    samples = token_batches(10 * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_norms, _ = train_with_accelerate(native, samples, wrap=False, epochs=2)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True, epochs=2,
                                           accumulation_steps=accumulation_steps)
    assert len(native_norms) == 6
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert all(s["step"].item() == 6 for s in opt.state.values())
    assert_same_params(native, ours)


@pytest.mark.parametrize("per_epoch", [2, 1])
def test_accelerate_epoch_shorter_than_window(per_epoch):
    """Every window is the short end-of-dataloader one, the very first window included.
    (Fixed in 0176121 for one micro-batch per epoch: sync_gradients is then never False, and the
    wrapper used to wait for N micro-batches, so no step and no .grad for the clip.)"""
    samples = token_batches(per_epoch * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_norms, _ = train_with_accelerate(native, samples, wrap=False, epochs=3)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True, epochs=3)
    assert len(native_norms) == 3
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_same_params(native, ours)
