"""The gradient-slot protocol: how a kernel that computes a weight gradient itself writes it into
the fp32 window without knowing who owns the window.

Megatron's fused wgrad layers know only parameter attributes (``param.main_grad``,
``grad_added_to_main_grad``), never the optimizer class; this is the same idea. An owner (the
``AccumulatingOptimizer``) sets, on every param it manages:

* ``p.main_grad``: the param's fp32 master gradient (a view of the flat buffer);
* ``p.accumkernels_slot``: a :class:`GradSlot`.

In backward, instead of returning a gradient for ``p``, a fused kernel calls
``slot.claim(p)`` and gets a :class:`SlotWrite`; it then computes, in fp32,
``view = (0 if overwrite else view) + scale * grad`` and, when ``found_inf`` is not None, sets
it to 1.0 if that gradient is non-finite. The owner counts the micro-batch at the end of the
backward like any other.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

import torch

__all__ = ["SLOT_ATTR", "GradSlot", "SlotWrite", "get_slot"]

SLOT_ATTR = "accumkernels_slot"


class SlotWrite(NamedTuple):
    """Where and how to write one gradient of the current micro-batch."""

    view: torch.Tensor  # fp32, p's shape and memory layout (its strides when p is dense)
    scale: float  # multiply the gradient by this before adding
    overwrite: bool  # first write of the window: ignore what view holds
    found_inf: torch.Tensor | None  # 1-element fp32 flag to set on a non-finite gradient


@runtime_checkable
class GradSlot(Protocol):
    """What an owner attaches to each managed param as ``p.accumkernels_slot``."""

    @property
    def owner(self) -> object | None:
        """The object that owns the window (None once it is gone)."""

    def check_fusable(self) -> None:
        """Raise ``ValueError`` if fused writes cannot be used with this owner's settings."""

    def claim(self, p: torch.Tensor) -> SlotWrite:
        """Called in backward in place of producing ``p``'s gradient."""


def get_slot(p: torch.Tensor) -> GradSlot | None:
    """p's slot, or None if no live owner manages p."""
    slot = getattr(p, SLOT_ATTR, None)
    if slot is None or slot.owner is None:
        return None
    return slot
