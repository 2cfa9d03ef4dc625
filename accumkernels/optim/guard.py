"""The wrapper's picture of the user's world, and where it is re-checked.

The window caches what the model looked like when it was built: each param's dtype and device,
and the fp32 view object that serves as its ``p.grad`` (whose storage the launch plans write).
Users change that world between calls: ``model.zero_grad()`` / ``p.grad = None``, ``model.double()
.float()`` or ``.cpu().cuda()`` (which swap the ``.data`` of every ``.grad``, our views
included), ``model.half()``, ``model.share_memory()`` (which moves the buffer's storage).

Where it is checked:

* per gradient, in the tensor pre-hook that runs anyway (:meth:`Guard.before_grad`): the param's
  dtype and device, the view's data pointer, sparse and graph-carrying gradients: a few
  attribute reads per param, no extra pass;
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
* a param whose dtype or device changed after the wrapper was built: ``ValueError``, raised
  before anything of the micro-batch is counted or written.
"""

from __future__ import annotations

import torch


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

    # -- per gradient (hot path) ------------------------------------------------------------
    def before_grad(self, i: int, grad: torch.Tensor) -> None:
        """Checks for param i before its gradient lands; raises before anything is counted."""
        intake = self.intake
        p = intake.params[i]
        if p.dtype is not self.dtypes[i] or p.device != self.devices[i]:
            self._raise_changed(i)
        if grad.layout is not torch.strided:
            raise ValueError(f"{self._name(i)} got a {grad.layout} gradient (e.g. "
                             "nn.Embedding(sparse=True)); the fp32 window holds dense gradients "
                             "only: use sparse=False, or train without AccumulatingOptimizer")
        g = p.grad
        if g is None:
            if self.shown and intake.is_touched(p):
                self.cleared_outside()
        elif g is intake.views[i] and g.data_ptr() != self.ptrs[i]:
            self.check_views()

    # -- whole (at the wrapper's calls) -----------------------------------------------------
    def check_all(self) -> None:
        """Every param: dtype/device unchanged, views aliasing the buffer, outside clears."""
        intake = self.intake
        for i, p in enumerate(intake.params):
            if p.dtype is not self.dtypes[i] or p.device != self.devices[i]:
                self._raise_changed(i)
        self.check_views()
        if self.shown:
            self.cleared_outside()

    def check_views(self) -> None:
        """Views whose ``.data`` was swapped take their values back into the buffer."""
        intake = self.intake
        for i, view in enumerate(intake.views):
            if view.data_ptr() == self.ptrs[i]:
                continue
            flat = self.flats[self.devices[i]]
            if view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                self.ptrs[i] = view.data_ptr()  # the buffer itself moved (share_memory_)
                continue
            p = intake.params[i]
            slot = flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)
            if view.dtype != torch.float32 or view.device != slot.device \
                    or view.shape != slot.shape:
                self._raise_changed(i)
            with torch.no_grad():
                if intake.is_touched(p):
                    slot.copy_(view)
                view.data = slot
            self.ptrs[i] = view.data_ptr()

    def cleared_outside(self) -> None:
        """Touched params whose ``.grad`` is None although the wrapper showed their views."""
        intake = self.intake
        owner = intake._owner()
        touched = owner._window.touched
        cleared = [p for p in intake.params if p.grad is None and id(p) in touched]
        if not cleared:
            return
        if owner._keeps_window():
            self.shown = False  # kept, as by opt.zero_grad(); shown again after the backward
            return
        if len(cleared) == len(touched):
            owner._reset_window()
        else:
            touched.difference_update(id(p) for p in cleared)

    def _name(self, i: int) -> str:
        p = self.intake.params[i]
        owner = self.intake._owner()
        names = owner._names if owner is not None else {}
        return names.get(id(p), f"param {i} (shape {tuple(p.shape)})")

    def _raise_changed(self, i: int) -> None:
        p = self.intake.params[i]
        raise ValueError(
            f"{self._name(i)} is now {p.dtype} on {p.device}, but was {self.dtypes[i]} on "
            f"{self.devices[i]} when the AccumulatingOptimizer was built (the model was cast or "
            "moved after wrapping, e.g. model.half() or model.to(device)). Cast and move the "
            "model first, then build the optimizer and the wrapper")
