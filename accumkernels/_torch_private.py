"""Every private PyTorch API the wrapper relies on, in one place, with the torch it was checked on.

Each entry names what it reads and why no public API serves. tests/optim/test_torch_private.py calls
every one on the installed torch and fails loudly, naming the entry, when torch changes it.
Checked on torch 2.11 (the GPU machines), 2.13 (CPU CI) and 2.14.1. It is also the one module of
the package that reads ``sys.modules`` (whether a torch subsystem was imported at all).

The last section is the version check: the public features the package needs, the torch release
that brought each, and ``require``, which refuses a missing one with that release's number.

The kernel layer's dispatch-key reads (``torch._C._dispatch_keys``, ``_increment_version`` in
accumkernels.ops.accumulate, accumkernels.ops.master_step and accumkernels.ops.backends) belong to the ops' custom-op
contract and stay there; so do the fused master step reference's calls of torch's own fused
optimizer ops (``torch._fused_adamw_`` and kin, tested against ``torch.optim``'s fused steps).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections import OrderedDict

import torch

CHECKED_ON = ("2.11", "2.13", "2.14")

# -- autograd engine --------------------------------------------------------------------------------
# The end of a backward: a final callback queued on the running engine (no public hook fires
# after every AccumulateGrad of one backward, nested/reentrant backwards included).
_engine = torch.autograd.Variable._execution_engine


def queue_callback(callback) -> None:
    """Run ``callback()`` when the running backward ends (after the callbacks queued before)."""
    _engine.queue_callback(callback)


def current_autograd_node():
    """The autograd node running now (None outside a backward): tells a backward nested in a
    running one (reentrant checkpointing) from an outer one."""
    return torch._C._current_autograd_node()


def compiled_autograd_on() -> bool:
    """Whether compiled autograd traces the running backward (it would trace FSDP2's hooks)."""
    ca = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(ca is not None and (getattr(ca, "in_compiled_autograd_region", False)
                                    or getattr(ca, "compiled_autograd_enabled", False)))


# -- tensor hooks -----------------------------------------------------------------------------------
# A param's post-accumulate-grad hooks run in the order of the dict ``_post_accumulate_grad_hooks``
# (handle id -> hook) that ``register_post_accumulate_grad_hook`` fills; the engine walks it with
# PyDict_Next, i.e. in the dict's insertion order (``OrderedDict.move_to_end`` does not change
# that order). There is no public way to run a hook before those registered earlier.
def has_post_accumulate_hooks(p: torch.Tensor) -> bool:
    """Whether ``p`` has post-accumulate-grad hooks (registered by anyone, so far)."""
    return bool(getattr(p, "_post_accumulate_grad_hooks", None))


def run_post_accumulate_hook_first(p: torch.Tensor, handle) -> None:
    """Make the hook of ``handle`` (``p.register_post_accumulate_grad_hook``'s) run before
    the hooks registered on ``p`` earlier; their handles still remove them."""
    hooks = p._post_accumulate_grad_hooks
    items = list(hooks.items())
    hooks.clear()
    hooks[handle.id] = dict(items)[handle.id]
    for key, hook in items:
        if key != handle.id:
            hooks[key] = hook


def post_accumulate_hook_ends(p: torch.Tensor) -> tuple[int, object, object]:
    """How many post-accumulate-grad hooks ``p`` has, and the handle ids of the one the engine
    runs first and the one it runs last (``None, None`` without hooks)."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    if not hooks:
        return 0, None, None
    return len(hooks), next(iter(hooks)), next(reversed(hooks))


def hook_registrations() -> int:
    """A number that changes whenever a hook is registered anywhere (tensor, module or
    post-accumulate hooks: each registration takes the next ``RemovableHandle`` id): the
    intake re-reads its params' hook order only when it moved."""
    return torch.utils.hooks.RemovableHandle.next_id


# -- torch.distributed.pipelining -------------------------------------------------------------------
def pipelining_imported() -> bool:
    """Whether ``torch.distributed.pipelining`` was imported: no schedule of it can run before
    (a cheap gate in front of the wrapper's stack walk for a weight pass it missed)."""
    return "torch.distributed.pipelining" in sys.modules


# -- DistributedDataParallel ------------------------------------------------------------------------
def ddp_comm_hooks(ddp) -> list:
    """The Python hooks given to ``register_comm_hook`` (DDP keeps (hook, state) pairs in
    ``_comm_hooks``; there is no getter). A builtin hook is not listed."""
    return [hook for hook, *_ in getattr(ddp, "_comm_hooks", None) or []]


# -- FSDP2 ------------------------------------------------------------------------------------------
def fsdp2_offload_unsafe() -> bool:
    """Whether this torch's FSDP2 may run the post-accumulate hooks before a pinned D2H gradient
    copy is done (fixed when ``foreach_reduce`` learned ``has_post_acc_grad_hook``)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
        return "has_post_acc_grad_hook" not in inspect.getsource(_fsdp_collectives.foreach_reduce)
    except (ImportError, OSError, TypeError):  # pragma: no cover - source not readable
        return True


def fsdp2_group_mesh(module):
    """The device mesh FSDP2 shards the params of ``module`` (an ``FSDPModule``) over: its param
    group's data-parallel mesh (``_get_fsdp_state()._fsdp_param_group.mesh_info.mesh``; no
    public getter), without the tensor-parallel dims of the params' own mesh. None for a module
    holding no params of its own; AttributeError where this torch keeps it elsewhere."""
    group = module._get_fsdp_state()._fsdp_param_group
    return None if group is None else group.mesh_info.mesh


def flat_leaves(tree) -> list:
    """The leaves of a nested output (tuples, lists, dicts, dataclasses torch registered):
    ``torch.utils._pytree.tree_flatten``, the flattening FSDP2's own hooks use."""
    from torch.utils._pytree import tree_flatten
    return tree_flatten(tree)[0]


