"""The window's 2-norm from the kernels that wrote it (issue 20: the norm for free).

With ``max_grad_norm`` every fused launch into the window also writes the squared L2 norm of
each param's view as it leaves the kernel (``accumulate_(..., norm_sq=...)``: one FMA per
element on values already in registers), into one slot per param. A param's last launch is its
final value, so at the step the window's norm is the sum of the slots of the params the window
touched: no pass over the window.

The slots describe the window only while nothing else wrote to it. Every write through a view
of the buffer bumps the buffer's version counter (views share it), so the version is recorded
after each launch and checked before the next one and at the step: a user's in-place change of
``p.grad``, ``zero_grad(set_to_none=False)``, an assigned gradient taken in, a fused weight
gradient, a rescale at the step, all make the step compute the norm with a pass instead, as
does a window reduced across ranks (DDP, ``process_group``) or spread over several devices.
"""

from __future__ import annotations

import torch


class WindowNorm:
    """Per-param squared-norm slots for one buffer, and whether they still describe it."""

    def __init__(self, buffer, enabled: bool):
        self.buffer = buffer
        flats = list(buffer.buffers.values())
        self.enabled = enabled and len(flats) == 1
        self.slots = torch.zeros(len(buffer.params), device=flats[0].device) \
            if self.enabled else None
        self._versions: list[int] | None = None
        self._valid = True

    def _current(self) -> list[int]:
        return [flat._version for flat in self.buffer.buffers.values()]

    def for_launch(self) -> torch.Tensor | None:
        """The slots a launch writes (None: not tracked); checks nobody wrote in between."""
        if not self.enabled or not self._valid:
            return None
        if self._versions is not None and self._versions != self._current():
            self._valid = False  # written from outside since our last launch
            return None
        return self.slots

    def launched(self) -> None:
        if self.enabled and self._valid:
            self._versions = self._current()

    def reset(self) -> None:
        """A new window: nothing launched yet."""
        self._versions, self._valid = None, True

    def norm(self, touched: list[torch.Tensor]) -> torch.Tensor | None:
        """The window's 2-norm from the slots of the ``touched`` params, or None if the slots
        do not describe the window (then the caller computes it)."""
        if not self.enabled or not self._valid or self._versions != self._current():
            return None
        if not touched:
            return None
        index = torch.tensor([self.buffer.norm_index(p) for p in touched],
                             device=self.slots.device)
        return self.slots.index_select(0, index).sum().sqrt()


class NoNorm:
    """No tracking (no ``max_grad_norm``, or a room with its own intake such as FSDP2's)."""

    enabled = False

    def for_launch(self) -> None:
        return None

    def launched(self) -> None:
        pass

    def reset(self) -> None:
        pass

    def norm(self, touched: list[torch.Tensor]) -> None:
        return None


NO_NORM = NoNorm()
