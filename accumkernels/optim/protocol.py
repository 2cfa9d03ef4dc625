"""The torch.optim.Optimizer protocol the wrapper keeps: step and state-dict hooks, closures.

torch patches ``Optimizer.step`` so that global and per-instance step hooks run around every
call. The wrapper's ``step()`` is often a no-op (mid-window), so it is not patched: its hooks
run around each *real* step only, once, with the wrapper as the optimizer (the inner
optimizer's own patched step is called unwrapped, so global hooks do not run twice).
"""

from __future__ import annotations

import inspect
from itertools import chain

import torch
from torch.optim import optimizer as _torch_optimizer

_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def init_hook_registries(opt) -> None:
    """The registries ``torch.optim.Optimizer.__init__`` would create."""
    from collections import OrderedDict

    for name in _HOOK_REGISTRIES:
        setattr(opt, name, OrderedDict())


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS)."""
    step = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)
    try:
        param = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False
    return param is not None and param.default is inspect.Parameter.empty


def inner_step(optimizer: torch.optim.Optimizer, closure=None):
    """Step the inner optimizer without running the global step hooks a second time.

    Its own per-instance hooks still run (they were registered on it, not on the wrapper).
    """
    step = getattr(type(optimizer).step, "__wrapped__", None)
    if step is None:  # a step torch did not patch: no hooks of its own
        return optimizer.step(closure) if closure is not None else optimizer.step()
    args: tuple = (optimizer,) if closure is None else (optimizer, closure)
    kwargs: dict = {}
    for hook in optimizer._optimizer_step_pre_hooks.values():
        args, kwargs = _hook_result(hook(optimizer, args, kwargs), args, kwargs)
    out = step(*args, **kwargs)
    for hook in optimizer._optimizer_step_post_hooks.values():
        hook(optimizer, args, kwargs)
    return out


def run_step(opt, args: tuple, kwargs: dict, fn):
    """Run ``fn()`` (a real step) between the wrapper's step hooks, as torch's patch does."""
    for hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(),
                      opt._optimizer_step_pre_hooks.values()):
        args, kwargs = _hook_result(hook(opt, args, kwargs), args, kwargs)
    out = fn()
    for hook in chain(opt._optimizer_step_post_hooks.values(),
                      _torch_optimizer._global_optimizer_post_hooks.values()):
        hook(opt, args, kwargs)
    return out


def _hook_result(result, args, kwargs):
    if result is None:
        return args, kwargs
    if isinstance(result, tuple) and len(result) == 2:
        return result
    raise RuntimeError(f"a step pre-hook must return None or a tuple of (new_args, new_kwargs), "
                       f"but got {result}")


def state_dict_with_hooks(opt, build):
    for hook in opt._optimizer_state_dict_pre_hooks.values():
        hook(opt)
    sd = build()
    for hook in opt._optimizer_state_dict_post_hooks.values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load_with_hooks(opt, state_dict, load) -> None:
    for hook in opt._optimizer_load_state_dict_pre_hooks.values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for hook in opt._optimizer_load_state_dict_post_hooks.values():
        hook(opt)
