"""AccumulatingOptimizer under attack (issue 13, wrapper level): a failure never leaves state
half-changed, overflow never reaches the weights, nothing piles up.

Every test pits the wrapper against an independent reference: a stock torch optimizer on a plain
copy of the model (native accumulation in ``.grad``), or a byte-level checksum of everything a
caller can observe, taken before a call that must fail and change nothing.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import io
import math
import re
import weakref

import pytest
import torch
from test_optim import SMALL_BUCKET, batches, make_model, mse, params_of
from torch import nn

from accumkernels import AccumulatingOptimizer

# -- helpers ----------------------------------------------------------------------------------


def _digest(obj, h) -> None:
    """Feed every tensor's bytes (with dtype and shape) and every scalar of a nested state to h."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for k in sorted(obj, key=repr):
            h.update(f"K{k!r}:".encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        h.update(f"{type(obj).__name__}{len(items)}:".encode())
        for v in items:
            _digest(v, h)
    else:
        h.update(f"S{type(obj).__name__}{obj!r}:".encode())


def checksum(opt: AccumulatingOptimizer, model: nn.Module) -> str:
    """Everything a caller can observe: ``opt.state_dict()`` (every tensor's bytes and every
    scalar), the public counters, and each model param with its ``.grad`` and ``.main_grad``."""
    h = hashlib.sha256()
    _digest(opt.state_dict(), h)
    _digest([opt.micro_steps, opt.sync_step, opt.loss_scale, opt.skipped_steps,
             opt.skipped_microbatches, opt.last_grad_norm], h)
    for name, p in model.named_parameters():
        _digest([name, p, p.requires_grad, p.grad, getattr(p, "main_grad", None)], h)
    return h.hexdigest()


def count_hooks(model: nn.Module) -> int:
    """Tensor hooks (register_hook) and post-accumulate-grad hooks on the model's params."""
    return sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
               for p in model.parameters())


def assert_params_close(model, ref, atol=1e-6, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), f"{what}{name} is not finite"
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


def all_close(tensors, refs, atol=1e-6) -> bool:
    return all(torch.allclose(a, b, rtol=0, atol=atol) for a, b in zip(tensors, refs))


def roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _sgd(model, lr=0.1, **kw):
    kw.setdefault("bucket_size_mb", SMALL_BUCKET)
    return AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), **kw)


# -- load_state_dict is atomic ---------------------------------------------------------------

def _adamw_wrapper(template, **kw):
    model = copy.deepcopy(template)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=3, bucket_size_mb=SMALL_BUCKET, **kw)
    return model, opt


def _train(model, opt, data):
    for x, y in data:
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()


def _drop_window_key(key):
    def corrupt(state):
        del state["accumkernels"]["window"][key]
        return state
    return corrupt


# case: (source wrapper kwargs, target wrapper kwargs, corruption of the source's state_dict)
LOAD_REFUSALS = {
    "window-missing-kept": ({}, {}, _drop_window_key("kept")),
    "window-missing-touched": ({}, {}, _drop_window_key("touched")),
    "window-missing-divisor": ({}, {}, _drop_window_key("divisor")),
    "loss-scale-dynamic-into-static": ({"loss_scale": "dynamic"}, {"loss_scale": 1024.0}, None),
    "loss-scale-static-into-dynamic": ({"loss_scale": 1024.0}, {"loss_scale": "dynamic"}, None),
}


