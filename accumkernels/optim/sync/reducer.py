"""Data parallel without DDP: one all-reduce of the fp32 master buffer per window.

Used by AccumulatingOptimizer(process_group=...). Buckets are all-reduced asynchronously as they
are finished during the last micro-batch's backward (when the window length is known), so the
communication overlaps the rest of that backward; other micro-batches communicate nothing.
A small "agreement" all-reduce then checks that every rank ran the same number of
micro-batches and sums what the normalisation needs (kept micro-batches, weights, non-finite
flags, which params got gradients).

Under DDP (accumkernels.optim.sync.ddp_hook) the gradients travel through DDP's comm hook; this module
then provides only the agreement (``agree``) and, for a window that ended without a DDP sync,
the reduction of the whole buffer.
"""

from __future__ import annotations

import datetime
import hashlib

import torch
import torch.distributed as dist

from accumkernels.buffer import Bucket, MasterGradBuffer

__all__ = ["WindowReducer"]

# Set on a param by accumkernels.integrations.pipelining (stage index, number of stages): the
# replica check below then tells the stages of one pipeline apart even where their shapes agree.
PIPELINE_STAGE_ATTR = "_accumkernels_pipeline_stage"

_NOT_REPLICAS = (
    "AccumulatingOptimizer: process_group must hold replicas of one model (data parallel: every "
    "rank holds the same params and sees different data), but its ranks hold {what}, so the "
    "broadcast of rank 0's params at construction would overwrite (or, with other shapes, "
    "abort) the others'. Nothing was broadcast. For the stages of a pipeline "
    "(torch.distributed.pipelining) pass process_group=<this stage's data-parallel group> (the "
    "ranks that hold this same stage), or independent_ranks=True without data parallelism")


def _fingerprint(items: list) -> float:
    """A 48-bit hash of ``items`` as a float64 (exact: below 2**53)."""
    digest = hashlib.blake2b(repr(items).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "big"))


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


def weight_counts(missing: int, refused: str | None) -> torch.Tensor:
    """This rank's part of the weights' agreement: micro-batches without a weight (and its
    square), and whether ``add_weight`` refused a value here."""
    return torch.tensor([missing, missing**2, float(refused is not None)], dtype=torch.float64)


def check_weights(summed: list[float], world: int, rank: int, missing: int,
                  refused: str | None) -> None:
    """After the all-reduce of :func:`weight_counts`: the same error on every rank if a rank
    refused a weight (ValueError) or the ranks miss different numbers of ``add_weight`` calls
    (RuntimeError; one rank skipped one: its window would be normalised apart from the
    others', and a user's clip would measure different windows)."""
    total, squares, refusals = summed
    if refusals > 0:
        here = f" (here: {refused})" if refused is not None else ""
        raise ValueError(
            f"AccumulatingOptimizer: add_weight() refused a negative or non-finite weight on "
            f"{refusals:g} of the {world} ranks{here}; rank {rank} raises with them. Every "
            "rank's weight must be finite and >= 0 (0 for a micro-batch without tokens)")
    if squares * world != total ** 2:  # Cauchy-Schwarz: every rank misses the same number
        raise RuntimeError(
            f"AccumulatingOptimizer: the ranks disagree on the weights (reduction='weighted'): "
            f"rank {rank} has {missing} micro-batch(es) of this window without add_weight(), "
            f"the {world} ranks {total:g} in all. Every rank must call add_weight() once per "
            "micro-batch (add_weight(0) for a micro-batch without tokens), at the same point "
            "(all before their backward, or all after)")


def check_phase(stepping: float, world: int, rank: int, here_stepping: bool,
                others: str) -> None:
    """After an all-reduce that ranks enter from different points of the loop (``stepping``:
    how many of them entered it from ``step()``; the others from ``others``): the same
    RuntimeError on every rank unless all or none of them are stepping. One rank's extra
    ``step()`` meets the others' next collective here instead of leaving them waiting."""
    if 0 < stepping < world:
        raise RuntimeError(
            f"AccumulatingOptimizer: the ranks disagree on where the window ends: {stepping:g} "
            f"of the {world} ranks called step() while the others {others}; this rank (rank "
            f"{rank}) {'called step()' if here_stepping else 'did not'}. Every rank must call "
            "step() at the same point of its loop (each step() that ends a window is agreed "
            "across the ranks)")


