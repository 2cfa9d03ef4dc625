"""The host paths of issue 48: the intake's hooks in C (csrc/grad_hooks.cpp) and in Python give
native's result alike, the guard's once-per-backward reader pass sees every change the Python
rules see, and the step's fast paths (nothing assigned, every view held) change nothing a caller
can observe.

Each loop runs three times on the same model and data: native PyTorch, the wrapper with the C
hooks, the wrapper with the Python hooks (``intake_hooks.C_HOOKS = None``); fp32 models must
match native bit for bit (the window sums fp32 gradients in fp32, in native's order).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint as ckpt
from torch import nn

from accumkernels import AccumulatingOptimizer
from accumkernels.ops import host
from accumkernels.ops.backends import native
from accumkernels.optim.intake import intake as intake_mod
from accumkernels.optim.intake import hooks as intake_hooks
from tests.optim._optim_common import D_IN, D_OUT, SMALL_BUCKET, batches, make_model, mse

HOOKS = ["c", "python"]


@pytest.fixture
def hooks(request, monkeypatch):
    """Which hooks the wrappers built in the test get."""
    if request.param == "c":
        if intake_hooks.C_HOOKS is None:
            pytest.fail("accumkernels._C lacks the C hooks (PreHook/PostHook)")
    else:
        monkeypatch.setattr(intake_hooks, "C_HOOKS", None)
    return request.param


class Reentrant(nn.Module):
    """An MLP whose middle runs under reentrant checkpointing (a backward inside a backward)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(D_IN, 16), nn.Linear(16, 16), nn.Linear(16, D_OUT)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = ckpt.checkpoint(lambda t: torch.tanh(self.b(t)), h, use_reentrant=True)
        return self.c(h)


def _loop(model, opt, data, *, per_window=3, how="plain"):
    """Windows of ``per_window`` micro-batches; ``how`` varies what happens around them."""
    for k, (x, y) in enumerate(data):
        loss = mse(model, x, y)
        if how == "create_graph":
            loss.backward(create_graph=True)
        elif how == "freeze_between" and k % per_window == 1:
            last = list(model.parameters())[-1]
            last.requires_grad_(False)  # frozen after the forward: natively .grad stays as is
            loss.backward()
            last.requires_grad_(True)
        else:
            loss.backward()
        if how == "clear_mid" and k % per_window == 0:
            model.zero_grad()  # from outside, mid-window (N None: native drops those grads)
        if how == "assign" and k % per_window == 1:
            p = next(iter(model.parameters()))
            p.grad = p.grad * 2  # an assigned .grad is what p's gradient means from now on
        if k % per_window == per_window - 1:
            opt.step()
            opt.zero_grad()
            if how == "create_graph":
                for p in model.parameters():
                    p.grad = None  # (break create_graph's cycle, as torch advises)


def _three(build, how="plain", dtype=torch.float32, steps=3, **wrap):
    """Native, and the wrapper with the hooks in use; the models after ``steps`` windows."""
    data = batches(3 * steps, 4, dtype=dtype)
    base = build().to(dtype)
    native_model, model = copy.deepcopy(base), copy.deepcopy(base)
    native_opt = torch.optim.SGD(native_model.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                bucket_size_mb=SMALL_BUCKET, **wrap)
    _loop(native_model, native_opt, data, how=how)
    _loop(model, opt, data, how=how)
    return native_model, model, opt


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
@pytest.mark.parametrize("how", ["plain", "create_graph", "freeze_between", "clear_mid",
                                 "assign"])