@pytest.mark.parametrize("case", list(LOAD_REFUSALS))
def test_refused_state_dict_changes_nothing(case):
    """A state_dict that fails validation is refused with ValueError, and the target (mid-window,
    with AdamW state) is bit-identical afterwards and trains exactly like an untouched twin."""
    src_kw, dst_kw, corrupt = LOAD_REFUSALS[case]
    template = make_model()
    src_model, src = _adamw_wrapper(template, **src_kw)
    _train(src_model, src, batches(4, 4))  # one window and one micro-batch of the next
    state = roundtrip(src.state_dict())
    if corrupt is not None:
        state = corrupt(state)

    data = batches(4, 4)  # other data: every tensor of the target differs from the source's
    model, opt = _adamw_wrapper(template, **dst_kw)
    twin, twin_opt = _adamw_wrapper(template, **dst_kw)
    _train(model, opt, data)
    _train(twin, twin_opt, data)
    before = checksum(opt, model)
    assert before == checksum(twin_opt, twin)

    with pytest.raises(Exception) as info:
        opt.load_state_dict(state)
    assert checksum(opt, model) == before, f"the refused load ({info.value!r}) changed the wrapper"
    assert isinstance(info.value, ValueError), f"expected ValueError, got {info.value!r}"

    more = batches(5, 4)
    _train(model, opt, more)
    _train(twin, twin_opt, more)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_state_of_other_shapes_with_the_same_padded_size_is_refused():
    """Linear(4, 8) and Linear(8, 4) have the same number of params and the same padded buffer;
    the load must be refused (ValueError, nothing changed), not fail at the next Adam step."""
    def build(model):
        opt = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                    accumulation_steps=2)
        x = torch.randn(3, model.in_features)
        for _ in range(3):  # one window (Adam state exists) and one micro-batch of the next
            model(x).square().mean().backward()
            opt.step()
        return opt

    src = build(nn.Linear(4, 8))
    assert [t.shape for t in src.state_dict()["accumkernels"]["window"]["main_grad"]] \
        == [torch.Size([64])]
    state = roundtrip(src.state_dict())
    model = nn.Linear(8, 4)
    opt = build(model)
    assert [t.shape for t in opt.state_dict()["accumkernels"]["window"]["main_grad"]] \
        == [torch.Size([64])]
    before = checksum(opt, model)
    with pytest.raises(ValueError):
        opt.load_state_dict(state)
    assert checksum(opt, model) == before
    model(torch.randn(3, 8)).square().mean().backward()  # the wrapper still works
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("cut", ["after-nan", "at-boundary"])
def test_in_memory_round_trip_keeps_a_nan_window_skipped(cut, in_backward):
    """``opt.load_state_dict(opt.state_dict())`` is a no-op: a window holding a NaN micro-batch
    is still skipped (the live non-finite flag must survive being copied onto itself)."""
    N = 3
    model = make_model()
    opt = _sgd(model, accumulation_steps=N, accumulate_in_backward=in_backward)
    start = params_of(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        loss = mse(model, x, y)
        (loss * math.nan if i == 1 else loss).backward()
        if cut == "at-boundary" and i == N - 1:
            opt.load_state_dict(opt.state_dict())
        opt.step()
        if cut == "after-nan" and i == 1:
            opt.load_state_dict(opt.state_dict())
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start)), \
        "a NaN window reached the weights"
    assert opt.skipped_steps == 1 and opt.micro_steps == 0
    for x, y in batches(N, 4):
        mse(model, x, y).backward()
        opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))


def test_resume_mid_window_keeps_grads_not_yet_accumulated():
    """accumulate_in_backward=False, checkpoint after 2 of 4 backwards with no accumulate()/step()
    in between (Trainer-style loop): the grads sitting in .grad must survive the checkpoint."""
    N, lr = 4, 0.1
    template = make_model()
    data = batches(2 * N, 4)
    cut = N + 2

    def build():
        model = copy.deepcopy(template)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                    accumulation_steps=N, accumulate_in_backward=False,
                                    bucket_size_mb=SMALL_BUCKET)
        return model, opt

    def train(model, opt, indices):
        for i in indices:
            mse(model, *data[i]).backward()
            if (i + 1) % N == 0:
                opt.step()

    native = copy.deepcopy(template)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr, momentum=0.9)
    for w in range(2):
        for x, y in data[w * N:(w + 1) * N]:
            mse(native, x, y).backward()
        native_opt.step()
        native_opt.zero_grad()
    whole, whole_opt = build()
    train(whole, whole_opt, range(2 * N))
    assert_params_close(whole, native, what="uninterrupted: ")

    model, opt = build()
    train(model, opt, range(cut))
    state = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build()  # fresh model, optimizer and wrapper
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, range(cut, 2 * N))
    assert opt.micro_steps == 0
    # fp32 sums of the same grads, possibly in another order: a few ulps of O(1) params.
    assert_params_close(model, whole, what="resumed: ")


