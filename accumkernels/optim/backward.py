"""The end of one backward, and hook handles: shared by the flat and the FSDP2 intakes.

No public hook fires once after every AccumulateGrad of a backward (nested, reentrant ones
included): a final callback queued on the autograd engine does (accumkernels._torch_private).
"""

from __future__ import annotations

import weakref

from accumkernels._torch_private import current_autograd_node, queue_callback


class EndOfBackward:
    """The final callback of one backward; holds the intake weakly, runs once more after the
    other final callbacks (DDP's, FSDP2's), then calls ``intake.end_backward()``. ``nested``:
    a callback of a backward nested in a running one defers to the outer backward."""

    def __init__(self, intake, nested: bool = True):
        self.intake = weakref.ref(intake)
        self.nested = nested
        self.requeued = False

    def __call__(self) -> None:
        intake = self.intake()
        if intake is None:
            return
        node = current_autograd_node() if self.nested else None
        if node is not None:  # nested in a running backward: the outer one ends the micro-batch
            intake.defer_to(node)
            return
        if not self.requeued:  # run once more, after the other final callbacks
            self.requeued = True
            queue_callback(self)
            return
        intake.end_backward()


def remove_handles(handles: list) -> None:
    """Remove hook handles (idempotent: the list is emptied)."""
    for h in handles:
        h.remove()
    handles.clear()
