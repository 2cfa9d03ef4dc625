"""Synchronisation of the window across ranks: one protocol, one implementation per engine.

Every implementation answers the same calls, made by the intake (a backward begins, a bucket
was moved), the face (a backward ended, a weight was added, the window was reset) and the step
(check the world, finish the reduction and agree on the bookkeeping, agree on the norm):

* :class:`LocalSync`: one rank (or ``independent_ranks=True``). In a job of several ranks it
  refuses to step on rank-local gradients (the ranks would silently diverge);
* :class:`GroupSync`: ``process_group=``. The wrapper all-reduces (sums) the fp32 window once
  per step (accumkernels.distributed.WindowReducer), overlapped with the last backward when N is
  known;
* :class:`DDPSync`: the model is in DistributedDataParallel. DDP decides when to sync (its
  ``no_sync`` cadence); on a sync backward its comm hook (accumkernels.optim.ddp) calls
  :meth:`DDPSync.reduce` per DDP bucket, which averages the fp32 window of the bucket's params.
  At the end of that backward one small all-reduce agrees on the bookkeeping and the window is
  normalised, so what ``p.grad`` shows -- and what clipping on the sync step scales -- is final;
* the FSDP2 mesh (accumkernels.optim.fsdp2.MeshSync): FSDP2 reduce-scatters; the mesh agrees on
  the bookkeeping and the norm.

:func:`make_sync` picks one when the wrapper is built. DDP can also be met later (its comm hook
registered on a DDP module built after the wrapper: Accelerate, the HF Trainer): the face then
swaps its LocalSync for a DDPSync (:func:`ddp_sync_for`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from accumkernels.distributed import WindowReducer, WindowTotals

_BOTH = ("AccumulatingOptimizer: process_group= and a DistributedDataParallel model would both "
         "reduce the window; under DDP leave process_group out (DDP's comm hook reduces it)")


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class LocalSync:
    """One rank, or ranks that deliberately train apart (``independent_ranks=True``)."""

    active = False  # the window is not reduced across ranks
    ddp_group = None
    timeout_s = None

    def __init__(self, independent_ranks: bool):
        self.independent_ranks = independent_ranks

    def check_world(self) -> None:
        """Raise before a step that would use rank-local gradients in a multi-rank job."""
        world = world_size()
        if world > 1 and not self.independent_ranks:
            raise RuntimeError(
                f"AccumulatingOptimizer: torch.distributed runs {world} ranks but nothing reduced "
                "this wrapper's window across them, so each rank would step on its own "
                "gradients and the ranks would silently diverge. If the model is in "
                "DistributedDataParallel, pass model=<the DDP module> (or register "
                "accumkernels.ddp_comm_hook on it: ddp.register_comm_hook(None, "
                "accumkernels.ddp_comm_hook)) before the first backward. For data parallel "
                "without DDP, pass process_group=<the group of ranks that hold the same model "
                "and see different data> (the wrapper averages the fp32 window once per step). "
                "independent_ranks=True if the ranks are meant to train apart (e.g. the stages "
                "of a pipeline without data parallelism).")

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

    def finish(self, found_inf: torch.Tensor) -> WindowTotals | None:
        return None

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        return norm

    def reset(self) -> None:
        pass

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        """The window's storage was rebuilt for ``params`` (``add_param_group``)."""


class GroupSync(LocalSync):
    """``process_group=``: the wrapper all-reduces the window once per step."""

    active = True

    def __init__(self, group, window, params: list[torch.Tensor]):
        super().__init__(independent_ranks=False)
        self.window, self.params = window, params
        self.reducer = WindowReducer(group, window.storage)
        self.reducer.broadcast_params(params)

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

    def backward_begins(self) -> None:
        """A backward after the window's reduction started must reach it too."""
        if self.reducer.started:
            self.reducer.reopen()

    def bucket_moved(self, bucket, last_microbatch: bool) -> None:
        """During the window's last backward: start reducing a finished bucket (overlap)."""
        if last_microbatch:
            self.reducer.reduce_bucket(bucket)

    def finish(self, found_inf: torch.Tensor) -> WindowTotals:
        w = self.window
        return self.reducer.finish(w.micro_steps, w.kept, w.local_weight(), found_inf,
                                   w.held(self.params))

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """No agreement needed: the window is reduced inside ``step()`` just before it is
        measured, so a rank's non-finite value reaches every rank through the sum."""
        return norm

    def reset(self) -> None:
        self.reducer.reset()

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        timeout = self.reducer.timeout_s
        self.window, self.params = window, params
        self.reducer = WindowReducer(self.reducer.group, window.storage, timeout_s=timeout)


