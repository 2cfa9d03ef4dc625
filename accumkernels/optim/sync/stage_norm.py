"""The pipeline's norm round: the wrappers of one rank's pipeline stages measure the norm of the
whole pipeline together (``accumkernels.integrations.pipelining.clip_across_stages``)."""

from __future__ import annotations

import datetime
import math
import weakref

import torch
import torch.distributed as dist


class StageNorm:
    """The wrappers of one rank's pipeline stages measure the whole pipeline's norm together
    (``accumkernels.integrations.pipelining.clip_across_stages``).

    A wrapper's step measures its own window's norm (``agree_norm``); here it becomes the norm of
    every stage's window on every rank of the pipeline ``group`` (as torchtitan clips: the sum of
    squares over the stages, all-reduced over the pipeline group). A rank may hold several
    stages, one wrapper each, stepped one after the other: the first of them to step measures
    the others' windows too (each reduced over its data-parallel ranks and normalised as its
    own step will do it; one read pass each), and one all-reduce of the rank's sum of squares
    serves the round. A later wrapper of the round takes that total with its own share
    measured again, from its window as it is at its step. A non-finite window anywhere makes
    the norm non-finite on every stage, so every stage skips (or raises) together.

    Its members are the wrappers' step rooms (``Step``: ``sync``, ``due``, ``pending_factor``,
    ``final_square``), added by ``AccumulatingOptimizer.join_stage_norm``.
    """

    def __init__(self, group, timeout_s: float = 300.0):
        self.members: list = []
        self.group = group
        self.timeout_s = timeout_s
        self._round: dict | None = None  # {"total": float, "shares": {k: float}, "due": set}
        self._measuring = False

    def add(self, step) -> None:
        self.members.append(weakref.ref(step))

    def replace(self, old, new) -> None:
        """A wrapper rebuilt its rooms (``add_param_group``): its new step takes the old place."""
        self.members = [weakref.ref(new) if ref() is old else ref for ref in self.members]

    def _index(self, sync) -> tuple[list, int | None]:
        steps = [ref() for ref in self.members]
        return steps, next((i for i, s in enumerate(steps)
                            if s is not None and s.sync is sync), None)

    def gathered(self, sync) -> None:
        """A wrapper's step reduced its window (``finish``; every real step gets here, also one
        that will skip): the round's all-reduce, unless this wrapper's round is under way."""
        if self._measuring:
            return
        steps, k = self._index(sync)
        if k is None or (self._round is not None and k in self._round["due"]):
            return
        self._measuring = True
        try:
            shares = {i: s.final_square(must=(i == k)) for i, s in enumerate(steps)
                      if s is not None}
        finally:
            self._measuring = False
        total = torch.tensor([sum(shares.values())], dtype=torch.float64)
        work = dist.all_reduce(total, group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise RuntimeError(
                f"AccumulatingOptimizer: waited {self.timeout_s:g} s for the pipeline stages' "
                "norm (clip_across_stages): every rank of the pipeline group must step its "
                "stages' wrappers at every window end") from exc
        self._round = {"total": float(total), "shares": shares,
                       "due": {i for i in shares if i == k or steps[i].due()}}

    def leave(self, sync) -> None:
        _, k = self._index(sync)
        if self._round is not None and k in self._round["due"]:
            self._round["due"].discard(k)
            if not self._round["due"]:
                self._round = None

    def agree(self, sync, norm: torch.Tensor) -> torch.Tensor:
        """The pipeline's norm for this wrapper's step: the round's total, with this wrapper's
        share measured again from its window as the step sees it (``norm``)."""
        steps, k = self._index(sync)
        if k is None:  # (a wrapper no longer in the set)
            return norm
        if self._round is None or k not in self._round["due"]:
            self.gathered(sync)
        rnd = self._round
        rnd["due"].discard(k)
        if not rnd["due"]:
            self._round = None
        factor = steps[k].pending_factor()
        own = (float(norm) * factor) ** 2
        square = rnd["total"] - rnd["shares"][k] + own
        value = math.sqrt(square) / factor if math.isfinite(square) else float("nan")
        return torch.tensor(value, dtype=norm.dtype, device=norm.device)
