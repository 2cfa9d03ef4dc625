"""DistributedDataParallel reduces the wrapper's fp32 window: a DDP communication hook.

How DDP's reducer (torch/csrc/distributed/c10d/reducer.cpp, torch 2.13) meets the wrapper:

* The reducer's hook on each param is a post hook of the param's AccumulateGrad node; it runs
  *after* the param's post-accumulate-grad hooks (the wrapper's). With
  ``find_unused_parameters=True`` it first marks the param "locally used" if ``p.grad`` is
  defined, in ``no_sync`` backwards too; otherwise those return early. On a sync backward it
  copies what ``p.grad`` holds into DDP's bucket (in the param dtype; an fp32 ``.grad`` on a
  bf16 param is an error, "Expected BFloat16, got Float"), or zeroes the slot if ``p.grad`` is
  None -- an error ("Encountered gradient which is undefined, but still allreduced") for a param
  marked locally used. Params its graph search found unused in the sync forward are marked
  ready, the same way, at its first hook of that backward.
* When a bucket is complete it calls the comm hook (or its own all-reduce), in bucket order,
  the same on every rank; at the end of the backward (a final callback it queued during the
  backward) it waits for the hook's future and writes the result into every ``p.grad``.
* The wrapper takes each gradient out of ``p.grad`` before DDP's hook sees it (moved into the
  window, or held until its wrapper bucket is complete: accumkernels.optim.intake.intake), and in a
  job of several ranks it hides every window view when a backward begins, so DDP finds
  ``p.grad`` None for every param of ours: it zeroes their bucket slots, and with
  ``find_unused_parameters=True`` never counts them "locally used" (no check that a used
  param's ``.grad`` is still there; at its end they look globally unused and DDP leaves their
  ``.grad`` alone). Without this hook DDP would reduce those zeros, write them into ``p.grad``,
  and the wrapper would show its rank-local window again: ranks would diverge.

With :func:`ddp_comm_hook` registered, a sync backward makes DDP call it per bucket; it moves
the bucket's pending gradients into the window and averages the fp32 window slices of those
params over DDP's process group (divide by the world size, then sum, as DDP does), overlapped
with the rest of the backward. DDP's own bf16/fp32 bucket is not sent. The wrapper's end of
backward runs after DDP's, so ``p.grad`` then shows the reduced window, and DDP's writes are
dropped. Averaging is idempotent on what ranks already agree on (R + g_r averages to
R + mean(g)), so a backward that syncs every micro-batch is as exact as ``no_sync`` cadence.
"""

import torch
import torch.distributed as dist

from accumkernels._torch_private import ddp_comm_hooks
from accumkernels.slot import get_slot

__all__ = ["ddp_comm_hook", "register"]


def ddp_comm_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket
                  ) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: average the ``AccumulatingOptimizer``'s fp32 window, not
    DDP's micro-batch bucket, for the params it manages.

    Register it on the DDP module when the wrapper was built before it (Accelerate's
    ``prepare``, the HF Trainer)::

        ddp_model.register_comm_hook(None, accumkernels.ddp_comm_hook)

    (``process_group`` None means the default group, like torch's ``allreduce_hook``.)
    ``AccumulatingOptimizer(..., model=ddp_model)`` registers it itself. Params of the bucket
    that no wrapper manages are averaged the native way.
    """
    group = process_group if process_group is not None else dist.group.WORLD
    owners: dict[int, tuple[object, list[torch.Tensor]]] = {}
    native = False
    for p in bucket.parameters():
        slot = get_slot(p)
        owner = slot.owner if slot is not None else None
        if owner is None or not hasattr(slot, "ddp_sync"):  # (not a window DDP can reduce)
            native = True
            continue
        owners.setdefault(id(owner), (slot, []))[1].append(p)
    futures = [slot.ddp_sync(group).reduce(params) for slot, params in owners.values()]
    buffer = bucket.buffer()
    if native:  # DDP's own semantics for the rest: average the bucket (DDP writes it back)
        buffer.div_(dist.get_world_size(group))
        futures.append(dist.all_reduce(buffer, group=group, async_op=True).get_future())
    if not futures:
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    # DDP copies the returned tensor into p.grad; the wrapper shows its window afterwards.
    return torch.futures.collect_all(futures).then(lambda _: buffer)


def register(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
    """Register :func:`ddp_comm_hook` on ``ddp`` (for ``AccumulatingOptimizer(model=ddp)``)."""
    if any(getattr(h, "__wrapped__", h) is ddp_comm_hook for h in ddp_comm_hooks(ddp)):
        return  # already ours (an integration registered it): nothing to do
    try:
        ddp.register_comm_hook(ddp.process_group, ddp_comm_hook)
    except RuntimeError as exc:
        raise ValueError(
            "model=: this DistributedDataParallel module already has a communication hook (DDP "
            "allows one); the wrapper needs accumkernels.ddp_comm_hook to reduce its fp32 "
            f"window. Build a DDP module without one. ({exc})") from exc
