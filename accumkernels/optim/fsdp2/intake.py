"""The FSDP2 window and its intake: fp32 storage shaped like each param's local shard, fed by
FSDP2's own post-reduce-scatter hooks.

FSDP2 (``fully_shard``) reduce-scatters each param group's gradients and then, itself, calls
the post-accumulate-grad hooks of the sharded params, where ``p.grad.to_local()`` is the fp32
reduce-scatter output for this rank's shard. The intake:

1. at the start of each backward (a multi-grad hook on the forward outputs of every FSDP
   module, the mechanism FSDP2 uses for its own pre-backward) hides the window
   (``p.grad = None``), so FSDP2 hands over each new shard instead of adding it into ``.grad``;
2. in the hooks collects the shards of one FSDP param group and moves them into the window with
   one fused ``accumulate_`` launch (scale and non-finite flag fused), then drops them;
3. at the end of the backward (a final callback re-queued once, so it runs after FSDP2's own)
   moves what is left, counts the micro-batch and shows the window again: ``p.grad`` is a
   DTensor over the param's window shard (same mesh and placements as ``p``), so
   ``clip_grad_norm_`` and the inner optimizer see an ordinary FSDP2 gradient.

With ``set_requires_gradient_sync(False)`` (and HSDP's ``set_requires_all_reduce(False)``) FSDP2
accumulates the skipped micro-batches itself and the hooks fire once, on the syncing backward.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor

from accumkernels._torch_private import compiled_autograd_on, flat_leaves, queue_callback
from accumkernels.ops.accumulate import accumulate_
from accumkernels.optim.intake.backward import EndOfBackward, remove_handles

_ALIGN = 32  # elements: every shard view starts on a 128-byte boundary (the kernels' vector path)


class ShardedWindow:
    """One flat fp32 buffer per device holding every managed param's local shard (no unsharded
    copy: about 4 B/param / world, plus alignment padding)."""

    def __init__(self, params: list[torch.Tensor]):
        self.params = params
        self.buffers: dict[torch.device, torch.Tensor] = {}
        offsets, totals = [], {}
        for p in params:
            local = p.to_local()
            start = totals.get(local.device, 0)
            offsets.append(start)
            totals[local.device] = start + -(-local.numel() // _ALIGN) * _ALIGN
        for device, total in totals.items():
            self.buffers[device] = torch.zeros(total, dtype=torch.float32, device=device)
        self.views: list[torch.Tensor] = []  # local fp32 shard views
        self.shown: list[DTensor] = []  # the same memory as DTensors shaped like the params
        for p, off in zip(params, offsets):
            local = p.to_local()
            view = self.buffers[local.device][off:off + local.numel()].view(local.shape)
            self.views.append(view)
            self.shown.append(DTensor.from_local(view, p.device_mesh, p.placements,
                                                 shape=p.shape, stride=p.stride(),
                                                 run_check=False))
        self._index = {id(p): i for i, p in enumerate(params)}

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """p's local fp32 window shard."""
        return self.views[self._index[id(p)]]

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers.values())


