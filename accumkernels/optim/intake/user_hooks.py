"""Params with post-accumulate-grad hooks of the user's (registered before wrapping or after:
hooks.HookOrder keeps the front hook first and the intake's post hook last): natively such a hook
sees the running sum in ``.grad``, so the intake (accumkernels.optim.intake.intake) moves
that param's gradient alone, before the user's hooks run (the wrapper's front hook runs first),
and shows them the window; what they write in place is what the step uses. A part of the
intake: it launches through the intake's Mover (moves.py) and asks the intake where the
backward stands.
"""

from __future__ import annotations

import torch


class FrontMoves:
    """This backward's front moves: which params were moved early, and (with
    ``nonfinite="skip_microbatch"``) their views before it and their gradients."""

    def __init__(self, intake, moves):
        self.intake, self.moves = intake, moves
        self.early: dict[int, bool] = {}  # param index -> counted toward its bucket
        self.saved: dict[int, torch.Tensor | None] = {}
        self.grads: list[torch.Tensor] = []

    def end(self) -> tuple[list[torch.Tensor], dict[int, torch.Tensor | None]]:
        """The backward ended: (gradients moved early, views before them); reset."""
        grads, saved = self.grads, self.saved
        self.grads, self.saved, self.early = [], {}, {}
        return grads, saved

    def front_grad(self, i: int) -> None:
        """Param i's gradient is in ``.grad`` and the user's post-accumulate-grad hooks run
        next: move it now, alone, and show the running window in ``.grad`` to them. (A per-param
        launch, only for such params; inside ``weight_pass()`` and with
        ``accumulate_in_backward=False`` they see ``.grad`` as it is.)"""
        intake = self.intake
        p = intake.params[i]
        if not p.requires_grad:  # frozen since the forward: autograd added nothing, and
            if p.grad is None and intake.window.holds(p) and not intake.in_weight_pass:
                p.grad = intake.views[i]  # natively .grad is as it was: the window (hidden by
            return  # the pre-hook or by a clear that kept it; after_grad hides it again)
        if not intake.move_in_backward or intake.in_weight_pass:
            return
        intake.arrived(count=False)
        g = p.grad
        if g is None or g.requires_grad:
            return  # (undefined, or carrying create_graph's graph: after_grad's cases)
        intake.arrived()
        view = intake.views[i]
        if g is view and intake.run.compiled:
            return  # compiled autograd added it into the view: the user's hooks see the window
        if intake.check_each_microbatch:  # checked at the end; put back if dropped
            if i not in self.saved:
                self.saved[i] = view.clone() if intake.window.holds(p) else None
            self.grads.append(g)
        self.moves.move([p], [g])
        p.grad = view
        self.early.setdefault(i, False)  # (its bucket hears of it after the user's hooks)

    def after_user_hooks(self, i: int) -> None:
        """Param i, moved by front_grad, after the user's hooks wrote its window: now it counts
        toward its bucket (whose reduction across ranks may start when it is complete)."""
        intake = self.intake
        p = intake.params[i]
        g = p.grad
        if g is not None and g is not intake.views[i] and not g.requires_grad:
            self.moves.absorb(p, g)  # a .grad the user's hook assigned: p's gradient now
        # hidden again in a multi-rank job (DDP must not see the window: the intake's docstring)
        p.grad = None if intake.sync.ddp_possible() else intake.showable[i]
        if self.early[i] or intake.check_each_microbatch:
            return  # (counted already; skip_microbatch moves the rest at the end)
        self.early[i] = True
        pend = self.moves.counted_early(i)
        if pend is None:
            return  # (its bucket is not complete yet)
        index = self.moves.bucket_index[i]
        if pend:
            intake.launch_held(index, pend)
        else:
            self.moves.bucket_moved(self.moves.buffer.buckets[index])

    def put_back(self, saved: dict[int, torch.Tensor | None]) -> None:
        """A dropped micro-batch: the views front_grad wrote hold what they held before it."""
        intake = self.intake
        held = intake.window.held(intake.params)
        for i, old in saved.items():
            if old is None:  # its first write of the window: no data of it again, and .grad
                held[i] = False  # None as natively without it (not the view it overwrote)
                intake.params[i].grad = None
            else:
                intake.views[i].copy_(old)
        intake.window.keep_only(intake.params, held)
