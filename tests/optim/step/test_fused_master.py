"""The wrapper's fused master step (optim/fused_master.py): for a bf16/fp16 model with master
weights and an inner ``torch.optim.AdamW``/``Adam``/``SGD`` built with ``fused=True``, a real step
is one pass of ``master_adam_step_``/``master_sgd_step_`` (exact take-in of user-written weights,
the update, the rounded weight); a group key or value it does not implement takes torch's own
step.

The judge is a hand-kept reference of what master weights mean, built from torch alone: fp32
masters stepped by torch's own fused optimizer on the window (the micro-batch gradients summed in
fp32, normalised as the wrapper folds it: ``grad_scale``), then ``weight.copy_(master)``; a weight
the user wrote is taken where it differs from the rounded master. Params, masters and every
optimizer state tensor must be bit-identical. Data are fresh on every run (the seed is in the
failure message)."""

from __future__ import annotations

import os

import pytest
import torch

from accumkernels import AccumulatingOptimizer
from accumkernels.optim.step import fused_master

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

N = 3


@pytest.fixture
def seed() -> int:
    return int.from_bytes(os.urandom(8), "little") >> 1


def make_model(dtype: torch.dtype, seed: int, *, mixed: bool = False) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 37), torch.nn.GELU(), torch.nn.Linear(37, 5),
                                torch.nn.LayerNorm(5))
    model.to(dtype)
    if mixed:
        model[3].float()  # a norm kept in fp32: params without masters in the same group
    return model


def loss_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    dtype = model[0].weight.dtype
    h = model[2](model[1](model[0](x.to(dtype))))
    return model[3](h.to(model[3].weight.dtype)).float().square().mean()


def inner_of(kind: str, params, **kw) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True, **kw)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2, weight_decay=0.05, fused=True, **kw)
    if kind == "amsgrad":
        return torch.optim.AdamW(params, lr=1e-2, amsgrad=True, fused=True, **kw)
    if kind == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01,
                               fused=True, **kw)
    if kind == "sgd_nesterov":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, fused=True, **kw)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, fused=True, **kw)
    raise AssertionError(kind)


class Reference:
    """Master weights from torch alone: fp32 copies of the low-precision params, torch's fused
    optimizer over them (fp32 params stepped in place), the window summed in fp32 and folded
    into ``grad_scale`` as the wrapper folds it, the copy-back by torch's cast."""

    def __init__(self, model: torch.nn.Module, kind: str, reduction: str, clip: float | None,
                 **kw):
        self.model, self.reduction, self.clip = model, reduction, clip
        self.params = list(model.parameters())
        self.masters = [p.detach().float().clone().requires_grad_() if p.dtype != torch.float32
                        else p for p in self.params]
        self.inner = inner_of(kind, self.masters, **kw)
        self.window = [torch.zeros_like(m) for m in self.masters]
        self.count = 0

    def backward(self, x: torch.Tensor) -> None:
        for p in self.params:
            p.grad = None
        loss_of(self.model, x).backward()
        for w, p in zip(self.window, self.params):
            if p.grad is not None:
                w.add_(p.grad.float())
        self.count += 1

    def user_writes(self) -> None:
        """Take in weights written behind the optimizer (the contract of master weights)."""
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                if m is not p:
                    m.copy_(torch.where(p.ne(m.to(p.dtype)), p.float(), m))

    def step(self) -> None:
        self.norms = getattr(self, "norms", [])
        self.user_writes()
        # the wrapper's fold (optim/step.py): the window's norm as clip_grad_norm_ measures
        # it, times the normalisation factor; grad_scale = clip coefficient / factor
        factor = 1.0 / self.count if self.reduction == "mean" else 1.0
        scale = torch.tensor(1.0 / factor)
        if self.clip is not None:
            norm = torch.nn.utils.get_total_norm(
                [w for w, p in zip(self.window, self.params) if p.requires_grad]) * factor
            self.norms.append(norm.float())
            scale = torch.clamp((norm + 1e-6) / self.clip, min=1.0) / factor
        for m, w, p in zip(self.masters, self.window, self.params):
            m.grad = w.clone() if p.requires_grad else None
        if factor != 1.0 or self.clip is not None:
            self.inner.grad_scale, self.inner.found_inf = scale, torch.zeros(())
        self.inner.step()
        self.inner.__dict__.pop("grad_scale", None)
        self.inner.__dict__.pop("found_inf", None)
        with torch.no_grad():
            for m, p in zip(self.masters, self.params):
                if m is not p:
                    p.copy_(m)
        for w in self.window:
            w.zero_()
        self.count = 0


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
    return torch.equal(a.detach().contiguous().view(ints[a.dtype]),
                       b.detach().contiguous().view(ints[b.dtype]))


