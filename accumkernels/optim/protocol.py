"""The torch.optim.Optimizer protocol the wrapper keeps: step and state-dict hooks, closures.

torch patches ``Optimizer.step`` so that global and per-instance step hooks run around every
call. The wrapper's ``step()`` is often a no-op (mid-window), so it is not patched: its hooks
run around each *real* step only, once, with the wrapper as the optimizer (the inner
optimizer's own patched step is called unwrapped, so global hooks do not run twice).

An LR scheduler also patches ``step`` on the optimizer instance it is built on, to record that
the optimizer stepped (``_opt_called``; ``_step_count`` in older schedulers) and warn at its
first ``step()`` otherwise ("Detected call of `lr_scheduler.step()` before
`optimizer.step()`"). Calling the class's step unwrapped bypasses that instance patch, so every
real step records it itself (``mark_stepped``) on the inner optimizer and on the wrapper: a
scheduler built on either (before wrapping, as the integrations do, or on the wrapper) sees
the step, as natively. Only the patch found on the instance is read, never global state.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from itertools import chain

import torch
from torch.optim import optimizer as _torch_optimizer

_HOOK_REGISTRIES = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks",
                    "_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                    "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks")


def init_hook_registries(opt) -> None:
    """The registries ``torch.optim.Optimizer.__init__`` would create."""
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
    mark_stepped(optimizer)  # what a scheduler's patch on the instance (bypassed here) records
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
    # a scheduler built on the wrapper: a real step counts as a step, whichever way it came
    # (``flush()`` does not go through the instance's ``step``)
    mark_stepped(opt, at_least=True)
    for hook in chain(_torch_optimizer._global_optimizer_pre_hooks.values(),
                      opt._optimizer_step_pre_hooks.values()):
        args, kwargs = _hook_result(hook(opt, args, kwargs), args, kwargs)
    out = fn()
    for hook in chain(opt._optimizer_step_post_hooks.values(),
                      _torch_optimizer._global_optimizer_post_hooks.values()):
        hook(opt, args, kwargs)
    return out


def mark_stepped(optimizer, *, at_least: bool = False) -> None:
    """Record a step the way an LR scheduler's patch of ``optimizer.step`` would have.

    torch's ``LRScheduler`` replaces ``step`` on the instance by a wrapper marked
    ``_wrapped_by_lr_sched`` that sets ``optimizer._opt_called``; older schedulers (and
    schedulers built on their pattern) by one marked ``_with_counter`` that increments
    ``optimizer._step_count``. Nothing is recorded on an optimizer without such a patch.
    ``at_least``: the patch may already have counted this call (a ``step()`` on the wrapper
    goes through it): the count becomes at least 1 instead of one more.
    """
    patched = getattr(optimizer, "__dict__", {}).get("step")
    for _ in range(8):  # the patch, and what it wraps (functools.wraps' __wrapped__ chain)
        if patched is None:
            return
        if getattr(patched, "_wrapped_by_lr_sched", False):
            optimizer._opt_called = True
        if getattr(patched, "_with_counter", False):
            count = getattr(optimizer, "_step_count", 0)
            optimizer._step_count = max(count, 1) if at_least else count + 1
        patched = getattr(patched, "__wrapped__", None)


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