def fsdp2_reduce_scatter_base() -> type:
    """FSDP2's ``ReduceScatter`` policy base class (``set_custom_reduce_scatter``'s argument)."""
    require("FSDPModule.set_custom_reduce_scatter", "accumkernels.optim.fsdp2.wire", ImportError)
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter


# -- torch.optim ------------------------------------------------------------------------------------
def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """A fused optimizer that divides its gradients by ``grad_scale`` (and skips on
    ``found_inf``) in its own pass, as GradScaler drives it (``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


# ``register_step_pre_hook`` and kin keep an instance's hooks in registries that
# ``Optimizer.__init__`` creates on it (no getter); the wrapper, which does not run that
# ``__init__``, creates them itself so those public methods work on it.
_HOOK_REGISTRIES = {
    "step_pre": "_optimizer_step_pre_hooks", "step_post": "_optimizer_step_post_hooks",
    "state_dict_pre": "_optimizer_state_dict_pre_hooks",
    "state_dict_post": "_optimizer_state_dict_post_hooks",
    "load_state_dict_pre": "_optimizer_load_state_dict_pre_hooks",
    "load_state_dict_post": "_optimizer_load_state_dict_post_hooks",
}


def init_hook_registries(opt) -> None:
    """The per-instance hook registries ``torch.optim.Optimizer.__init__`` would create."""
    for name in _HOOK_REGISTRIES.values():
        setattr(opt, name, OrderedDict())


def instance_hooks(opt, kind: str) -> dict:
    """The hooks ``opt.register_<kind>_hook`` registered (handle id -> hook, in their order);
    ``kind``: step_pre, step_post, state_dict_pre, state_dict_post, load_state_dict_pre,
    load_state_dict_post."""
    return getattr(opt, _HOOK_REGISTRIES[kind])


def has_step_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether step pre- or post-hooks are registered on ``optimizer`` itself."""
    return bool(instance_hooks(optimizer, "step_pre") or instance_hooks(optimizer, "step_post"))


def unpatched_step(step):
    """The class's step under torch's hook patch (``Optimizer._patch_step_function`` marks its
    wrapper ``hooked``), every layer of it: a class patched twice (its step replaced by a wrapper
    of the patched one that torch then patched again) must not run the global hooks once more.
    None where torch did not patch it."""
    if not getattr(step, "hooked", False):
        return None
    while getattr(step, "hooked", False) and hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


def global_step_hooks() -> tuple[dict, dict]:
    """The global optimizer step pre- and post-hooks (``register_optimizer_step_*_hook``)."""
    from torch.optim import optimizer as torch_optimizer
    return (torch_optimizer._global_optimizer_pre_hooks,
            torch_optimizer._global_optimizer_post_hooks)


