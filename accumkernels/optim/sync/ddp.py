"""DistributedDataParallel reduces the window: the sync protocol's DDP implementation.

DDP decides when to sync (its ``no_sync`` cadence); on a sync backward its comm hook
(accumkernels.optim.sync.ddp_hook) calls :meth:`DDPSync.reduce` per DDP bucket, which averages the fp32
window of the bucket's params. At the end of that backward one small all-reduce agrees on the
bookkeeping and the window is normalised, so what ``p.grad`` shows -- and what clipping on the
sync step scales -- is final. DDP can be met late (its comm hook registered on a DDP module
built after the wrapper: Accelerate, the HF Trainer): :func:`ddp_sync_for` then replaces the
wrapper's LocalSync once.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from accumkernels.optim.sync.reducer import WindowReducer, WindowTotals
from accumkernels.optim.sync.local import BOTH_REDUCE, GroupSync, LocalSync


NO_SYNC_WINDOW = (
    "AccumulatingOptimizer: a window ended at step() without a DDP sync backward (every "
    "micro-batch ran under ddp.no_sync(), the window's last one included). The wrapper averaged "
    "the window over the ranks at step(), so the ranks stay identical, but until then p.grad "
    "was each rank's own window, as natively without the sync: a clip or a gradient log before "
    "step() measured this rank's window, not the average DDP's sync would have shown. Run the "
    "window's last backward outside no_sync(). (Warned once.)")


class DDPSync(LocalSync):
    """DistributedDataParallel reduces the window through ``accumkernels.ddp_comm_hook``."""

    active = True

    def __init__(self, group, window, params: list[torch.Tensor], flush, found_inf,
                 weighted: bool = False):
        super().__init__(independent_ranks=False)
        self.weighted = weighted  # every step agrees on the weights (see finish)
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
        self.warned_no_sync = False  # (NO_SYNC_WINDOW: once per wrapper)

    timeout_s = GroupSync.timeout_s

    def check_world(self) -> None:
        pass

    def rank_local_window(self) -> tuple[int, int] | None:
        if self.clean:
            return None  # DDP's sync backward averaged it: the same on every rank
        return dist.get_rank(self.ddp_group), dist.get_world_size(self.ddp_group)

    def ddp_possible(self) -> bool:
        return True

    def agreement_group(self):
        return self.ddp_group

    def reduce(self, params: list[torch.Tensor]) -> torch.futures.Future:
        """From DDP's comm hook, on a sync backward: average the fp32 window of ``params``."""
        if not self.synced:  # the backward's first bucket: no rank is in step() instead
            self.reducer.meet_backward(len(self.params))
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
        if not self.window.weights_pending():  # (else the weight that completes them does it)
            self.window.normalise(self.window.target_divisor(self.totals))
        return True

    def weight_added(self) -> None:
        """A weight after the sync backward. The one that completes the window's weights
        (``add_weight`` after each backward) is agreed on at once and the window normalised,
        so ``p.grad`` is the final sum / total weight before ``step()`` (a user's clip)."""
        if not self.clean:
            return
        if len(self.window.weights) == self.window.micro_steps:
            self.totals, self.stale = self._agree(), False
            self.window.normalise(self.window.target_divisor(self.totals))
        else:
            self.stale = True

    def agreed_totals(self) -> WindowTotals | None:
        return self.totals if self.clean else None

    def _agree(self) -> WindowTotals:
        w = self.window
        totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(), self.found_inf,
                                    w.held(self.params), self.weight_state())
        totals.averaged = True
        return totals

    def finish(self, found_inf: torch.Tensor) -> WindowTotals:
        if not self.clean:  # micro-batches no DDP sync reduced (no sync in this window's end)
            if self.window.micro_steps and not self.warned_no_sync:
                self.warned_no_sync = True
                warnings.warn(NO_SYNC_WINDOW, stacklevel=2)
            world = dist.get_world_size(self.ddp_group)
            for flat in self.window.storage.buffers.values():
                flat.div_(world)
            w = self.window
            # agreed first: a rank here meets others that run on into a sync backward in its
            # first collective (DDPSync.reduce), never with buckets shaped apart from DDP's
            self.totals = self.reducer.agree(w.micro_steps, w.kept, w.local_weight(), found_inf,
                                             w.held(self.params), self.weight_state())
            self.reducer.reduce_all()
            self.totals.averaged = True
            self.clean, self.stale = True, False  # reduced: a second call returns the same
        elif self.stale or self.weighted:  # weighted: a weight reported after the sync on
            self.totals = self._agree()  # one rank only (or skipped) is met here, every step
            self.stale = False
        self.gathered()
        return self.totals

    def agree_norm(self, norm: torch.Tensor) -> torch.Tensor:
        """The window was reduced in the sync backward and the user may write into one rank's
        ``p.grad`` before ``step()``: a non-finite norm on any rank is non-finite on every rank
        (one flag all-reduce), so the ranks skip or raise together, never step apart."""
        bad = (~torch.isfinite(norm)).double().reshape(1)
        self.reducer.wait(dist.all_reduce(bad, group=self.ddp_group, async_op=True),
                          "non-finite check")
        return self.across_stages(norm if float(bad) == 0 else torch.full_like(norm,
                                                                               float("nan")))

    def reset(self) -> None:
        self.totals, self.refused_weight = None, None
        self.clean = self.stale = self.synced = False
        self.futures = []
        self.reducer.reset()
        self.left_round()

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        timeout = self.reducer.timeout_s
        self.window, self.params = window, params
        self.reducer = WindowReducer(self.ddp_group, window.storage, timeout_s=timeout)
        self.layout = {id(p): k for k, p in enumerate(reversed(window.storage.params))}


def ddp_sync_for(current, group, config, window, params, flush, found_inf) -> DDPSync:
    """The DDPSync that reduces the window over DDP's ``group`` (met at the first sync, or at
    construction with ``model=ddp``): ``current`` if it already is one."""
    if isinstance(current, DDPSync):
        if group is not current.ddp_group:
            raise RuntimeError("AccumulatingOptimizer: two DDP process groups reduce the same "
                               "window (one DDP module per wrapper)")
        return current
    if isinstance(current, GroupSync):
        raise ValueError(BOTH_REDUCE)
    if config.nonfinite == "skip_microbatch" or not config.accumulate_in_backward:
        raise ValueError(
            "AccumulatingOptimizer under DistributedDataParallel needs "
            "accumulate_in_backward=True and a nonfinite policy other than "
            "'skip_microbatch' (DDP reduces each gradient during the backward, before a "
            "micro-batch could be dropped)")
    sync = DDPSync(group, window, params, flush, found_inf,
                   weighted=config.weighted)
    sync.stage_norm = current.stage_norm  # (clip_across_stages before DDP was met)
    return sync
