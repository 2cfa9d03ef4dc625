"""Every private PyTorch API the wrapper relies on, in one place, with the torch it was checked on.

Each entry names what it reads and why no public API serves. tests/optim/test_torch_private.py calls
every one on the installed torch and fails loudly, naming the entry, when torch changes it.
Checked on torch 2.11 (the GPU machines) and 2.13 (CPU CI).

The kernel layer's dispatch-key reads (``torch._C._dispatch_keys``, ``_increment_version`` in
accumkernels.ops, accumkernels.master_step and accumkernels.backends) belong to the ops' custom-op
contract and stay there; so do the fused master step reference's calls of torch's own fused
optimizer ops (``torch._fused_adamw_`` and kin, tested against ``torch.optim``'s fused steps).
"""

from __future__ import annotations

import inspect
import sys

import torch

CHECKED_ON = ("2.11", "2.13")

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


def fsdp2_reduce_scatter_base() -> type:
    """FSDP2's ``ReduceScatter`` policy base class (``set_custom_reduce_scatter``'s argument)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
    return ReduceScatter


# -- torch.optim ------------------------------------------------------------------------------------
def takes_grad_scale(optimizer: torch.optim.Optimizer) -> bool:
    """A fused optimizer that divides its gradients by ``grad_scale`` (and skips on
    ``found_inf``) in its own pass, as GradScaler drives it (``_step_supports_amp_scaling``)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


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
