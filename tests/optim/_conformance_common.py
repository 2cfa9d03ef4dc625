"""Shared pieces of the optimizer conformance suite (test_conformance.py, and the state-dict
contracts of test_checkpoint.py): AccumulatingOptimizer against torch's optim_db.

The configurations are PyTorch's own: ``optim_db`` (torch.testing._internal.common_optimizers)
gives, per optimizer, the constructor kwargs its suite runs on the CPU. Every contract runs the
same loop twice, once with the stock optimizer ("native", the judge) and once with it wrapped in
``AccumulatingOptimizer``, on identical fp32 models and data.

Precision: with ``reduction="sum"`` and one backward per step the wrapper hands the inner
optimizer autograd's very fp32 gradient; with N backwards it adds them in autograd's order
(g1 written, then + g2, ...). Either way the inner optimizer sees bit-identical ``.grad`` and
runs the same kernels, so params and states are compared with ``torch.equal``: any missed,
doubled or dropped gradient, a lost LR change or a skipped step moves them by ~lr.
"""

from __future__ import annotations

import copy
import re
import sys
import types
import unittest
from dataclasses import dataclass

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import StepLR

from accumkernels import AccumulatingOptimizer

try:  # common_utils (imported by common_optimizers) needs expecttest only for its TestCase base
    import expecttest  # noqa: F401
except ImportError:
    _shim = types.ModuleType("expecttest")
    _shim.TestCase = unittest.TestCase
    sys.modules["expecttest"] = _shim

from torch.testing._internal.common_optimizers import (  # noqa: E402
    OptimizerErrorEnum,
    OptimizerInfo,
    optim_db,
)

D_IN, D_HID, D_OUT, BATCH = 5, 4, 3, 6
INFOS = {info.optim_cls.__name__: info for info in optim_db}


# -- configurations -------------------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One optim_db constructor configuration (kwargs are deep-copied per optimizer built)."""

    info: OptimizerInfo
    kwargs: dict
    desc: str

    @property
    def name(self) -> str:
        return self.info.optim_cls.__name__

    @property
    def id(self) -> str:
        return re.sub(r"[^0-9A-Za-z&.]+", "_", f"{self.name}-{self.desc}").strip("_")

    @property
    def closure_only(self) -> bool:
        return self.info.step_requires_closure

    @property
    def sparse_only(self) -> bool:
        return self.info.only_supports_sparse_grads

    def build(self, params) -> torch.optim.Optimizer:
        return self.info.optim_cls(params, **copy.deepcopy(self.kwargs))


def _natively_valid(info: OptimizerInfo, kwargs: dict) -> bool:
    """Whether native builds and steps with ``kwargs`` (derived variants only, e.g. foreach)."""
    p = nn.Parameter(torch.randn(2, 2))
    p.grad = torch.randn(2, 2)
    try:
        opt = info.optim_cls([p], **copy.deepcopy(kwargs))
        opt.step((lambda: p.sum()) if info.step_requires_closure else None)
    except (ValueError, RuntimeError, TypeError):
        return False
    return True


def _variants(info: OptimizerInfo) -> list[Config]:
    """The info's CPU inputs, each also with foreach=True / fused=True where the info supports
    them, and a tensor-lr default where the info gives none."""
    out: list[Config] = []
    inputs = info.optim_inputs_func(device="cpu")
    for oi in inputs:
        out.append(Config(info, oi.kwargs, oi.desc))
        for flag in ("foreach", "fused"):
            if flag not in info.supported_impls:
                continue
            if flag == "fused" and "cpu" not in info.supports_fused_on:
                continue
            kwargs = {**oi.kwargs, flag: True}
            if _natively_valid(info, kwargs):
                out.append(Config(info, kwargs, f"{oi.desc} & {flag}"))
    if info.optim_cls is not torch.optim.SparseAdam and not any(
            isinstance(oi.kwargs.get("lr"), torch.Tensor) for oi in inputs):
        lr = info.optim_cls.__init__.__defaults__[0]
        kwargs = {"lr": torch.tensor(lr)}
        if isinstance(lr, float) and _natively_valid(info, kwargs):
            out.append(Config(info, kwargs, "default & tensor lr"))
    return out


ALL_CONFIGS: list[Config] = [c for info in optim_db for c in _variants(info)]


