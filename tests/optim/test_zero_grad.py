"""zero_grad() and .grad cleared from outside (DESIGN section of that name): ``opt.zero_grad()``
with N given keeps a window that is still filling; ``model.zero_grad()`` and ``p.grad = None``
mean what they mean natively, on the same rules; the zeros ``set_to_none=False`` leaves on params
that get no gradient are stepped as natively; params frozen at wrap time are cleared too.

Native PyTorch is the judge: the same loop with the stock optimizer (native fp32 ``.grad``
accumulation), fp32 models and ``reduction="sum"``, so params are expected bit-identical (see
tests/_native_common.py for the precision argument).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _native_common import (
    assert_grads_match_native,
    assert_same_params,
    mlp,
    mlp_batches,
    mse,
    random_seed,
    sgd_pair,
)
from _optim_common import (
    D_IN,
    D_OUT,
    SMALL_BUCKET,
    batches,
    make_model,
    params_of,
    run_loop,
    wrap_sgd,
)
from torch import nn

from accumkernels import AccumulatingOptimizer

LR = 0.1


# -- opt.zero_grad() -------------------------------------------------------------------------------


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_keeps_the_window(set_to_none, in_backward):
    N = 3
    model = make_model()
    twin = copy.deepcopy(model)
    kw = {"accumulation_steps": N, "reduction": "mean", "accumulate_in_backward": in_backward,
          "bucket_size_mb": SMALL_BUCKET}
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **kw)
    twin_opt = AccumulatingOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-2), **kw)
    start = params_of(model)
    data = batches(2 * N, 4)
    run_loop(model, opt, data, zero_grad=set_to_none, in_backward=in_backward)
    run_loop(twin, twin_opt, data, in_backward=in_backward)
    for p, q, s in zip(model.parameters(), twin.parameters(), start):
        assert not torch.equal(p, s)
        assert torch.equal(p, q)  # same arithmetic: bitwise equal


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero"])
def test_zero_grad_clears_params_frozen_at_wrap_time(set_to_none):
    """The wrapper's zero_grad() clears every param of its param_groups like the inner
    optimizer's would, those frozen when it was built included."""
    model = make_model()
    model[0].weight.requires_grad_(False)
    native = copy.deepcopy(model)
    opt = wrap_sgd(model, accumulation_steps=2)
    native_opt = torch.optim.SGD(native.parameters(), lr=0.1)
    g = torch.randn_like(model[0].weight)
    model[0].weight.grad = g.clone()  # what a backward leaves once the param is unfrozen
    native[0].weight.grad = g.clone()
    opt.zero_grad(set_to_none=set_to_none)
    native_opt.zero_grad(set_to_none=set_to_none)
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: .grad {p.grad} vs native {q.grad}"
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name


# -- model.zero_grad() and p.grad = None -----------------------------------------------------------


def test_model_zero_grad_mid_window_drops_what_came_before():
    native, nopt, ours, opt = sgd_pair()
    data = mlp_batches(3)
    for model, o in ((native, nopt), (ours, opt)):
        mse(model, data[0]).backward()
        model.zero_grad()  # HF Trainer's way of clearing
        mse(model, data[1]).backward()
        o.step()
    assert_same_params(native, ours, rtol=0)


def test_grad_set_to_none_on_some_params_drops_only_theirs():
    native, nopt, ours, opt = sgd_pair()
    data = mlp_batches(2)
    for model, o in ((native, nopt), (ours, opt)):
        mse(model, data[0]).backward()
        model[0].weight.grad = None
        mse(model, data[1]).backward()
        o.step()
    assert_same_params(native, ours, rtol=0)


@pytest.mark.parametrize("accumulation_steps", [None, 2])
def test_overflow_skip_then_model_zero_grad_steps_again(accumulation_steps):
    """GradScaler-style: a non-finite window is not stepped, model.zero_grad() clears it, and
    training steps again (native: [skip, step, step, step])."""
    native, nopt, ours, opt = sgd_pair(accumulation_steps)
    data = mlp_batches(8)
    log = {"native": [], "ours": []}
    for name, model, o in (("native", native, nopt), ("ours", ours, opt)):
        for w in range(4):
            for k in range(2):
                loss = mse(model, data[2 * w + k])
                (loss * float("inf") if w == 0 and k == 0 else loss).backward()
            finite = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
            if finite:
                o.step()
            log[name].append(finite)
            model.zero_grad()
    assert log["native"] == log["ours"] == [False, True, True, True]
    assert_same_params(native, ours, rtol=0)