def assert_same_run(opt: AccumulatingOptimizer, ref: Reference, seed: int) -> None:
    """Params, masters, state (below), and every loss and clip norm of the run, bit for bit."""
    assert_same_state(opt, ref, seed)
    assert all(same_bits(a, b) for a, b in zip(opt.losses, ref.losses)), f"losses (seed {seed})"
    if ref.clip is not None:
        assert all(same_bits(a.reshape(()), b.reshape(())) for a, b in zip(opt.norms, ref.norms)), \
            f"clip norms (seed {seed})"


def assert_same_state(opt: AccumulatingOptimizer, ref: Reference, seed: int) -> None:
    for i, (p, q) in enumerate(zip(opt.optimizer.param_groups[0]["params"], ref.params)):
        assert same_bits(p, q), f"param {i} differs (seed {seed})"
        mine, theirs = opt.optimizer.state.get(p, {}), ref.inner.state.get(ref.masters[i], {})
        assert sorted(mine) == sorted(theirs), (i, sorted(mine), sorted(theirs))
        for key, value in theirs.items():
            assert same_bits(mine[key], value), f"state {key!r} of param {i} (seed {seed})"
    # a master is read with the weight the user wrote since the last step taken in (as the next
    # step takes it in: README, checkpoints)
    theirs = [torch.where(p.detach() != m.detach().to(p.dtype), p.detach().float(), m)
              for m, p in zip(ref.masters, ref.params) if m is not p and p.requires_grad]
    assert len(opt.master_params) == len(theirs)  # (a frozen param is not managed: no master)
    for m, rm in zip(opt.master_params, theirs):
        assert same_bits(m, rm), f"master differs (seed {seed})"


def train(kind: str, dtype: torch.dtype, seed: int, *, reduction: str = "sum",
          clip: float | None = None, mixed: bool = False, writes=None, windows: int = 3,
          frozen: bool = False, zero_grad_each: bool = False, edit=None, **kw):
    """The same loop on the wrapper and on the reference; returns both and, per window, the
    losses and clip norms of each (``opt.losses``/``ref.losses``, ``opt.norms``/``ref.norms``).
    ``frozen``: the first layer's bias frozen; ``zero_grad_each``: N given, ``opt.step()``
    after every backward and ``model.zero_grad()`` (not the optimizer's) after each window;
    ``writes(model, w)`` after each window's step; ``edit(group)`` on every param group of both
    inner optimizers once built."""
    model = make_model(dtype, seed, mixed=mixed)
    ref = Reference(make_model(dtype, seed, mixed=mixed), kind, reduction, clip, **kw)
    if frozen:
        model[0].bias.requires_grad_(False)
        ref.model[0].bias.requires_grad_(False)
        ref.params[1].requires_grad_(False)
    # accumulation_steps=None (the Trainer's recipe): "mean" divides at the step, folded into
    # the fused step's grad_scale (with N declared the 1/N would be fused into accumulation)
    opt = AccumulatingOptimizer(inner_of(kind, model.parameters(), **kw), reduction=reduction,
                                max_grad_norm=clip,
                                accumulation_steps=N if zero_grad_each else None)
    for group in (opt.optimizer.param_groups + ref.inner.param_groups) if edit else ():
        edit(group)
    opt.losses, opt.norms, ref.losses = [], [], []
    gen = torch.Generator().manual_seed(seed)
    for w in range(windows):
        for _ in range(N):
            x = torch.randn(4, 13, generator=gen)
            loss = loss_of(model, x)
            loss.backward()
            opt.losses.append(loss.detach())
            ref.losses.append(loss_of(ref.model, x).detach())
            ref.backward(x)
            if zero_grad_each:
                opt.step()  # every micro-batch (Accelerate-style): a no-op until N are in
        if zero_grad_each:
            model.zero_grad()  # the model's, not the optimizer's, after the window's step
        else:
            opt.step()
            opt.zero_grad()
        opt.norms.append(opt.last_grad_norm)
        ref.step()
        if writes is not None:
            writes(model, w)
            writes(ref.model, w)
    return opt, ref


