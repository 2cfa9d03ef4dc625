"""The end of one backward, weight passes, and hook handles (shared by the intakes).

No public hook fires once after every AccumulateGrad of a backward (nested, reentrant ones
included): a final callback queued on the autograd engine does (accumkernels._torch_private).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass

from accumkernels._torch_private import current_autograd_node, queue_callback
from accumkernels.optim.intake.compiled import eager


@dataclass(slots=True)
class Running:
    """Where an intake's current backward stands."""

    active: bool = False  # inside a backward that touched the intake's params
    deferred: bool = False  # ... waiting for the outer backward to end (a nested one)
    got_grad: bool = False  # an AccumulateGrad (or a fused write) ran in it: a micro-batch
    end_ref: object = None  # weakref to its final callback (dropped when the backward raised)
    show_now: bool = False  # its post hooks show each view as they go
    shown_at_begin: bool = False  # when it began, every param showed what expose() shows
    refused: bool = False  # the wrapper refused a gradient of it (it raised): no micro-batch
    compiled: bool = False  # it runs under compiled autograd (accumkernels.optim.intake.compiled)
    met_compiled: bool = False  # some backward of the intake's ran under compiled autograd

    def starting(self) -> bool:
        """Whether a hook now begins a backward: none runs, or the last one raised."""
        return not self.active or (not self.deferred and self.end_ref() is None)

    def raised(self) -> bool:
        """Whether the running backward raised (its final callback was dropped unrun)."""
        return self.active and not self.deferred and self.end_ref() is None

    def queue_end(self, intake) -> None:
        """Queue the running backward's final callback (:class:`EndOfBackward`) for ``intake``.
        A backward that raises drops it unrun; the weakref's callback then closes the backward
        at once (``intake.settle()``), so ``.grad`` holds what its AccumulateGrads added, as
        natively, before the user's next line runs (a clip, a clear) and not at the next event.
        Under compiled autograd the callback is never run, only dropped: that ends the backward."""
        end = EndOfBackward(intake)
        self.end_ref = weakref.ref(end, functools.partial(_dropped, weakref.ref(intake)))
        queue_callback(end)

    def defer_to(self, intake, node) -> None:
        """The backward is nested in the one running ``node``: that one ends the micro-batch."""
        self.deferred, intake.state.fast = True, None

        def outer_continues(*_):
            self.deferred = False
            self.queue_end(intake)

        node.register_hook(outer_continues)


@eager
def _dropped(me, ref) -> None:
    """The final callback ``ref`` of a backward was dropped unrun (it raised, or ran under
    compiled autograd): close that backward, unless a later one runs."""
    owner = me()
    if owner is not None and owner.run.end_ref is ref:  # (not a later backward's)
        owner.settle()


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
            intake.run.defer_to(intake, node)
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


@contextlib.contextmanager
def weight_pass(intake):
    """A weight pass: gradients computed with ``torch.autograd.grad`` (AccumulateGrad never
    runs) and assigned to (or added into) ``.grad`` inside the block are one micro-batch. The
    window is hidden meanwhile (each gradient lands in ``.grad`` alone); at the end they are
    moved like a backward's (fused, scaled, checked), and the block counts one micro-batch,
    also when a backward ran inside it (stage 0 of a pipeline runs a full backward there). A
    block nested in another is part of the outer one. An exception that leaves the block still
    moves what was written (natively it stays summed in ``.grad``)."""
    if intake.in_weight_pass:  # nested: the outer block moves and counts
        yield
        return
    intake.take_in()
    intake.hide_all()  # what the block writes lands alone, in a backward's units
    intake.in_weight_pass, intake.counted = True, False
    try:
        yield
    finally:
        intake.in_weight_pass = False
        if intake.move_in_backward:
            intake.move_unmoved(count_new=not intake.counted)
        elif any(p.grad is not None for p in intake.params):
            if not intake.counted:
                intake.unmoved_backward()  # in .grad until accumulate()/step()/the N-th
            else:  # a backward in the block counted it; what was assigned after it is noted
                intake.left.remember()  # too (a clear from outside keeps it, with N)
        else:
            intake.expose()
