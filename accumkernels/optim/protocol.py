"""The torch.optim.Optimizer protocol the wrapper keeps: step and state-dict hooks, closures.

torch patches ``Optimizer.step`` so that global and per-instance step hooks run around every
call. The wrapper's ``step()`` is often a no-op (mid-window), so it is not patched: its hooks
run around each *real* step only, once, with the wrapper as the optimizer (the inner
optimizer's own patched step is called unwrapped, so global hooks do not run twice). A window
dropped as non-finite is no step: natively GradScaler does not call ``optimizer.step()`` then,
so no hook fires (:class:`StepHooks`, run by the step room once it steps).

An LR scheduler also patches ``step`` on the optimizer instance it is built on, to record that
the optimizer stepped (``_opt_called``; ``_step_count`` in older schedulers) and warn at its
first ``step()`` otherwise ("Detected call of `lr_scheduler.step()` before
`optimizer.step()`"). Calling the class's step unwrapped bypasses that instance patch, so every
real step records it itself (``_torch_private.record_scheduler_step``) on the inner optimizer and on the wrapper: a
scheduler built on either (before wrapping, as the integrations do, or on the wrapper) sees
the step, as natively. Only the patch found on the instance is read, never global state.
"""

from __future__ import annotations

import inspect
from itertools import chain

import torch

from accumkernels import _torch_private
from accumkernels._torch_private import global_step_hooks, instance_hooks, record_scheduler_step


def init_hook_registries(opt) -> None:
    """The registries ``torch.optim.Optimizer.__init__`` would create."""
    _torch_private.init_hook_registries(opt)


def needs_closure(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` requires a closure (LBFGS)."""
    step = getattr(type(optimizer).step, "__wrapped__", type(optimizer).step)
    try:
        param = inspect.signature(step).parameters.get("closure")
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False
    return param is not None and param.default is inspect.Parameter.empty


def inner_step(optimizer: torch.optim.Optimizer, closure=None, run=None):
    """Step the inner optimizer without running the global step hooks a second time.

    Its own per-instance hooks still run (they were registered on it, not on the wrapper).
    ``run()``: what takes the place of its step between them (the fused master step).
    """
    step = _torch_private.unpatched_step(type(optimizer).step)
    if run is not None:
        step = lambda *args, **kwargs: run()  # noqa: E731
    elif step is None:  # a step torch did not patch: no hooks of its own
        return optimizer.step(closure) if closure is not None else optimizer.step()
    record_scheduler_step(optimizer)  # what a scheduler's patch on the instance (bypassed here) records
    args: tuple = (optimizer,) if closure is None else (optimizer, closure)
    kwargs: dict = {}
    for hook in instance_hooks(optimizer, "step_pre").values():
        args, kwargs = _hook_result(hook(optimizer, args, kwargs), args, kwargs)
    out = step(*args, **kwargs)
    for hook in instance_hooks(optimizer, "step_post").values():
        hook(optimizer, args, kwargs)
    return out


class StepHooks:
    """The wrapper's step hooks (global and per instance) around one call of its ``step()``, as
    torch's patch runs them, but only when that call takes a real step: the step room calls
    :meth:`pre` once it has decided to step (finite window) and :meth:`post` after it. A window
    dropped (``skip_step``) or not due fires none, as natively GradScaler skipping
    ``optimizer.step()`` fires none."""

    def __init__(self, opt, args: tuple, kwargs: dict):
        self.opt, self.args, self.kwargs = opt, args, kwargs

    def pre(self) -> None:
        # a scheduler built on the wrapper: a real step counts as a step, whichever way it came
        # (``flush()`` does not go through the instance's ``step``)
        record_scheduler_step(self.opt, at_least=True)
        global_pre, _ = global_step_hooks()
        for hook in chain(global_pre.values(), instance_hooks(self.opt, "step_pre").values()):
            self.args, self.kwargs = _hook_result(hook(self.opt, self.args, self.kwargs),
                                                  self.args, self.kwargs)

    def post(self) -> None:
        _, global_post = global_step_hooks()
        for hook in chain(instance_hooks(self.opt, "step_post").values(), global_post.values()):
            hook(self.opt, self.args, self.kwargs)


def run_step(opt, args: tuple, kwargs: dict, fn):
    """Run ``fn()`` (a step the caller takes whatever it finds: a closure step) between the
    wrapper's step hooks."""
    hooks = StepHooks(opt, args, kwargs)
    hooks.pre()
    out = fn()
    hooks.post()
    return out


def forward_attribute(opt, config, inner, name: str, masters):
    """An attribute the wrapper does not define: an option of ``config``, else a public
    attribute of the ``inner`` optimizer (what frameworks duck-type). A ``train()``/``eval()``
    that moves the weights it steps (schedule-free optimizers) runs on the fp32 ``masters``
    (MasterWeights), and the model then gets the moved masters."""
    if config is not None and name in config.__dataclass_fields__:
        return getattr(config, name)
    if inner is not None and not name.startswith("_") and hasattr(inner, name):
        value = getattr(inner, name)
        if name in ("train", "eval") and callable(value) and masters is not None:
            def call(*args, **kwargs):
                with masters.swapped():
                    out = value(*args, **kwargs)
                masters.copy_back()
                return out
            return call
        return value
    raise AttributeError(f"{type(opt).__name__!r} object has no attribute {name!r}")


def _hook_result(result, args, kwargs):
    if result is None:
        return args, kwargs
    if isinstance(result, tuple) and len(result) == 2:
        return result
    raise RuntimeError(f"a step pre-hook must return None or a tuple of (new_args, new_kwargs), "
                       f"but got {result}")


def state_dict_with_hooks(opt, build):
    for hook in instance_hooks(opt, "state_dict_pre").values():
        hook(opt)
    sd = build()
    for hook in instance_hooks(opt, "state_dict_post").values():
        result = hook(opt, sd)
        if result is not None:
            sd = result
    return sd


def load_with_hooks(opt, state_dict, load) -> None:
    for hook in instance_hooks(opt, "load_state_dict_pre").values():
        result = hook(opt, state_dict)
        if result is not None:
            state_dict = result
    load(state_dict)
    for hook in instance_hooks(opt, "load_state_dict_post").values():
        hook(opt)
