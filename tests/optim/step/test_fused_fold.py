"""A fused inner optimizer (Adam/AdamW/SGD with ``fused=True``) against native PyTorch, for the
reductions that normalise: ``"mean"``, ``"weighted"`` and dropped micro-batches
(``nonfinite="skip_microbatch"``), without clipping.

With a fused inner optimizer the wrapper may fold the normalisation (Σg / k, Σg / Σw) into the
optimizer's ``grad_scale`` (the optimizer divides the gradients by it in its own pass, the hook
``GradScaler`` uses) instead of a separate multiply pass. Without clipping, nothing else in the
suite runs that fold, so a fold by the wrong factor (k instead of 1/k) went unseen. Here native
PyTorch is the judge: the same loop runs twice on the same fp32 MLP and the same fresh random data,

* native: the plain fused optimizer; the per-micro-batch gradients are summed by autograd, then
  divided as the reduction means (``p.grad.div_(k)`` with k the kept micro-batches for
  ``"mean"``; ``p.grad.div_(Σw)`` over the kept micro-batches for ``"weighted"``, whose loss is
  a sum over items); a poisoned micro-batch simply has no backward;
* wrapper: ``AccumulatingOptimizer(<the same fused optimizer>, ...)``, ``add_weight`` per
  micro-batch, the poisoned micro-batch's NaN backward run and left to the wrapper to drop,

and after every window the params, ``p.grad`` (after the step both show the gradient the step
used: the fused kernels write the unscaled gradient back) and the optimizer state
(``exp_avg``/``exp_avg_sq``/``step`` for Adam(W), ``momentum_buffer`` for SGD) are compared.

Precision argument for the tolerance. The wrapper sums the same fp32 micro-batch gradients in the
same order as autograd (``x + 1.0*y`` rounds as ``x + y``); the only legitimate difference is how
the normalisation is rounded: native computes ``Σg / k``, the wrapper ``Σg / fl(1/k)`` (folded),
``Σg * fl(1/k)`` or ``(Σg * fl(1/N)) * fl(N/k)`` (N known, short window) -- each within a few fp32
ulps (u = 2**-24 ≈ 6e-8) of the other, elementwise and relative. In the first window both sides
start from the same params and state, so gradients, Adam's moments (v: twice the error), its
update m̂/(√v̂+ε) and SGD's momentum agree elementwise to a few ulps: ``rtol=1e-5, atol=1e-7``.
From the second window on the params differ by those ulps, and a gradient entry that is a
near-cancelling sum of O(1) terms moves by ulps of the *terms*, not of the entry (measured: 2.2e-7
on a 7e-3 entry of an O(1) gradient, window 2, SGD) -- elementwise-relative is no bound there.
Those windows keep ``rtol=1e-5`` and take the absolute floor relative to the tensor's scale,
``atol = max(1e-7, 1e-5 * max|native|)``; the measured drift over these ≤ 5 windows is ≤ ~1e-6 of
that scale (well-conditioned dynamics: lr and gradient sizes are kept moderate). A normalisation
by the wrong factor moves every entry of the gradients and SGD's momentum by a factor k² (Adam's
exp_avg by k², exp_avg_sq by k⁴): with k ≥ 2 that is ≥ 300 % of the largest entry -- orders of
magnitude outside either bound. ``test_large_factor`` uses k = 4 and weights 3 and 17 so such an
error fails by factors of 16 to 10^6.
"""

from __future__ import annotations

import copy
import zlib
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from accumkernels import AccumulatingOptimizer

RTOL, ATOL = 1e-5, 1e-7
D_IN, D_HID, D_OUT = 7, 13, 5

OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2, fused=True),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.02, momentum=0.9, fused=True),
}
OPT_IDS = list(OPTIMIZERS)

# (accumulation_steps, how the caller steps, window sizes). With N given the last window is
# short (3 of 4): "every" calls step() (+ zero_grad()) after every micro-batch and flush() for
# the short one (Accelerate-style); "boundary" calls step() only at window ends, the short one
# included (Trainer-style: the wrapper learns it); with N=None every step() ends the window (k
# learned at the step, where the fold happens).
CADENCES = [
    pytest.param(None, "boundary", (4, 3, 5, 1, 2), id="N=None"),
    pytest.param(4, "every", (4, 4, 3), id="N=4-step-every-microbatch+flush"),
    pytest.param(4, "boundary", (4, 4, 3), id="N=4-step-at-boundaries"),
]


@dataclass
class MicroBatch:
    x: torch.Tensor
    y: torch.Tensor
    weight: float
    poison: str | None = None  # None, "input" (NaN in x) or "loss" (loss * NaN)


