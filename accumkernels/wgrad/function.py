"""The autograd Function of a fused layer: ``F.linear`` whose backward writes the weight gradient
into the param's gradient slot (accumkernels.slot) and returns None for it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from accumkernels.slot import GradSlot, get_slot

from . import gemms

__all__ = ["PROFILE_LABEL", "FusedLayer", "FusedLinear", "gradient_node", "write_weight_gradient"]

# The profiler range around each fused write (claim, GEMM, finiteness check).
PROFILE_LABEL = "accumkernels::wgrad_gemm"


@dataclass(eq=False)
class FusedLayer:
    """What a patched layer needs in forward and backward."""

    module: nn.Linear
    param: nn.Parameter  # the weight as its slot's owner knows it
    owner: weakref.ref  # the optimizer the layer was fused for (held weakly, like a slot does)
    backend: str  # requested GEMM backend ("auto" or a name)
    gemms: dict = field(default_factory=dict)  # (device, dtype) -> resolved name

    def gemm_for(self, device: torch.device, dtype: torch.dtype) -> str:
        key = (device, dtype)
        name = self.gemms.get(key)
        if name is None:
            name = self.gemms[key] = gemms.resolve(self.backend, device, dtype)
        return name

    def live_slot(self, weight: torch.Tensor) -> GradSlot | None:
        """The weight's slot if the layer may write through it now: same weight, and its slot's
        owner is still the optimizer it was fused for. Else None (the usual path)."""
        if weight is not self.param:
            return None
        slot = get_slot(weight)
        if slot is None or slot.owner is not self.owner():
            return None
        return slot


def write_weight_gradient(layer: FusedLayer, slot: GradSlot, dy2: torch.Tensor,
                          x2: torch.Tensor) -> None:
    """Claim the weight's slot and write ``(0 if overwrite else view) + scale * dy2^T x2``."""
    with torch.no_grad(), torch.profiler.record_function(PROFILE_LABEL):
        view, scale, overwrite, found_inf = slot.claim(layer.param)
        name = layer.gemm_for(dy2.device, dy2.dtype)
        if not gemms.GEMMS[name](view, dy2, x2, scale, overwrite, found_inf):
            gemms.flag_nonfinite(view, found_inf)


def gradient_node(t: torch.Tensor):
    """The autograd node that receives t's gradient (AccumulateGrad for a leaf)."""
    try:
        return torch.autograd.graph.get_gradient_edge(t).node
    except (AttributeError, RuntimeError):
        return t.view_as(t).grad_fn.next_functions[0][0]


def _weight_gradient_wanted(node) -> str:
    """How this backward wants the weight's gradient: "write", "return" or "skip".

    ``loss.backward()`` (or ``backward(inputs=...)`` naming the weight): accumulate it ->
    "write". ``torch.autograd.grad(..., inputs=[..., weight])``: the caller wants it returned and
    ``.grad``/the window untouched -> "return". A backward that does not reach the weight
    (``autograd.grad`` w.r.t. inputs only, ``backward(inputs=...)`` without it) -> "skip".
    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will_execute is None:
        return "write"
    try:
        return "write" if will_execute(node) else "skip"
    except RuntimeError:  # raised for a leaf that torch.autograd.grad captures
        return "return"


class FusedLinear(torch.autograd.Function):
    """``F.linear`` whose backward writes the weight gradient into the slot (returns None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, slot, node):
        ctx.layer, ctx.slot, ctx.node = layer, slot, node
        ctx.has_bias = bias is not None
        # Like native linear: x is needed for the weight gradient, the weight for the input's.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              weight if ctx.needs_input_grad[0] else None)
        ctx.x_shape = x.shape
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = dy2.mm(weight).view(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.sum(0)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            mode = _weight_gradient_wanted(ctx.node)
            if mode == "write":
                write_weight_gradient(ctx.layer, ctx.slot, dy2, x2)
            elif mode == "return":
                grad_w = dy2.t().mm(x2)
        return grad_x, grad_w, grad_b, None, None, None
