"""Gradients left in ``.grad`` (``accumulate_in_backward=False``): the backwards whose gradients
autograd summed there in the param dtype, not yet moved into the window, and what moves them
(``accumulate()``, ``step()``, the N-th backward) or clears them from outside.

Owned by the intake (accumkernels.optim.intake.intake), whose params, views and launches it moves
them with; the intake asks it at a backward's end, at the next backward's start and before a
weight is added.
"""

from __future__ import annotations

import torch


class Unmoved:
    """The count of backwards still in ``.grad`` and their gradients after the last one."""

    def __init__(self, intake):
        self.intake = intake
        self.count = 0  # backwards whose gradients still sit in .grad
        # param index -> its unmoved .grad after the last backward: a clear from outside
        # (model.zero_grad()) then means what opt.zero_grad() means (cleared)
        self.grads: dict[int, torch.Tensor] = {}

    def forget(self) -> None:
        """``reset_window()``: the backwards not yet moved go with the window."""
        self.count, self.grads = 0, {}

    def backward_ended(self) -> None:
        """A backward whose gradients stay in ``.grad``."""
        intake = self.intake
        self.count += 1  # counted when moved: the non-finite check sees its gradients
        if intake.window.complete_with(self.count):
            self.move()  # the N-th backward: .grad shows the complete window
        else:
            self.remember()

    def remember(self) -> None:
        """Note every unmoved ``.grad`` now (a clear from outside is then seen: cleared())."""
        intake = self.intake
        self.grads = {i: p.grad for i, (p, view) in enumerate(
            zip(intake.params, intake.views)) if p.grad is not None and p.grad is not view}

    def any_cleared(self) -> bool:
        params = self.intake.params
        return bool(self.grads) and any(params[i].grad is None for i in self.grads)

    def cleared(self) -> None:
        """Unmoved gradients whose ``.grad`` was cleared from outside (``model.zero_grad()``,
        ``p.grad = None``) since the last backward: with N given the window is still filling
        (the N-th backward moves them), and the clear keeps them, as ``opt.zero_grad()`` does:
        moved into the window, ``.grad`` None. With N None they are gone, as natively."""
        params, views = self.intake.params, self.intake.views
        refs, self.grads = self.grads, {}
        cleared = [i for i in refs if params[i].grad is None]
        if not cleared:
            return
        if not self.intake.window.length_given:
            if len(cleared) == len(refs) and not any(
                    p.grad is not None and p.grad is not v for p, v in zip(params, views)):
                self.count = 0  # every unmoved gradient is gone: no backward left to count
            return
        for i in cleared:
            params[i].grad = refs[i]
        self.move()
        for i in cleared:
            params[i].grad = None

    def move(self, count_new: bool = True) -> None:
        """Move every ``.grad`` that is not the param's view; ``count_new``: gradients without a
        counted backward are one micro-batch."""
        intake = self.intake
        intake.settle()
        intake.guard.check_all()
        if self.grads:
            self.cleared()
        by_bucket: dict[int, list[torch.Tensor]] = {}
        for p, view in zip(intake.params, intake.views):
            g = p.grad
            if g is not None and g is not view:
                by_bucket.setdefault(intake.buffer.bucket_of(p).index, []).append(p)
        kept = True
        if intake.nonfinite.per_microbatch:
            kept = intake.nonfinite.all_finite(
                [p.grad for params in by_bucket.values() for p in params])
        for index, params in by_bucket.items():
            if kept:
                intake.moves.launch(intake.buffer.buckets[index], params,
                                    [p.grad for p in params])
            for p in params:
                p.grad = None
        count, self.count = self.count, 0
        if by_bucket and not count and count_new:
            count = 1  # gradients set without a backward this wrapper saw: one micro-batch
        for _ in range(count):
            intake.events.microbatch_ended(kept)
        intake.expose()
