"""Synchronisation of the window across ranks: one protocol, one implementation per engine.

Every implementation answers the same calls, made by the intake (a backward begins, a bucket
was moved), the face (a backward ended, a weight was added, the window was reset) and the step
(check the world, finish the reduction and agree on the bookkeeping, agree on the norm):

* :class:`LocalSync`: one rank (or ``independent_ranks=True``). In a job of several ranks it
  refuses to step on rank-local gradients (the ranks would silently diverge);
* :class:`GroupSync`: ``process_group=``. The wrapper all-reduces (sums) the fp32 window once
  per step (accumkernels.optim.sync.reducer.WindowReducer), overlapped with the last backward when N is
  known (the sums that backward started are complete when it returns: what the caller then
  writes into ``p.grad`` never races them). Before its construction-time broadcast, the group
  agrees that it holds replicas (:meth:`WindowReducer.check_replicas`);
* :class:`~accumkernels.optim.sync.ddp.DDPSync`: the model is in DistributedDataParallel. DDP decides when to sync (its
  ``no_sync`` cadence); on a sync backward its comm hook (accumkernels.optim.sync.ddp_hook) calls
  :meth:`DDPSync.reduce` per DDP bucket, which averages the fp32 window of the bucket's params.
  At the end of that backward one small all-reduce agrees on the bookkeeping and the window is
  normalised, so what ``p.grad`` shows -- and what clipping on the sync step scales -- is final;
* the FSDP2 mesh (accumkernels.optim.fsdp2.layout.MeshSync): FSDP2 reduce-scatters; the mesh agrees on
  the bookkeeping and the norm.

:func:`make_sync` picks one when the wrapper is built. DDP can also be met later (its comm hook
registered on a DDP module built after the wrapper: Accelerate, the HF Trainer): the face then
swaps its LocalSync for a DDPSync (``sync_ddp.ddp_sync_for``).

:class:`~accumkernels.optim.sync.stage_norm.StageNorm` (``clip_across_stages``) joins the wrappers of
one rank's pipeline stages: their steps measure the norm of the whole pipeline together.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from accumkernels._util import positive_weight
from accumkernels.optim.sync.reducer import WindowReducer, WindowTotals

BOTH_REDUCE = ("AccumulatingOptimizer: process_group= and a DistributedDataParallel model would both "
         "reduce the window; under DDP leave process_group out (DDP's comm hook reduces it)")


_RANK_LOCAL = (
    "AccumulatingOptimizer: torch.distributed runs {world} ranks but nothing reduces this "
    "wrapper's window across them, so each rank would step on its own gradients and the ranks "
    "would silently diverge. Say which job this is: "
    "(1) data parallel with DistributedDataParallel: pass model=<the DDP module> (or register "
    "accumkernels.ddp_comm_hook on it: ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)) "
    "before the first backward; "
    "(2) data parallel without DDP: process_group=<the ranks that hold this same model and see "
    "different data> (the wrapper averages the fp32 window over them once per step); "
    "(3) pipeline parallel (torch.distributed.pipelining): each rank holds its own stages, so "
    "independent_ranks=True; with data parallelism as well, process_group=<this stage's "
    "data-parallel group> (the ranks that hold this same stage), never one that spans "
    "different stages; "
    "(4) ranks meant to train apart: independent_ranks=True.")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class LocalSync:
    """One rank, or ranks that deliberately train apart (``independent_ranks=True``)."""

    active = False  # the window is not reduced across ranks
    # the window is reduced and agreed on at its last backward (N known), not only at step()
    agrees_at_last_backward = False
    ddp_group = None
    timeout_s = None
    stage_norm = None  # StageNorm: the norm is the whole pipeline's (pipelining.clip_across_stages)
    joins_stage_norm = True

    def __init__(self, independent_ranks: bool):
        self.independent_ranks = independent_ranks

    def check_world(self) -> None:
        """Raise before a step that would use rank-local gradients in a multi-rank job."""
        world = world_size()
        if world > 1 and not self.independent_ranks:
            raise RuntimeError(_RANK_LOCAL.format(world=world))

    def rank_local_window(self) -> tuple[int, int] | None:
        """(rank, world) when this rank's window is its own in a multi-rank job, else None."""
        world = world_size()
        if world <= 1 or self.independent_ranks:
            return None
        return dist.get_rank(), world

    def ddp_possible(self) -> bool:
        """DDP may reduce this window (a comm hook registered but not yet called)."""
        return world_size() > 1 and not self.independent_ranks

    def backward_begins(self) -> None:
        pass

    def bucket_moved(self, bucket, last_microbatch: bool) -> None:
        pass

    def end_backward(self) -> bool:
        return False

    def weight_added(self) -> None:
        pass

    refused_weight: str | None = None  # (an active sync's: a weight this rank refused)

    def take_weight(self, weight: object) -> float | None:
        """The value ``add_weight(weight)`` adds to the window. One rank refuses a bad value
        at once (ValueError). Ranks that agree on the window (an active sync) keep the
        refusal for their next agreement instead, where every rank raises it alike: raised
        here alone, the others would wait in the next collective for this one."""
        if not self.active or world_size() <= 1:
            return positive_weight(weight)
        try:
            return positive_weight(weight)
        except ValueError as exc:
            self.refused_weight = self.refused_weight or str(exc)
            return None

    def any_rank(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on any of the ranks whose windows this one is reduced with
        (one small all-reduce with a deadline; a rank alone: its own). For a refusal that
        every rank must raise alike (a load that would leave the ranks in different windows)."""
        group = self.agreement_group()
        if group is False:
            return flag
        value = torch.tensor([float(flag)], dtype=torch.float64)
        work = dist.all_reduce(value, group=group, async_op=True)
        seconds = self.timeout_s or 300.0
        try:
            work.wait(timeout=datetime.timedelta(seconds=seconds))
        except RuntimeError as exc:
            raise RuntimeError(f"AccumulatingOptimizer: waited {seconds:g} s for the other "
                               f"ranks' {what}; every rank must call it") from exc
        return float(value) > 0

    def agreement_group(self):
        """The process group the ranks agree over (None: the default one); False: none."""
        return None if self.rank_local_window() is not None else False

    def weight_state(self) -> tuple[int, str | None]:
        """What the ranks agree on about the weights: this rank's micro-batches without a
        weight, and the weight it refused (accumkernels.optim.sync.reducer.check_weights)."""
        w = self.window
        return max(0, w.micro_steps - len(w.weights)), self.refused_weight

    def finish(self, found_inf: torch.Tensor) -> WindowTotals | None:
        self.gathered()
        return None

    def gathered(self) -> None:
        """The window is reduced and agreed on (the end of ``finish``): with
        ``clip_across_stages``, the pipeline's norm round starts here, so that every real step
        of every stage takes part in it (also one that then skips)."""
        if self.stage_norm is not None:
            self.stage_norm.gathered(self)

    def agreed_totals(self) -> WindowTotals | None:
        """The window's totals over the ranks, once ``finish`` agreed on them (else None)."""
        return None

    def left_round(self) -> None:
        """The window was reset (stepped, skipped or dropped): out of the norm round."""
        if self.stage_norm is not None:
            self.stage_norm.leave(self)

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return self.across_stages(norm)

    def across_stages(self, norm: torch.Tensor) -> torch.Tensor:
        """The norm of every pipeline stage's window (``clip_across_stages``), else ``norm``."""
        return norm if self.stage_norm is None else self.stage_norm.agree(self, norm)

    def reset(self) -> None:
        self.left_round()

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        """The window's storage was rebuilt for ``params`` (``add_param_group``)."""

    def summed_buckets(self) -> list[int]:
        """Buckets of the window already summed across the ranks (a checkpoint records them:
        resumed, they must not be summed again). None here."""
        return []

    def check_summed(self, indices: list) -> None:
        """A checkpoint's window holds buckets summed across ``process_group``'s ranks: only a
        wrapper that reduces over those ranks can resume it (ValueError)."""
        if indices:
            raise ValueError(_SUMMED_ELSEWHERE)

    def take_summed(self, indices: list[int]) -> None:
        pass


_SUMMED_ELSEWHERE = (
    "load_state_dict: this checkpoint was taken after the window's last backward under "
    "process_group, when its gradients were already summed across the ranks; only a wrapper "
    "with the same process_group (same ranks) can resume it. Load it there, or save at a "
    "window boundary (after step())")


class GroupSync(LocalSync):
    """``process_group=``: the wrapper all-reduces the window once per step."""

    active = True

    @property
    def agrees_at_last_backward(self) -> bool:
        """Not with ``clip_across_stages``: agreeing starts the pipeline's norm round, a
        collective over the stages that must not run inside a schedule's backward."""
        return self.stage_norm is None

    def __init__(self, group, window, params: list[torch.Tensor], weighted: bool = False):
        super().__init__(independent_ranks=False)
        self.window, self.params = window, params
        self.weighted = weighted  # the window's weights are agreed once all are in (below)
        self.reducer = WindowReducer(group, window.storage)
        self.reducer.check_replicas(params)  # a group over other params or stages: refused
        self.reducer.broadcast_params(params)
        self._totals: WindowTotals | None = None  # the window was reduced and agreed on
        self._stale = False  # ... but a weight was reported after that

    @property
    def timeout_s(self) -> float:
        return self.reducer.timeout_s

    @timeout_s.setter
    def timeout_s(self, seconds: float) -> None:
        self.reducer.timeout_s = seconds

    def check_world(self) -> None:
        pass

    def rank_local_window(self) -> tuple[int, int] | None:
        reducer = self.reducer
        return (reducer.rank, reducer.world) if reducer.world > 1 else None

    def ddp_possible(self) -> bool:
        return False

    def agreement_group(self):
        return self.reducer.group if self.reducer.world > 1 else False

    def backward_begins(self) -> None:
        """A backward after the window's reduction started (or finished) must reach it too:
        the sums become this rank's share (sum / world), summed again at the step."""
        if self._totals is not None:
            self._totals = None
            world = self.reducer.world
            for flat in self.window.storage.buffers.values():
                flat.div_(world)
        elif self.reducer.started:
            self.reducer.reopen()

    def bucket_moved(self, bucket, last_microbatch: bool) -> None:
        """During the window's last backward: start reducing a finished bucket (overlap)."""
        if last_microbatch:
            self.reducer.reduce_bucket(bucket)

    def end_backward(self) -> bool:
        """The sums this backward started are complete when it returns: what the caller writes
        into ``p.grad`` next (pipelining's ``scale_grads``, a clip) must not race an
        all-reduce reading and writing the same memory."""
        if self.reducer.started:
            self.reducer.settle()
        self._agree_weight(after_backward=True)
        return False

    def weight_added(self) -> None:
        if self._totals is not None:
            self._stale = True
        self._agree_weight(after_backward=False)

    def _agree_weight(self, after_backward: bool) -> None:
        """``weighted``: once the window is complete (N given) and every micro-batch's weight
        is in -- after the N-th backward, or at the ``add_weight`` that completes them -- the
        ranks agree on the window's bookkeeping (the weight total, and that every rank misses
        the same number of weights) and the window is normalised by the total, so ``p.grad``
        shows the final sum / total weight before ``step()`` (a user's clip). It is the same
        all-reduce as the step's agreement: a rank that skipped an ``add_weight`` meets the
        others there, and every rank raises."""
        w = self.window
        if not (self.weighted and w.complete) or w.weights_pending():
            return
        if not after_backward and len(w.weights) != w.micro_steps:
            return  # (a weight beyond the window's micro-batches: agreed at the step)
        totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(), _no_inf(w),
                                    w.held(self.params), self.weight_state())
        if totals.weight > 0:
            w.normalise(totals.weight)

    def finish(self, found_inf: torch.Tensor) -> WindowTotals:
        """Reduce the window and agree on it; again in the same window (the first wrapper of
        ``clip_across_stages`` measures the others before they step), the same totals."""
        w = self.window
        if self._totals is None:
            self._totals = self.reducer.finish(w.micro_steps, w.kept, w.local_weight(),
                                               found_inf, w.held(self.params),
                                               self.weight_state())
        elif self._stale:
            self._totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(),
                                              found_inf, w.held(self.params),
                                              self.weight_state())
        self._stale = False
        self.gathered()
        return self._totals

    def agreed_totals(self) -> WindowTotals | None:
        return self._totals

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """Non-finite on every rank if on one (one flag all-reduce): with N given the window's
        buckets were summed during its last backward, so a value written into one rank's
        ``p.grad`` after it reaches no other rank through the sum; the ranks still skip (or
        raise) together, never step apart."""
        bad = (~torch.isfinite(norm)).double().reshape(1)
        self.reducer.wait(dist.all_reduce(bad, group=self.reducer.group, async_op=True),
                          "non-finite check")
        norm = norm if float(bad) == 0 else torch.full_like(norm, float("nan"))
        return self.across_stages(norm)

    def reset(self) -> None:
        self._totals, self._stale = None, False
        self.refused_weight = None
        self.reducer.reset()
        self.left_round()

    def summed_buckets(self) -> list[int]:
        """The buckets whose sums the last backward started (complete once it returned), or
        every bucket once ``finish`` reduced the window."""
        if self._totals is not None:
            return list(range(len(self.window.storage.buckets)))
        return self.reducer.summed_buckets()

    def check_summed(self, indices: list) -> None:
        buckets = len(self.window.storage.buckets)
        if any(not isinstance(i, int) or not 0 <= i < buckets for i in indices):
            raise ValueError("load_state_dict: the summed buckets do not match this optimizer's "
                             "buckets (another bucket_size_mb or model?)")

    def take_summed(self, indices: list[int]) -> None:
        """Restored buckets that were already summed: ``finish`` (and a backward past N) treats
        them as sums it started itself (``reset`` forgets them)."""
        self._totals, self._stale = None, False
        self.reducer.reset()
        self.reducer.mark_summed(indices)

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        timeout = self.reducer.timeout_s
        self.window, self.params = window, params
        self.reducer = WindowReducer(self.reducer.group, window.storage, timeout_s=timeout)
        self._totals, self._stale = None, False


def _no_inf(window) -> torch.Tensor:
    """A clear non-finite flag on the window's device (an agreement before the step's)."""
    return torch.zeros((), device=next(iter(window.storage.buffers), torch.device("cpu")))


def make_sync(config, process_group, ddp, window, params):
    """The implementation for this wrapper (FSDP2's mesh is picked by its own room)."""
    if process_group is not None:
        if ddp is not None:
            raise ValueError(BOTH_REDUCE)
        return GroupSync(process_group, window, params,
                         weighted=config.weighted)
    return LocalSync(config.independent_ranks)
