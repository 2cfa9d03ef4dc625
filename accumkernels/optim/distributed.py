"""The data-parallel room: what the wrapper does when more than one rank trains.

* ``process_group=``: the wrapper itself all-reduces (sums) the fp32 window once per step
  (accumkernels.distributed.WindowReducer), overlapped with the last backward when N is known.
* DistributedDataParallel (``model=ddp``, or ``accumkernels.ddp_comm_hook`` registered on it):
  DDP decides when to sync (its ``no_sync`` cadence); on a sync backward its comm hook calls
  :meth:`DataParallel.ddp_reduce` per DDP bucket, which averages the fp32 window of the
  bucket's params (accumkernels.optim.ddp). At the end of that backward one small all-reduce
  agrees on the bookkeeping (micro-batch counts, weights, non-finite flags) and the window is
  normalised, so what ``p.grad`` shows -- and what clipping on the sync step scales -- is final.
  A window that reaches ``step()`` with micro-batches no sync reduced is averaged there.
* Otherwise, in a job of more than one rank, a step on rank-local gradients would silently
  diverge: the first real step raises, naming ``process_group`` and ``model=``
  (``independent_ranks=True`` opts out, for ranks that deliberately train apart).
* FSDP2 (``fully_shard``: DTensor params) has its own room, accumkernels.optim.fsdp2;
  FSDP1 and DeepSpeed-managed params are refused when the wrapper is built (accumkernels._engines).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist

from accumkernels.buffer import Bucket
from accumkernels.distributed import WindowReducer, WindowTotals


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def refuse_sharded(params: list[torch.Tensor]) -> None:
    """DTensor params outside the FSDP2 room (e.g. tensor parallel): say so before any state.

    FSDP1 and DeepSpeed params are refused by accumkernels._engines; FSDP2 params get their own
    room (accumkernels.optim.fsdp2)."""
    if not dist.is_available():
        return
    from accumkernels.optim.fsdp2 import RECIPE, _dtensor_type

    dtensor = _dtensor_type()
    for i, p in enumerate(params):
        if dtensor is not None and isinstance(p, dtensor):
            raise ValueError(
                f"AccumulatingOptimizer: param {i} is a DTensor; FSDP2 params are handled by "
                f"AccumulatingOptimizer(optimizer, model=...) itself: {RECIPE}")


class DataParallel:
    """Reduction of the window across ranks, and the guard against silent divergence."""

    def __init__(self, owner, process_group, *, independent_ranks: bool, ddp=None):
        self._owner = weakref.ref(owner)
        self.independent_ranks = independent_ranks
        self.reducer: WindowReducer | None = None
        self.totals: WindowTotals | None = None
        self.ddp_group = None  # DDP's process group, once known
        self._futures: list = []
        self._synced = False  # DDP's comm hook ran in the current backward
        self._clean = False  # no micro-batch since the last DDP sync (totals are current)
        self._stale = False  # ... but a weight was reported after it
        self._layout: dict[int, int] = {}  # id(param) -> position in the buffer
        if process_group is not None:
            if ddp is not None:
                raise ValueError(_BOTH)
            self.reducer = WindowReducer(process_group, owner._buffer)
            self.reducer.broadcast_params(owner._params)
        if ddp is not None:
            from accumkernels.optim.ddp import register

            self._attach(ddp.process_group)
            register(ddp)

    @property
    def active(self) -> bool:
        """The window is reduced across ranks (process_group, or DDP once known)."""
        return self.reducer is not None

    def check_world(self) -> None:
        """Raise before a step that would use rank-local gradients in a multi-rank job."""
        if self.reducer is not None or self.independent_ranks:
            return
        world = _world_size()
        if world > 1:
            raise RuntimeError(
                f"AccumulatingOptimizer: torch.distributed runs {world} ranks but nothing reduced "
                "this wrapper's window across them, so each rank would step on its own "
                "gradients and the ranks would silently diverge. If the model is in "
                "DistributedDataParallel, pass model=<the DDP module> (or register "
                "accumkernels.ddp_comm_hook on it: ddp.register_comm_hook(None, "
                "accumkernels.ddp_comm_hook)) before the first backward. Without DDP, pass "
                "process_group=torch.distributed.group.WORLD (the wrapper averages the fp32 "
                "window once per step). independent_ranks=True if the ranks are meant to train "
                "apart.")

    def rank_local_window(self) -> tuple[int, int] | None:
        """(rank, world) when this rank's window is its own (a multi-rank job before the window
        was reduced across the ranks); None when every rank holds the same window."""
        world = _world_size()
        if world <= 1 or (self.independent_ranks and self.reducer is None):
            return None
        if self.ddp_group is not None and self._clean:
            return None  # DDP's sync backward averaged it: the same on every rank
        group = self.ddp_group if self.ddp_group is not None else (
            self.reducer.group if self.reducer is not None else None)
        return dist.get_rank(group), dist.get_world_size(group)

    def ddp_possible(self) -> bool:
        """DDP reduces this window, or may (its comm hook registered but not yet called)."""
        return self.ddp_group is not None or (self.reducer is None and _world_size() > 1)

    def backward_begins(self) -> None:
        """process_group: a backward after the window's reduction started must reach it too."""
        if self.reducer is not None and self.ddp_group is None and self.reducer._works:
            self.reducer.reopen()

    def bucket_moved(self, bucket: Bucket, last_microbatch: bool) -> None:
        """During the window's last backward: start reducing a finished bucket (overlap)."""
        if self.reducer is not None and self.ddp_group is None and last_microbatch:
            self.reducer.reduce_bucket(bucket)

    # -- DistributedDataParallel ----------------------------------------------------------------
    def _attach(self, group) -> None:
        """DDP reduces this window over ``group`` from now on."""
        if self.ddp_group is not None:
            if group is not self.ddp_group:
                raise RuntimeError("AccumulatingOptimizer: two DDP process groups reduce the same "
                                   "window (one DDP module per wrapper)")
            return
        if self.reducer is not None:
            raise ValueError(_BOTH)
        owner = self._owner()
        config = owner.config
        if config.nonfinite == "skip_microbatch" or not config.accumulate_in_backward:
            raise ValueError(
                "AccumulatingOptimizer under DistributedDataParallel needs "
                "accumulate_in_backward=True and a nonfinite policy other than "
                "'skip_microbatch' (DDP reduces each gradient during the backward, before a "
                "micro-batch could be dropped)")
        self.ddp_group = group
        self._follow_buffer(owner)

    def _follow_buffer(self, owner) -> None:
        """(Re)bind to the owner's master buffer (add_param_group rebuilds it)."""
        if self.reducer is not None and self.reducer.buffer is owner._buffer:
            return
        timeout = self.reducer.timeout_s if self.reducer is not None else 300.0
        self.reducer = WindowReducer(self.ddp_group, owner._buffer, timeout_s=timeout)
        self._layout = {id(p): k for k, p in enumerate(reversed(owner._buffer.params))}

    def ddp_reduce(self, params: list[torch.Tensor], group) -> torch.futures.Future:
        """From DDP's comm hook, on a sync backward: average the fp32 window of ``params``."""
        self._attach(group)
        owner = self._owner()
        self._follow_buffer(owner)
        owner._intake.flush(params)  # gradients waiting for the rest of a wrapper bucket
        touched, buffer = owner._window.touched, owner._buffer
        views = []
        for p in params:
            view = buffer.view(p)
            if id(p) not in touched:  # no gradient on this rank in this window: 0, as in DDP;
                view.zero_()  # it counts as touched if another rank has one (end_backward)
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
        self._futures.append(future)
        self._synced = True
        return future

    def _contiguous_range(self, params, views) -> torch.Tensor | None:
        """The buffer range holding exactly ``params`` (and zero padding), if there is one."""
        positions = sorted(self._layout.get(id(p), -1) for p in params)
        if positions[0] < 0 or positions[-1] - positions[0] != len(positions) - 1:
            return None
        first = min(views, key=lambda v: v.storage_offset())
        last = max(views, key=lambda v: v.storage_offset())
        flat = next(iter(self._owner()._buffer.buffers.values()))
        start = first.storage_offset() - flat.storage_offset()
        return flat[start:last.storage_offset() - flat.storage_offset() + last.numel()]

    def end_backward(self) -> bool:
        """After each backward (its micro-batch counted). True if DDP synced it: the window is
        then averaged, agreed on and normalised."""
        if self.ddp_group is None:
            return False
        if not self._synced:
            self._clean = False
            return False
        self._synced = False
        owner = self._owner()
        self._wait()
        self.totals = self._agree(owner)
        self._clean, self._stale = True, False
        # a param some rank has a gradient for is in p.grad on every rank; one no rank has
        # keeps p.grad None (DDP leaves globally unused params' .grad alone too)
        owner._window.touched = {id(p) for p, t in zip(owner._params, self.totals.touched) if t}
        owner._normalise(owner._target_divisor(self.totals))
        return True

    def weight_added(self) -> None:
        if self._clean:
            self._stale = True

    def _wait(self) -> None:
        futures, self._futures = self._futures, []
        for future in futures:
            future.wait()

    def _agree(self, owner) -> WindowTotals:
        w = owner._window
        totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(),
                                    owner._nonfinite.found_inf,
                                    [id(p) in w.touched for p in owner._params])
        totals.averaged = True
        return totals

    # -- the step -------------------------------------------------------------------------------
    def finish(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
               touched: list[bool]) -> WindowTotals | None:
        if self.reducer is None:
            return None
        if self.ddp_group is None:
            self.totals = self.reducer.finish(micro_steps, kept, weight, found_inf, touched)
            return self.totals
        owner = self._owner()
        self._follow_buffer(owner)
        if not self._clean:  # micro-batches no DDP sync reduced (no sync in this window's end)
            world = dist.get_world_size(self.ddp_group)
            for flat in owner._buffer.buffers.values():
                flat.div_(world)
            self.totals = self.reducer.finish(micro_steps, kept, weight, found_inf, touched)
            self.totals.averaged = True
        elif self._stale:
            self.totals = self._agree(owner)
        return self.totals

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The window's norm as the step uses it: every rank holds the whole (reduced) window,
        so the norm is this rank's, but a non-finite value on any rank makes it non-finite on
        every rank: the ranks skip (or raise) together, never step apart.

        Under DDP the window was reduced in the sync backward and the user may write into one
        rank's ``p.grad`` before ``step()``: one flag all-reduce. ``process_group`` reduces the
        window inside ``step()``, just before it is measured: a rank's non-finite value reaches
        every rank through the sum, so the ranks measure the same window without one."""
        if self.reducer is None or self.ddp_group is None:
            return norm
        bad = (~torch.isfinite(norm)).double().reshape(1)
        reducer = self.reducer
        reducer._wait(dist.all_reduce(bad, group=reducer.group, async_op=True),
                      "non-finite check")
        return norm if float(bad) == 0 else torch.full_like(norm, float("nan"))

    def reset(self) -> None:
        self.totals = None
        self._clean = self._stale = self._synced = False
        self._futures = []
        if self.reducer is not None:
            self.reducer.reset()


_BOTH = ("AccumulatingOptimizer: process_group= and a DistributedDataParallel model would both "
         "reduce the window; under DDP leave process_group out (DDP's comm hook reduces it)")