# -- an exception in the middle of a backward ---------------------------------------------------

class _Boom(RuntimeError):
    pass


class _BombFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.owner.armed:
            raise _Boom("a module failed in the middle of the backward")
        return g, None


class Bomb(nn.Module):
    """Identity whose backward raises while armed: the layers above it have their gradients by
    then (some buckets complete, some not), the layers below never get theirs."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return _BombFn.apply(x, self)


def bomb_model():
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), Bomb(), nn.Linear(24, 16), nn.Tanh(),
                         nn.Linear(16, 5))


def _failing_backward(model, x, y):
    model[2].armed = True
    try:
        with pytest.raises(_Boom):
            mse(model, x, y).backward()
    finally:
        model[2].armed = False


@pytest.mark.parametrize("bucket_mb", [SMALL_BUCKET, 25], ids=["buckets", "one-bucket"])
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_exception_mid_backward_leaves_a_consistent_window(in_backward, bucket_mb):
    """Micro-batch 2 of a window raises in its backward; the user catches it and goes on. The
    window must hold the failed micro-batch fully out (= native without it) or exactly its
    partial gradients (= native, which keeps them in .grad); the next window is normal."""
    lr, fail = 0.1, 1
    template = bomb_model()
    window1, window2 = batches(3, 4), batches(2, 4)

    def run(model, opt, mode):
        for i, (x, y) in enumerate(window1):
            if i == fail:
                if mode != "without":
                    _failing_backward(model, x, y)
                continue
            mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        after1 = params_of(model)
        for x, y in window2:
            mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        return after1

    refs = {}
    for mode in ("without", "partial"):
        ref = copy.deepcopy(template)
        refs[mode] = (run(ref, torch.optim.SGD(ref.parameters(), lr=lr), mode), ref)
    assert not all_close(refs["without"][0], refs["partial"][0])  # partial grads do exist

    model = copy.deepcopy(template)
    opt = _sgd(model, lr=lr, accumulate_in_backward=in_backward, bucket_size_mb=bucket_mb)
    after1 = run(model, opt, "wrapper")
    matching = [mode for mode, (ref1, _) in refs.items() if all_close(after1, ref1)]
    assert matching, ("after a backward that raised, the window is neither without the failed "
                      "micro-batch nor with exactly its partial gradients")
    assert_params_close(model, refs[matching[0]][1], what="the window after the failure: ")


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_reset_window_after_a_failed_backward_resumes_training(in_backward):
    N, lr = 2, 0.1
    template = bomb_model()
    model, native = copy.deepcopy(template), copy.deepcopy(template)
    opt = _sgd(model, lr=lr, accumulation_steps=N, accumulate_in_backward=in_backward)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    mse(model, *batches(1, 4)[0]).backward()
    opt.step()
    _failing_backward(model, *batches(1, 4)[0])
    opt.reset_window()
    assert opt.micro_steps == 0
    for w in range(3):
        data = batches(N, 4)
        before = params_of(model)
        for x, y in data:  # Accelerate style: step() after every micro-batch
            mse(model, x, y).backward()
            opt.step()
        for x, y in data:
            mse(native, x, y).backward()
        native_opt.step()
        native_opt.zero_grad()
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), \
            f"window {w} after reset_window() did not step"
        assert_params_close(model, native, what=f"window {w}: ")


# -- overflow never reaches the weights ----------------------------------------------------------

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dynamic_loss_scale_survives_200_overflowing_windows(dtype):
    """200 windows in a row hold a non-finite micro-batch (each backs the scale off); then healthy
    windows: the scale stays positive and finite, and training resumes (like native for fp32)."""
    N, lr = 2, 0.1
    template = make_model(dtype)
    model, native = copy.deepcopy(template), copy.deepcopy(template)
    opt = _sgd(model, lr=lr, accumulation_steps=N, loss_scale="dynamic")
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    start = params_of(model)
    x, y = batches(1, 4, dtype)[0]
    bad = x.clone()
    bad[0, 0] = math.inf
    for _ in range(200):
        for inp in (bad, x):
            opt.scale_loss(mse(model, inp, y)).backward()
            opt.step()
    assert opt.skipped_steps == 200
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    scale = float(opt.loss_scale)
    assert math.isfinite(scale) and scale > 0, f"loss scale {scale} after 200 overflows"
    for w in range(3):
        data = batches(N, 4, dtype)
        before = params_of(model)
        for xi, yi in data:
            opt.scale_loss(mse(model, xi, yi)).backward()
            opt.step()
        assert opt.skipped_steps == 200, f"healthy window {w} was skipped"
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"window {w}: not finite"
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), \
            f"healthy window {w} did not change the params"
        if dtype == torch.float32:
            for xi, yi in data:
                mse(native, xi, yi).backward()
            native_opt.step()
            native_opt.zero_grad()
            assert_params_close(model, native, atol=1e-5, what=f"window {w}: ")
        scale = float(opt.loss_scale)
        assert math.isfinite(scale) and scale > 0


# -- nothing piles up ------------------------------------------------------------------------

def test_discarded_wrappers_leave_no_hooks_behind():
    """100 wrap-and-discard cycles on one model (``del opt; gc.collect()``, half of them discarded
    mid-window): the hooks do not pile up, the wrappers are freed, and a fresh wrapper trains
    like native."""
    N, lr = 2, 0.1
    gc.collect()
    gc.freeze()  # keeps the 100 full collections cheap: only objects made here are scanned
    try:
        template = make_model()
        model, native = copy.deepcopy(template), copy.deepcopy(template)
        opt = _sgd(model, lr=lr, accumulation_steps=N)
        per_wrapper = count_hooks(model)
        del opt
        gc.collect()
        refs = []
        for i in range(100):
            opt = _sgd(model, lr=lr, accumulation_steps=N)
            refs.append(weakref.ref(opt))
            hooks = count_hooks(model)
            assert hooks <= 2 * per_wrapper, f"cycle {i}: {hooks} hooks ({per_wrapper} per wrapper)"
            if i % 2:
                mse(model, *batches(1, 4)[0]).backward()
            del opt
            gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} discarded wrappers are still alive"
        model.zero_grad()
        opt = _sgd(model, lr=lr, accumulation_steps=N)
        native_opt = torch.optim.SGD(native.parameters(), lr=lr)
        for w in range(2):
            data = batches(N, 4)
            for x, y in data:
                mse(model, x, y).backward()
                opt.step()
                mse(native, x, y).backward()
            native_opt.step()
            native_opt.zero_grad()
            assert_params_close(model, native, what=f"window {w}: ")
        assert count_hooks(model) == per_wrapper
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrapping_the_same_optimizer_twice_is_refused(dtype):
    N, lr = 2, 0.1
    model = make_model(dtype)
    native = copy.deepcopy(model)
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    hooks = count_hooks(model)
    views = [p.main_grad.data_ptr() for p in model.parameters()]
    with pytest.raises((ValueError, RuntimeError)):
        AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    # The refused construction left the first wrapper's hooks and buffer views alone.
    assert count_hooks(model) == hooks
    assert [p.main_grad.data_ptr() for p in model.parameters()] == views
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    start = params_of(model)
    for x, y in batches(N, 4, dtype):
        mse(model, x, y).backward()
        opt.step()
        mse(native, x, y).backward()
    native_opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))
    if dtype == torch.float32:
        assert_params_close(model, native)


# -- frozen params ---------------------------------------------------------------------------

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
    opt = _sgd(model, lr=lr, accumulation_steps=N, reduction=reduction)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    factor = 1.0 / N if reduction == "mean" else 1.0

    def window(name, first_after_unfreeze=False):
        data = batches(N, 4)
        for i, (x, y) in enumerate(data):
            loss = mse(model, x, y)
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
            (mse(native, x, y) * factor).backward()
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


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set_to_none", "zero"])
def test_zero_grad_clears_params_frozen_at_wrap_time(set_to_none):
    """The wrapper's zero_grad() clears every param of its param_groups like the inner
    optimizer's would, those frozen when it was built included."""
    model = make_model()
    model[0].weight.requires_grad_(False)
    native = copy.deepcopy(model)
    opt = _sgd(model, accumulation_steps=2)
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


