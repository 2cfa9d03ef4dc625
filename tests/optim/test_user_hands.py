"""Robust to the user's own hands (DESIGN section of that name): what a user does to the model,
its params and the optimizer's param groups between calls -- a dtype cast and back, a cast that
is refused, params appended to ``param_groups``, frozen at wrap time and unfrozen later,
``create_graph`` backwards, sparse gradients, float64 params -- gives native's result or a clear
error with nothing changed. A model moved to another device: test_device_moves.py; failures and
refused calls mid-training: test_failures.py; ``.grad`` cleared from outside: test_zero_grad.py.

Each test runs the same loop with the stock optimizer (native fp32 ``.grad`` accumulation) and
with ``AccumulatingOptimizer``; fp32 models, ``reduction="sum"``: the wrapper adds the same fp32
gradients in the same order, so params are expected bit-identical (see tests/_native_common.py
for the precision argument). A refusal must leave params, ``.grad``, ``main_grad`` and the
state dict unchanged (checksums before/after).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from _native_common import assert_same_params, mlp, mlp_batches, mse, sgd_pair
from _optim_common import assert_params_close, batches, make_model, wrap_sgd
from torch import nn

from accumkernels import AccumulatingOptimizer


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


# -- a dtype cast after wrapping -------------------------------------------------------------------

def test_double_then_float_mid_window_keeps_the_window():
    native, nopt, ours, opt = sgd_pair(2)
    data = mlp_batches(4)
    for model, o, wrapped in ((native, nopt, False), (ours, opt, True)):
        for w in range(2):
            mse(model, data[2 * w]).backward()
            if wrapped:
                o.step()  # a no-op: the window is still filling
            model.double()
            model.float()
            mse(model, data[2 * w + 1]).backward()
            o.step()
            o.zero_grad()
    assert_same_params(native, ours, rtol=0)
    for p in ours.parameters():  # the views alias the buffer again
        assert p.main_grad.untyped_storage().data_ptr() == \
            opt._parts.window.storage.buffers[p.device].untyped_storage().data_ptr()


@pytest.mark.parametrize("change", ["half", "bfloat16", "double"])
def test_model_cast_after_wrapping_is_refused_with_nothing_changed(change):
    ours = mlp()
    opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), accumulation_steps=4)
    x, y = mlp_batches(1)[0]
    mse(ours, (x, y)).backward()
    opt.step()
    getattr(ours, change)()
    dtype = next(ours.parameters()).dtype
    before = [t.clone() for t in opt._parts.window.storage.buffers.values()]
    with pytest.raises(ValueError, match="when the AccumulatingOptimizer was built"):
        mse(ours, (x.to(dtype), y.to(dtype))).backward()
    assert opt.micro_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, opt._parts.window.storage.buffers.values()))
    with pytest.raises(ValueError, match="when the AccumulatingOptimizer was built"):
        opt.step()


def test_refused_backward_leaves_state_unchanged():
    ours = mlp()
    opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), accumulation_steps=4)
    x, y = mlp_batches(1)[0]
    mse(ours, (x, y)).backward()
    opt.step()
    ours.half()  # the user's cast (it rounds params and .grad); the refusal must change nothing
    before = [t.clone() for t in opt._parts.window.storage.buffers.values()] + \
        [t for p in ours.parameters() for t in (p.detach().clone(), p.grad.clone())]
    with pytest.raises(ValueError):
        mse(ours, (x.half(), y.half())).backward()
    after = [t.clone() for t in opt._parts.window.storage.buffers.values()] + \
        [t for p in ours.parameters() for t in (p.detach().clone(), p.grad.clone())]
    assert _same(before, after)
    assert opt.micro_steps == 1


# -- params appended, frozen and unfrozen ----------------------------------------------------------

def test_param_appended_to_param_groups_is_cleared_and_stepped_natively():
    native, nopt, ours, opt = sgd_pair()
    extra_n = nn.Parameter(torch.randn(5))
    extra_o = nn.Parameter(extra_n.detach().clone())
    nopt.param_groups[0]["params"].append(extra_n)
    opt.param_groups[0]["params"].append(extra_o)
    data = mlp_batches(3)
    for model, o, extra in ((native, nopt, extra_n), (ours, opt, extra_o)):
        for x in data:
            (mse(model, x) + (extra * x[0][0, :5]).sum()).backward()
            o.step()
            o.zero_grad()
    assert_same_params(native, ours, rtol=0)
    assert torch.equal(extra_n, extra_o)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_param_frozen_at_wrap_time_and_unfrozen_gets_the_whole_window(reduction):
    """The documented zero_grad-every-micro-batch loop with N: the unfrozen param (outside the
    window, native .grad) must get every micro-batch, normalised like the window."""
    data = mlp_batches(4)

    def run(wrap: bool) -> nn.Module:
        model = mlp()
        model[0].weight.requires_grad_(False)
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        opt = AccumulatingOptimizer(inner, accumulation_steps=2, reduction=reduction) \
            if wrap else inner
        model[0].weight.requires_grad_(True)
        for k, x in enumerate(data):
            loss = mse(model, x) / (2 if reduction == "mean" and not wrap else 1)
            loss.backward()
            if wrap or k % 2 == 1:
                opt.step()
                opt.zero_grad()
        return model

    assert_same_params(run(False), run(True), rtol=1e-6 if reduction == "mean" else 0)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_param_unfrozen_after_wrapping_trains_like_native_or_raises_clearly(reduction):
    """Progressive unfreezing: a param frozen when the wrapper was built gets requires_grad=True
    later. Accepted: it trains like native (normalised like the rest, its .grad cleared by the
    wrapper's zero_grad), or the first backward that produces its gradient raises an error that
    says what to do. Nothing else."""
    N, lr = 2, 0.1
    template = make_model()
    template[0].weight.requires_grad_(False)
    model, native = copy.deepcopy(template), copy.deepcopy(template)
    opt = wrap_sgd(model, lr=lr, accumulation_steps=N, reduction=reduction)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    factor = 1.0 / N if reduction == "mean" else 1.0

    def window(name, first_after_unfreeze=False):
        data = batches(N, 4)
        for i, (x, y) in enumerate(data):
            loss = mse(model, (x, y))
            if first_after_unfreeze and i == 0:
                try:
                    loss.backward()
                except (RuntimeError, ValueError) as e:
                    return e
            else:
                loss.backward()
            opt.step()
        opt.zero_grad()
        for x, y in data:
            (mse(native, (x, y)) * factor).backward()
        native_opt.step()
        native_opt.zero_grad()
        assert_params_close(model, native, what=f"{name}: ")
        return None

    window("frozen")
    for mod in (model, native):
        mod[0].weight.requires_grad_(True)
    error = window("first window after unfreezing", first_after_unfreeze=True)
    if error is not None:
        message = str(error)
        assert re.search(r"(?i)requires_grad|frozen", message), message
        assert re.search(r"(?i)AccumulatingOptimizer|wrap", message), message
        return
    for w in range(3):
        window(f"window {w + 2} after unfreezing")


# -- gradients of other kinds, params of another dtype ---------------------------------------------

def test_create_graph_gradient_penalty_is_native():
    native, nopt, ours, opt = sgd_pair()
    data = mlp_batches(2)
    for model, o in ((native, nopt), (ours, opt)):
        for x in data:
            mse(model, x).backward(create_graph=True)
            penalty = sum((p.grad ** 2).sum() for p in model.parameters())
            penalty.backward()
            o.step()
            o.zero_grad()
    assert_same_params(native, ours, rtol=0)


def test_sparse_gradient_is_refused_before_anything_is_counted():
    model = nn.Embedding(10, 3, sparse=True)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="sparse"):
        model(torch.tensor([1, 2])).sum().backward()
    assert opt.micro_steps == 0


def test_float64_params_train_natively():
    native = mlp(torch.float64)
    ours = copy.deepcopy(native)
    nopt = torch.optim.AdamW(native.parameters(), lr=0.01)
    opt = AccumulatingOptimizer(torch.optim.AdamW(ours.parameters(), lr=0.01),
                                accumulation_steps=2)
    data = mlp_batches(4, dtype=torch.float64)
    for model, o, wrapped in ((native, nopt, False), (ours, opt, True)):
        for k, x in enumerate(data):
            mse(model, x).backward()
            if wrapped or k % 2 == 1:
                o.step()
                o.zero_grad()
    assert_same_params(native, ours, rtol=0)
