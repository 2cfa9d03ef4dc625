"""Module patching and the public ``fuse_wgrad_accumulation(model, optimizer) -> handle``.

A layer is eligible when its weight has a gradient slot (accumkernels.slot) whose owner is the
given optimizer; nothing here knows the optimizer's class.
"""

from __future__ import annotations

import itertools
import types
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from accumkernels.slot import GradSlot, get_slot

from .function import FusedLayer, FusedLinear, gradient_node
from .gemms import GEMM_BACKENDS, LOW_PRECISION

__all__ = ["WgradFusionHandle", "fuse_wgrad_accumulation"]

# Patched module -> its FusedLayer. Weak: a patched module that is dropped is simply forgotten.
_PATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fused_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    layer = _PATCHED.get(module)
    weight = module.weight
    if (layer is None or not weight.requires_grad or not torch.is_grad_enabled()
            or torch.compiler.is_compiling()):
        # Removed patch, frozen weight, inference, torch.compile: the usual path.
        return F.linear(input, weight, module.bias)
    slot = layer.live_slot(weight)
    if slot is None:  # replaced weight, or its window is no longer the optimizer's: usual path
        return F.linear(input, weight, module.bias)
    bias = module.bias
    device_type = input.device.type
    if _autocast_enabled(device_type):
        # What autocast does for linear: run it in the autocast dtype. Cast here so the
        # function (and the fused GEMM) sees the low-precision tensors.
        dtype = torch.get_autocast_dtype(device_type)
        input = input.to(dtype) if input.is_floating_point() else input
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return FusedLinear.apply(input, weight, bias, layer, slot, gradient_node(module.weight))


# Pickling a patched module stores its forward as getattr(module, "forward"): the class forward.
_fused_forward.__name__ = "forward"


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # very old torch: no device argument
        return device_type == "cuda" and torch.is_autocast_enabled()


def _bound_here(module: nn.Module) -> bool:
    """Whether the instance-level forward of ``module`` is our forward bound to it."""
    current = module.__dict__.get("forward")
    return (isinstance(current, types.MethodType) and current.__func__ is _fused_forward
            and current.__self__ is module)


class WgradFusionHandle:
    """Returned by :func:`fuse_wgrad_accumulation`; ``remove()`` restores the layers."""

    def __init__(self, layers: dict[str, FusedLayer], backend: str):
        self._layers = layers
        self.backend = backend
        self._removed = False

    @property
    def num_layers(self) -> int:
        """Number of ``nn.Linear`` layers patched."""
        return len(self._layers)

    @property
    def layer_names(self) -> list[str]:
        """Qualified names (in the model) of the patched layers."""
        return list(self._layers)

    @property
    def gemm_backends(self) -> dict[str, str]:
        """``"<device> <dtype>" -> GEMM implementation`` chosen so far (probed at fuse time)."""
        out = {}
        for layer in self._layers.values():
            for (device, dtype), name in layer.gemms.items():
                out[f"{device} {str(dtype).removeprefix('torch.')}"] = name
        return out

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Restore every patched layer's forward (idempotent). Graphs already built keep writing."""
        if self._removed:
            return
        for layer in self._layers.values():
            module = layer.module
            if _PATCHED.get(module) is layer:
                del _PATCHED[module]
            if _bound_here(module):
                del module.forward
        self._removed = True

    def __enter__(self) -> WgradFusionHandle:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{self.num_layers} layers"
        return f"WgradFusionHandle({state}, backend={self.backend!r})"


# --- what gets fused ------------------------------------------------------------------------------

def _owned_slot(model: nn.Module, optimizer: object) -> GradSlot | None:
    """A gradient slot ``optimizer`` owns, on a param of ``model`` or of its param groups (an
    owner with master weights steps fp32 copies: its groups do not hold the model's params)."""
    groups = getattr(optimizer, "param_groups", None) or ()
    grouped = (p for g in groups if isinstance(g, dict) for p in g.get("params", ()))
    for p in itertools.chain(model.parameters(), grouped):
        slot = get_slot(p) if isinstance(p, torch.Tensor) else None
        if slot is not None and slot.owner is optimizer:
            return slot
    return None