# -- a failing call changes nothing -------------------------------------------------------------

def _weighted(n_backwards, steps, weights_before=()):
    model = make_model()
    native = copy.deepcopy(model)
    opt = _sgd(model, accumulation_steps=steps, reduction="weighted")
    data = batches(n_backwards, 4)
    for i, (x, y) in enumerate(data):
        if i < len(weights_before):
            opt.add_weight(weights_before[i])
        mse(model, x, y).backward()
    return model, native, opt, data


def _native_weighted(native, data, weights, lr=0.1):
    total = sum(weights)
    for x, y in data:
        (mse(native, x, y) / total).backward()
    torch.optim.SGD(native.parameters(), lr=lr).step()


def _no_weights(call, steps, n=2):
    """step()/flush() of a 'weighted' window whose weights were not reported: ValueError; then
    the weights come and the step equals native sum(g) / sum(w)."""
    def scenario():
        model, native, opt, data = _weighted(n, steps)
        weights = [float(w) for w in torch.randint(1, 9, (n,))]

        def fail():
            getattr(opt, call)()

        def recover():
            for w in weights:
                opt.add_weight(w)
            getattr(opt, call)()
            _native_weighted(native, data, weights)
            assert_params_close(model, native)
        return model, opt, fail, (ValueError,), recover
    return scenario


