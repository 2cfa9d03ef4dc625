"""The wrapper's picture of the user's world, and where it is re-checked.

The window caches what the model looked like when it was built: each param's dtype and device,
and the fp32 view object that serves as its ``p.grad`` (whose storage the launch plans write).
Users change that world between calls: ``model.zero_grad()`` / ``p.grad = None``, ``model.double()
.float()`` or ``.cpu().cuda()`` (which swap the ``.data`` of every ``.grad``, our views
included), ``model.half()``, ``model.share_memory()`` (which moves the buffer's storage).

Where it is checked:

* once per backward, when its first hook runs (:meth:`Guard.check_backward`): every param's
  dtype, device and layout and every view's data pointer, read in one pass of the tensor
  reader and compared with what they were when last found right (the Python rules when they
  differ or cannot be read); a sparse gradient is refused where the post-accumulate hook takes
  it (:meth:`Guard.refuse_layout`);
* whole, at the wrapper's own calls (``step``, ``zero_grad``, ``state_dict``, ...):
  :meth:`Guard.check_all`, O(params) Python like the native ``zero_grad``;
* the launch plans re-validate their buffer storage themselves, once per launch.

What a change means:

* a ``.grad`` cleared from outside means what the wrapper's own ``zero_grad()`` means for
  those params (a window still filling with ``accumulation_steps=N`` is kept; otherwise
  their gradients are dropped, the whole window when every accumulated param was cleared);
* a view whose ``.data`` was swapped, to a copy of the same dtype and device (a dtype or
  device round trip): its current values are taken back into the buffer and it aliases the
  buffer again, as native ``.grad`` would hold those values;
* a param moved to another device after the wrapper was built (``model.to(device)`` after
  wrapping: the HF Trainer's ``optimizers=``, "wrap before ``prepare``"): the wrapper follows
  it (:func:`follow_move`) before anything of the micro-batch lands: the window (with what it
  holds), the master weights and the inner optimizer's state move with the params, and the
  launch plans are rebuilt for the new storage (nothing is written through the old pointers);
* a param whose layout changed (``p.data = p.data.t()``, ``model.to(memory_format=...)``
  after wrapping): its view and master take the new layout (:meth:`Guard.relayout`), so the
  kernels, the masters and the inner optimizer pair the same elements as natively;
* a param whose dtype changed after the wrapper was built (``model.half()``): ``ValueError``,
  raised before anything of the micro-batch is counted or written.
"""

from __future__ import annotations

import sys

import torch

from accumkernels.buffer import grad_strides
from accumkernels.ops import host
from accumkernels.ops.host import metas_same, metas_snapshot