class ShardedIntake:
    """Hooks and fused launches for one FSDP2 wrapper (see the module docstring)."""

    def __init__(self, parts, storage: ShardedWindow, events, groups: list[list[int]],
                 modules: list[torch.nn.Module], root: torch.nn.Module | None = None):
        self.config, self.window, self.nonfinite = parts.config, parts.window, parts.nonfinite
        self.scaler, self.events = parts.scaler, events
        params = parts.params
        self.params = params
        self.storage = storage
        self.views = storage.shown  # what the core rooms hand to the inner optimizer as .grad
        self._group_of = {i: g for g, members in enumerate(groups) for i in members}
        self._group_size = [len(members) for members in groups]
        self.pending: dict = {}  # group index -> [(param index, local grad)]
        self.unmoved = 0  # the core's counter; FSDP2 gradients are always moved in backward
        self._active = False
        self._shown = False  # the window was put in p.grad and not hidden by the wrapper since
        self._end_ref = None
        self.handles: list = []
        me = weakref.ref(self)
        for module in modules:
            self.handles.append(module.register_forward_hook(_forward_hook(me)))
        for i, p in enumerate(params):
            self.handles.append(p.register_post_accumulate_grad_hook(_post_hook(me, i)))
        if root is not None and not parts.window.length_given:
            # every step() ends a window: the mesh meets before each forward's all-gather
            # (MeshSync.forward_begins), ahead of FSDP2's own pre-forward hook
            self.handles.append(root.register_forward_pre_hook(_pre_forward_hook(parts),
                                                               prepend=True))

    def remove(self) -> None:
        """Detach from the model and its params (idempotent)."""
        remove_handles(self.handles)

    # -- one backward ----------------------------------------------------------------------------
    def begin(self) -> None:
        """Start of a backward through an FSDP module: hide the window, queue the end."""
        if self._active and self._end_ref() is not None:
            return
        if compiled_autograd_on():
            raise RuntimeError(
                "AccumulatingOptimizer (FSDP2): compiled autograd is not supported (it traces "
                "FSDP2's gradient hooks); run the backward eagerly (torch.compile on the model's "
                "forward is fine)")
        self.settle()
        self.cleared_outside()
        self._active = True
        end = EndOfBackward(self, nested=False)
        self._end_ref = weakref.ref(end)
        queue_callback(end)
        self.hide_all()

    def discard(self) -> None:
        """``reset_window()``: gradients held for the rest of their group go with it (FSDP2
        hands every gradient over during backward: nothing else waits to be moved)."""
        self.settle()
        self.pending = {}

    def settle(self) -> None:
        """Close a backward that raised (its final callback was dropped without running)."""
        if self._active and self._end_ref() is None:
            self.end_backward()

    def arrived(self, i: int) -> None:
        """FSDP2's hook: p's reduced shard of this backward is in ``p.grad``."""
        p = self.params[i]
        grad = p.grad
        if grad is None:
            return
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if not self._active:
            self.begin()  # a forward that ran before the wrapper was built
            p.grad = grad
        if local.data_ptr() == self.storage.views[i].data_ptr() and local.numel():
            return self._added_in_place(i)
        group = self._group_of[i]
        for other in [g for g in self.pending if g != group]:
            self._launch(other)  # FSDP2 reduces one group at a time: that one is complete
        pend = self.pending.setdefault(group, [])
        pend.append((i, local))
        if len(pend) == self._group_size[group]:
            self._launch(group)

    def _added_in_place(self, i: int) -> None:
        """FSDP2 found the window in ``p.grad`` and added the new shard into it (fp32 add)."""
        if self.window.prescale(self.scaler.scale) != 1.0:
            raise RuntimeError(
                "AccumulatingOptimizer (FSDP2): a gradient was added into the window without the "
                "wrapper (the forward ran before the wrapper was built, with a loss scale or "
                "reduction='mean'); build the wrapper before the first forward")
        self.window.touch([self.params[i]])

    def _launch(self, group: int) -> None:
        """Move the pending shards of ``group`` into the window, then drop them."""
        pend = self.pending.pop(group, [])
        if not pend:
            return
        window, views = self.window, self.storage.views
        fresh = [(i, g) for i, g in pend if window.first_write(self.params[i])]
        again = [(i, g) for i, g in pend if not window.first_write(self.params[i])]
        scale, flag = window.prescale(self.scaler.scale), self.nonfinite.launch_flag()
        for _, g in pend:
            if g.is_cuda:  # a later launch (end of backward) runs on another stream than the
                g.record_stream(torch.cuda.current_stream(g.device))  # reduce-scatter's
        for items, overwrite in ((fresh, True), (again, False)):
            if items:  # the first write of a window overwrites: no zeroing pass
                accumulate_([views[i] for i, _ in items], [g for _, g in items], scale,
                            overwrite=overwrite, found_inf=flag, backend=self.config.backend)
        for i, _ in pend:
            self.params[i].grad = None
        window.touch([self.params[i] for i, _ in pend])

    def end_backward(self) -> None:
        self._active, self._end_ref = False, None
        for group in list(self.pending):
            self._launch(group)
        self.events.microbatch_ended(True)
        self.expose()

    def flush(self, params: list[torch.Tensor]) -> None:
        for group in list(self.pending):
            self._launch(group)

    # -- what p.grad shows ---------------------------------------------------------------------
    def expose(self) -> None:
        """``p.grad`` is p's window shard as a DTensor; None if untouched in this window."""
        for p, shown in zip(self.params, self.views):
            if self.window.holds(p) and p.grad is not shown:
                p.grad = shown
        self._shown = True

    def hide_all(self) -> None:
        self._shown = False
        for p in self.params:
            p.grad = None

    def cleared_outside(self) -> None:
        """Touched params whose ``.grad`` was cleared from outside (``model.zero_grad()``) since
        the window was shown: the rule of the wrapper's own ``zero_grad()`` applies."""
        if not self._shown:
            return
        cleared = [p for p in self.params if p.grad is None and self.window.holds(p)]
        if self.window.cleared(cleared):
            self.events.window_dropped()

    def notice_clears(self) -> None:
        """A clear from outside since the window was shown applies now, before a call that
        changes the window (``add_weight``): a weight reported after the clear belongs to the
        window after it, as natively (the flat intake's rule)."""
        self.settle()
        if not self._active:  # (inside a backward the wrapper hides nothing here: no views)
            self.cleared_outside()

    def absorb_assigned(self) -> None:
        """A ``.grad`` the user assigned (not the window) is what p's gradient means now;
        one cleared from outside is dropped on the wrapper's ``zero_grad()`` rule."""
        self.settle()
        self.cleared_outside()
        for i, (p, shown) in enumerate(zip(self.params, self.views)):
            g = p.grad
            if g is None or g is shown:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            if local.shape != self.storage.views[i].shape:
                raise ValueError(f"an assigned .grad of shape {tuple(local.shape)} does not fit "
                                 f"the local shard {tuple(self.storage.views[i].shape)}")
            with torch.no_grad():
                self.storage.views[i].copy_(local)
            self.window.touch([p])
            p.grad = shown

    def move_unmoved(self) -> None:
        self.absorb_assigned()

    def take_in(self) -> None:
        self.absorb_assigned()


def _forward_hook(intake_ref):
    def hook(module, args, output):
        if not torch.is_grad_enabled():
            return
        tensors = [t for t in flat_leaves(output)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:
            torch.autograd.graph.register_multi_grad_hook(tensors, _begin_hook(intake_ref),
                                                          mode="any")
    return hook


def _pre_forward_hook(parts):
    parts = weakref.ref(parts)

    def hook(module, args):
        live = parts()
        if live is not None:
            live.sync.forward_begins()
    return hook


def _begin_hook(intake_ref):
    def hook(grad):
        intake = intake_ref()
        if intake is not None:
            intake.begin()
    return hook


def _post_hook(intake_ref, i: int):
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.arrived(i)
    return hook