def _sample() -> list[Config]:
    """Per optimizer: its default and the first config of each kind of variant (maximize,
    foreach, fused, tensor lr, weight decay); every optimizer is in it."""
    kinds = {
        "default": lambda c: not c.kwargs,
        "maximize": lambda c: c.kwargs.get("maximize") is True,
        "foreach": lambda c: c.kwargs.get("foreach") is True,
        "fused": lambda c: c.kwargs.get("fused") is True,
        "tensor_lr": lambda c: isinstance(c.kwargs.get("lr"), torch.Tensor),
        "weight_decay": lambda c: bool(c.kwargs.get("weight_decay")),
    }
    picked: list[Config] = []
    for info in optim_db:
        mine = [c for c in ALL_CONFIGS if c.info is info]
        for test in kinds.values():
            first = next((c for c in mine if test(c)), None)
            if first is not None and first not in picked:
                picked.append(first)
    return picked


SAMPLE = [c for c in _sample() if not c.sparse_only]
DEFAULTS = [c for c in ALL_CONFIGS if not c.kwargs and not c.sparse_only]
DENSE_CONFIGS = [c for c in ALL_CONFIGS if not c.sparse_only]


def ids(configs: list[Config]) -> list[str]:
    return [c.id for c in configs]


# -- models, loops ---------------------------------------------------------------------------------

def make_model(config: Config, dtype: torch.dtype = torch.float32) -> nn.Sequential:
    """A tiny MLP (2-D weights only for Muon, which steps matrices only). Under ``maximize=True``
    its loss is negated (``loss_sign``): the optimizer climbs -MSE, the same bounded problem,
    where climbing the MSE itself sends LBFGS (lr=1, torch >= 2.14) to inf/NaN in one step."""
    bias = config.info.optim_cls is not torch.optim.Muon
    model = nn.Sequential(nn.Linear(D_IN, D_HID, bias=bias), nn.Tanh(),
                          nn.Linear(D_HID, D_OUT, bias=bias)).to(dtype)
    model.loss_sign = -1.0 if config.kwargs.get("maximize") else 1.0
    return model


def batches(n: int, dtype: torch.dtype = torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(BATCH, D_IN, dtype=dtype), torch.randn(BATCH, D_OUT, dtype=dtype))
            for _ in range(n)]


