"""The declared public surface: everything a user can call, pass, register, do to the model or do
on one rank only, each item an axis value of the matrix (``Axis``) or an exclusion with its reason
and the test that covers it instead (``Excluded``). test_surface.py enumerates the surface from
the code (the wrapper's members and constructor, every optimizer class of the installed torch and
its flags, the hooks torch offers, nn.Module's methods, DDP's and FSDP2's options) and fails on
anything undeclared, so the declaration cannot fall behind the surface.

An ``Axis`` entry names values of _matrix_axes' single- or multi-process axes ("part.axis=value");
an ``Excluded`` entry gives the reason and a test file that must exist and mention ``needle``
(default: the item's name).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class Axis:
    """Crossed by the matrix: "single.loop=model-zero_grad", "multi.engine=ddp-static-graph"."""

    values: tuple[str, ...]


@dataclass(frozen=True)
class Excluded:
    """Not crossed: why, and the test file that covers it (which must mention ``needle``)."""

    reason: str
    where: str | None = None
    needle: str | None = None


def ax(*values: str) -> Axis:
    return Axis(tuple(values))


def ex(reason: str, where: str | None = None, needle: str | None = None) -> Excluded:
    return Excluded(reason, where, needle)


READS = "reads only: changes nothing the wrapper's step or window depends on"
NOT_GRAD = "no part of the gradient path: the model's forward, buffers or structure only"

# -- the enumerations ------------------------------------------------------------------------------


def wrapper_members() -> set[str]:
    from accumkernels import AccumulatingOptimizer

    # (and the ways in that are no attribute: a closure, the inner optimizer's pass-throughs,
    # the copies Python makes of any object, a subclass)
    return {n for n in dir(AccumulatingOptimizer) if not n.startswith("_")} | {
        "step(closure)", "train", "eval", "copy.copy", "copy.deepcopy", "pickle", "subclass",
        "compiled_autograd", "compiled_autograd(fullgraph=True)"}


def wrapper_options() -> set[str]:
    """Every constructor keyword, and every value of the keywords that take a choice."""
    from accumkernels import AccumulatingOptimizer
    from accumkernels.ops import backends
    from accumkernels.optim.config import NONFINITE_POLICIES, REDUCTIONS

    sig = inspect.signature(AccumulatingOptimizer.__init__)
    out = {f"{k}" for k in sig.parameters if k not in ("self", "optimizer")}
    out |= {f"reduction={v}" for v in REDUCTIONS}
    out |= {f"nonfinite={v}" for v in NONFINITE_POLICIES}
    out |= {f"backend={v}" for v in ("auto",) + tuple(backends.BACKENDS)}
    out |= {"master_weights=auto", "master_weights=True", "master_weights=False",
            "loss_scale=None", "loss_scale=float", "loss_scale=dynamic",
            "accumulation_steps=None", "accumulation_steps=int",
            "accumulate_in_backward=True", "accumulate_in_backward=False",
            "max_grad_norm=None", "max_grad_norm=float",
            "process_group=None", "process_group=group",
            "independent_ranks=False", "independent_ranks=True",
            "model=None", "model=module", "model=DDP", "model=FSDP2"}
    return out


def constructor_flags(cls) -> list[str]:
    """The flags of an optimizer's constructor, read from its signature (not a fixed list, so
    that a flag a newer torch adds fails the gate until it is declared): every keyword whose
    default is a bool or None (``foreach``, ``fused``, ``maximize``, ``centered``,
    ``line_search_fn``...); numeric hyperparameters (lr, betas, eps) are no flags."""
    return [k for k, p in inspect.signature(cls.__init__).parameters.items()
            if k not in ("self", "params") and p.kind is not p.VAR_KEYWORD
            and (p.default is None or isinstance(p.default, bool))]


def optimizer_classes() -> set[str]:
    """Every optimizer class of the installed torch.optim, and each flag its constructor takes."""
    out = set()
    for name in dir(torch.optim):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) \
                or cls is torch.optim.Optimizer:
            continue
        out.add(name)
        out |= {f"{name}.{f}" for f in constructor_flags(cls)}
    return out


def _torchs(cls, name: str) -> bool:
    """Whether ``cls.name`` is torch's own: other libraries add methods to nn.Module when
    imported (transformers' ``smart_apply``), which would make the surface depend on the order
    the tests import them in."""
    return getattr(getattr(cls, name), "__module__", None) in (None, "") or \
        getattr(getattr(cls, name), "__module__", "").startswith("torch")


def user_hooks() -> set[str]:
    """The hooks torch lets a user register on a tensor, a module, or the inner optimizer."""
    out = {f"Tensor.{n}" for n in dir(torch.Tensor) if n.startswith("register_")
           and _torchs(torch.Tensor, n)}
    out |= {f"inner.{n}" for n in dir(torch.optim.Optimizer) if n.startswith("register_")
            and _torchs(torch.optim.Optimizer, n)}
    return out


def module_actions() -> set[str]:
    """What a loop can do to the model: every public method of nn.Module, and requires_grad_
    at each point of a micro-batch, params added or replaced, no clear at all."""
    out = {f"Module.{n}" for n in dir(nn.Module) if not n.startswith("_") and _torchs(nn.Module, n)}
    return out | {"requires_grad-before-forward", "requires_grad-between-forward-and-backward",
                  "requires_grad-mid-window", "param-added", "param-replaced", "no-zero_grad",
                  "p.grad=None"}


def engine_options() -> set[str]:
    """The options multi-process jobs set: DDP's constructor, fully_shard's, FSDPModule's
    methods beyond nn.Module's."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {f"DDP.{k}" for k in inspect.signature(DDP.__init__).parameters
           if k not in ("self", "module")}
    out |= {f"fully_shard.{k}" for k in inspect.signature(fully_shard).parameters
            if k != "module"}
    out |= {f"FSDPModule.{n}" for n in dir(FSDPModule)
            if not n.startswith("_") and n not in dir(nn.Module)}
    return out


# What ranks do differently (not introspectable: the issue-49 list, declared here)
RANK_DISAGREEMENTS = {
    "one-rank-missing-add_weight", "one-rank-zero-add_weight", "one-rank-extra-step",
    "one-rank-nan-microbatch", "no_sync-on-every-microbatch", "dcp-checkpoint-ddp",
    "dcp-checkpoint-fsdp2", "dcp-checkpoint-fsdp2-tp",
}


def package_names() -> set[str]:
    """Every public name of the package and of its public modules (optimizers, integrations)."""
    import importlib

    import accumkernels

    out = set(accumkernels.__all__)
    for mod in ("optimizers", "integrations.transformers", "integrations.accelerate",
                "integrations.lightning", "integrations.fabric", "integrations.pipelining"):
        m = importlib.import_module(f"accumkernels.{mod}")
        out |= {f"{mod}.{n}" for n in m.__all__}
    return out


def surface() -> dict[str, set[str]]:
    return {"package": package_names(), "member": wrapper_members(), "option": wrapper_options(),
            "optimizer": optimizer_classes(), "hook": user_hooks(), "model": module_actions(),
            "engine": engine_options(), "ranks": set(RANK_DISAGREEMENTS)}