class Guard:
    """Expected dtype/device/view pointer per param; the checks and what they lead to."""

    def __init__(self, intake):
        self.intake = intake
        self.dtypes = [p.dtype for p in intake.params]
        self.devices = [p.device for p in intake.params]
        self.ptrs = [v.data_ptr() for v in intake.views]
        self.flats = {dev: flat for dev, flat in intake.buffer.buffers.items()}
        self.offsets = [v.storage_offset() - self.flats[v.device].storage_offset()
                        for v in intake.views]
        self.shown = False  # the views were put in p.grad and not hidden by the wrapper since
        self.strides = [p.stride() for p in intake.params]  # each param's layout, and where
        self.places = [p.data_ptr() for p in intake.params]  # it lay when it was last seen
        # what check_backward reads in one pass: the params and the views, as last found right
        self._watched = list(intake.params) + list(intake.views)
        self._record = b""

    # -- once per backward (hot path) ----------------------------------------------------------
    def check_backward(self) -> None:
        """At a backward's begin, before anything of it lands: the intake's hooks in order among
        post-accumulate hooks the user registered since (``HookOrder.look``); every param's
        dtype, device and layout unchanged and every view aliasing the buffer (else follow,
        relayout or raise, as :meth:`check_all`; outside clears are looked for by the intake).
        The facts are read again each time: one pass of the tensor reader compares them with
        the record of the last time they were found right (``ops.host.metas_same``); anything
        it cannot read, or any difference, takes the Python checks, which then record the new
        facts."""
        self.intake.order.look()  # (a post-accumulate hook the user registered since)
        watched = self._watched
        if metas_same(watched, self._record):
            return
        self._check_layouts()
        if self.intake.guard is self:  # (a followed move made a new guard: it records its own)
            self._record = metas_snapshot(watched, len(self.dtypes))  # (views: their address)

    def refuse_layout(self, i: int, grad: torch.Tensor) -> None:
        """Param i got a sparse (non-strided) gradient: the window holds dense ones only."""
        raise ValueError(f"{self._name(i)} got a {grad.layout} gradient (e.g. "
                         "nn.Embedding(sparse=True)); the fp32 window holds dense gradients "
                         "only: use sparse=False, or train without AccumulatingOptimizer")

    # -- whole (at the wrapper's calls) -----------------------------------------------------
    def check_all(self) -> None:
        """Every param: dtype/device unchanged, views aliasing the buffer, outside clears."""
        self._check_layouts()
        if self.shown:
            self.cleared_outside()

    def _check_layouts(self) -> None:
        """Every param's dtype, device and layout, and the views' data (the Python rules)."""
        for i, (p, dtype, device, stride) in enumerate(zip(self.intake.params, self.dtypes,
                                                           self.devices, self.strides)):
            if p.dtype is not dtype or p.device != device:
                self._changed(i)
                return
            if p.stride() != stride:
                self.relayout(i)
        self.check_views()

    def relayout(self, i: int) -> None:
        """Param i's layout changed (``p.data = p.data.t()``, ``.to(memory_format=...)``): its
        view and master take the new one (``MasterGradBuffer.relayout``,
        ``MasterWeights.relayout``), so each still pairs with p element by element in memory."""
        intake = self.intake
        p = intake.params[i]
        same_memory = p.data_ptr() == self.places[i]
        self.strides[i], self.places[i] = p.stride(), p.data_ptr()
        relayout = getattr(intake.buffer, "relayout", None)  # (FSDP2 shards keep theirs)
        if relayout is not None:
            relayout(p)
        intake.masters.relayout(p, same_memory)

    def check_views(self) -> None:
        """Views whose ``.data`` was swapped take their values back into the buffer."""
        intake = self.intake
        for i, (view, ptr) in enumerate(zip(intake.views, self.ptrs)):
            if view.data_ptr() == ptr:
                continue
            flat = self.flats[self.devices[i]]
            if view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                self.ptrs[i] = view.data_ptr()  # the buffer itself moved (share_memory_)
                continue
            p = intake.params[i]
            slot = flat.as_strided(p.shape, grad_strides(p),  # (its param's layout)
                                   flat.storage_offset() + self.offsets[i])
            if view.dtype != torch.float32 or view.device != slot.device \
                    or view.shape != slot.shape:
                self._raise_changed(i)
            with torch.no_grad():
                if intake.window.holds(p):
                    slot.copy_(view)
                view.data = slot
            self.ptrs[i] = view.data_ptr()

    def cleared_outside(self) -> None:
        """Touched params whose ``.grad`` is None although the wrapper showed their views."""
        intake = self.intake
        window = intake.window
        cleared = [p for p, held, shown in zip(intake.params, window.held(intake.params),
                                               intake.showable)
                   if held and shown is not None and p.grad is None]
        if not cleared:
            return
        if window.keeps_on_clear():
            self.shown = False  # kept, as by opt.zero_grad(); shown again after the backward
            return
        if window.cleared(cleared):
            intake.events.window_dropped()

    def _name(self, i: int) -> str:
        p = self.intake.params[i]
        return self.intake.names.get(id(p), f"param {i} (shape {tuple(p.shape)})")

    def _changed(self, i: int) -> None:
        """Param i's dtype or device is not what it was: follow a pure device move, else raise."""
        intake = self.intake
        dtypes_kept = all(p.dtype is d for p, d in zip(intake.params, self.dtypes))
        if not dtypes_kept or intake.sync.active or intake.pending:
            self._raise_changed(i)
        intake.events.params_moved()

    def _raise_changed(self, i: int) -> None:
        p = self.intake.params[i]
        raise ValueError(
            f"{self._name(i)} is now {p.dtype} on {p.device}, but was {self.dtypes[i]} on "
            f"{self.devices[i]} when the AccumulatingOptimizer was built (the model was cast "
            "after wrapping, e.g. model.half(), or moved in a data-parallel job or in the "
            "middle of a backward). Cast the model first, then build the optimizer and the "
            "wrapper")


