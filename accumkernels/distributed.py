"""Data parallel without DDP: one all-reduce of the fp32 master buffer per window.

Used by AccumulatingOptimizer(process_group=...). Buckets are all-reduced asynchronously as they
are finished during the last micro-batch's backward (when the window length is known), so the
communication overlaps the rest of that backward; other micro-batches communicate nothing.
A small "agreement" all-reduce then checks that every rank ran the same number of
micro-batches and sums what the normalisation needs (kept micro-batches, weights, non-finite
flags, which params got gradients).

Under DDP (accumkernels.optim.ddp) the gradients travel through DDP's comm hook; this module
then provides only the agreement (``agree``) and, for a window that ended without a DDP sync,
the reduction of the whole buffer.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from accumkernels.buffer import Bucket, MasterGradBuffer

__all__ = ["WindowReducer"]


class WindowTotals:
    """The window summed over ranks.

    ``averaged``: the gradients were averaged over the ranks (DDP's semantics, the
    ``ddp_comm_hook`` path) rather than summed (``process_group``).
    """

    def __init__(self, values: list[float], world: int, num_params: int):
        self.world = world
        self.averaged = False
        self.kept = int(values[2])
        self.weight = values[3]
        self.found_inf = values[4] > 0
        self.touched = [v > 0 for v in values[5:5 + num_params]]


class WindowReducer:
    """All-reduces a MasterGradBuffer's buckets (sum) and the window's bookkeeping."""

    def __init__(self, group: object, buffer: MasterGradBuffer, timeout_s: float = 300.0):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("process_group given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group first")
        if group is not None and not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup, got "
                            f"{type(group).__name__}")
        if len(buffer.buffers) > 1:
            raise ValueError("process_group: the params must all be on one device")
        self.group = group
        self.buffer = buffer
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.timeout_s = timeout_s
        self._works: dict[int, dist.Work] = {}

    @torch.no_grad()
    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        """Make every rank start from rank 0's parameters."""
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        for p in params:
            dist.broadcast(p.data, src=src, group=self.group)

    def reduce_bucket(self, bucket: Bucket) -> None:
        """Start the (asynchronous) sum of one finished bucket across ranks."""
        if bucket.index not in self._works:
            self._works[bucket.index] = dist.all_reduce(bucket.flat, group=self.group,
                                                        async_op=True)

    def wait(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` with this reducer's deadline (RuntimeError naming ``what``)."""
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RuntimeError(
                f"AccumulatingOptimizer: rank {self.rank} waited {self.timeout_s:g} s for the "
                f"{what} all-reduce; the ranks disagree on the window (a different number of "
                "micro-batches, or a rank stopped early)") from exc

    def finish(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
               touched: list[bool]) -> WindowTotals:
        """Reduce every bucket not yet reduced, wait for all, then agree on the window."""
        for bucket in self.buffer.buckets:
            self.reduce_bucket(bucket)
        works, self._works = self._works, {}
        for work in works.values():
            self.wait(work, "gradient")
        return self.agree(micro_steps, kept, weight, found_inf, touched)

    def agree(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
              touched: list[bool]) -> WindowTotals:
        """One small all-reduce of the window's bookkeeping (no gradients); checks the counts."""
        device = next(iter(self.buffer.buffers))
        head = torch.tensor([micro_steps, micro_steps**2, kept, weight], dtype=torch.float64)
        info = torch.cat([head.to(device), found_inf.double().reshape(1),
                          torch.tensor(touched, dtype=torch.float64).to(device)])
        self.wait(dist.all_reduce(info, group=self.group, async_op=True), "window bookkeeping")
        values = info.tolist()
        # Every rank ran m micro-batches iff sum(m^2) * world == sum(m)^2 (Cauchy-Schwarz).
        if values[1] * self.world != values[0] ** 2:
            raise RuntimeError(
                f"AccumulatingOptimizer: the ranks disagree on the window: this rank (rank "
                f"{self.rank}) ran {micro_steps} micro-batches, the {self.world} ranks "
                f"{values[0]:g} in all; every rank must run the same number before step()")
        return WindowTotals(values, self.world, len(touched))

    @property
    def started(self) -> bool:
        """Whether sums of this window's buckets are under way (or done, not yet collected)."""
        return bool(self._works)

    def reopen(self) -> None:
        """A backward arrives after buckets of this window were summed across ranks (a
        micro-batch past N): wait for those sums and turn them into averages, so that the
        final sum in ``finish`` gives sum(window) + sum(new gradients) on every rank."""
        works, self._works = self._works, {}
        for index, work in works.items():
            self.wait(work, "gradient")
            self.buffer.buckets[index].flat.div_(self.world)

    def reset(self) -> None:
        self._works = {}