_SYNC_BACKWARD = "ran on into a DDP sync backward"


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

    def check_replicas(self, params: list[torch.Tensor]) -> None:
        """Before anything is broadcast: every rank of the group holds the same params (their
        number, shapes and dtypes, and the pipeline stage where one is marked). One all-reduce
        (MAX) of two 48-bit fingerprints and their negations; ranks that differ raise
        ``ValueError`` on every rank, with nothing changed."""
        shapes = _fingerprint([(tuple(p.shape), str(p.dtype)) for p in params])
        stages = _fingerprint([getattr(p, PIPELINE_STAGE_ATTR, None) for p in params])
        device = next(iter(self.buffer.buffers), torch.device("cpu"))
        info = torch.tensor([shapes, -shapes, stages, -stages], dtype=torch.float64,
                            device=device)
        self.wait(dist.all_reduce(info, op=dist.ReduceOp.MAX, group=self.group, async_op=True),
                  "replica check")
        most, least_neg, most_stage, least_stage_neg = info.tolist()
        if most != -least_neg:
            raise ValueError(_NOT_REPLICAS.format(what="params of different counts, shapes or "
                                                       "dtypes"))
        if most_stage != -least_stage_neg:
            raise ValueError(_NOT_REPLICAS.format(what="different stages of a pipeline"))

    @torch.no_grad()
    def broadcast_params(self, params: list[torch.Tensor]) -> None:
        """Make every rank start from rank 0's parameters (after :meth:`check_replicas`)."""
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
               touched: list[bool], weights: tuple[int, str | None] = (0, None)
               ) -> WindowTotals:
        """Reduce every bucket not yet reduced, wait for all, then agree on the window."""
        self.reduce_all()
        return self.agree(micro_steps, kept, weight, found_inf, touched, weights)

    def reduce_all(self) -> None:
        """Reduce every bucket not yet reduced and wait for all."""
        for bucket in self.buffer.buckets:
            self.reduce_bucket(bucket)
        works, self._works = self._works, {}
        for work in works.values():
            self.wait(work, "gradient")

    def meet_backward(self, num_params: int) -> None:
        """DDP's sync backward, before its first bucket is reduced: the ranks meet in an
        all-reduce shaped like :meth:`agree`'s, marked "not agreeing". A rank that calls
        ``step()`` while the others run on into their sync backward agrees there (its first
        collective) instead of sending its buckets into DDP's, whose sizes differ: every rank
        raises alike (:func:`check_phase`)."""
        device = next(iter(self.buffer.buffers))
        # agree's length: head (4), found_inf, touched, weight counts (3), the phase
        info = torch.zeros(9 + num_params, dtype=torch.float64, device=device)
        self.wait(dist.all_reduce(info, group=self.group, async_op=True), "sync backward")
        check_phase(info[-1].item(), self.world, self.rank, False, _SYNC_BACKWARD)

    def agree(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
              touched: list[bool], weights: tuple[int, str | None] = (0, None)
              ) -> WindowTotals:
        """One small all-reduce of the window's bookkeeping (no gradients); checks the counts.
        ``weights``: (micro-batches still without ``add_weight``, this rank's refused weight
        or None), checked by :func:`check_weights` on every rank alike."""
        device = next(iter(self.buffer.buffers))
        head = torch.tensor([micro_steps, micro_steps**2, kept, weight], dtype=torch.float64)
        info = torch.cat([head.to(device), found_inf.double().reshape(1),
                          torch.tensor(touched, dtype=torch.float64).to(device),
                          weight_counts(*weights).to(device),
                          torch.ones(1, dtype=torch.float64, device=device)])
        self.wait(dist.all_reduce(info, group=self.group, async_op=True), "window bookkeeping")
        values = info.tolist()
        check_phase(values.pop(), self.world, self.rank, True, _SYNC_BACKWARD)
        # Every rank ran m micro-batches iff sum(m^2) * world == sum(m)^2 (Cauchy-Schwarz).
        if values[1] * self.world != values[0] ** 2:
            raise RuntimeError(
                f"AccumulatingOptimizer: the ranks disagree on the window: this rank (rank "
                f"{self.rank}) ran {micro_steps} micro-batches, the {self.world} ranks "
                f"{values[0]:g} in all; every rank must run the same number before step()")
        check_weights(values[-3:], self.world, self.rank, *weights)
        return WindowTotals(values, self.world, len(touched))

    def settle(self) -> None:
        """Wait for the sums under way (they stay recorded: ``finish`` does not redo them).
        Called at the end of the backward that started them, so that nothing the caller then
        writes into the window (``p.grad``: pipelining's ``scale_grads``, a clip) races an
        all-reduce that reads and writes the same memory in place."""
        for work in self._works.values():
            self.wait(work, "gradient")

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

    def summed_buckets(self) -> list[int]:
        """The buckets whose sums were started (waited for: complete on return)."""
        self.settle()
        return sorted(self._works)

    def mark_summed(self, indices: list[int]) -> None:
        """Buckets summed before a checkpoint this window was restored from: ``finish`` (and a
        backward past N) treat them as sums started here."""
        for i in indices:
            self._works[i] = _Summed()

    def reset(self) -> None:
        self._works = {}


class _Summed:
    """A bucket's sum across the ranks, done before the checkpoint it was restored from."""

    def wait(self, timeout=None) -> bool:
        return True