class DDPSync(LocalSync):
    """DistributedDataParallel reduces the window through ``accumkernels.ddp_comm_hook``."""

    active = True

    def __init__(self, group, window, params: list[torch.Tensor], flush, found_inf):
        super().__init__(independent_ranks=False)
        self.ddp_group = group
        self.window, self.params = window, params
        self.flush = flush  # moves the pending gradients of given params into the window
        self.found_inf = found_inf  # the nonfinite room's flag tensor (bookkeeping only)
        self.reducer = WindowReducer(group, window.storage)
        # id(param) -> position in the buffer (reverse registration order)
        self.layout = {id(p): k for k, p in enumerate(reversed(window.storage.params))}
        self.futures: list = []
        self.synced = False  # DDP's comm hook ran in the current backward
        self.clean = False  # no micro-batch since the last DDP sync (totals are current)
        self.stale = False  # ... but a weight was reported after it
        self.totals: WindowTotals | None = None

    timeout_s = GroupSync.timeout_s

    def check_world(self) -> None:
        pass

    def rank_local_window(self) -> tuple[int, int] | None:
        if self.clean:
            return None  # DDP's sync backward averaged it: the same on every rank
        return dist.get_rank(self.ddp_group), dist.get_world_size(self.ddp_group)

    def ddp_possible(self) -> bool:
        return True

    def reduce(self, params: list[torch.Tensor]) -> torch.futures.Future:
        """From DDP's comm hook, on a sync backward: average the fp32 window of ``params``."""
        self.flush(params)  # gradients waiting for the rest of a wrapper bucket
        storage, group = self.window.storage, self.ddp_group
        views = []
        for p in params:
            view = storage.view(p)
            if not self.window.holds(p):  # no gradient on this rank in this window: 0, as in
                view.zero_()  # DDP; it counts as held if another rank has one (end_backward)
            views.append(view)
        flat = self._contiguous_range(params, views)
        copy_back = flat is None
        if copy_back:
            flat = torch.cat([v.reshape(-1) for v in views])
        flat.div_(dist.get_world_size(group))  # DDP's order: divide, then sum
        future = dist.all_reduce(flat, group=group, async_op=True).get_future()
        if copy_back:
            def scatter(_, flat=flat, views=views):
                pieces = torch.split(flat, [v.numel() for v in views])
                torch._foreach_copy_(views, [x.view_as(v) for x, v in zip(pieces, views)])
            future = future.then(scatter)
        self.futures.append(future)
        self.synced = True
        return future

    def _contiguous_range(self, params, views) -> torch.Tensor | None:
        """The buffer range holding exactly ``params`` (and zero padding), if there is one."""
        positions = sorted(self.layout.get(id(p), -1) for p in params)
        if positions[0] < 0 or positions[-1] - positions[0] != len(positions) - 1:
            return None
        first = min(views, key=lambda v: v.storage_offset())
        last = max(views, key=lambda v: v.storage_offset())
        flat = next(iter(self.window.storage.buffers.values()))
        start = first.storage_offset() - flat.storage_offset()
        return flat[start:last.storage_offset() - flat.storage_offset() + last.numel()]

    def end_backward(self) -> bool:
        """After each backward (its micro-batch counted). True if DDP synced it: the window is
        then averaged, agreed on and normalised."""
        if not self.synced:
            self.clean = False
            return False
        self.synced = False
        futures, self.futures = self.futures, []
        for future in futures:
            future.wait()
        self.totals = self._agree()
        self.clean, self.stale = True, False
        # a param some rank has a gradient for is in p.grad on every rank; one no rank has
        # keeps p.grad None (DDP leaves globally unused params' .grad alone too)
        self.window.keep_only(self.params, self.totals.touched)
        self.window.normalise(self.window.target_divisor(self.totals))
        return True

    def weight_added(self) -> None:
        if self.clean:
            self.stale = True

    def _agree(self) -> WindowTotals:
        w = self.window
        totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(), self.found_inf,
                                    w.held(self.params))
        totals.averaged = True
        return totals

    def finish(self, found_inf: torch.Tensor) -> WindowTotals:
        if not self.clean:  # micro-batches no DDP sync reduced (no sync in this window's end)
            world = dist.get_world_size(self.ddp_group)
            for flat in self.window.storage.buffers.values():
                flat.div_(world)
            w = self.window
            self.totals = self.reducer.finish(w.micro_steps, w.kept, w.local_weight(), found_inf,
                                              w.held(self.params))
            self.totals.averaged = True
        elif self.stale:
            self.totals = self._agree()
        return self.totals

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The window was reduced in the sync backward and the user may write into one rank's
        ``p.grad`` before ``step()``: a non-finite norm on any rank is non-finite on every rank
        (one flag all-reduce), so the ranks skip or raise together, never step apart."""
        bad = (~torch.isfinite(norm)).double().reshape(1)
        self.reducer.wait(dist.all_reduce(bad, group=self.ddp_group, async_op=True),
                          "non-finite check")
        return norm if float(bad) == 0 else torch.full_like(norm, float("nan"))

    def reset(self) -> None:
        self.totals = None
        self.clean = self.stale = self.synced = False
        self.futures = []
        self.reducer.reset()

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        timeout = self.reducer.timeout_s
        self.window, self.params = window, params
        self.reducer = WindowReducer(self.ddp_group, window.storage, timeout_s=timeout)
        self.layout = {id(p): k for k, p in enumerate(reversed(window.storage.params))}


def make_sync(config, process_group, ddp, window, params):
    """The implementation for this wrapper (FSDP2's mesh is picked by its own room)."""
    if process_group is not None:
        if ddp is not None:
            raise ValueError(_BOTH)
        return GroupSync(process_group, window, params)
    return LocalSync(config.independent_ranks)


def ddp_sync_for(current, group, config, window, params, flush, found_inf) -> DDPSync:
    """The DDPSync that reduces the window over DDP's ``group`` (met at the first sync, or at
    construction with ``model=ddp``): ``current`` if it already is one."""
    if isinstance(current, DDPSync):
        if group is not current.ddp_group:
            raise RuntimeError("AccumulatingOptimizer: two DDP process groups reduce the same "
                               "window (one DDP module per wrapper)")
        return current
    if isinstance(current, GroupSync):
        raise ValueError(_BOTH)
    if config.nonfinite == "skip_microbatch" or not config.accumulate_in_backward:
        raise ValueError(
            "AccumulatingOptimizer under DistributedDataParallel needs "
            "accumulate_in_backward=True and a nonfinite policy other than "
            "'skip_microbatch' (DDP reduces each gradient during the backward, before a "
            "micro-batch could be dropped)")
    return DDPSync(group, window, params, flush, found_inf)