def record_scheduler_step(optimizer, *, at_least: bool = False) -> None:
    """Record a step the way an LR scheduler's patch of ``optimizer.step`` would have.

    ``LRScheduler`` replaces ``step`` on the optimizer instance by a wrapper marked
    ``_wrapped_by_lr_sched`` that sets ``optimizer._opt_called``; older schedulers (and those
    built on their pattern) by one marked ``_with_counter`` that increments
    ``optimizer._step_count``. Nothing is recorded on an optimizer without such a patch.
    ``at_least``: the patch may already have counted this call: the count becomes at least 1.
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


def optimizer_records() -> frozenset[str]:
    """What torch's optimizer machinery sets on an optimizer instance besides its state: the hook
    registries, the step profiler's name (``_patch_step_function``), the capturable check's flag,
    the records of an LR scheduler's patch of ``step`` (``_opt_called``, ``_step_count``).
    ``Optimizer.__getstate__`` carries none of them: a copy starts without (the patched ``step``
    itself is an attribute that shadows the class's method)."""
    return frozenset(_HOOK_REGISTRIES.values()) | {
        "_zero_grad_profile_name", "_warned_capturable_if_run_uncaptured", "_opt_called",
        "_step_count"}


def initial_state_hook(optimizer: torch.optim.Optimizer, seen) -> bool:
    """Call ``seen(group)`` after each ``_init_group(group, ...)`` of ``optimizer`` (an instance
    the caller owns: the hook is set on it), where every torch.optim class with lazy state creates
    a param's first state before its update: the state a fresh optimizer steps from (Rprop's
    ``step_size`` = lr, ASGD's ``eta``/``mu``, NAdam's ``mu_product``; none for SGD's momentum,
    made by the update). False for a class without ``_init_group`` (LBFGS, SparseAdam, custom)."""
    init = getattr(type(optimizer), "_init_group", None)
    if init is None:
        return False

    def init_then_record(group, *args, **kwargs):
        out = init(optimizer, group, *args, **kwargs)
        seen(group)
        return out

    optimizer._init_group = init_then_record
    return True


# -- versions --------------------------------------------------------------------------------------
# The declared floor (pyproject.toml) is the oldest torch the whole suite passed on; below it, each
# feature below is still checked where it is used, so a missing one is refused by name.
TORCH_FLOOR = "2.11"


def _has(path: str) -> bool:
    """Whether the dotted path (``torch.`` first) names something, importing submodules."""
    parts = path.split(".")
    obj = torch
    for i in range(1, len(parts)):
        try:
            obj = getattr(obj, parts[i])
        except AttributeError:
            try:
                obj = importlib.import_module(".".join(parts[:i + 1]))
            except ImportError:
                return False
    return True


# feature -> (the torch release that brought it, what to look up on the installed torch). The
# package also uses, where present, Tensor.grad_dtype (2.10; without it bf16 params show no fp32
# .grad view mid-window) and, from the user's code, fully_shard (public in 2.6) and
# torch.distributed.pipelining (2.4).
FEATURES = {
    "torch.library.custom_op": ("2.4", "torch.library.custom_op"),
    "torch.library.register_fake": ("2.4", "torch.library.register_fake"),
    "torch.compiler.is_compiling": ("2.3", "torch.compiler.is_compiling"),
    "FSDPModule.set_custom_reduce_scatter":
        ("2.9", "torch.distributed.fsdp.FSDPModule.set_custom_reduce_scatter"),
}
# What ``import accumkernels`` cannot do without (the ops register at import).
CORE = ("torch.library.custom_op", "torch.library.register_fake", "torch.compiler.is_compiling")


def has_feature(feature: str) -> bool:
    return _has(FEATURES[feature][1])


def require(feature: str, user: str, error: type[Exception] = RuntimeError) -> None:
    """Raise ``error`` naming the torch release ``user`` needs when ``feature`` is missing."""
    if not has_feature(feature):
        version = FEATURES[feature][0]
        raise error(f"{user} needs {feature}, new in torch {version}; this is torch "
                    f"{torch.__version__} (accumkernels is tested on torch >= {TORCH_FLOOR})")


def check_core() -> None:
    """At ``import accumkernels``: refuse a torch without what the package's import needs."""
    for feature in CORE:
        require(feature, "accumkernels", ImportError)
