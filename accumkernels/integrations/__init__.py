"""One line per training framework turns accumkernels on (fp32 gradient accumulation).

=============  ==============================================================================
framework      the one line
=============  ==============================================================================
HF Trainer     ``trainer = AccumulatingTrainer(model=..., args=..., ...)``
               (``accumkernels.integrations.transformers``; instead of ``Trainer``)
Accelerate     ``accelerator = AccumulatingAccelerator(gradient_accumulation_steps=N, ...)``
               (``accumkernels.integrations.accelerate``; instead of ``Accelerator``)
Lightning      ``L.Trainer(..., callbacks=[FP32Accumulation()])``
               (``accumkernels.integrations.lightning``)
Fabric         ``model, optimizer = setup(fabric, model, optimizer)``
               (``accumkernels.integrations.fabric``; instead of ``fabric.setup``)
=============  ==============================================================================

Each wraps the optimizer the framework builds or is given in ``AccumulatingOptimizer(...,
accumulation_steps=None)`` (the frameworks call ``step()`` only at window ends) and registers
``accumkernels.ddp_comm_hook`` on the ``DistributedDataParallel`` module the framework builds,
so one script runs on one process or many. The wrapper's options (``reduction``,
``master_weights``, ``max_grad_norm``, ``nonfinite``, ...) pass through. Each module imports
its framework only when one of its names is first used: importing accumkernels, or this
package, imports no framework.

This file holds what they share: the option check, the wrapping, the hook registration.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch

from accumkernels._engines import refuse_foreign_engines
from accumkernels._torch_private import ddp_comm_hooks
from accumkernels.optim import AccumulatingOptimizer
from accumkernels.optim.sync.ddp_hook import ddp_comm_hook

__all__ = ["check_ddp_hook", "check_options", "find_ddp", "inner_wrapper", "module_level",
           "register_ddp_hook", "wrap_optimizer"]

# Set by the integration itself: the window ends at every step() the framework makes, and the
# integration hands the DDP module over through the comm hook.
_RESERVED = {
    "accumulation_steps": "the frameworks call step() only at window ends, so the integration "
                          "builds the wrapper with accumulation_steps=None",
    "model": "the integration registers accumkernels.ddp_comm_hook on the framework's DDP module",
    "process_group": "the framework's DDP module reduces the window (through the comm hook)",
}


def module_level(cls: type, module: str) -> type:
    """Name a class built on first use (its framework imported then) as if it were defined at
    the top of ``module``, whose ``__getattr__`` returns it: pickle and reprs find it there."""
    cls.__module__, cls.__qualname__ = module, cls.__name__
    return cls


def _wrapper_options() -> set[str]:
    signature = inspect.signature(AccumulatingOptimizer.__init__)
    return {name for name, p in signature.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY} - set(_RESERVED)


def check_options(options: Mapping | None) -> dict:
    """The AccumulatingOptimizer keyword arguments an integration passes through, checked by name
    now (values are checked by the wrapper when it is built, before it touches anything)."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"accumkernels options must be a dict of AccumulatingOptimizer keyword "
                        f"arguments, got {type(options).__name__}")
    for name in options:
        if name in _RESERVED:
            raise ValueError(f"accumkernels option {name!r} is set by the integration: "
                             f"{_RESERVED[name]}")
        if name not in _wrapper_options():
            raise TypeError(f"accumkernels option {name!r} is not an AccumulatingOptimizer "
                            f"argument; expected one of {sorted(_wrapper_options())}")
    return dict(options)


def inner_wrapper(optimizer: object) -> AccumulatingOptimizer | None:
    """The AccumulatingOptimizer inside a framework's optimizer wrappers (``.optimizer``
    chains: Accelerate's AcceleratedOptimizer, Lightning's LightningOptimizer), or None."""
    seen = 0
    while optimizer is not None and seen < 8:
        if isinstance(optimizer, AccumulatingOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
        seen += 1
    return None


def wrap_optimizer(optimizer: torch.optim.Optimizer, options: Mapping, *,
                   model: torch.nn.Module | None = None) -> AccumulatingOptimizer:
    """``AccumulatingOptimizer(optimizer, accumulation_steps=None, **options)``; an optimizer
    already wrapped is returned as it is. Engines that own the gradient path are refused first."""
    if isinstance(optimizer, AccumulatingOptimizer):
        return optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"accumkernels: expected a torch.optim.Optimizer to wrap, got "
                        f"{type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    refuse_foreign_engines(params, model, optimizer=optimizer)
    if model is not None and not isinstance(model, torch.nn.Module):
        model = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # names and checks only: the hook is registered separately
    return AccumulatingOptimizer(optimizer, accumulation_steps=None, model=model, **options)


def find_ddp(module: object) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP module a framework built: ``module`` itself, or under ``torch.compile``."""
    for candidate in (module, getattr(module, "_orig_mod", None)):
        if isinstance(candidate, torch.nn.parallel.DistributedDataParallel):
            return candidate
    return None


def _registered_hooks(ddp: torch.nn.parallel.DistributedDataParallel) -> list:
    # a builtin C++ hook is not listed there, and register_comm_hook then raises below
    return ddp_comm_hooks(ddp)


def check_ddp_hook(ddp: torch.nn.parallel.DistributedDataParallel) -> bool:
    """True if ``accumkernels.ddp_comm_hook`` is already registered on ``ddp``; ValueError if
    another hook is (DDP takes one); False if none is. Changes nothing."""
    hooks = _registered_hooks(ddp)
    if any(hook is ddp_comm_hook for hook in hooks):
        return True
    if hooks:
        raise ValueError(_foreign_hook(hooks[0]))
    return False


def register_ddp_hook(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Register ``accumkernels.ddp_comm_hook`` on ``ddp`` once (already there: nothing to do;
    another hook there: ValueError). Params no wrapper manages are reduced natively by it."""
    if check_ddp_hook(ddp):
        return
    try:
        ddp.register_comm_hook(ddp.process_group, ddp_comm_hook)
    except RuntimeError as exc:  # a builtin hook (not listed in _comm_hooks)
        raise ValueError(_foreign_hook(None) + f" ({exc})") from exc


def _foreign_hook(hook) -> str:
    name = getattr(hook, "__qualname__", None) or "a builtin hook"
    return (f"accumkernels: this DistributedDataParallel module already has a communication hook "
            f"({name}); DDP takes one, and the wrapper needs accumkernels.ddp_comm_hook to "
            f"reduce its fp32 window. Remove the other hook (e.g. a DDP comm_hook setting in "
            f"the framework) or leave accumkernels off for this model.")