def _check_arguments(model: object, optimizer: object, backend: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_wgrad_accumulation: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    slot = _owned_slot(model, optimizer)
    if slot is None:
        raise TypeError("fuse_wgrad_accumulation: optimizer must own the fp32 gradient window of "
                        "the model's params (an AccumulatingOptimizer wrapping them attaches its "
                        f"gradient slots to them); got {type(optimizer).__name__}, which owns none")
    slot.check_fusable()  # ValueError, e.g. nonfinite='skip_microbatch'
    if backend != "auto" and backend not in GEMM_BACKENDS:
        raise ValueError(f"fuse_wgrad_accumulation: backend must be 'auto' or one of "
                         f"{', '.join(map(repr, GEMM_BACKENDS))}; got {backend!r}")


def _eligible(module: nn.Module, optimizer: object) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is not nn.Linear.forward:  # a subclass with its own forward
        return False
    if "forward" in module.__dict__ and not (_bound_here(module) and module not in _PATCHED):
        # Someone else patched this instance. (Our forward bound here but not registered is a
        # copy.deepcopy of a fused module: it runs the plain path and may be fused anew.)
        return False
    w = module.weight
    if not (type(w) is nn.Parameter and w.layout == torch.strided and w.is_floating_point()
            and w.requires_grad and w.dim() == 2):
        return False
    slot = get_slot(w)
    return slot is not None and slot.owner is optimizer


def _find_layers(model: nn.Module, optimizer: object) -> dict[str, nn.Linear]:
    found: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if module in _PATCHED:
            raise RuntimeError(f"fuse_wgrad_accumulation: layer {name or '<model>'!r} is already "
                               "fused; call remove() on its handle first")
        if _eligible(module, optimizer):
            found[name] = module
    return found


def _prepare(module: nn.Linear, optimizer: object, backend: str) -> FusedLayer:
    """A FusedLayer with its GEMMs resolved (on CUDA: probed) now, not in mid-backward.

    Auto: the weight dtype, and on CUDA the autocast dtypes too. An explicit backend must work
    for the weight dtype, or for bf16 when the weights are fp32 (it then serves autocast).
    """
    w = module.weight
    layer = FusedLayer(module, w, weakref.ref(optimizer), backend)
    if backend == "auto":
        dtypes = {w.dtype} | (set(LOW_PRECISION) if w.device.type == "cuda" else set())
    else:
        dtypes = {w.dtype if w.dtype in LOW_PRECISION else torch.bfloat16}
    for dtype in dtypes:
        layer.gemm_for(w.device, dtype)
    return layer


def fuse_wgrad_accumulation(model: nn.Module, optimizer: object, *,
                            backend: str = "auto") -> WgradFusionHandle:
    """Compute the weight gradient of every managed ``nn.Linear`` straight into its fp32 window.

    Patched: each ``nn.Linear`` in ``model`` (plain ``nn.Linear.forward``, not already patched
    at instance level) whose weight requires grad and has a gradient slot owned by ``optimizer``
    (an :class:`~accumkernels.AccumulatingOptimizer` attaches one to every param it manages).
    Its backward computes ``main_grad (+)= scale * dy^T x`` as one GEMM with fp32 accumulation
    and output, ``beta=0`` on the window's first write; the input and bias gradients take the
    usual path. Other layers and params are untouched. Inputs with more than 2 dims are
    flattened over the leading dims. Under ``torch.no_grad()``/inference and under
    ``torch.compile`` a patched layer runs the plain ``F.linear`` (unfused), as it does once its
    weight's slot is no longer ``optimizer``'s (the optimizer is gone, or another took the
    param over). Under autocast it runs in the autocast dtype, as native linear does.

    ``backend``: ``"auto"`` or one of :data:`GEMM_BACKENDS` (see the package docstring); checked
    (and on CUDA probed) now for the layers' devices.

    Returns a handle: ``num_layers`` (how many were patched; 0 gives a ``UserWarning``),
    ``layer_names``, ``gemm_backends``, ``remove()`` (restores the layers; idempotent; also a
    context manager).

    Raises ``TypeError`` for a model that is not an ``nn.Module`` or an optimizer that owns no
    gradient slot (on the model's params or its own); ``ValueError`` when the owner cannot take
    fused writes (``nonfinite='skip_microbatch'``: a fused write cannot be undone) or for an
    unknown/unusable backend; ``RuntimeError`` if a layer of ``model`` is already fused
    (``remove()`` it first).

    Not supported: double backward through a fused weight's gradient (``create_graph=True``
    gives correct input gradients, but the weight-gradient write is not differentiable), tensor
    hooks on a fused weight (they see no gradient), and autocast's weight-cast cache (a layer
    called several times per forward under autocast casts its weight each time).
    """
    _check_arguments(model, optimizer, backend)
    layers = {name: _prepare(module, optimizer, backend)
              for name, module in _find_layers(model, optimizer).items()}
    if not layers:
        warnings.warn("fuse_wgrad_accumulation: no nn.Linear in the model has a weight managed "
                      "by this optimizer (that requires grad); nothing was fused",
                      UserWarning, stacklevel=2)
    for layer in layers.values():
        _PATCHED[layer.module] = layer
        layer.module.forward = types.MethodType(_fused_forward, layer.module)
    return WgradFusionHandle(layers, backend)