def loss_of(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return (model(x) - y).square().mean() * getattr(model, "loss_sign", 1.0)


def wrap(inner: torch.optim.Optimizer, accumulation_steps: int | None = 1,
         **kwargs) -> AccumulatingOptimizer:
    return AccumulatingOptimizer(inner, accumulation_steps=accumulation_steps, **kwargs)


def param_groups(config: Config, model: nn.Module):
    """Two groups (first layer, the rest) where the optimizer takes groups, else one list."""
    params = list(model.parameters())
    if not config.info.supports_param_groups:
        return params
    first = list(model[0].parameters())
    return [{"params": first}, {"params": [p for p in params if all(p is not q for q in first)]}]


def pair(config: Config, dtype: torch.dtype = torch.float32, accumulation_steps: int | None = 1,
         **kwargs):
    """(native model, native optimizer, wrapper's model, wrapper): identical starts."""
    model = make_model(config, dtype)
    twin = copy.deepcopy(model)
    return (model, config.build(param_groups(config, model)), twin,
            wrap(config.build(param_groups(config, twin)), accumulation_steps, **kwargs))


def drive(opt, config: Config, work):
    """One step whose gradients ``work()`` produces (it returns the loss): through a closure
    where the optimizer requires one, else ``work(); opt.step()``. Returns step()'s value."""
    if config.closure_only:
        return opt.step(work)
    work()
    return opt.step()


def train_step(model: nn.Module, opt, batch, config: Config, *, backward: bool = True):
    """One textbook step (zero_grad, backward, step); ``backward=False``: a step on all-None
    gradients. Returns step()'s value."""
    def work():
        opt.zero_grad()
        loss = loss_of(model, batch)
        if backward:
            loss.backward()
        return loss
    return drive(opt, config, work)


# -- comparisons -----------------------------------------------------------------------------------

def assert_same(a, b, where: str = "") -> None:
    """Recursive equality of nested dicts/lists/tuples; tensors bit-identical, same dtype."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), \
            f"{where}: {type(a).__name__} vs {type(b).__name__}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{where}: values differ (max {(a - b).abs().max().item():.3g})"
    elif isinstance(a, dict) and isinstance(b, dict):
        assert set(a) == set(b), f"{where}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_params(native: nn.Module, ours: nn.Module, where: str = "") -> None:
    for (name, p), q in zip(native.named_parameters(), ours.parameters()):
        assert p.dtype == q.dtype, f"{where}{name}: dtype {q.dtype}, native {p.dtype}"
        diff = (p.detach().double() - q.detach().double()).abs().max().item()
        assert torch.equal(p.detach(), q.detach()), \
            f"{where}{name}: differs from native by {diff:.3g}"


def assert_moved(model: nn.Module, start: dict[str, torch.Tensor]) -> None:
    """Training changed the params (two runs that agree because neither stepped prove nothing)."""
    assert any(not torch.equal(p.detach(), start[n]) for n, p in model.named_parameters()), \
        "no param moved"


def same_outcome(native_call, wrapper_call) -> bool:
    """Run both; where native raises, the wrapper must raise the same type (False returned);
    where native succeeds, so must the wrapper (True returned)."""
    try:
        native_call()
    except Exception as exc:  # noqa: BLE001 -- whatever native raises is the expectation
        try:
            wrapper_call()
        except type(exc):
            return False
        raise AssertionError(f"native raises {type(exc).__name__}: {exc}; the wrapper does not")
    wrapper_call()
    return True


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def torch_sd(sd: dict) -> dict:
    """The torch optimizer state dict part (``state``, ``param_groups``) of a state dict: the
    wrapper's own entries (``param_groups[g]["accumkernels"]``, per-param keys starting with
    ``accumkernels_``) removed, the rest as the wrapper wrote it."""
    state = {}
    for k, entry in sd["state"].items():
        entry = {n: v for n, v in entry.items() if not str(n).startswith("accumkernels_")}
        if entry:
            state[k] = entry
    groups = [{k: v for k, v in g.items() if k != "accumkernels"} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


# -- loops shared by several contracts -------------------------------------------------------------

# Two real steps, a step on all-None gradients, the first layer frozen for two steps (it gets
# no gradient: native leaves it and its state alone) and unfrozen again; StepLR halves the LR
# after every step, so a wrapper that missed an LR change would drift at once.
PLAN = ("grad", "grad", "none", "freeze", "freeze", "unfreeze", "grad")


def lockstep(config: Config, plan=PLAN, dtype=torch.float32) -> None:
    """Run ``plan`` natively and wrapped, side by side; params equal after every step."""
    n_model, native, model, opt = pair(config, dtype)
    scheds = [StepLR(native, step_size=1, gamma=0.5), StepLR(opt, step_size=1, gamma=0.5)]
    start = snapshot(model)
    for i, (event, batch) in enumerate(zip(plan, batches(len(plan), dtype))):
        if event in ("freeze", "unfreeze"):
            for m in (n_model, model):
                m[0].requires_grad_(event == "unfreeze")
        results = [train_step(m, o, batch, config, backward=event != "none")
                   for m, o in ((n_model, native), (model, opt))]
        assert_same(results[1], results[0], f"step {i} ({event}): value step() returned")
        assert_same_params(n_model, model, f"step {i} ({event}): ")
        for s in scheds:
            s.step()
    assert_moved(model, start)


def assert_refused(build, *words: str) -> None:
    """``build()`` raises ValueError/TypeError whose message names one of ``words``."""
    with pytest.raises((ValueError, TypeError)) as info:
        build()
    msg = str(info.value).lower()
    assert any(w in msg for w in words), f"refusal does not name {words}: {info.value}"


def trained(config: Config, steps: int = 2, **kwargs):
    """``pair()`` after ``steps`` identical training steps."""
    n_model, native, model, opt = pair(config, **kwargs)
    for batch in batches(steps):
        train_step(n_model, native, batch, config)
        train_step(model, opt, batch, config)
    return n_model, native, model, opt


def fresh(config: Config, like: torch.nn.Module, kind: str):
    """A new model with ``like``'s weights, and a new optimizer on it (native or wrapped)."""
    model = make_model(config, next(like.parameters()).dtype)
    model.load_state_dict(like.state_dict())
    inner = config.build(param_groups(config, model))
    return model, (wrap(inner) if kind == "wrapper" else inner)


def continue_alike(config: Config, a, b, steps: int = 2) -> None:
    """Train (model, opt) pairs ``a`` and ``b`` on the same data; params equal throughout."""
    start = snapshot(b[0])
    for i, batch in enumerate(batches(steps)):
        train_step(*a, batch, config)
        train_step(*b, batch, config)
        assert_same_params(a[0], b[0], f"step {i} after loading: ")
    assert_moved(b[0], start)
