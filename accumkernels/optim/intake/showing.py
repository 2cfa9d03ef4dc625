"""What ``p.grad`` shows of the window between backwards: each param's fp32 view where the window
holds data of it, else None; a master weight's ``.grad`` shows the same view. The intake asks
this room to show or hide the window (and records that it did: the guard's ``shown``).
"""

from __future__ import annotations

import torch

from accumkernels._util import LOW_PRECISION
from accumkernels.ops.host import grads_are
from accumkernels.optim.intake.hooks import HAS_GRAD_DTYPE


def showable_views(params: list[torch.Tensor], views: list[torch.Tensor]) -> list:
    """Per param what ``.grad`` shows of the window: its view, or None for a bf16/fp16 param
    on a torch without ``grad_dtype`` (an fp32 ``.grad`` cannot sit on it)."""
    return [view if (HAS_GRAD_DTYPE or p.dtype not in LOW_PRECISION) else None
            for p, view in zip(params, views)]


class Display:
    """Shows the window in ``.grad`` for the intake's ``params`` (``views`` and ``showable`` are
    the intake's lists, updated in place when the params move)."""

    def __init__(self, params: list[torch.Tensor], views: list[torch.Tensor], showable: list,
                 window, masters):
        self.params, self.views, self.showable = params, views, showable
        self.window, self.masters = window, masters

    def shows_window(self) -> bool:
        """Whether every param's ``.grad`` is what :meth:`expose` would make it now (its view
        if the window holds it, else None): one read of each ``.grad``."""
        if grads_are(self.params, self.views):
            return True
        grads = [p.grad for p in self.params]
        held = self.window.held(self.params)
        return all((g is view) if h else (g is None)
                   for g, view, h in zip(grads, self.showable, held))

    def expose(self) -> None:
        """``p.grad`` (and its master's) is p's fp32 view where the window holds p."""
        params, views = self.params, self.views
        if self.window.holds_all(map(id, params)) and grads_are(params, views) \
                and self.masters.grads_are(params, views):
            return  # (each .grad shows its view already)
        held, masters = self.window.held(params), self.masters.masters  # (id(p) -> master)
        for p, view, shown, holds in zip(params, views, self.showable, held):
            if not holds:
                continue
            master = masters.get(id(p)) if masters else None
            if master is not None and master.grad is not view:
                master.grad = view
            g = p.grad
            if shown is None:  # (an fp32 .grad cannot sit on it: p.main_grad shows the view)
                if g is view:
                    p.grad = None
            elif g is not view and (g is None or not g.requires_grad):
                p.grad = view  # (a .grad carrying create_graph's graph stays until absorbed)

    def show(self, i: int, p: torch.Tensor) -> None:
        """Param i's view in ``.grad`` now (and in its master's), its gradient held apart."""
        p.grad = self.showable[i]
        masters = self.masters.masters
        if masters:
            master, view = masters.get(id(p)), self.views[i]
            if master is not None and master.grad is not view:
                master.grad = view

    def hide_all(self) -> None:
        """``.grad`` None on every param and master (the window itself is untouched)."""
        for p in self.params:
            p.grad = None
            master = self.masters.get(p)
            if master is not None:
                master.grad = None