def test_hooks_match_native_fp32(hooks, how):
    """fp32: every param equals native's, bit for bit, after three windows."""
    native_model, model, _ = _three(make_model, how)
    for (name, p), q in zip(model.named_parameters(), native_model.parameters()):
        assert torch.equal(p, q), (hooks, how, name, (p - q).abs().max())


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
def test_hooks_reentrant_checkpoint(hooks):
    """A param whose gradient arrives in a backward nested in the outer one (reentrant
    checkpointing) still lands once per micro-batch."""
    native_model, model, _ = _three(Reentrant)
    for (name, p), q in zip(model.named_parameters(), native_model.parameters()):
        assert torch.equal(p, q), (hooks, name)


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
@pytest.mark.parametrize("nonfinite", ["skip_step", "skip_microbatch"])
def test_hooks_bf16_masters(hooks, nonfinite):
    """bf16 model, fp32 masters: the C and the Python hooks give the same bits (native sums in
    bf16, so the reference here is the other hook kind, and a float64 sum bounds both)."""
    torch.manual_seed(1234)
    ref_state = make_model().state_dict()
    data = batches(6, 4)
    finals = {}
    for kind in ("c", "python"):
        prev = intake_hooks.C_HOOKS
        if kind == "python":
            intake_hooks.C_HOOKS = None
        try:
            model = make_model()
            model.load_state_dict(ref_state)
            model = model.to(torch.bfloat16)
            opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                        bucket_size_mb=SMALL_BUCKET, nonfinite=nonfinite)
            _loop(model, opt, [(x.bfloat16(), y.bfloat16()) for x, y in data])
            finals[kind] = [p.detach().clone() for p in model.parameters()]
        finally:
            intake_hooks.C_HOOKS = prev
    for a, b in zip(finals["c"], finals["python"]):
        assert torch.equal(a, b)


def test_c_hooks_are_installed_and_take_the_common_case(monkeypatch):
    """With the extension's hooks the Python ``before_grad`` runs once per backward (its first
    hook opens it) and ``after_grad`` never, on a loop with nothing unusual."""
    if intake_hooks.C_HOOKS is None:
        pytest.fail("accumkernels._C lacks the C hooks (PreHook/PostHook)")
    calls = {"before_grad": 0, "after_grad": 0}
    for name in calls:
        original = getattr(intake_mod.Intake, name)

        def counted(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)
        monkeypatch.setattr(intake_mod.Intake, name, counted)
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    pre_type, post_type = intake_hooks.C_HOOKS
    p = next(model.parameters())
    assert any(isinstance(h, pre_type) for h in p._backward_hooks.values())
    assert any(isinstance(h, post_type) for h in p._post_accumulate_grad_hooks.values())
    data = batches(6, 4)
    _loop(model, opt, data)
    assert calls == {"before_grad": 6, "after_grad": 0}, calls


def test_c_hooks_refuse_bad_arguments():
    """The hook types check what they are built from and called with (TypeError)."""
    if intake_hooks.C_HOOKS is None:
        pytest.fail("accumkernels._C lacks the C hooks (PreHook/PostHook)")
    pre_type, _ = intake_hooks.C_HOOKS
    import weakref

    from accumkernels.optim.intake.moves import HookState

    class Owner:
        pass

    owner, p = Owner(), torch.zeros(2, requires_grad=True)
    state = HookState([torch.zeros(2)], [None])
    with pytest.raises(TypeError):
        pre_type(1, state, 0, None)
    bad = HookState([torch.zeros(2)], [None])
    bad.hidden = []  # (a state whose containers are not what the hooks read: refused)
    with pytest.raises(TypeError, match="state.hidden must be a set"):
        pre_type(weakref.ref(owner), bad, 0, weakref.ref(p))
    hook = pre_type(weakref.ref(owner), state, 0, weakref.ref(p))
    with pytest.raises(TypeError):
        hook()
    with pytest.raises(TypeError):
        hook(torch.zeros(2), torch.zeros(2))
    del owner
    assert hook(torch.zeros(2)) is None  # (its intake is gone: nothing to do)


def test_metas_record_sees_every_change():
    """``metas_same`` is False after each change the guard's Python rules look for, True for
    the untouched list; a list it cannot record gives ``b""``."""
    if not native.READER:
        pytest.fail("the tensor reader is off: " + native.READER_NOTE)
    def fresh():
        return [torch.zeros(3, 4), torch.zeros(5), nn.Parameter(torch.zeros(2, 2))]
    changes = {
        "data (same layout, new memory)": lambda ts: setattr(ts[1], "data", torch.zeros(5)),
        "dtype": lambda ts: setattr(ts[2], "data", ts[2].data.half()),
        "sizes": lambda ts: setattr(ts[0], "data", torch.zeros(4, 3)),
        "layout": lambda ts: setattr(ts[0], "data", ts[0].data.t()),
        "neg bit": lambda ts: setattr(ts[1], "data", torch.zeros(5, dtype=torch.complex64)
                                      .conj().imag),
    }
    for what, change in changes.items():
        ts = fresh()
        record = host.metas_snapshot(ts)
        assert record and host.metas_same(ts, record), what
        change(ts)
        assert not host.metas_same(ts, record), what
    ts = fresh()
    ts[0] = ts[0].t()
    assert host.metas_snapshot(ts) == b""  # (strides are not recorded: not contiguous)
    assert not host.metas_same(ts, b"")
    ts = fresh()  # the last ones by their address only: their other changes are not seen
    record = host.metas_snapshot(ts, full=2)
    assert record and host.metas_same(ts, record)
    ts[2].data = ts[2].data.view(4)  # (same address)
    assert host.metas_same(ts, record)
    ts[2].data = torch.zeros(2, 2)
    assert not host.metas_same(ts, record)
    assert not host.metas_same(ts[:2], record)


