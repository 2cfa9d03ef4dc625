"""Intake: moves each backward's gradients into the fp32 window and shows the window as ``p.grad``.

Between backwards every managed param's ``p.grad`` is its fp32 view of the master buffer (for
bf16/fp16 params ``grad_dtype`` is None, so an fp32 ``.grad`` may sit on them). During a
backward (``accumulate_in_backward=True``):

1. a tensor pre-hook sees p's incoming gradient first and hides the view (``p.grad = None``),
   so autograd's AccumulateGrad stores the new low-precision gradient instead of adding it
   into the view param by param;
2. a post-accumulate-grad hook takes it out of ``.grad`` (``p.grad`` stays None for the rest
   of the backward) and holds it; when all params of a bucket are in, the bucket is moved with
   one fused launch and the held low-precision gradients are released;
3. at the end of the outermost backward (an autograd final callback, run after every other
   final callback) the rest is moved, the views are shown again, and the micro-batch counted.

A backward counts as a micro-batch only if some AccumulateGrad (or fused weight-gradient
write) ran in it: ``torch.autograd.grad`` fires the pre-hooks but never the post hooks, so it
leaves the window alone. A backward nested in another one (reentrant checkpointing) is part of
the outer one: its final callback defers to the node that is running it. A backward that raised
leaves its final callback uncalled; the next event notices and closes that micro-batch with
the gradients it produced ("fully in", as native PyTorch keeps them in ``.grad``).

With ``accumulate_in_backward=False`` the views are hidden the same way, but the new gradients
stay in ``.grad`` (in the param dtype, summed by autograd over backwards) until
``accumulate()`` or ``step()`` moves them (:meth:`Intake.move_unmoved`) and shows the window.
Hooks hold the intake weakly; the wrapper removes them when it is collected.

Why a gradient waiting for its bucket is held here and not left in ``.grad``: DDP's hook on a
param runs after ours and reads ``p.grad``. With ``find_unused_parameters=True`` it marks a param
"locally used" when that ``.grad`` is defined -- in ``no_sync`` backwards too -- and on the sync
backward it insists that a locally used param it marks ready as unused in that graph (a module
only the ``no_sync`` micro-batches used) still has a defined ``.grad``. The window, not ``.grad``,
holds such a gradient, so DDP must never see one of ours: then it never counts our params as
used, zeroes their bucket slots (accumkernels.optim.ddp reduces the window instead) and, finding
them "globally unused" at its end, leaves their ``.grad`` alone. For the same reason, in a job of
more than one rank every view is hidden when a backward begins (:meth:`Intake._begin`).
"""

from __future__ import annotations

import weakref

import torch

from accumkernels._torch_private import (
    has_post_accumulate_hooks,
    queue_callback,
    run_post_accumulate_hook_first,
)
from accumkernels._util import LOW_PRECISION
from accumkernels.buffer import Bucket, MasterGradBuffer
from accumkernels.optim.backward import EndOfBackward, remove_handles
from accumkernels.optim.guard import FORGOTTEN_LINE, Guard, pipeline_weight_pass
from accumkernels.slot import SlotWrite

