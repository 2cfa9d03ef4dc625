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
leaves its final callback uncalled; the next event notices and closes that micro-batch with
the gradients it produced ("fully in", as native PyTorch keeps them in ``.grad``).

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

import weakref

import torch

from accumkernels._torch_private import queue_callback
from accumkernels._util import LOW_PRECISION
from accumkernels.ops.host import grads_are
from accumkernels.buffer import Bucket, MasterGradBuffer
from accumkernels.optim.intake.backward import EndOfBackward, remove_handles
from accumkernels.optim.intake.guard import FORGOTTEN_LINE, Guard, pipeline_weight_pass
from accumkernels.optim.intake.hooks import HAS_GRAD_DTYPE, install_hooks
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
        self.events = events
        self.params = params
        self.buffer = buffer
        self.views = [buffer.view(p) for p in params]
        self._index = {id(p): i for i, p in enumerate(params)}
        self.bucket_index = [buffer.bucket_of(p).index for p in params]
        self.bucket_len = [len(b.params) for b in buffer.buckets]
        self._bucket_ids = [[id(p) for p in b.params] for b in buffer.buckets]
        self.check_each_microbatch = self.config.nonfinite == "skip_microbatch"
        self.move_in_backward = self.config.accumulate_in_backward
        # bucket index -> {param index: its gradient of this backward, held until moved}
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.flushed: dict[int, int] = {}  # bucket index -> params moved early (flush)
        self._active = False  # inside a backward that touched our params
        self._deferred = False  # ... waiting for the outer backward to end
        self._got_grad = False  # an AccumulateGrad (or fused write) ran in it
        self._end_ref = None  # weakref to the active backward's final callback
        self.left = Unmoved(self)  # accumulate_in_backward=False: gradients left in .grad
        self.in_weight_pass = False  # inside weight_pass(): the window stays hidden
        self.counted = False  # a backward counted itself (since the weight pass began)
        self.forgotten_line = False  # a pipeline weight pass ran outside weight_pass()
        self.front = FrontMoves(self)  # params with post-accumulate hooks of the user's
        self._show_now = False  # this backward's post hooks show each view as they go
        # the hooks' fast case (intake_hooks.C_HOOKS) applies to this backward: the weakref to
        # its final callback (alive while it runs), else None
        self._fast = None
        self._shown_at_begin = False  # when it began, every param showed what expose() shows
        # (the hooks hold these objects: they are updated in place, never replaced)
        self.hidden: set[int] = set()  # views its pre-hooks hid that no post hook showed again
        self.showable = self._showable_views()
        self.guard = Guard(self)
        self.handles: list = install_hooks(self, params, outside)

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
        self.showable[:] = self._showable_views()
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
        if not self._active:
            self.guard.check_backward()  # (a followed move rebuilds the window: before anything)
            if not self.in_weight_pass and pipeline_weight_pass():
                self.forgotten_line = True  # raised at step() (every rank gets there)
            self.outside_room.check_unfrozen(self.config.nonfinite, self.names)
            if self.left.grads:
                self.left.cleared()
            self._active, self._got_grad, self._deferred = True, False, False
            self._shown_at_begin = self._shows_window()
            if self.guard.shown:
                if not self._shown_at_begin:  # .grad cleared from outside since the views were
                    self.guard.cleared_outside()  # shown
                self.guard.shown = False  # from here on a None .grad is the wrapper's doing
            self.hidden.clear()
            end = EndOfBackward(self)
            self._end_ref = weakref.ref(end)
            queue_callback(end)
            self.sync.backward_begins()
            ddp = self.sync.ddp_possible()
            # each post hook shows its param's view as it goes (end_backward then has nothing
            # to show when every param showed it at the begin), unless the window stays hidden
            self._show_now = self.move_in_backward and not self.in_weight_pass and not ddp \
                and not self.check_each_microbatch
            self._fast = self._end_ref if self._show_now and not torch.is_grad_enabled() \
                else None  # (grad mode inside a backward: create_graph=True)
            if ddp:
                # DDP reads p.grad of params this backward gives no gradient too (those its
                # graph search found unused): none may show the fp32 window (see the docstring),
                # also before the wrapper learns of DDP at its first sync (hook registered later)
                for i in range(len(self.params)):
                    self._hide(i)

    def _shows_window(self) -> bool:
        """Whether every param's ``.grad`` is what :meth:`expose` would make it now (its view
        if the window holds it, else None): one read of each ``.grad``."""
        if grads_are(self.params, self.views):
            return True
        grads = [p.grad for p in self.params]
        held = self.window.held(self.params)
        return all((g is view) if h else (g is None)
                   for g, view, h in zip(grads, self.showable, held))

    def _showable_views(self) -> list:
        """Per param what ``.grad`` shows of the window: its view, or None for a bf16/fp16
        param on a torch without ``grad_dtype`` (an fp32 ``.grad`` cannot sit on it)."""
        return [view if (HAS_GRAD_DTYPE or p.dtype not in LOW_PRECISION) else None
                for p, view in zip(self.params, self.views)]

    def settle(self) -> None:
        """Close a backward that raised (its final callback was dropped without running)."""
        if self._active and not self._deferred and self._end_ref() is None:
            self.end_backward()

    def notice_clears(self) -> None:
        """Apply a clear from outside (``model.zero_grad()``, ``p.grad = None``) made since the
        last call now, before a call that changes the window (``add_weight``): a weight
        reported after the clear belongs to the window after it, as natively."""
        self.settle()
        if self._active:
            return  # (inside a backward the views are hidden by the wrapper, not cleared)
        if self.left.any_cleared():
            self.left.cleared()  # (it forgets the gradients it looks at: only if cleared)
        if self.guard.shown:
            self.guard.cleared_outside()

    def defer_to(self, node) -> None:
        self._deferred, self._fast = True, None

        def outer_continues(*_):
            self._deferred = False
            end = EndOfBackward(self)
            self._end_ref = weakref.ref(end)
            queue_callback(end)

        node.register_hook(outer_continues)

    def arrived(self, count: bool = True) -> None:
        """A hook of ours runs in a backward (begun here if it is new); ``count``: it saw a
        gradient of this backward, which makes the backward a micro-batch."""
        if self._starting():
            self._begin()
        if count:
            self._got_grad = True

    def _starting(self) -> bool:
        """Whether ``_begin`` has anything to do (the hot hooks skip the call otherwise)."""
        return not self._active or (not self._deferred and self._end_ref() is None)

    def before_grad(self, i: int, grad: torch.Tensor) -> None:
        """The tensor pre-hook: p's gradient of this backward comes next; hide p's view."""
        if self._starting():
            self._begin()
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
                pend = self.pending.setdefault(self.bucket_index[i], {})
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
            return  # .grad stays as it was), so this is no gradient of a micro-batch
        if i in self.front.early:  # moved by front_grad; the user's hooks ran on the window
            self.front.after_user_hooks(i)
            return
        self._got_grad = True  # (the backward began: p's pre-hook ran just before)
        g = p.grad
        if g is None:  # undefined gradient (a Function returned None, or a fused write)
            return
        if g.layout is not torch.strided:
            self.guard.refuse_layout(i, g)
        if not self.move_in_backward:
            return
        if g.requires_grad:  # create_graph: .grad (window + this gradient) keeps its graph
            self.window.touch([p])  # until the next call absorbs it
            self.hidden.add(i)  # (the end of the backward shows the rest: expose)
            return
        if self._show_now:  # held below until moved; .grad shows the window meanwhile
            p.grad = self.showable[i]
            self.hidden.discard(i)
            masters = self.masters.masters
            if masters:
                master, view = masters.get(id(p)), self.views[i]
                if master is not None and master.grad is not view:
                    master.grad = view
        else:
            p.grad = None  # held below until moved (the module docstring says why)
        index = self.bucket_index[i]
        pend = self.pending.get(index)
        if pend is None:
            pend = self.pending[index] = {}
        held = pend.get(i)
        if held is not None:  # a second gradient for p in this backward (reentrant
            held.add_(g)  # checkpointing): added in p's dtype, as AccumulateGrad adds it
            return
        pend[i] = g
        if self.check_each_microbatch:
            return  # checked, then moved, at the end of the backward
        if len(pend) + self.flushed.get(index, 0) == self.bucket_len[index]:
            del self.pending[index]
            self.launch_held(index, pend)

    def flush(self, params: list[torch.Tensor]) -> None:
        """Move the pending gradients of ``params`` now, before their bucket is complete
        (DDP's comm hook reduces them in DDP's buckets, which are cut elsewhere)."""
        wanted = {self._index.get(id(p)) for p in params}
        for index in list(self.pending):
            pend = self.pending[index]
            take = {i: g for i, g in pend.items() if i in wanted}
            if not take:
                continue
            for i in take:
                del pend[i]
            if not pend:
                del self.pending[index]
            self.flushed[index] = self.flushed.get(index, 0) + len(take)
            self.launch_held(index, take)

    def end_backward(self) -> None:
        self._active, self._deferred, self._end_ref, self._fast = False, False, None, None
        pending = dict(self.pending)
        self.pending.clear()
        self.flushed.clear()
        if pending:
            self._got_grad = True  # (the C post hook holds gradients without saying so)
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
        self.counted = self.counted or self._got_grad
        if self._got_grad and self.move_in_backward:
            self.events.microbatch_ended(kept)
        elif self._got_grad:
            self.left.backward_ended()
        if self.move_in_backward and not self.in_weight_pass:
            if self._show_now and self._shown_at_begin and not self.hidden and not early:
                self.guard.shown = True  # each param shows what expose() would show it
            else:
                self.expose()

    def claim(self, p: torch.Tensor) -> SlotWrite:
        """A fused kernel writes p's gradient of this backward straight into the window."""
        self._begin()
        self._got_grad = True
        self.hidden.add(self._index[id(p)])  # (no hook shows its view: the end of it does)
        overwrite = self.window.first_write(p)
        self.window.touch([p])
        return SlotWrite(self.buffer.view(p), self.window.prescale(self.scaler.scale), overwrite,
                         self.nonfinite.launch_flag())

    # -- moving gradients ----------------------------------------------------------------------
    def launch_held(self, index: int, pend: dict[int, torch.Tensor]) -> None:
        """Move the gradients held for bucket ``index`` (``pend``: param index -> gradient) of
        this backward, which is a micro-batch from here on."""
        self._got_grad = True
        params = self.params
        whole = len(pend) == self.bucket_len[index]
        try:
            self.launch(self.buffer.buckets[index], [params[i] for i in pend],
                        list(pend.values()), self._bucket_ids[index] if whole else None)
        except (TypeError, ValueError, RuntimeError):
            for i, g in pend.items():  # (the hooks' fast case leaves the layout to the launch)
                if g.layout is not torch.strided:
                    self.guard.refuse_layout(i, g)
            raise

    def launch(self, bucket: Bucket, params: list[torch.Tensor],
               grads: list[torch.Tensor], ids: list[int] | None = None) -> None:
        """Move ``grads`` of ``params`` (of one bucket) into the window."""
        if not params:
            return
        self.move(params, grads, ids)
        self.bucket_moved(bucket)

    def bucket_moved(self, bucket: Bucket) -> None:
        self.sync.bucket_moved(bucket, self.window.completing())

    def move(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             ids: list[int] | None = None) -> None:
        """Move ``grads`` of ``params`` into their views (``ids``: the params' ``id``, if
        known): one launch when all are first writes of the window, or none is (the usual
        case), else one of each."""
        window = self.window
        ids = [id(p) for p in params] if ids is None else ids
        first = window.first_writes(ids)
        if first is None:
            touched = [window.holds(p) for p in params]
            groups = [([p for p, t in zip(params, touched) if t is not fresh],
                       [g for g, t in zip(grads, touched) if t is not fresh], fresh)
                      for fresh in (True, False)]
        else:
            groups = [(params, grads, first)]
        for group_params, group_grads, overwrite in groups:
            self.buffer.accumulate(group_params, group_grads,
                                   window.prescale(self.scaler.scale), overwrite=overwrite,
                                   found_inf=self.nonfinite.launch_flag(),
                                   backend=self.config.backend)
        window.touch_ids(ids)

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
                p.grad = view

    def absorb(self, p: torch.Tensor, g: torch.Tensor) -> None:
        self.window.settle_carry()  # (before a write: the other views' carried gradients)
        with torch.no_grad():  # same units as the view it replaced
            self.buffer.view(p).copy_(g)
        self.window.touch([p])

    # -- what p.grad shows ---------------------------------------------------------------------
    def expose(self) -> None:
        """Show the window: ``p.grad`` (and its master's) is p's fp32 view; None if untouched."""
        if self.window.holds_all(map(id, self.params)) and grads_are(self.params, self.views) \
                and self.masters.grads_are(self.params, self.views):
            self.guard.shown = True  # (each .grad shows its view already)
            return
        show_lowp = HAS_GRAD_DTYPE
        held, masters = self.window.held(self.params), self.masters.masters  # (id(p) -> master)
        for p, view, holds in zip(self.params, self.views, held):
            if not holds:
                continue
            master = masters.get(id(p)) if masters else None
            if master is not None and master.grad is not view:
                master.grad = view
            g = p.grad
            if g is not view and (g is None or not g.requires_grad) \
                    and (show_lowp or p.dtype not in LOW_PRECISION):
                p.grad = view  # (a .grad carrying create_graph's graph stays until absorbed)
        self.guard.shown = True

    def hide_all(self) -> None:
        """``.grad`` None on every param and master (the window itself is untouched)."""
        self.guard.shown = False
        for p in self.params:
            p.grad = None
            master = self.masters.get(p)
            if master is not None:
                master.grad = None
