"""Intake: moves each backward's gradients into the fp32 window and shows the window as ``p.grad``.

Between backwards every managed param's ``p.grad`` is its fp32 view of the master buffer (for
bf16/fp16 params ``grad_dtype`` is None, so an fp32 ``.grad`` may sit on them). During a
backward (``accumulate_in_backward=True``):

1. a tensor pre-hook sees p's incoming gradient first and hides the view (``p.grad = None``),
   so autograd's AccumulateGrad stores the new low-precision gradient instead of adding it
   into the view param by param;
2. a post-accumulate-grad hook takes it out of ``.grad`` and holds it; when all params of a
   bucket are in, the bucket is moved with one fused launch and the held low-precision
   gradients are released. In a one-process job ``.grad`` shows p's view again at once (what
   the bucket's launch completes); in a multi-rank job, under ``nonfinite="skip_microbatch"``
   and in a weight pass it stays None for the rest of the backward;
3. at the end of the outermost backward (an autograd final callback, run after every other
   final callback) the rest is moved, the views are shown again (nothing to do when every hook
   showed its view and every param showed it when the backward began), and the micro-batch
   counted.

The two hooks run for every param in every backward, so their common case is C
(``csrc/grad_hooks.cpp``, installed by accumkernels.optim.intake.hooks): the same reads and
writes as :meth:`Intake.before_grad` / :meth:`Intake.after_grad`, which they call for anything
else, and one Python call per bucket (``launch_held``). The guard's checks (dtype, device,
layout, views) run once per backward, before anything of it lands (``Guard.check_backward``).

A backward counts as a micro-batch only if some AccumulateGrad (or fused weight-gradient
write) ran in it: ``torch.autograd.grad`` fires the pre-hooks but never the post hooks, so it
leaves the window alone. A backward nested in another one (reentrant checkpointing) is part of
the outer one: its final callback defers to the node that is running it. A backward that raised
drops its final callback unrun; the weakref's callback (``Running.queue_end``) then closes that
micro-batch at once with the gradients it produced, as native PyTorch keeps them in ``.grad``,
so the user's next line (a clip, a clear) sees native's ``.grad`` (the next event still settles
one that was not closed). A backward in which the wrapper refused a gradient is no micro-batch.
A param with post-accumulate hooks of the user's, registered before the wrapper or after it,
gets its gradient moved alone ahead of them (``hooks.HookOrder``, ``user_hooks.FrontMoves``).

With ``accumulate_in_backward=False`` the views are hidden the same way, but the new gradients
stay in ``.grad`` (in the param dtype, summed by autograd over backwards) until
``accumulate()`` or ``step()`` moves them (accumkernels.optim.intake.unmoved) and shows the window.
Hooks hold the intake weakly; the wrapper removes them when it is collected.

Why a gradient waiting for its bucket is held here and not left in ``.grad``: DDP's hook on a
param runs after ours and reads ``p.grad``. With ``find_unused_parameters=True`` it marks a param
"locally used" when that ``.grad`` is defined -- in ``no_sync`` backwards too -- and on the sync
backward it insists that a locally used param it marks ready as unused in that graph (a module
only the ``no_sync`` micro-batches used) still has a defined ``.grad``. The window, not ``.grad``,
holds such a gradient, so DDP must never see one of ours: then it never counts our params as
used, zeroes their bucket slots (accumkernels.optim.sync.ddp_hook reduces the window instead) and, finding
them "globally unused" at its end, leaves their ``.grad`` alone. For the same reason, in a job of
more than one rank every view is hidden when a backward begins (:meth:`Intake._begin`).
"""

from __future__ import annotations

import torch

from accumkernels.buffer import MasterGradBuffer
from accumkernels.ops.host import grads_are
from accumkernels.optim.intake import compiled
from accumkernels.optim.intake.backward import Running, remove_handles
from accumkernels.optim.intake.guard import FORGOTTEN_LINE, Guard, pipeline_weight_pass
from accumkernels.optim.intake.hooks import HookOrder
from accumkernels.optim.intake.moves import HookState, Mover
from accumkernels.optim.intake.showing import Display, showable_views
from accumkernels.optim.intake.unmoved import Unmoved
from accumkernels.optim.intake.user_hooks import FrontMoves
from accumkernels.slot import SlotWrite


