"""The data-parallel room: what the wrapper does when more than one rank trains.

* ``process_group=``: the wrapper itself all-reduces the fp32 window once per step
  (accumkernels.distributed.WindowReducer), overlapped with the last backward when N is known.
* Otherwise, in a job of more than one rank, a step on rank-local gradients would silently
  diverge: the first real step raises, naming ``process_group`` (``independent_ranks=True``
  opts out, for ranks that deliberately train apart).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from accumkernels.buffer import Bucket, MasterGradBuffer
from accumkernels.distributed import WindowReducer, WindowTotals


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class DataParallel:
    """Reduction of the window across ranks, and the guard against silent divergence."""

    def __init__(self, process_group, buffer: MasterGradBuffer, params: list[torch.Tensor], *,
                 independent_ranks: bool):
        self.independent_ranks = independent_ranks
        self.reducer = None
        if process_group is not None:
            self.reducer = WindowReducer(process_group, buffer)
            self.reducer.broadcast_params(params)
        self.totals: WindowTotals | None = None

    @property
    def active(self) -> bool:
        return self.reducer is not None

    def check_world(self) -> None:
        """Raise before a step that would use rank-local gradients in a multi-rank job."""
        if self.reducer is not None or self.independent_ranks:
            return
        world = _world_size()
        if world > 1:
            raise RuntimeError(
                f"AccumulatingOptimizer: torch.distributed runs {world} ranks but this wrapper "
                "was given no process_group, so each rank would step on its own gradients and "
                "the ranks would silently diverge. Pass process_group=torch.distributed.group."
                "WORLD (the wrapper averages the fp32 window once per step; do not also wrap the "
                "model in DistributedDataParallel), or independent_ranks=True if the ranks are "
                "meant to train apart.")

    def bucket_moved(self, bucket: Bucket, last_microbatch: bool) -> None:
        """During the window's last backward: start reducing a finished bucket (overlap)."""
        if self.reducer is not None and last_microbatch:
            self.reducer.reduce_bucket(bucket)

    def finish(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
               touched: list[bool]) -> WindowTotals | None:
        if self.reducer is None:
            return None
        self.totals = self.reducer.finish(micro_steps, kept, weight, found_inf, touched)
        return self.totals

    def reset(self) -> None:
        self.totals = None
        if self.reducer is not None:
            self.reducer.reset()