def test_external_clear_with_n_keeps_a_filling_window_like_opt_zero_grad():
    """Documented rule: with accumulation_steps=N, model.zero_grad() on a window still filling
    is what opt.zero_grad() is: the window is kept (the loop that clears every micro-batch)."""
    results = []
    for clear in ("model", "opt"):
        ours = mlp()
        opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1),
                                    accumulation_steps=3)
        for x in mlp_batches(3):
            mse(ours, x).backward()
            opt.step()
            ours.zero_grad() if clear == "model" else opt.zero_grad()
        results.append([p.detach().clone() for p in ours.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
    native = mlp()
    nopt = torch.optim.SGD(native.parameters(), lr=0.1)
    for x in mlp_batches(3):
        mse(native, x).backward()
    nopt.step()
    assert all(torch.equal(a, b) for a, b in zip(results[0], native.parameters()))


# -- zero_grad(set_to_none=False) and params without gradients -------------------------------------


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_OUT)
        self.b = nn.Sequential(nn.Linear(D_IN, 8), nn.Tanh(), nn.Linear(8, D_OUT))

    def forward(self, x, use_b: bool):
        out = self.a(x)
        return out + self.b(x) if use_b else out


@pytest.mark.parametrize("accumulation_steps", [3, None])
@pytest.mark.parametrize("set_to_none", [False, True])
@pytest.mark.parametrize("make_opt", [
    pytest.param(lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.9, weight_decay=0.1), id="sgd"),
    pytest.param(lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1), id="adamw"),
])
def test_zero_grad_keeps_params_without_gradient_like_native(make_opt, set_to_none,
                                                             accumulation_steps):
    """Windows of 3 where branch b is used in all, none, one, none of the micro-batches; the
    Trainer-style loop ends each window with step() and zero_grad(set_to_none=...). Native with
    set_to_none=False keeps zero gradients on b when it gets none, so momentum and weight decay
    keep moving it; with True b has no .grad and is skipped. The wrapper's p.grad after every
    backward and after zero_grad must be native's (zeros, not None, where native has zeros) and
    the params after every step too. (b's view holds the last window's sum when it gets no new
    gradient: a stale value the wrapper must not show or step on.)"""
    torch.manual_seed(random_seed())
    model = TwoBranch()
    native = copy.deepcopy(model)
    opt = AccumulatingOptimizer(make_opt(list(model.parameters())),
                                accumulation_steps=accumulation_steps, reduction="sum",
                                bucket_size_mb=SMALL_BUCKET)
    native_opt = make_opt(list(native.parameters()))
    schedule = [(True, True, True), (False, False, False), (False, True, False),
                (False, False, False)]
    start_b = [p.detach().clone() for p in model.b.parameters()]
    for w, uses in enumerate(schedule):
        for k, (use_b, (x, y)) in enumerate(zip(uses, mlp_batches(3))):
            for mod in (model, native):
                (F.mse_loss(mod(x, use_b), y) / 3).backward()
            assert_grads_match_native(model, native, f"window {w}, backward {k}: ")
        for o in (opt, native_opt):
            o.step()
            o.zero_grad(set_to_none=set_to_none)
        assert_grads_match_native(model, native, f"window {w}, after zero_grad: ")
        assert_same_params(native, model)
        if w == 1:  # b got no gradient in this window: native moved it only with zero grads
            moved = any(not torch.equal(p, s) for p, s in zip(native.b.parameters(), start_b))
            assert moved != set_to_none
        start_b = [p.detach().clone() for p in model.b.parameters()]


@pytest.mark.parametrize("clear", ["model.zero_grad", "grad=None"])
@pytest.mark.parametrize("accumulation_steps", [3, None], ids=["N-3", "N-None"])
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_weight_reported_after_an_outside_clear_belongs_to_the_next_window(
        clear, accumulation_steps, in_backward):
    """``reduction="weighted"`` with ``add_weight`` before each backward, the loop clearing
    ``.grad`` from outside after every step() call (the HF Trainer's way): the clear after a
    real step ends that window, so the next micro-batch's weight, reported before its backward,
    is the new window's first (the step divides by the weights of its own micro-batches).
    Native judge: the same loop summing losses over items, ``.grad`` divided by the weights."""
    N, windows = 3, 3
    data = [(torch.randn(4, D_IN), torch.randn(4, D_OUT)) for _ in range(N * windows)]
    weights = [float(k % 3 + 2) for k in range(N * windows)]

    def loss_of(model, x, y):
        return F.mse_loss(model(x), y, reduction="sum")

    def clear_grads(model):
        if clear == "model.zero_grad":
            model.zero_grad()
        else:
            for p in model.parameters():
                p.grad = None

    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                accumulation_steps=accumulation_steps, reduction="weighted",
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    native = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for w in range(windows):
        for k in range(w * N, (w + 1) * N):
            opt.add_weight(weights[k])
            loss_of(model, *data[k]).backward()
            if accumulation_steps is not None or k == (w + 1) * N - 1:
                opt.step()
                clear_grads(model)
            loss_of(ref, *data[k]).backward()
        total = sum(weights[w * N:(w + 1) * N])
        for p in ref.parameters():
            p.grad.div_(total)
        native.step()
        clear_grads(ref)
        assert_same_params(ref, model)


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_weight_reported_after_the_backward_then_cleared_every_microbatch(in_backward):
    """``add_weight`` after each backward, ``model.zero_grad()`` after every micro-batch with
    N given (a filling window is kept, as by ``opt.zero_grad()``), ``step()`` at window ends
    only: the weight report between
    the backward and the clear leaves the gradients not yet moved
    (``accumulate_in_backward=False``) to the clear's rule, which keeps them. Native judge: the
    same loop clearing at window ends."""
    N, windows = 3, 2
    data = [(torch.randn(4, D_IN), torch.randn(4, D_OUT)) for _ in range(N * windows)]
    weights = [float(k % 3 + 2) for k in range(N * windows)]
    torch.manual_seed(0)
    model = mlp()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01),
                                accumulation_steps=N, reduction="weighted",
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    native = torch.optim.AdamW(ref.parameters(), lr=0.01)
    for w in range(windows):
        for k in range(w * N, (w + 1) * N):
            F.mse_loss(model(data[k][0]), data[k][1], reduction="sum").backward()
            opt.add_weight(weights[k])
            if k == (w + 1) * N - 1:  # (Trainer-style: step() at the window's end only)
                opt.step()
            model.zero_grad()
            F.mse_loss(ref(data[k][0]), data[k][1], reduction="sum").backward()
        for p in ref.parameters():
            p.grad.div_(sum(weights[w * N:(w + 1) * N]))
        native.step()
        ref.zero_grad()
        assert_same_params(ref, model)