_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


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
        self._bucket_index = [buffer.bucket_of(p).index for p in params]
        self._bucket_len = [len(b.params) for b in buffer.buckets]
        self._check_each_microbatch = self.config.nonfinite == "skip_microbatch"
        self.move_in_backward = self.config.accumulate_in_backward
        # bucket index -> {param index: its gradient of this backward, held until moved}
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self._flushed: dict[int, int] = {}  # bucket index -> params moved early (flush)
        self._active = False  # inside a backward that touched our params
        self._deferred = False  # ... waiting for the outer backward to end
        self._got_grad = False  # an AccumulateGrad (or fused write) ran in it
        self._end_ref = None  # weakref to the active backward's final callback
        self.unmoved = 0  # backwards whose gradients still sit in .grad (not moved in backward)
        # param index -> its unmoved .grad after the last backward: a clear from outside
        # (model.zero_grad()) then means what opt.zero_grad() means (_cleared_unmoved)
        self._unmoved_grads: dict[int, torch.Tensor] = {}
        self.in_weight_pass = False  # inside weight_pass(): the window stays hidden
        self.counted = False  # a backward counted itself (since the weight pass began)
        self.forgotten_line = False  # a pipeline weight pass ran outside weight_pass()
        # params with hooks of the user's before the wrapper's (_front_hook): moved alone,
        # in this backward; with skip_microbatch their views before it and their gradients
        self._early: dict[int, bool] = {}  # param index -> counted toward its bucket
        self._early_saved: dict[int, torch.Tensor | None] = {}
        self._early_grads: list[torch.Tensor] = []
        self.handles: list = []
        self.guard = Guard(self)
        me = weakref.ref(self)
        for i, p in enumerate(params):
            if _HAS_GRAD_DTYPE and p.dtype in LOW_PRECISION:
                p.grad = None
                p.grad_dtype = None  # any dtype may sit in .grad: the fp32 view, or bf16 grads
            user_hooks = has_post_accumulate_hooks(p)  # registered before wrapping
            self.handles.append(p.register_hook(_pre_hook(me, i)))
            if user_hooks:
                front = p.register_post_accumulate_grad_hook(_front_hook(me, i))
                run_post_accumulate_hook_first(p, front)
                self.handles.append(front)
            self.handles.append(p.register_post_accumulate_grad_hook(_post_hook(me, i)))
        for p in outside:  # params outside the window (float64, frozen): their backwards count
            self.handles.append(p.register_post_accumulate_grad_hook(_outside_hook(me)))

    def remove(self) -> None:
        """Detach from the params (idempotent)."""
        remove_handles(self.handles)

    @property
    def sync(self):
        """The window's synchronisation (it changes once when DDP is met)."""
        return self._parts.sync

    def rebase(self, buffer: MasterGradBuffer) -> None:
        """Point at a new buffer of the same params (rebuilt after they moved device); the
        hooks stay. Views shown in ``.grad`` are replaced by the new ones."""
        shown = [p.grad is view for p, view in zip(self.params, self.views)]
        self.buffer = buffer
        self.views = [buffer.view(p) for p in self.params]
        for p, view, was_shown in zip(self.params, self.views, shown):
            if was_shown:
                p.grad = view
        self.guard = Guard(self)

    def discard(self) -> None:
        """``reset_window()``: held gradients and the backwards not yet moved go with it."""
        self.settle()
        self.pending = {}
        self.unmoved = 0
        self._unmoved_grads = {}

    # -- backward tracking ---------------------------------------------------------------------
    def _begin(self) -> None:
        self.settle()
        if not self._active:
            if not self.in_weight_pass and pipeline_weight_pass():
                self.forgotten_line = True  # raised at step() (every rank gets there)
            self.outside_room.check_unfrozen(self.config.nonfinite, self.names)
            if self._unmoved_grads:
                self._cleared_unmoved()
            self._active, self._got_grad, self._deferred = True, False, False
            if self.guard.shown:  # .grad cleared from outside since the views were shown
                self.guard.cleared_outside()
                self.guard.shown = False  # from here on a None .grad is the wrapper's doing
            end = EndOfBackward(self)
            self._end_ref = weakref.ref(end)
            queue_callback(end)
            self.sync.backward_begins()
            if self.sync.ddp_possible():
                # DDP reads p.grad of params this backward gives no gradient too (those its
                # graph search found unused): none may show the fp32 window (see the docstring),
                # also before the wrapper learns of DDP at its first sync (hook registered later)
                for i in range(len(self.params)):
                    self._hide(i)

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
        refs = self._unmoved_grads
        if refs and any(self.params[i].grad is None for i in refs):
            self._cleared_unmoved()  # (it forgets the gradients it looks at: only if cleared)
        if self.guard.shown:
            self.guard.cleared_outside()

    def defer_to(self, node) -> None:
        self._deferred = True

        def outer_continues(*_):
            self._deferred = False
            end = EndOfBackward(self)
            self._end_ref = weakref.ref(end)
            queue_callback(end)

        node.register_hook(outer_continues)

    def _starting(self) -> bool:
        """Whether ``_begin`` has anything to do (the hot hooks skip the call otherwise)."""
        return not self._active or (not self._deferred and self._end_ref() is None)

    def before_grad(self, i: int, grad: torch.Tensor) -> None:
        self.guard.before_grad(i, grad)
        if self._starting():
            self._begin()
        if grad is not None and grad.requires_grad:  # backward(create_graph=True): autograd
            return  # adds out of place into the view, so .grad carries the graph (after_grad)
        if self.params[i].grad is not None:
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
                pend = self.pending.setdefault(self._bucket_index[i], {})
                held = pend.get(i)
                pend[i] = g.detach().clone() if held is None else held.add_(g)
            else:
                self.absorb(p, g)  # assigned from outside (held gradients never sit in .grad)
        p.grad = None

    def front_grad(self, i: int) -> None:
        """Param i's gradient is in ``.grad`` and the user's post-accumulate-grad hooks
        (registered before the wrapper's) run next: move it now, alone, and show the running
        window in ``.grad`` to them, as native ``.grad`` holds the running sum there; what they
        write in place is what the step uses. (A per-param launch, only for such params; inside
        ``weight_pass()`` and with ``accumulate_in_backward=False`` they see ``.grad`` as it is.)"""
        p = self.params[i]
        if not p.requires_grad or not self.move_in_backward or self.in_weight_pass:
            return
        if self._starting():
            self._begin()
        g = p.grad
        if g is None or g.requires_grad:
            return  # (undefined, or carrying create_graph's graph: after_grad's cases)
        self._got_grad = True
        view = self.views[i]
        if self._check_each_microbatch:  # checked at the end; put back if dropped
            if i not in self._early_saved:
                self._early_saved[i] = view.clone() if self.window.holds(p) else None
            self._early_grads.append(g)
        self._move([p], [g])
        p.grad = view
        self._early.setdefault(i, False)  # (its bucket hears of it after the user's hooks)

    def after_grad(self, i: int) -> None:
        p = self.params[i]
        if not p.requires_grad:  # frozen since the forward: autograd stored nothing (native
            return  # .grad stays as it was), so this is no gradient of a micro-batch
        if i in self._early:  # moved by front_grad; the user's hooks ran on the window
            self._after_user_hooks(i)
            return
        if self._starting():
            self._begin()
        self._got_grad = True
        if not self.move_in_backward:
            return
        g = p.grad
        if g is None:  # undefined gradient (a Function returned None, or a fused write)
            return
        if g.requires_grad:  # create_graph: .grad (window + this gradient) keeps its graph
            self.window.touch([p])  # until the next call absorbs it
            return
        p.grad = None  # held below until moved (the module docstring says why)
        index = self._bucket_index[i]
        pend = self.pending.get(index)
        if pend is None:
            pend = self.pending[index] = {}
        held = pend.get(i)
        if held is not None:  # a second gradient for p in this backward (reentrant
            held.add_(g)  # checkpointing): added in p's dtype, as AccumulateGrad adds it
            return
        pend[i] = g
        if self._check_each_microbatch:
            return  # checked, then moved, at the end of the backward
        if len(pend) + self._flushed.get(index, 0) == self._bucket_len[index]:
            del self.pending[index]
            self._launch_held(index, pend)

    def _after_user_hooks(self, i: int) -> None:
        """Param i, moved by front_grad, after the user's hooks wrote its window: now it counts
        toward its bucket (whose reduction across ranks may start when it is complete)."""
        p = self.params[i]
        g = p.grad
        if g is not None and g is not self.views[i] and not g.requires_grad:
            self.absorb(p, g)  # a .grad the user's hook assigned: p's gradient now
        # hidden again in a multi-rank job (DDP must not see the window: module docstring)
        p.grad = None if self.sync.ddp_possible() else self.views[i]
        if self._early[i] or self._check_each_microbatch:
            return  # (counted already; skip_microbatch moves the rest at the end)
        self._early[i] = True
        index = self._bucket_index[i]
        flushed = self._flushed[index] = self._flushed.get(index, 0) + 1
        pend = self.pending.get(index, {})
        if len(pend) + flushed == self._bucket_len[index]:
            self.pending.pop(index, None)
            if pend:
                self._launch_held(index, pend)
            else:
                self._bucket_moved(self.buffer.buckets[index])

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
            self._flushed[index] = self._flushed.get(index, 0) + len(take)
            self._launch_held(index, take)

    def end_backward(self) -> None:
        self._active, self._deferred, self._end_ref = False, False, None
        pending, self.pending = self.pending, {}
        self._flushed = {}
        early, self._early_grads, self._early = self._early_grads, [], {}
        saved, self._early_saved = self._early_saved, {}
        kept = True
        if pending or early:
            if self.nonfinite.per_microbatch:
                kept = self.nonfinite.all_finite(
                    [g for pend in pending.values() for g in pend.values()] + early)
            if kept:  # (a dropped micro-batch: its held gradients are released with ``pending``)
                for index, pend in pending.items():
                    self._launch_held(index, pend)
            else:  # what front_grad moved of it leaves the window
                self._put_back(saved)
        self.counted = self.counted or self._got_grad
        if self._got_grad and self.move_in_backward:
            self.events.microbatch_ended(kept)
        elif self._got_grad:
            self.unmoved_backward()
        if self.move_in_backward and not self.in_weight_pass:
            self.expose()

    def unmoved_backward(self) -> None:
        """A backward whose gradients stay in ``.grad`` (``accumulate_in_backward=False``)."""
        self.unmoved += 1  # counted when moved: the non-finite check sees its gradients
        n = self.config.accumulation_steps
        if n is not None and self.window.micro_steps + self.unmoved >= n:
            self.move_unmoved()  # the N-th backward: .grad shows the complete window
        else:
            self._unmoved_grads = {i: p.grad for i, (p, view) in enumerate(
                zip(self.params, self.views)) if p.grad is not None and p.grad is not view}

    def _cleared_unmoved(self) -> None:
        """Unmoved gradients whose ``.grad`` was cleared from outside (``model.zero_grad()``,
        ``p.grad = None``) since the last backward: with N given the window is still filling
        (the N-th backward moves them), and the clear keeps them, as ``opt.zero_grad()`` does:
        moved into the window, ``.grad`` None. With N None they are gone, as natively."""
        refs, self._unmoved_grads = self._unmoved_grads, {}
        cleared = [i for i, g in refs.items() if self.params[i].grad is None]
        if not cleared:
            return
        if self.config.accumulation_steps is None:
            if len(cleared) == len(refs) and not any(
                    p.grad is not None and p.grad is not v for p, v in zip(self.params,
                                                                             self.views)):
                self.unmoved = 0  # every unmoved gradient is gone: no backward left to count
            return
        for i in cleared:
            self.params[i].grad = refs[i]
        self.move_unmoved()
        for i in cleared:
            self.params[i].grad = None

    def claim(self, p: torch.Tensor) -> SlotWrite:
        """A fused kernel writes p's gradient of this backward straight into the window."""
        self._begin()
        self._got_grad = True
        overwrite = self.window.first_write(p)
        self.window.touch([p])
        return SlotWrite(self.buffer.view(p), self.window.prescale(self.scaler.scale), overwrite,
                         self.nonfinite.launch_flag())

    # -- moving gradients ----------------------------------------------------------------------
    def _launch_held(self, index: int, pend: dict[int, torch.Tensor]) -> None:
        self.launch(self.buffer.buckets[index], [self.params[i] for i in pend],
                    list(pend.values()))

    def launch(self, bucket: Bucket, params: list[torch.Tensor],
               grads: list[torch.Tensor]) -> None:
        """Move ``grads`` of ``params`` (of one bucket) into the window."""
        if not params:
            return
        self._move(params, grads)
        self._bucket_moved(bucket)

    def _bucket_moved(self, bucket: Bucket) -> None:
        n = self.config.accumulation_steps
        self.sync.bucket_moved(bucket, n is not None and self.window.micro_steps == n - 1)

    def _put_back(self, saved: dict[int, torch.Tensor | None]) -> None:
        """A dropped micro-batch: the views front_grad wrote hold what they held before it."""
        held = self.window.held(self.params)
        for i, old in saved.items():
            if old is None:
                held[i] = False  # (its first write of the window: no data of it again)
            else:
                self.views[i].copy_(old)
        self.window.keep_only(self.params, held)

    def _move(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        window = self.window
        fresh = [k for k, p in enumerate(params) if window.first_write(p)]
        again = [k for k, p in enumerate(params) if not window.first_write(p)] \
            if len(fresh) < len(params) else []
        for group, overwrite in ((fresh, True), (again, False)):
            if group:  # normally all of a bucket is fresh, or none: one launch
                self.buffer.accumulate([params[k] for k in group], [grads[k] for k in group],
                                       window.prescale(self.scaler.scale), overwrite=overwrite,
                                       found_inf=self.nonfinite.launch_flag(),
                                       backend=self.config.backend)
        window.touch(params)

    def take_in(self) -> None:
        """Before any decision: close a backward that raised and take in what ``.grad`` holds
        (assigned gradients; with ``accumulate_in_backward=False`` the unmoved ones). A
        pipeline weight pass that ran without ``weight_pass()`` raises here, before anything."""
        if self.forgotten_line:
            raise RuntimeError(FORGOTTEN_LINE)
        if self.move_in_backward:
            self.absorb_assigned()
        else:
            self.move_unmoved()

    def move_unmoved(self, count_new: bool = True) -> None:
        """Move every ``.grad`` that is not the param's view (accumulate_in_backward=False);
        ``count_new``: gradients without a counted backward are one micro-batch."""
        self.settle()
        self.guard.check_all()
        if self._unmoved_grads:
            self._cleared_unmoved()
        by_bucket: dict[int, list[torch.Tensor]] = {}
        for p, view in zip(self.params, self.views):
            g = p.grad
            if g is not None and g is not view:
                by_bucket.setdefault(self.buffer.bucket_of(p).index, []).append(p)
        kept = True
        if self.nonfinite.per_microbatch:
            kept = self.nonfinite.all_finite(
                [p.grad for params in by_bucket.values() for p in params])
        for index, params in by_bucket.items():
            if kept:
                self.launch(self.buffer.buckets[index], params, [p.grad for p in params])
            for p in params:
                p.grad = None
        count, self.unmoved = self.unmoved, 0
        if by_bucket and not count and count_new:
            count = 1  # gradients set without a backward this wrapper saw: one micro-batch
        for _ in range(count):
            self.events.microbatch_ended(kept)
        self.expose()

    def absorb_assigned(self) -> None:
        """A ``.grad`` the user assigned (not the view) is what p's gradient means now."""
        self.settle()
        self.guard.check_all()
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
        show_lowp = _HAS_GRAD_DTYPE
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


def _pre_hook(intake_ref, i: int):
    def hook(grad):
        intake = intake_ref()
        if intake is not None:
            intake.before_grad(i, grad)
    return hook


def _outside_hook(intake_ref):
    def hook(param):
        intake = intake_ref()
        if intake is not None and param.requires_grad:  # (frozen since the forward: nothing)
            if intake._starting():
                intake._begin()
            intake._got_grad = True
    return hook


def _front_hook(intake_ref, i: int):
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.front_grad(i)
    return hook


def _post_hook(intake_ref, i: int):
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.after_grad(i)
    return hook
