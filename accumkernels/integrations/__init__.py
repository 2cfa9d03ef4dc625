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

Mistakes they can see are refused (or warned about) before the framework or the integration
changes anything: a misspelt option ("did you mean ...?"), a bad value (the wrapper's own
check), an option the integration sets itself (``accumulation_steps``, ``model``,
``process_group``), ``reduction="mean"`` where the framework already divides the loss by the
accumulation count (the Trainer, Accelerate with ``gradient_accumulation_steps`` > 1,
Lightning), options for an optimizer that is already an ``AccumulatingOptimizer`` (they would
not reach it). A warning is an :class:`AccumulationWarning`: each names its fix and the keyword
that says the setup is meant, and ``warnings.filterwarnings("ignore",
category=accumkernels.integrations.AccumulationWarning)`` silences them.

This file holds what they share: the option check, the wrapping, the hook registration.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Mapping

import torch

from accumkernels._engines import refuse_foreign_engines
from accumkernels._torch_private import ddp_comm_hooks
from accumkernels._util import AccumulationWarning, closest
from accumkernels.optim import AccumulatingOptimizer
from accumkernels.optim.sync.ddp_hook import ddp_comm_hook

__all__ = ["AccumulationWarning", "check_ddp_hook", "check_options", "check_wrappable",
           "find_ddp", "inner_wrapper", "module_level", "refuse_options_for_wrapped",
           "register_ddp_hook", "wrap_optimizer"]


# AccumulationWarning (accumkernels._util, one class for the wrapper and the integrations): a
# setup an integration can see is probably not what was meant (e.g. an AccumulatingTrainer
# whose windows hold one micro-batch); each message names the fix and the keyword that says the
# setup is meant; warnings.filterwarnings("ignore", category=AccumulationWarning) silences them.


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


def _keyword_options() -> dict[str, inspect.Parameter]:
    """AccumulatingOptimizer's keyword-only parameters, read from its signature."""
    signature = inspect.signature(AccumulatingOptimizer.__init__)
    return {name: p for name, p in signature.parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def _wrapper_options() -> set[str]:
    return set(_keyword_options()) - set(_RESERVED)


def _unknown(name: str) -> TypeError:
    close = closest(name, _keyword_options())
    hint = ""
    if close:
        hint = f" (did you mean {close!r}?"
        hint += f" It is set by the integration: {_RESERVED[close]})" if close in _RESERVED \
            else ")"
    return TypeError(f"accumkernels option {name!r} is not an AccumulatingOptimizer "
                     f"argument{hint}; expected one of {sorted(_wrapper_options())}")


def _check_values(options: Mapping) -> None:
    """The wrapper's own check of every option value (``make_config``), run now with the
    wrapper's defaults for the options not given: a bad value is refused before the framework
    changes anything, with the message the wrapper would give."""
    from accumkernels.optim.config import make_config

    defaults = _keyword_options()
    make_config(**{name: options[name] if name in options else defaults[name].default
                   for name in inspect.signature(make_config).parameters})


def check_options(options: Mapping | None, *, normalised_by: str | None = None) -> dict:
    """The AccumulatingOptimizer keyword arguments an integration passes through, checked now,
    before the framework or the integration changes anything: names (a misspelt one: "did you
    mean"; one the integration sets: refused, saying why) and values (the wrapper's own check).

    ``normalised_by``: where the framework already divides the loss by the accumulation count,
    what does (a sentence); ``reduction="mean"`` is then refused: it would divide again."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"accumkernels options must be a dict of AccumulatingOptimizer keyword "
                        f"arguments, got {type(options).__name__}")
    for name in options:
        if not isinstance(name, str):
            raise TypeError(f"accumkernels option names must be strings, got {name!r}")
        if name in _RESERVED:
            raise ValueError(f"accumkernels option {name!r} is set by the integration: "
                             f"{_RESERVED[name]}")
        if name not in _wrapper_options():
            raise _unknown(name)
    if normalised_by is not None and options.get("reduction") == "mean":
        raise ValueError(
            f"accumkernels option reduction='mean' would normalise the window a second time: "
            f"{normalised_by}, so the gradients of a window already add up to its mean. Leave "
            f"reduction out, or pass reduction='sum' (the default: the micro-batches are added, "
            f"as native accumulation adds them)")
    _check_values(options)
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


# The wrappers an integration built itself (with its options): handed back to it later (a second
# create_optimizer, an optimizer prepared again) they are not "already wrapped by the user".
_BUILT: weakref.WeakSet = weakref.WeakSet()


def refuse_options_for_wrapped(wrapper: AccumulatingOptimizer | None, options: Mapping,
                               where: str = "the optimizer") -> None:
    """Options given to an integration for an optimizer that is already an AccumulatingOptimizer
    (built by the user, or a by-name class) would not reach it: ValueError, naming them."""
    if wrapper is None or not options or wrapper in _BUILT:
        return
    given = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
    raise ValueError(
        f"accumkernels: {where} is already an AccumulatingOptimizer "
        f"({type(wrapper).__name__}), so the integration builds no wrapper and the options "
        f"{given} would not reach it. Give them where the wrapper is built "
        f"(AccumulatingOptimizer(inner, {given}), or the by-name class's keywords), or give the "
        f"integration the plain optimizer")


def check_wrappable(optimizer: object, options: Mapping, *,
                    model: torch.nn.Module | None = None) -> None:
    """What :func:`wrap_optimizer` refuses that can be seen without building anything: not an
    optimizer, options for one already wrapped, engines that own the gradient path. Changes
    nothing; call it before the framework touches the model."""
    wrapper = inner_wrapper(optimizer)
    if wrapper is not None:
        refuse_options_for_wrapped(wrapper, options)
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"accumkernels: expected a torch.optim.Optimizer to wrap, got "
                        f"{type(optimizer).__name__}")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    refuse_foreign_engines(params, model, optimizer=optimizer)


def wrap_optimizer(optimizer: torch.optim.Optimizer, options: Mapping, *,
                   model: torch.nn.Module | None = None) -> AccumulatingOptimizer:
    """``AccumulatingOptimizer(optimizer, accumulation_steps=None, **options)``; an optimizer
    already wrapped is returned as it is (refused when ``options`` are given for it: they would
    not reach it). Engines that own the gradient path are refused first."""
    check_wrappable(optimizer, options, model=model)
    if inner_wrapper(optimizer) is not None:
        return optimizer
    if model is not None and not isinstance(model, torch.nn.Module):
        model = None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module  # names and checks only: the hook is registered separately
    wrapper = AccumulatingOptimizer(optimizer, accumulation_steps=None, model=model, **options)
    _BUILT.add(wrapper)
    return wrapper


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