def test_grads_are():
    """``grads_are`` is True exactly when every ``.grad`` is its view object."""
    params = [nn.Parameter(torch.zeros(3)) for _ in range(4)]
    views = [torch.zeros(3) for _ in params]
    assert not host.grads_are(params, views)
    for p, v in zip(params, views):
        p.grad = v
    assert host.grads_are(params, views)
    params[2].grad = views[2].clone()  # equal values, another object
    assert not host.grads_are(params, views)
    params[2].grad = None
    assert not host.grads_are(params, views)
    assert not host.grads_are(params, views[:3])


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
@pytest.mark.parametrize("change", ["half", "relayout", "swap_grad_data"])
def test_guard_sees_changes_between_backwards(hooks, change):
    """Between two backwards of a window: ``model.half()`` is refused (ValueError) before
    anything of the backward is counted; a transposed ``.data`` and a swapped view keep the
    window native's (fp32, bit for bit)."""
    data = batches(3, 4)
    base = make_model()
    native_model, model = copy.deepcopy(base), copy.deepcopy(base)
    native_opt = torch.optim.SGD(native_model.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    for m in (native_model, model):
        mse(m, *data[0]).backward()
    if change == "half":
        model.half()
        with pytest.raises(ValueError, match="when the AccumulatingOptimizer was built"):
            mse(model, data[1][0].half(), data[1][1].half()).backward()
        assert opt.micro_steps == 1
        return
    for m in (native_model, model):
        w = m[0].weight
        if change == "relayout":
            w.data = w.data.t().contiguous().t()  # same values, the other memory order
        else:
            w.grad.data = w.grad.data.clone()  # the view's .data swapped (a dtype round trip)
    for m in (native_model, model):
        for x, y in data[1:]:
            mse(m, x, y).backward()
    native_opt.step()
    opt.step()
    for (name, p), q in zip(model.named_parameters(), native_model.parameters()):
        assert torch.equal(p, q), (change, name)


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
@pytest.mark.parametrize("clip", [None, 0.05])
def test_step_decides_from_the_window_on_the_fast_path(hooks, clip):
    """A NaN written into one view through its storage (no version bump, nothing assigned):
    the step is skipped, with and without clipping; the next window steps as native."""
    data = batches(4, 4)
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), max_grad_norm=clip)
    before = [p.detach().clone() for p in model.parameters()]
    for x, y in data[:2]:
        mse(model, x, y).backward()
    view = list(model.parameters())[3].grad
    view.detach().numpy()[0] = float("nan")  # a write torch does not see
    opt.step()
    assert opt.skipped_steps == 1
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b)


@pytest.mark.parametrize("hooks", HOOKS, indirect=True)
def test_finite_window_whose_sum_overflows_still_steps(hooks):
    """Without clipping the step checks finiteness by one sum per flat buffer; finite gradients
    whose fp32 sum overflows (two entries of 3e38) are looked at again element by element: the
    step is taken, as natively."""
    data = batches(2, 4)
    base = make_model()
    native_model, model = copy.deepcopy(base), copy.deepcopy(base)
    native_opt = torch.optim.SGD(native_model.parameters(), lr=1e-40)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=1e-40))
    for m in (native_model, model):
        for x, y in data:
            mse(m, x, y).backward()
        m[0].weight.grad[0, :2] = 3e38  # (each finite; their sum is not)
    assert not torch.isfinite(model[0].weight.grad.sum())
    native_opt.step()
    opt.step()
    assert opt.skipped_steps == 0
    for (name, p), q in zip(model.named_parameters(), native_model.parameters()):
        assert torch.equal(p, q), name