def _generator(request) -> torch.Generator:
    """A fresh generator per test, seeded from the test id (random data, reproducible)."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()) + 1)


def _model(gen: torch.Generator) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, D_OUT))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def _plan(gen, sizes, *, rows=None, weights=None, poisoned=()) -> list[list[MicroBatch]]:
    """Windows of micro-batches. ``rows``/``weights``: per micro-batch (flat, in order); by
    default a random row count 1..20 and weight = rows (a token count). ``poisoned``: flat
    indices of (index, mode) of micro-batches whose gradients are NaN."""
    total = sum(sizes)
    if rows is None:
        rows = [int(r) for r in torch.randint(1, 21, (total,), generator=gen)]
    if weights is None:
        weights = [float(r) for r in rows]
    poison = dict(poisoned)
    flat = []
    for i in range(total):
        x = torch.randn(rows[i], D_IN, generator=gen)
        y = torch.randn(rows[i], D_OUT, generator=gen)
        flat.append(MicroBatch(x, y, weights[i], poison.get(i)))
    windows, start = [], 0
    for n in sizes:
        windows.append(flat[start:start + n])
        start += n
    return windows


def _loss(model, mb: MicroBatch, reduction: str, *, poisoned: bool) -> torch.Tensor:
    x = mb.x
    if poisoned and mb.poison == "input":
        x = x.clone()
        x[0, 0] = float("nan")
    err = (model(x) - mb.y) ** 2
    # "mean": the micro-batch's loss is a mean; "weighted": a sum over its items
    loss = err.mean() if reduction == "mean" else err.sum()
    if poisoned and mb.poison == "loss":
        loss = loss * float("nan")
    return loss


def _state_of(opt, params) -> list[dict[str, torch.Tensor]]:
    out = []
    for p in params:
        st = opt.state[p]
        out.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v))
                    for k, v in st.items()
                    if k in ("exp_avg", "exp_avg_sq", "step", "momentum_buffer")})
    return out


def _snapshot(model, opt) -> dict:
    params = list(model.parameters())
    return {
        "params": [p.detach().clone() for p in params],
        "grads": [None if p.grad is None else p.grad.detach().clone() for p in params],
        "state": _state_of(opt, params),
    }


def run_native(model, inner, plan, reduction) -> list[dict]:
    snaps = []
    for window in plan:
        inner.zero_grad(set_to_none=True)
        kept = [mb for mb in window if mb.poison is None]
        for mb in kept:  # a poisoned micro-batch natively: its backward is simply not run
            _loss(model, mb, reduction, poisoned=False).backward()
        divisor = len(kept) if reduction == "mean" else sum(mb.weight for mb in kept)
        with torch.no_grad():
            for p in model.parameters():
                p.grad.div_(divisor)
        inner.step()
        snaps.append(_snapshot(model, inner))
    inner.zero_grad(set_to_none=True)
    return snaps


def run_wrapper(model, opt, plan, reduction, n, style, weight_when="after") -> list[dict]:
    snaps = []
    for window in plan:
        for j, mb in enumerate(window):
            if reduction == "weighted" and weight_when == "before":
                opt.add_weight(mb.weight)
            _loss(model, mb, reduction, poisoned=True).backward()
            if reduction == "weighted" and weight_when == "after":
                opt.add_weight(mb.weight)
            if style == "every" and j < len(window) - 1:
                opt.step()  # a no-op mid-window
                opt.zero_grad()  # keeps a window that is still filling (N given)
        if style == "every" and n is not None and len(window) < n:
            opt.flush()  # the short last window
        else:
            opt.step()
        snaps.append(_snapshot(model, opt))
        opt.zero_grad()
    return snaps


def _close(actual, expected, window: int, what: str) -> None:
    """Window 0 (same params, same state on both sides): elementwise, rtol=1e-5, atol=1e-7.
    Later windows: the same rtol, the atol floor relative to the tensor's scale (see the module
    docstring: ulp-level drift of the params moves near-cancelling gradient entries by ulps of
    the tensor's magnitude, not of the entry)."""
    actual, expected = actual.float(), expected.float()
    atol = ATOL if window == 0 else max(ATOL, RTOL * float(expected.abs().max()))
    torch.testing.assert_close(actual, expected, rtol=RTOL, atol=atol,
                               msg=lambda m: f"window {window}, {what}: {m}")


def assert_runs_match(wrapped: list[dict], native: list[dict]) -> None:
    assert len(wrapped) == len(native)
    for w, (a, b) in enumerate(zip(wrapped, native)):
        for i, (pa, pb) in enumerate(zip(a["params"], b["params"])):
            _close(pa, pb, w, f"param {i}")
        for i, (ga, gb) in enumerate(zip(a["grads"], b["grads"])):
            assert ga is not None, f"window {w}, param {i}: p.grad is None after the step"
            _close(ga, gb, w, f"p.grad {i} after the step")
        for i, (sa, sb) in enumerate(zip(a["state"], b["state"])):
            assert sa.keys() == sb.keys(), f"window {w}, param {i}: state keys differ"
            assert sa, f"window {w}, param {i}: no optimizer state"
            for key in sa:
                _close(sa[key], sb[key], w, f"param {i}, state {key!r}")


