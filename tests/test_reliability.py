"""What users do behind the wrapper's back (issue 18, wrapper side): native PyTorch is the judge.

Each test runs the same loop with the stock optimizer (native fp32 ``.grad`` accumulation) and
with ``AccumulatingOptimizer``; fp32 models, ``reduction="sum"``: the wrapper adds the same fp32
gradients in the same order, so params are expected bit-identical (see tests/_native_common.py
for the precision argument). A refusal must leave params, ``.grad``, ``main_grad`` and the
state dict unchanged (checksums before/after).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accumkernels import AccumulatingOptimizer

from _native_common import assert_same_params, mlp, mlp_batches, mse


def _pair(accumulation_steps=None, dtype=torch.float32, **kw):
    native = mlp(dtype)
    ours = copy.deepcopy(native)
    return (native, torch.optim.SGD(native.parameters(), lr=0.1, momentum=0.9),
            ours, AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9),
                                        accumulation_steps=accumulation_steps, **kw))


def _checksum(model: nn.Module, opt: AccumulatingOptimizer) -> list[torch.Tensor]:
    out = []
    for p in model.parameters():
        out.append(p.detach().clone())
        out.append(None if p.grad is None else p.grad.detach().clone())
        out.append(p.main_grad.detach().clone())
    sd = opt.state_dict()
    out += [v.clone() for st in sd["state"].values() for v in st.values() if torch.is_tensor(v)]
    window = sd["accumkernels"].get("window")
    out += [] if window is None else [t.clone() for t in window["main_grad"]]
    return out


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
        for x, y in zip(a, b))


def test_model_zero_grad_mid_window_drops_what_came_before():
    native, nopt, ours, opt = _pair()
    data = mlp_batches(3)
    for model, o in ((native, nopt), (ours, opt)):
        mse(model, data[0]).backward()
        model.zero_grad()  # HF Trainer's way of clearing
        mse(model, data[1]).backward()
        o.step()
    assert_same_params(native, ours, rtol=0)


def test_grad_set_to_none_on_some_params_drops_only_theirs():
    native, nopt, ours, opt = _pair()
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
    native, nopt, ours, opt = _pair(accumulation_steps)
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


def test_double_then_float_mid_window_keeps_the_window():
    native, nopt, ours, opt = _pair(2)
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


def test_param_appended_to_param_groups_is_cleared_and_stepped_natively():
    native, nopt, ours, opt = _pair()
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


def test_create_graph_gradient_penalty_is_native():
    native, nopt, ours, opt = _pair()
    data = mlp_batches(2)
    for model, o in ((native, nopt), (ours, opt)):
        for x in data:
            mse(model, x).backward(create_graph=True)
            penalty = sum((p.grad ** 2).sum() for p in model.parameters())
            penalty.backward()
            o.step()
            o.zero_grad()
    assert_same_params(native, ours, rtol=0)


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


def test_sparse_gradient_is_refused_before_anything_is_counted():
    model = nn.Embedding(10, 3, sparse=True)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="sparse"):
        model(torch.tensor([1, 2])).sum().backward()
    assert opt.micro_steps == 0


def test_refusals_at_construction_change_nothing():
    with pytest.raises(ValueError, match="complex"):
        AccumulatingOptimizer(torch.optim.SGD([nn.Parameter(torch.randn(2, dtype=torch.cfloat))],
                                              lr=0.1))
    with pytest.raises(ValueError, match="SparseAdam"):
        AccumulatingOptimizer(torch.optim.SparseAdam([nn.Parameter(torch.randn(2))]))
    with pytest.raises(ValueError, match="differentiable"):
        AccumulatingOptimizer(torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1,
                                              differentiable=True))


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