@torch.no_grad()
def follow_move(parts, layout, intake) -> None:
    """The params moved to other devices: rebuild the window on their devices (carrying what it
    holds), move the master weights and the inner optimizer's state with them; the hooks stay."""
    window, masters, nonfinite = parts.window, parts.masters, parts.nonfinite
    old_devices = intake.guard.devices
    if any(d.type == "meta" for d in old_devices) and not window.empty:
        window.reset()  # a window on meta holds no values to carry
    held = {id(p): view.detach().clone() for p, view in zip(intake.params, intake.views)
            if window.holds(p)}
    masters.follow(old_devices, intake.params)
    _move_state(parts.optimizer, masters, intake.params, old_devices)
    for device in {p.device for p in parts.params}:  # an unusable backend fails here
        host.resolve(parts.config.backend, device)
    window.rebase(layout.storage(parts.params, parts.config))
    intake.rebase(window.storage)
    for p, view in zip(intake.params, intake.views):
        if id(p) in held:
            view.copy_(held[id(p)])
    device = next(iter(window.storage.buffers), nonfinite.found_inf.device)
    nonfinite.follow(device)


def _move_state(optimizer, masters, params: list, old_devices: list) -> None:
    """Tensors of the inner optimizer's state follow their param (``step`` counters stay
    where torch keeps them: on the CPU unless the optimizer is fused or capturable)."""
    keep_step = not any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    for p, old in zip(params, old_devices):
        if p.device == old:
            continue
        target = masters.get(p)
        target = target if target is not None else p
        for key, value in optimizer.state.get(target, {}).items():
            if not torch.is_tensor(value) or value.device != old:
                continue
            if key == "step" and keep_step and value.device.type == "cpu":
                continue
            optimizer.state[target][key] = value.to(p.device)


FORGOTTEN_LINE = (
    "AccumulatingOptimizer: a pipeline schedule ran a weight pass (the W action of "
    "InterleavedZeroBubble, ZBVZeroBubble, DualPipeV or a custom schedule with I/W actions) "
    "without this wrapper: it writes its weight gradients into .grad itself, past the fused "
    "accumulation, so the window would step wrongly. Nothing was stepped. Add the recipe's one "
    "line right after building this rank's stages, before the wrappers: "
    "accumkernels.integrations.pipelining.accumulate_weight_passes(stages), and start the "
    "training again")
_PIPELINING = "torch/distributed/pipelining/"


def pipeline_weight_pass() -> bool:
    """Whether a pipeline stage's weight pass runs (``torch.distributed.pipelining``'s
    ``backward_weight_one_chunk`` on a thread's stack: the hooks may run on an autograd device
    thread, the schedule on the caller's). One walk per thread, once per backward, made only
    outside ``weight_pass()``."""
    from accumkernels._torch_private import pipelining_imported
    if not pipelining_imported():
        return False  # (its code cannot be running before the module is imported)
    for frame in sys._current_frames().values():
        while frame is not None:
            code = frame.f_code
            if code.co_name == "backward_weight_one_chunk" \
                    and _PIPELINING in code.co_filename.replace("\\", "/"):
                return True
            frame = frame.f_back
    return False