def _bad_weight(weight, errors, reduction="weighted"):
    """add_weight() with a bad value: refused; then the window completes like native."""
    def scenario():
        model, native, opt, data = _weighted(1, 2, weights_before=[3.0])
        if reduction != "weighted":
            model = make_model()
            native = copy.deepcopy(model)
            opt = _sgd(model, accumulation_steps=2, reduction=reduction)
            mse(model, *data[0]).backward()

        def fail():
            opt.add_weight(weight() if callable(weight) else weight)

        def recover():
            x, y = batches(1, 4)[0]
            if reduction == "weighted":
                opt.add_weight(5.0)
            mse(model, x, y).backward()
            opt.step()
            if reduction == "weighted":
                _native_weighted(native, data + [(x, y)], [3.0, 5.0])
            else:
                for xi, yi in data + [(x, y)]:
                    mse(native, xi, yi).backward()
                torch.optim.SGD(native.parameters(), lr=0.1).step()
            assert_params_close(model, native)
        return model, opt, fail, errors, recover
    return scenario


FAILING_CALLS = {
    "step-weighted-no-weights-at-N": _no_weights("step", steps=2),
    "step-weighted-no-weights-steps-None": _no_weights("step", steps=None),
    "flush-weighted-no-weights": _no_weights("flush", steps=3),
    "add_weight-negative": _bad_weight(-1.0, (ValueError,)),
    "add_weight-zero": _bad_weight(0.0, (ValueError,)),
    "add_weight-nan": _bad_weight(math.nan, (ValueError,)),
    "add_weight-inf": _bad_weight(math.inf, (ValueError,)),
    "add_weight-str": _bad_weight("4", (TypeError,)),
    "add_weight-bool": _bad_weight(True, (TypeError,)),
    "add_weight-2-element-tensor": _bad_weight(lambda: torch.tensor([1.0, 2.0]),
                                               (TypeError, ValueError, RuntimeError)),
    "add_weight-reduction-sum": _bad_weight(2.0, (ValueError,), reduction="sum"),
}