KINDS = ["adamw", "adam", "amsgrad", "sgd_momentum", "sgd_nesterov", "sgd"]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reduction,clip", [("sum", None), ("mean", None), ("mean", 0.05)])
def test_fused_master_step_equals_torch_on_fp32_masters(kind, dtype, reduction, clip, seed,
                                                        monkeypatch):
    calls = []
    real = fused_master.step
    monkeypatch.setattr(fused_master, "step", lambda *a, **k: (calls.append(1), real(*a, **k)))
    opt, ref = train(kind, dtype, seed, reduction=reduction, clip=clip)
    assert len(calls) == 3, "the fused master step did not run"
    assert_same_run(opt, ref, seed)


def _write_every_way(model: torch.nn.Module, window: int) -> None:
    """Writes that bump no version counter, at every position of an 8-wide block and the
    tail: ``.data``, a numpy view, the storage."""
    w = model[0].weight
    with torch.no_grad():
        flat = w.data.view(-1)
        k = window % 8
        flat[k::8] = flat[k::8] * 0.5 + 0.25  # .data
        flat[-3:] = torch.tensor([1.5, -2.0, 0.0], dtype=w.dtype)  # the tail
    b = model[2].bias
    as_int = b.data.view(torch.int16).numpy()
    as_int[window % b.numel()] ^= 0x0100  # numpy, one exponent bit
    storage = model[2].weight.untyped_storage()
    alias = torch.empty(0, dtype=model[2].weight.dtype).set_(storage)
    alias[window] = 3.0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_weights_written_between_steps_are_taken_in(kind, dtype, seed):
    opt, ref = train(kind, dtype, seed, writes=_write_every_way, windows=4)
    assert_same_run(opt, ref, seed)  # a reverted write leaves the masters apart
    # the last window's writes came after its step: the model shows them until the next step
    assert float(opt.optimizer.param_groups[0]["params"][2].detach().view(-1)[3]) == 3.0


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_params_without_masters_in_the_same_group(kind, seed):
    """A bf16 model with an fp32 LayerNorm: the masters go through the fused op, the fp32
    params through torch's own step, in the same group."""
    opt, ref = train(kind, torch.bfloat16, seed, reduction="mean", clip=0.05, mixed=True)
    assert_same_run(opt, ref, seed)