class Intake:
    """Hooks, pending gradients and fused launches for one wrapper (see the module docstring)."""

    def __init__(self, parts, params: list[torch.Tensor], buffer: MasterGradBuffer, events, *,
                 outside: list[torch.Tensor] = ()):
        """``parts``: the wrapper's rooms this one works with (config, window, nonfinite,
        scaler, masters, outside, sync, names); ``events``: where the intake reports upward (a
        micro-batch ended, the window was dropped, the params moved): the face's seam, which
        holds the face weakly."""
        self.config, self.window = parts.config, parts.window
        self.nonfinite, self.scaler, self.masters = parts.nonfinite, parts.scaler, parts.masters
        self.outside_room, self.names, self._parts = parts.outside, parts.names, parts
        self.events, self.params, self.buffer = events, params, buffer
        self.views = [buffer.view(p) for p in params]
        # what the per-param hooks share with the intake (the C hooks hold these objects)
        self.state = HookState(self.views, showable_views(params, self.views))
        self.pending, self.flushed = self.state.pending, self.state.flushed
        self.hidden, self.showable = self.state.hidden, self.state.showable
        self.moves = Mover(parts, params, buffer, self.state, self.refuse_layout)
        self.display = Display(params, self.views, self.showable, parts.window, parts.masters)
        self.check_each_microbatch = self.config.nonfinite == "skip_microbatch"
        self.move_in_backward = self.config.accumulate_in_backward
        self.run = Running()  # where the current backward stands
        self.left = Unmoved(self)  # accumulate_in_backward=False: gradients left in .grad
        self.in_weight_pass = False  # inside weight_pass(): the window stays hidden
        self.counted = False  # a backward counted itself (since the weight pass began)
        self.forgotten_line = False  # a pipeline weight pass ran outside weight_pass()
        self.front = FrontMoves(self, self.moves)  # params with the user's post-accumulate hooks
        self.guard = Guard(self)
        self.order = HookOrder(self, params, outside)  # (read again by guard.check_backward)
        self.handles: list = self.order.handles

    def remove(self) -> None:
        """Detach from the params (idempotent)."""
        remove_handles(self.handles)

    @property
    def unmoved(self) -> int:
        """Backwards whose gradients still sit in ``.grad`` (not moved in backward)."""
        return self.left.count

    def move_unmoved(self, count_new: bool = True) -> None:
        self.left.move(count_new)

    def unmoved_backward(self) -> None:
        self.left.backward_ended()

    @property
    def sync(self):
        """The window's synchronisation (it changes once when DDP is met)."""
        return self._parts.sync

    def rebase(self, buffer: MasterGradBuffer) -> None:
        """Point at a new buffer of the same params (rebuilt after they moved device); the
        hooks stay. Views shown in ``.grad`` are replaced by the new ones."""
        shown = [p.grad is view for p, view in zip(self.params, self.views)]
        self.buffer = buffer
        self.views[:] = [buffer.view(p) for p in self.params]
        self.showable[:] = showable_views(self.params, self.views)
        compiled.hide_low_precision(self)  # (once a backward ran under compiled autograd)
        self.moves.rebase(buffer)
        for p, view, was_shown in zip(self.params, self.views, shown):
            if was_shown:
                p.grad = view
        self.guard = Guard(self)

    def discard(self) -> None:
        """``reset_window()``: held gradients and the backwards not yet moved go with it."""
        self.settle()
        self.pending.clear()
        self.left.forget()

    # -- backward tracking ---------------------------------------------------------------------
    def _begin(self) -> None:
        self.settle()
        if not self.run.active:
            self.run.compiled = compiled.begins(self)  # (it refuses what cannot meet it)
            self.guard.check_backward()  # (a followed move rebuilds the window: before anything)
            if not self.in_weight_pass and pipeline_weight_pass():
                self.forgotten_line = True  # raised at step() (every rank gets there)
            self.outside_room.check_unfrozen(self.config.nonfinite, self.names)
            if self.left.grads:
                self.left.cleared()
            self.run.active, self.run.got_grad, self.run.deferred = True, False, False
            if self.run.compiled:
                compiled.prepare(self)
            self.run.shown_at_begin = self.display.shows_window()
            if self.guard.shown:
                if not self.run.shown_at_begin:  # .grad cleared from outside since the views were
                    self.guard.cleared_outside()  # shown
                self.guard.shown = False  # from here on a None .grad is the wrapper's doing
            self.hidden.clear()
            self.run.queue_end(self)
            self.sync.backward_begins()
            ddp = self.sync.ddp_possible()
            # each post hook shows its param's view as it goes (end_backward then has nothing
            # to show when every param showed it at the begin), unless the window stays hidden
            self.run.show_now = self.move_in_backward and not self.in_weight_pass and not ddp \
                and not self.check_each_microbatch
            self.state.fast = self.run.end_ref if self.run.show_now and not self.run.compiled \
                and not torch.is_grad_enabled() else None  # (grad mode: create_graph=True)
            if ddp:
                # DDP reads p.grad of params this backward gives no gradient too (those its
                # graph search found unused): none may show the fp32 window (see the docstring),
                # also before the wrapper learns of DDP at its first sync (hook registered later)
                for i in range(len(self.params)):
                    self._hide(i)

    def settle(self) -> None:
        """Close a backward that raised (its final callback was dropped without running)."""
        if self.run.raised():
            self.end_backward()

    def notice_clears(self) -> None:
        """Apply a clear from outside (``model.zero_grad()``, ``p.grad = None``) made since the
        last call now, before a call that changes the window (``add_weight``): a weight
        reported after the clear belongs to the window after it, as natively."""
        self.settle()
        if self.run.active:
            return  # (inside a backward the views are hidden by the wrapper, not cleared)
        if self.left.any_cleared():
            self.left.cleared()  # (it forgets the gradients it looks at: only if cleared)
        if self.guard.shown:
            self.guard.cleared_outside()

    def arrived(self, count: bool = True) -> None:
        """A hook of ours runs in a backward (begun here if it is new); ``count``: it saw a
        gradient of this backward, which makes the backward a micro-batch."""
        if self.run.starting():
            self._begin()
        if count:
            self.run.got_grad = True

    def before_grad(self, i: int, grad: torch.Tensor) -> None:
        """The tensor pre-hook: p's gradient of this backward comes next; hide p's view."""
        if self.run.starting():
            self._begin()
        if self.run.compiled:
            return  # (autograd adds into the .grad it read when the backward started)
        p = self.params[i]
        g = p.grad
        if g is None:
            return
        if grad is not None and grad.requires_grad:  # backward(create_graph=True): autograd
            return  # adds out of place into the view, so .grad carries the graph (after_grad)
        if g is self.views[i]:
            p.grad = None
            self.hidden.add(i)
            return
        self._hide(i)

    def _hide(self, i: int) -> None:
        p = self.params[i]
        g = p.grad
        if g is None:
            return
        if g is not self.views[i]:
            if not self.move_in_backward:
                return  # unmoved gradients of earlier backwards: autograd adds to them
            if self.in_weight_pass:  # written in the block: held, this backward's adds to it
                pend = self.pending.setdefault(self.moves.bucket_index[i], {})
                held = pend.get(i)
                pend[i] = g.detach().clone() if held is None else held.add_(g)
            else:
                self.absorb(p, g)  # assigned from outside (held gradients never sit in .grad)
        p.grad = None
        self.hidden.add(i)

    def after_grad(self, i: int, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: p's gradient of this backward is in ``.grad``; take it
        out, hold it, and move its bucket once the bucket is complete."""
        if not p.requires_grad:  # frozen since the forward: autograd stored nothing (native
            if i in self.hidden and p.grad is self.views[i]:  # .grad stays as it was), so this
                p.grad = None  # is no gradient of a micro-batch; the view front_grad showed the
            return  # user's hooks is hidden again until the end of the backward shows it
        if i in self.front.early:  # moved by front_grad; the user's hooks ran on the window
            self.front.after_user_hooks(i)
            return
        self.run.got_grad = True  # (the backward began: p's pre-hook ran just before)
        g = p.grad
        if g is None:  # undefined gradient (a Function returned None, or a fused write)
            return
        if g.layout is not torch.strided:
            self.refuse_layout(i, g)
        if not self.move_in_backward:
            return
        if g.requires_grad:  # create_graph: .grad (window + this gradient) keeps its graph
            self.window.touch([p])  # until the next call absorbs it
            self.hidden.add(i)  # (the end of the backward shows the rest: expose)
            return
        if self.run.compiled:  # (autograd added it into the view it found, or it moves now)
            return compiled.after_grad(self, i, p, g)
        if self.run.show_now:  # held below until moved; .grad shows the window meanwhile
            self.display.show(i, p)
            self.hidden.discard(i)
        else:
            p.grad = None  # held below until moved (the module docstring says why)
        ready = self.moves.hold(i, g, launch=not self.check_each_microbatch)
        if ready is not None:
            self.launch_held(*ready)

    def flush(self, params: list[torch.Tensor]) -> None:
        """Move the pending gradients of ``params`` now, before their bucket is complete
        (DDP's comm hook reduces them in DDP's buckets, which are cut elsewhere)."""
        if self.moves.flush(params):
            self.run.got_grad = True

    def end_backward(self) -> None:
        self.run.active, self.run.deferred, self.run.end_ref = False, False, None
        self.state.fast = None
        if self.run.refused:  # the wrapper refused a gradient of it: no micro-batch
            self.run.refused = self.run.got_grad = False
            self.pending.clear()
        pending = dict(self.pending)
        self.pending.clear()
        self.flushed.clear()
        if pending:
            self.run.got_grad = True  # (the C post hook holds gradients without saying so)
        early, saved = self.front.end()
        kept = True
        if pending or early:
            if self.nonfinite.per_microbatch:
                kept = self.nonfinite.all_finite(
                    [g for pend in pending.values() for g in pend.values()] + early)
            if kept:  # (a dropped micro-batch: its held gradients are released with ``pending``)
                for index, pend in pending.items():
                    self.launch_held(index, pend)
            else:  # what front_grad moved of it leaves the window
                self.front.put_back(saved)
        self.counted = self.counted or self.run.got_grad
        if self.run.got_grad and self.move_in_backward:
            self.events.microbatch_ended(kept)
        elif self.run.got_grad:
            self.left.backward_ended()
        if self.move_in_backward and not self.in_weight_pass:
            if self.run.show_now and self.run.shown_at_begin and not self.hidden and not early:
                self.guard.shown = True  # each param shows what expose() would show it
            else:
                self.expose()

    def claim(self, p: torch.Tensor) -> SlotWrite:
        """A fused kernel writes p's gradient of this backward straight into the window."""
        self._begin()
        self.run.got_grad = True
        self.hidden.add(self.moves.index[id(p)])  # (no hook shows its view: the end of it does)
        overwrite = self.window.first_write(p)
        self.window.touch([p])
        return SlotWrite(self.buffer.view(p), self.window.prescale(self.scaler.scale), overwrite,
                         self.nonfinite.launch_flag())

    # -- moving gradients (moves.Mover) --------------------------------------------------------
    def launch_held(self, index: int, pend: dict[int, torch.Tensor]) -> None:
        """Move the gradients held for bucket ``index`` (``pend``: param index -> gradient) of
        this backward, which is a micro-batch from here on (the C post hook calls this)."""
        self.run.got_grad = True
        self.moves.launch_held(index, pend)

    def refuse_layout(self, i: int, g: torch.Tensor) -> None:
        self.run.refused = True
        self.guard.refuse_layout(i, g)

    def take_in(self) -> None:
        """Before any decision: close a backward that raised and take in what ``.grad`` holds
        (assigned gradients; with ``accumulate_in_backward=False`` the unmoved ones). A
        pipeline weight pass that ran without ``weight_pass()`` raises here, before anything."""
        if self.forgotten_line:
            raise RuntimeError(FORGOTTEN_LINE)
        if self.move_in_backward:
            self.absorb_assigned()
        else:
            self.left.move()

    def absorb_assigned(self) -> None:
        """A ``.grad`` the user assigned (not the view) is what p's gradient means now."""
        self.settle()
        self.guard.check_backward()  # (dtype, device, layout, views: as check_all, in one pass)
        if grads_are(self.params, self.views):
            return  # every .grad shows its view: nothing assigned, nothing cleared
        if self.guard.shown:  # (a followed move made a new guard: self.guard, read again)
            self.guard.cleared_outside()
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is not None and g is not view:
                self.absorb(p, g)
                p.grad = self.showable[self.moves.index[id(p)]]

    def absorb(self, p: torch.Tensor, g: torch.Tensor) -> None:
        self.moves.absorb(p, g)

    # -- what p.grad shows (showing.Display) -------------------------------------------------
    def expose(self) -> None:
        """Show the window: ``p.grad`` (and its master's) is p's fp32 view; None if untouched."""
        self.display.expose()
        self.guard.shown = True

    def hide_all(self) -> None:
        """``.grad`` None on every param and master (the window itself is untouched)."""
        self.guard.shown = False
        self.display.hide_all()


# The entries the C hooks call run eagerly under compiled autograd (the Python hooks do too)
for _name in ("before_grad", "after_grad", "launch_held"):
    setattr(Intake, _name, compiled.eager(getattr(Intake, _name)))
del _name