@pytest.mark.parametrize("case", list(FAILING_CALLS))
def test_failing_call_changes_nothing(case):
    model, opt, fail, errors, recover = FAILING_CALLS[case]()
    before = checksum(opt, model)
    with pytest.raises(errors):
        fail()
    assert checksum(opt, model) == before, "the failing call changed the wrapper's state"
    recover()


def test_backward_after_a_complete_window_is_refused_cleanly_or_joins_it():
    """A backward after the window of N micro-batches is complete, before step(): either it is
    refused (RuntimeError) and changes nothing, or it joins the window as native accumulation
    would. Then step() equals native over the micro-batches the window holds."""
    N, lr = 2, 0.1
    model = make_model()
    native = copy.deepcopy(model)
    opt = _sgd(model, lr=lr, accumulation_steps=N)
    data = batches(N + 1, 4)
    for x, y in data[:N]:
        mse(model, x, y).backward()
    before = checksum(opt, model)
    try:
        mse(model, *data[N]).backward()
    except RuntimeError:
        assert checksum(opt, model) == before, "the refused backward changed the wrapper's state"
        window = data[:N]
    else:
        window = data
    opt.step()
    for x, y in window:
        mse(native, x, y).backward()
    torch.optim.SGD(native.parameters(), lr=lr).step()
    assert_params_close(model, native)


def test_failed_construction_leaves_the_params_untouched():
    """A wrapper whose construction fails (a backend unusable on the params' device) leaves no
    trace on the params: no main_grad, no slot, no hooks."""
    model = make_model()
    with pytest.raises((ValueError, RuntimeError)):
        _sgd(model, accumulation_steps=2, backend="cuda")  # CPU params
    for name, p in model.named_parameters():
        assert not hasattr(p, "main_grad"), f"{name}.main_grad set by a failed construction"
        assert not hasattr(p, "accumkernels_slot"), f"{name} slot set by a failed construction"
    assert count_hooks(model) == 0


# -- soak ------------------------------------------------------------------------------------

def test_soak_3000_micro_steps_nothing_piles_up():
    """3000 micro-steps (Linear(8, 8), N=4, sum; Accelerate-style step()+zero_grad() every
    micro-step, a NaN micro-batch now and then, state_dict() now and then): live tensors and
    hooks do not grow between micro-step 500 and 3000, and the params track native."""
    N, lr, steps = 4, 0.05, 3000
    model = nn.Linear(8, 8)
    native = copy.deepcopy(model)
    opt = _sgd(model, lr=lr, accumulation_steps=N)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    poisoned_window = False
    skipped = 0
    for i in range(steps):
        x = torch.randn(4, 8)
        bad = i % 97 == 13
        loss = (model(x) - x.flip(1)).square().mean()
        (loss * math.nan if bad else loss).backward()
        opt.step()
        opt.zero_grad()
        if not bad:
            (native(x) - x.flip(1)).square().mean().backward()
        poisoned_window |= bad
        if i % N == N - 1:
            if poisoned_window:
                skipped += 1
            else:
                native_opt.step()
            native_opt.zero_grad()
            poisoned_window = False
        if i % 100 == 50:
            opt.state_dict()
        if i == 499:
            tensors_500, hooks_500 = live_tensors(), count_hooks(model)
    tensors_end = live_tensors()
    assert tensors_end <= tensors_500 + 4, f"live tensors grew: {tensors_500} -> {tensors_end}"
    assert count_hooks(model) == hooks_500
    assert opt.skipped_steps == skipped > 0
    assert_params_close(model, native, atol=1e-5)