def _share_memory(model: torch.nn.Module, window: int) -> None:
    if window == 0:
        model.share_memory()  # new storages for every weight (the masters keep the values)


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
@pytest.mark.parametrize("hands", ["frozen", "zero_grad_each", "share_memory"])
def test_what_users_do_behind_the_optimizer(kind, hands, seed, monkeypatch):
    """A frozen param (no master gradient: torch skips it), ``opt.step()`` every micro-batch
    with N given and ``model.zero_grad()`` after each window, ``model.share_memory()`` between
    windows (the weights move to new storages): the fused master step still equals the
    reference, losses and norms included."""
    calls = []
    real = fused_master.step
    monkeypatch.setattr(fused_master, "step", lambda *a, **k: (calls.append(1), real(*a, **k)))
    opt, ref = train(kind, torch.bfloat16, seed, reduction="sum", clip=0.05,
                     frozen=hands == "frozen", zero_grad_each=hands == "zero_grad_each",
                     writes=_share_memory if hands == "share_memory" else None)
    assert len(calls) == 3
    assert_same_run(opt, ref, seed)
    if hands == "share_memory":
        assert all(p.is_shared() for p in opt.optimizer.param_groups[0]["params"])


FRESH_PROCESS = r"""
import sys, torch
sys.path[:0] = sys.argv[1:4]
import accelerate, transformers  # another framework first, with its global state
accelerate.Accelerator(cpu=True)
transformers.set_seed(1)
import test_fused_master as t
opt, ref = t.train("adamw", torch.bfloat16, int(sys.argv[4]), reduction="mean", clip=0.05)
t.assert_same_run(opt, ref, int(sys.argv[4]))
print("same run")
"""


@pytest.mark.simd_once
def test_fresh_process_after_another_framework(seed):
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path
    if importlib.util.find_spec("accelerate") is None or \
            importlib.util.find_spec("transformers") is None:
        pytest.skip("needs accelerate and transformers")
    here = Path(__file__).resolve().parent
    paths = [str(here), str(here.parent), str(here.parents[1])]
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS, *paths, str(seed)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 and "same run" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("flag", ["foreach", "plain"])
def test_other_implementations_keep_the_separate_passes(flag, seed, monkeypatch):
    """Only a fused inner optimizer is reproduced by the fused master step; foreach and the
    for-loop keep their own arithmetic (torch's step over the masters, then the cast)."""
    def refuse(*a, **k):
        raise AssertionError("the fused master step ran for a non-fused inner optimizer")
    monkeypatch.setattr(fused_master, "step", refuse)
    model = make_model(torch.bfloat16, seed)
    kw = {"foreach": True} if flag == "foreach" else {"foreach": False}
    ref_model = make_model(torch.bfloat16, seed)
    ref = Reference.__new__(Reference)
    ref.model, ref.reduction, ref.clip = ref_model, "sum", None
    ref.params = list(ref_model.parameters())
    ref.masters = [p.detach().float().clone().requires_grad_() for p in ref.params]
    ref.inner = torch.optim.AdamW(ref.masters, lr=1e-2, **kw)
    ref.window, ref.count = [torch.zeros_like(m) for m in ref.masters], 0
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, **kw),
                                accumulation_steps=N)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(2 * N):
        x = torch.randn(4, 13, generator=gen)
        loss_of(model, x).backward()
        ref.backward(x)
        opt.step()
        opt.zero_grad()
        if ref.count == N:
            ref.step()
    for p, q in zip(model.parameters(), ref.params):
        assert same_bits(p, q), seed


