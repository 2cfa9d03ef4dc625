"""Non-finite windows (DESIGN: "nonfinite"): ``"skip_step"`` drops the whole window,
``"skip_microbatch"`` only the bad micro-batch (the rest of the window survives, ``"mean"``
divides by the kept ones), ``"raise"`` names the bad param; a window whose fp32 sum overflows
while every micro-batch is finite, or that overflows the param dtype on its way to the
optimizer, never reaches the weights. Where the step finds a non-finite value after writes to
the window: test_step_finiteness.py, test_step_measures.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    total_rel_err,
    wrap_sgd,
)
from torch import nn

from accumkernels import AccumulatingOptimizer

# -- the policies ----------------------------------------------------------------------------------


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("poison", ["nan_loss", "inf_input"])
def test_skip_step_drops_the_window(poison, in_backward):
    N, bad = 4, 2
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=N, accumulate_in_backward=in_backward,
                                bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        if i == bad and poison == "inf_input":
            x[1, 3] = math.inf
        loss = mse(model, x, y)
        (loss * math.nan if i == bad and poison == "nan_loss" else loss).backward()
        opt.step()
    assert opt.skipped_steps == 1 and opt.micro_steps == 0
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    assert not opt.optimizer.state  # the inner optimizer never ran
    for x, y in batches(N, 4):  # the next window is a normal one
        mse(model, x, y).backward()
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
def test_skip_microbatch_keeps_the_rest_of_the_window(reduction, in_backward):
    N, bad, lr = 4, 1, 0.1
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                reduction=reduction, nonfinite="skip_microbatch",
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    weights = [float(w) for w in torch.randint(1, 9, (N,))]
    caps, handles = capture_grads(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        if reduction == "weighted":
            opt.add_weight(weights[i])
        loss = mse(model, x, y)
        (loss * math.nan if i == bad else loss).backward()
        if not in_backward:
            opt.accumulate()
    for h in handles:
        h.remove()
    assert opt.sync_step  # the dropped micro-batch still counts toward N
    assert opt.skipped_microbatches == 1
    kept = [i for i in range(N) if i != bad]
    divisor = {"mean": len(kept), "sum": 1, "weighted": sum(weights[i] for i in kept)}[reduction]
    names = [n for n, _ in model.named_parameters()]
    ref = [sum(caps[n][i].double() for i in kept) / divisor for n in names]
    # fp32 sum of 3 fp32 grads vs float64: relative ~1e-7.
    assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
    opt.step()
    assert opt.skipped_steps == 0
    for p, s, r in zip(model.parameters(), start, ref):
        torch.testing.assert_close(p.double(), s.double() - lr * r, rtol=0, atol=1e-6)


def test_skip_microbatch_all_dropped_skips_the_step():
    N = 2
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=N, nonfinite="skip_microbatch", reduction="mean")
    start = params_of(model)
    for x, y in batches(N, 4):
        (mse(model, x, y) * math.nan).backward()
    opt.step()
    assert opt.skipped_microbatches == N and opt.skipped_steps == 1
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


@pytest.mark.parametrize("with_model", [True, False])
def test_raise_names_the_bad_param(with_model):
    model = Named()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2,
                                nonfinite="raise", model=model if with_model else None)
    x = torch.randn(4, 6)
    model(x).square().mean().backward()
    # Only head.bias receives a NaN (the extra term's gradient reaches nothing else).
    (model(x).square().mean() + model.head.bias.sum() * math.nan).backward()
    expected = "head.bias" if with_model else "parameter"  # no names without model=
    with pytest.raises(FloatingPointError, match=expected):
        opt.step()


# -- overflow never reaches the weights ------------------------------------------------------------


def _overflow_setup(case, nonfinite):
    """nn.Linear(4, 4), batch of 1, loss = K * sum(out): every micro-batch's gradient is finite
    (weight: K * x with x in [0.6, 1), bias: K), the fp32 result of the window is not."""
    model = nn.Linear(4, 4)
    kw = {"accumulation_steps": 2, "nonfinite": nonfinite, "bucket_size_mb": 25}
    if case == "weighted-normalisation":
        # Sum of two grads <= 2e38 is finite; divided by the reported weights (2e-3) it is 1e41.
        return model, 1e38, [1e-3, 1e-3], dict(kw, reduction="weighted")
    # Two grads in [1.8e38, 3e38]: their fp32 sum is inf.
    return model, 3e38, None, dict(kw, accumulate_in_backward=(case == "sum-hooks"))


@pytest.mark.parametrize("nonfinite", ["skip_step", "raise", "skip_microbatch"])
@pytest.mark.parametrize("case", ["sum-hooks", "sum-accumulate", "weighted-normalisation"])
def test_fp32_overflow_of_the_window_never_reaches_the_weights(case, nonfinite):
    model, K, weights, kw = _overflow_setup(case, nonfinite)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    start = params_of(model)
    native = copy.deepcopy(model)
    caps = []
    handles = [p.register_hook(lambda g: caps.append(g.detach().clone()))
               for p in model.parameters()]
    xs = [torch.empty(1, 4).uniform_(0.6, 1.0) for _ in range(2)]
    for i, x in enumerate(xs):
        if weights:
            opt.add_weight(weights[i])
        (model(x).sum() * K).backward()
        (native(x).sum() * K).backward()
    for h in handles:
        h.remove()
    assert caps and all(torch.isfinite(g).all() for g in caps)  # each micro-batch is finite ...
    if weights is None:  # ... and their fp32 sum is not (native accumulation overflows too)
        assert not all(torch.isfinite(p.grad).all() for p in native.parameters())
    if nonfinite == "raise":
        with pytest.raises(FloatingPointError):
            opt.step()
    else:
        opt.step()
    for p, s in zip(model.parameters(), start):
        assert torch.isfinite(p).all(), "an overflowed window reached the weights"
        if nonfinite != "skip_microbatch":  # which micro-batch to drop is the wrapper's choice
            assert torch.equal(p, s), "the step of an overflowed window was not skipped"
    if nonfinite == "skip_step":
        assert opt.skipped_steps == 1
    if nonfinite == "skip_microbatch":
        assert opt.skipped_steps + opt.skipped_microbatches >= 1
    if nonfinite == "raise":
        opt.reset_window()
    # A healthy window afterwards trains.
    for x in xs:
        if weights:
            opt.add_weight(1.0)
        model(x).square().mean().backward()
    opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))


def test_fp16_window_that_overflows_the_param_dtype_is_skipped():
    """master_weights=False hands fp16 grads to the optimizer: a finite fp32 window of 120000
    casts to inf; skip_step must catch the cast, never write -inf into the params."""
    model = nn.Linear(2, 1).half()
    start = [p.detach().clone() for p in model.parameters()]
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=1e-9),
                                master_weights=False)
    for _ in range(2):
        (model(torch.ones(1, 2, dtype=torch.half)).sum() * 60000).backward()
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=1e-9),
                                master_weights=False, nonfinite="raise")
    for _ in range(2):
        (model(torch.ones(1, 2, dtype=torch.half)).sum() * 60000).backward()
    with pytest.raises(FloatingPointError):
        opt.step()


@pytest.mark.parametrize("wrap", ["inner", "by-name"])
def test_fp16_window_overflowing_at_hand_over_fires_no_step_hooks(wrap):
    """fp16, ``master_weights=False``: a finite fp32 window that overflows fp16 when handed to
    the optimizer is a dropped step, and a dropped step is no step: natively (GradScaler finds
    the inf and never calls ``optimizer.step()``) no step hook runs, so an EMA or a scheduler
    hung on them counts nothing. Checked: the wrapper's, the inner optimizer's and the global
    step hooks, the inner state, and a healthy one-micro-batch window afterwards against the
    native fp16 step (one fp16 gradient: the fp32 sum casts back exactly, bit for bit)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    big = float(torch.randint(40000, 65000, ()).item())  # x2 micro-batches: > fp16's 65504
    x_ok = torch.randn(3, 2).half()

    def train(wrapped: bool):
        torch.manual_seed(0)
        model = nn.Linear(2, 1).half()
        if not wrapped:
            opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        elif wrap == "inner":
            opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3,
                                                        momentum=0.9), master_weights=False)
        else:
            from accumkernels.optimizers import SGD
            opt = SGD(model.parameters(), lr=1e-3, momentum=0.9, master_weights=False)
        inner = getattr(opt, "optimizer", opt)
        log: list = []
        handles = [opt.register_step_pre_hook(lambda o, a, k: log.append("pre")),
                   opt.register_step_post_hook(lambda o, a, k: log.append("post")),
                   register_optimizer_step_pre_hook(lambda o, a, k: log.append("global-pre")),
                   register_optimizer_step_post_hook(lambda o, a, k: log.append("global-post"))]
        if wrapped:  # the inner optimizer's own hook: once, for the healthy window only
            handles.append(inner.register_step_pre_hook(lambda o, a, k: log.append("inner")))
        try:
            if wrapped:  # the overflowing window: dropped (natively: found by hand, no step)
                for _ in range(2):
                    (model(torch.ones(1, 2, dtype=torch.half)).sum() * big).backward()
                opt.step()
                opt.zero_grad()
                assert opt.skipped_steps == 1
                assert log == [] and inner.state == {}
            model(x_ok).square().mean().backward()  # a healthy window of one micro-batch
            opt.step()
            opt.zero_grad()
        finally:
            for h in handles:
                h.remove()
        return model, log

    (model, log), (ref, native_log) = train(True), train(False)
    assert native_log == ["global-pre", "pre", "post", "global-post"]
    assert [e for e in log if e != "inner"] == native_log and log.count("inner") == 1
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("accumulation_steps", [None, 3], ids=["N-None", "N-3"])
def test_a_dropped_window_fires_no_step_hooks(accumulation_steps):
    """A window dropped as non-finite (``skip_step``) is no step: natively GradScaler does not
    call ``optimizer.step()``, so neither the optimizer's step hooks nor the global ones fire
    (here a post-hook that shrinks the params by 1 %, and counting hooks). Native judge: the same
    loop whose non-finite window is found by hand and not stepped (fp32: bit-identical)."""
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    N, windows, bad = 3, 3, (1, 2)  # window 1's micro-batch 2 is NaN
    data = batches(N * windows, 4)

    def train(wrap: bool):
        torch.manual_seed(0)
        model = make_model()
        inner = torch.optim.AdamW(model.parameters(), lr=0.01)
        opt = AccumulatingOptimizer(inner, accumulation_steps=accumulation_steps,
                                    nonfinite="skip_step") if wrap else inner
        log: list = []
        shrink = opt.register_step_post_hook(lambda o, a, k: [p.data.mul_(0.99)
                                                              for p in model.parameters()])
        handles = [shrink, opt.register_step_pre_hook(lambda o, a, k: log.append("pre")),
                   opt.register_step_post_hook(lambda o, a, k: log.append("post")),
                   register_optimizer_step_pre_hook(lambda o, a, k: log.append("global-pre")),
                   register_optimizer_step_post_hook(lambda o, a, k: log.append("global-post"))]
        try:
            for w in range(windows):
                for m in range(N):
                    x, y = data[w * N + m]
                    loss = mse(model, x, y)
                    if (w, m) == bad:
                        loss = loss * float("nan")
                    loss.backward()
                    if wrap and accumulation_steps is not None:
                        opt.step()
                finite = wrap or all(torch.isfinite(p.grad).all() for p in model.parameters())
                if (wrap and accumulation_steps is None) or (not wrap and finite):
                    opt.step()  # (natively: GradScaler steps only a finite window)
                opt.zero_grad()
        finally:
            for h in handles:
                h.remove()
        return [p.detach().clone() for p in model.parameters()], log, \
            getattr(opt, "skipped_steps", 1)

    native, native_log, _ = train(False)
    ours, our_log, skipped = train(True)
    assert skipped == 1
    assert our_log == native_log and len(native_log) == 4 * (windows - 1)
    for a, b in zip(ours, native):
        assert torch.equal(a, b)