def _compare(request, opt_name, plan, reduction, n, style, *, weight_when="after",
             nonfinite="skip_step", gen=None):
    gen = gen or _generator(request)
    model = _model(gen)
    native = copy.deepcopy(model)
    native_snaps = run_native(native, OPTIMIZERS[opt_name](native.parameters()), plan, reduction)
    opt = AccumulatingOptimizer(OPTIMIZERS[opt_name](model.parameters()),
                                accumulation_steps=n, reduction=reduction, nonfinite=nonfinite)
    wrapped_snaps = run_wrapper(model, opt, plan, reduction, n, style, weight_when)
    assert_runs_match(wrapped_snaps, native_snaps)
    return opt


# -- reduction="mean" -----------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", OPT_IDS)
@pytest.mark.parametrize("n,style,sizes", CADENCES)
def test_mean_matches_native(request, opt_name, n, style, sizes):
    gen = _generator(request)
    plan = _plan(gen, sizes)
    opt = _compare(request, opt_name, plan, "mean", n, style, gen=gen)
    assert opt.skipped_steps == 0


# -- reduction="weighted" -------------------------------------------------------------------------

@pytest.mark.parametrize("opt_name", OPT_IDS)
@pytest.mark.parametrize("n,style,sizes", CADENCES)
@pytest.mark.parametrize("weight_when", ["before", "after"])
def test_weighted_matches_native(request, opt_name, n, style, sizes, weight_when):
    """Weight = the micro-batch's row count (its loss is a sum over rows): Σg / Σw."""
    gen = _generator(request)
    plan = _plan(gen, sizes)
    opt = _compare(request, opt_name, plan, "weighted", n, style, weight_when=weight_when, gen=gen)
    assert opt.skipped_steps == 0


@pytest.mark.parametrize("opt_name", OPT_IDS)
@pytest.mark.parametrize("n,style,sizes", CADENCES)
def test_weighted_fractional_weights_match_native(request, opt_name, n, style, sizes):
    """Weights that are not row counts, some windows with Σw < 1 (normalising *up*), some with
    Σw > 1: the result is still Σg / Σw."""
    gen = _generator(request)
    total = sum(sizes)
    choices = [0.125, 0.3, 0.75, 2.5, 6.0]
    weights = [choices[int(i)] for i in torch.randint(0, len(choices), (total,), generator=gen)]
    weights[:4] = [0.125, 0.3, 0.125, 0.3]  # the first window is light: Σw = 0.85 < 1
    weights[-1] = 6.0  # the last one (short with N=4) heavy: Σw > 1
    rows = [int(r) for r in torch.randint(1, 3, (total,), generator=gen)]  # gradients O(1..10)
    plan = _plan(gen, sizes, rows=rows, weights=weights)
    _compare(request, opt_name, plan, "weighted", n, style, gen=gen)


# -- nonfinite="skip_microbatch" -------------------------------------------------------------------

# poisoned micro-batches (flat index): first of a window, middle of one, last of one
_POISON_AT = {None: (0, 5, 11), 4: (0, 6, 10)}


@pytest.mark.parametrize("opt_name", OPT_IDS)
@pytest.mark.parametrize("n,style,sizes", CADENCES)
@pytest.mark.parametrize("reduction", ["mean", "weighted"])
@pytest.mark.parametrize("mode", ["input", "loss"])
def test_skip_microbatch_matches_native(request, opt_name, n, style, sizes, reduction, mode):
    """A micro-batch whose gradients are NaN is dropped; "mean" divides by the kept count,
    "weighted" by the kept weight; the dropped one still counts toward N."""
    gen = _generator(request)
    at = _POISON_AT[n]
    plan = _plan(gen, sizes, poisoned=[(i, mode) for i in at])
    for window in plan:  # every window keeps at least one micro-batch
        assert any(mb.poison is None for mb in window)
    opt = _compare(request, opt_name, plan, reduction, n, style, nonfinite="skip_microbatch",
                   gen=gen)
    assert opt.skipped_microbatches == len(at)
    assert opt.skipped_steps == 0


# -- a large, clear normalisation effect ----------------------------------------------------------

@pytest.mark.parametrize("opt_name", OPT_IDS)
@pytest.mark.parametrize("n", [None, 4])
@pytest.mark.parametrize("case", ["mean", "weighted", "mean-skip", "weighted-skip"])
def test_large_factor(request, opt_name, n, case):
    """k = 4 micro-batches a window, weights 3 and 17 (Σw = 40 or 23 after a drop): a wrong
    normalisation factor is off by 16x to 10^6x, not by rounding. The last window is short (3
    micro-batches, flushed) when N=4."""
    gen = _generator(request)
    reduction = case.split("-")[0]
    sizes = (4, 4, 3) if n else (4, 4)
    rows = [3, 17, 3, 17, 17, 3, 17, 3, 3, 17, 3][:sum(sizes)]
    poisoned = [(2, "loss"), (5, "input")] if case.endswith("skip") else []
    plan = _plan(gen, sizes, rows=rows, poisoned=poisoned)
    nonfinite = "skip_microbatch" if poisoned else "skip_step"
    style = "every" if n else "boundary"
    opt = _compare(request, opt_name, plan, reduction, n, style, nonfinite=nonfinite, gen=gen)
    assert opt.skipped_microbatches == len(poisoned)