def test_inner_step_hooks_and_scheduler_see_the_fused_step(seed):
    model = make_model(torch.bfloat16, seed)
    inner = inner_of("adamw", model.parameters())
    seen = []
    inner.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    inner.register_step_post_hook(lambda o, a, k: seen.append("post"))
    opt = AccumulatingOptimizer(inner, accumulation_steps=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    loss_of(model, torch.randn(4, 13)).backward()
    opt.step()
    sched.step()
    assert seen == ["pre", "post"]
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_state_dict_after_fused_steps_continues_in_a_native_optimizer(seed):
    """The state stays under torch's keys: a native fused AdamW over fp32 copies of the masters
    continues exactly where the wrapper's masters are."""
    opt, ref = train("adamw", torch.bfloat16, seed, windows=2)
    native = torch.optim.AdamW([m.detach().clone().requires_grad_() for m in opt.master_params],
                               lr=1e-2, weight_decay=0.1, fused=True)
    sd = opt.state_dict()
    sd = {"state": {k: {n: v for n, v in e.items() if not n.startswith("accumkernels")}
                    for k, e in sd["state"].items()},
          "param_groups": [{k: v for k, v in g.items() if k != "accumkernels"}
                           for g in sd["param_groups"]]}
    native.load_state_dict(sd)
    for i, q in enumerate(native.param_groups[0]["params"]):
        for key, value in ref.inner.state[ref.masters[i]].items():
            assert same_bits(native.state[q][key], value), (key, seed)


def _refuse_fused_step(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("the fused master step ran for a group it does not implement")
    monkeypatch.setattr(fused_master, "step", refuse)


def _count_fused_steps(monkeypatch) -> list:
    calls = []
    real = fused_master.step
    monkeypatch.setattr(fused_master, "step", lambda *a, **k: (calls.append(1), real(*a, **k)))
    return calls


def _set(key: str, value):
    def edit(group: dict) -> None:
        group[key] = value() if callable(value) else value
    return edit


@pytest.mark.parametrize("kind", ["adamw", "sgd_momentum"])
def test_an_unknown_group_key_takes_torchs_own_step(kind, seed, monkeypatch):
    """A param-group key the fused master step does not know (a flag a newer torch adds):
    the step is torch's own over the masters, then the cast, bit for bit, never the kernel."""
    _refuse_fused_step(monkeypatch)
    opt, ref = train(kind, torch.bfloat16, seed, reduction="mean", clip=0.05,
                     edit=_set("new_flag", True))
    assert_same_run(opt, ref, seed)


# Values torch's fused step takes and the kernels do not: a tensor weight decay (SGD documents
# ``float | Tensor``; torch's fused Adam reads a one-element tensor as a number), an lr set below
# zero after construction, nesterov with dampening set later (the constructor refuses it).
UNIMPLEMENTED_VALUES = [
    pytest.param("adamw", "weight_decay", lambda: torch.tensor(0.1), id="adamw-tensor-wd"),
    pytest.param("adam", "lr", -1e-3, id="adam-negative-lr"),
    pytest.param("sgd_momentum", "weight_decay", lambda: torch.tensor(0.01), id="sgd-tensor-wd"),
    pytest.param("sgd_nesterov", "dampening", 0.5, id="sgd-nesterov-dampening"),
]


@pytest.mark.parametrize("kind,key,value", UNIMPLEMENTED_VALUES)
def test_a_known_key_with_an_unimplemented_value_takes_torchs_own_step(kind, key, value, seed,
                                                                       monkeypatch):
    """A key the fused master step knows, holding a value its kernels do not take: torch's
    own step over the masters, then the cast, bit for bit, never the kernel."""
    _refuse_fused_step(monkeypatch)
    opt, ref = train(kind, torch.bfloat16, seed, edit=_set(key, value))
    assert_same_run(opt, ref, seed)


@pytest.mark.parametrize("kind,edit", [
    pytest.param("adamw", None, id="adamw-as-built"),
    pytest.param("adamw", _set("lr", lambda: torch.tensor(1e-2)), id="adamw-tensor-lr"),
    pytest.param("adam", _set("betas", lambda: (torch.tensor(0.9), torch.tensor(0.99))),
                 id="adam-tensor-betas"),
    pytest.param("sgd_momentum", _set("initial_lr", 0.1), id="sgd-scheduler-key"),
    pytest.param("amsgrad", _set("max_lr", 1e-2), id="amsgrad-scheduler-key"),
])
def test_implemented_keys_and_values_take_the_fused_step(kind, edit, seed, monkeypatch):
    """The groups torch builds, a tensor lr or betas, and the LR schedulers' own keys keep the
    fused master step, with the reference's result."""
    calls = _count_fused_steps(monkeypatch)
    opt, ref = train(kind, torch.bfloat16, seed, edit=edit)
    assert len(calls) == 3, "the fused master step did not run"
    assert_same_run(opt, ref, seed)


def test_the_wrappers_own_group_key_keeps_the_fused_step(seed, monkeypatch):
    """A scheduler built on the wrapper and a checkpoint every step (both read
    ``opt.param_groups``, which puts the wrapper's key into every group) keep the fused step."""
    calls = _count_fused_steps(monkeypatch)
    model = make_model(torch.bfloat16, seed)
    opt = AccumulatingOptimizer(inner_of("adamw", model.parameters()), accumulation_steps=1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(3):
        loss_of(model, torch.randn(4, 13, generator=gen)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        opt.state_dict()
    assert "accumkernels" in opt.optimizer.param_groups[0]
    assert len(calls) == 3, "the fused master step did not run"


BAD_VALUES = [("lr", -1e-3), ("lr", float("nan")), ("lr", torch.tensor([1e-3, 1e-3])),
              ("lr", True), ("eps", float("inf")), ("betas", (0.9, 1.0)),
              ("betas", (0.9,)), ("betas", (torch.tensor([0.9, 0.9]), 0.99)),
              ("maximize", None), ("foreach", True), ("fused", 1), ("capturable", True),
              ("differentiable", True), ("decoupled_weight_decay", 0)]


@pytest.mark.simd_once
@pytest.mark.parametrize("key,value", BAD_VALUES, ids=lambda v: repr(v)[:24])
def test_every_unimplemented_value_is_refused(key, value):
    """Each value outside what the kernels implement, alone in a group torch built."""
    group = torch.optim.AdamW([torch.zeros(2, requires_grad=True)], fused=True).param_groups[0]
    assert fused_master.implements(torch.optim.AdamW, group)
    group[key] = value
    assert not fused_master.implements(torch.optim.AdamW, group), (key, value)


@pytest.mark.simd_once
def test_a_missing_key_is_refused():
    """A group without a key the step reads, or a class without an allow-list."""
    group = torch.optim.SGD([torch.zeros(2, requires_grad=True)], fused=True).param_groups[0]
    del group["nesterov"]
    assert not fused_master.implements(torch.optim.SGD, group)
    assert not fused_master.implements(torch.optim.RMSprop, {"params": []})


# Every way torch's constructors (and its LR schedulers) fill a group of the three classes.
BUILT = [
    pytest.param(torch.optim.AdamW, {}, id="AdamW"),
    pytest.param(torch.optim.AdamW, {"amsgrad": True, "maximize": True}, id="AdamW-flags"),
    pytest.param(torch.optim.Adam, {}, id="Adam"),
    pytest.param(torch.optim.Adam, {"decoupled_weight_decay": True}, id="Adam-decoupled"),
    pytest.param(torch.optim.SGD, {}, id="SGD"),
    pytest.param(torch.optim.SGD, {"momentum": 0.9, "nesterov": True}, id="SGD-nesterov"),
]


@pytest.mark.simd_once
@pytest.mark.parametrize("cls,kw", BUILT)
def test_the_allow_list_covers_what_torch_puts_in_a_group(cls, kw):
    """A key a newer torch adds to these constructors shows up here, not as a silent fallback
    (or, before the allow-list, as a flag the fused step ignored)."""
    p = torch.nn.Parameter(torch.zeros(2))
    opt = cls([p], lr=1e-2, fused=True, **kw)
    group = opt.param_groups[0]
    assert set(group) - set(fused_master.IMPLEMENTED_KEYS[cls]) == set(), sorted(group)
    assert fused_master.implements(cls, group)
    torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=10)
    torch.optim.swa_utils.SWALR(opt, swa_lr=1e-3)
    added = set(group) - set(fused_master.IMPLEMENTED_KEYS[cls])
    assert added <= fused_master.SCHEDULER_KEYS, sorted(added - fused_master.SCHEDULER_KEYS)
    assert fused_master.implements(cls, group)
