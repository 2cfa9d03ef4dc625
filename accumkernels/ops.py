"""The public op ``accumulate_``: validation, backend dispatch, torch.library registration.

``accumulate_`` checks every argument before anything is written, resolves the backend, and
calls the custom op ``torch.ops.accumkernels.accumulate_``, whose schema declares that it
mutates ``dst`` and ``found_inf`` (so torch.compile and functionalisation treat it correctly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from accumkernels import backends

__all__ = ["accumulate_", "available_backends"]

SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run ``accumulate_`` on ``device``, fastest first."""
    return backends.available_backends(device)


@torch.library.custom_op("accumkernels::accumulate_", mutates_args=("dst", "found_inf"))
def _accumulate_op(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
    backend: str,
) -> None:
    _accumulate_impl(dst, src, scale, scale_tensor, overwrite, found_inf, backend)


def _accumulate_impl(dst, src, scale, scale_tensor, overwrite, found_inf, backend) -> None:
    # Empty tensors carry no work; dropping them here keeps every backend branch-free.
    if not all(d.numel() for d in dst):
        pairs = [(d, x) for d, x in zip(dst, src) if d.numel() > 0]
        if not pairs:
            return
        dst, src = (list(t) for t in zip(*pairs))
    backends.get(backend).accumulate(dst, src, scale, scale_tensor, overwrite, found_inf)


@_accumulate_op.register_fake
def _accumulate_fake(dst, src, scale, scale_tensor, overwrite, found_inf, backend) -> None:
    return None


def _fail(kind: type[Exception], message: str) -> None:
    raise kind(f"accumulate_: {message}")


def _check_tensor_list(name: str, tensors: object) -> list[torch.Tensor]:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        _fail(TypeError, f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            _fail(TypeError, f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    return list(tensors)


def _pairs_ok(dst: list[torch.Tensor], src: list[torch.Tensor], device: torch.device) -> bool:
    """All checks of _check_pairs, one property per pass: the fast path for valid input."""
    strided, f32 = torch.strided, torch.float32
    return (
        all(d.layout is strided for d in dst) and all(x.layout is strided for x in src)
        and all(d.dtype is f32 for d in dst) and all(x.dtype in SRC_DTYPES for x in src)
        and all(d.shape == x.shape for d, x in zip(dst, src))
        and all(d.device == device for d in dst) and all(x.device == device for x in src)
        and all(d.is_contiguous() for d in dst) and all(x.is_contiguous() for x in src)
    )


def _check_pairs(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    device = dst[0].device
    if _pairs_ok(dst, src, device):
        return
    for i, (d, x) in enumerate(zip(dst, src)):  # find and name the first offender
        if d.layout != torch.strided or x.layout != torch.strided:
            which = "dst" if d.layout != torch.strided else "src"
            _fail(TypeError, f"{which}[{i}] is sparse ({(d if which == 'dst' else x).layout}); "
                  "only dense (strided) tensors are supported")
        if d.dtype != torch.float32:
            _fail(TypeError, f"dst[{i}] has dtype {d.dtype}; expected torch.float32")
        if x.dtype not in SRC_DTYPES:
            _fail(TypeError, f"src[{i}] has dtype {x.dtype}; expected float32, bfloat16 or float16")
        if d.shape != x.shape:
            _fail(ValueError, f"src[{i}] has shape {tuple(x.shape)} but dst[{i}] has shape "
                  f"{tuple(d.shape)}")
        if d.device != device:
            _fail(ValueError, f"dst[{i}] is on {d.device} but dst[0] is on {device}; "
                  "all tensors of one call must be on one device")
        if x.device != device:
            _fail(ValueError, f"src[{i}] is on {x.device} but dst[{i}] is on {device}")
        if not d.is_contiguous():
            _fail(ValueError, f"dst[{i}] is not contiguous")
        if not x.is_contiguous():
            _fail(ValueError, f"src[{i}] is not contiguous")


def _check_dst_aliasing(dst: list[torch.Tensor]) -> None:
    """No two dst may share memory: one kernel writes them all, in no particular order."""
    spans = sorted(
        (d.data_ptr(), d.data_ptr() + d.numel() * d.element_size(), i)
        for i, d in enumerate(dst)
        if d.numel() > 0
    )
    for (_, end_a, i), (start_b, _, j) in zip(spans, spans[1:]):
        if start_b < end_a:
            i, j = sorted((i, j))
            _fail(ValueError, f"dst[{j}] overlaps dst[{i}] in memory; each dst must be distinct")


def _check_device_scalar(name: str, t: torch.Tensor, device: torch.device) -> None:
    if t.dtype != torch.float32 or t.numel() != 1:
        _fail(TypeError, f"{name} must be a 1-element float32 tensor, got dtype {t.dtype} with "
              f"{t.numel()} elements")
    if t.device != device:
        _fail(ValueError, f"{name} is on {t.device} but the tensors are on {device}")


def accumulate_(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    scale: float | torch.Tensor = 1.0,
    *,
    overwrite: bool = False,
    found_inf: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """In place, in fp32: ``dst[i] = (0 if overwrite else dst[i]) + scale * float32(src[i])``.

    One fused launch for the whole list (per src dtype on Triton). ``scale`` is a Python float or
    a 1-element float32 tensor on the device (read by the kernel: no host sync). ``found_inf``,
    if given, is a 1-element float32 tensor set to 1.0 when any ``src`` element is inf/NaN
    (never reset; ``dst`` is written all the same). Every argument is validated before anything
    is written; errors name the offending index.
    """
    dst = _check_tensor_list("dst", dst)
    src = _check_tensor_list("src", src)
    if len(dst) != len(src):
        _fail(ValueError, f"dst has {len(dst)} tensors but src has {len(src)}")
    if not isinstance(backend, str):
        _fail(TypeError, f"backend must be a string, got {type(backend).__name__}")
    if backend != "auto" and backend not in backends.BACKENDS:
        _fail(ValueError, f"unknown backend {backend!r}; choose from 'auto', "
              + ", ".join(repr(b) for b in backends.BACKENDS))
    if not isinstance(overwrite, bool):
        _fail(TypeError, f"overwrite must be a bool, got {type(overwrite).__name__}")

    scale_tensor = None
    if isinstance(scale, torch.Tensor):
        scale_tensor, scale = scale, 1.0
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail(TypeError, f"scale must be a float or a float32 tensor, got {type(scale).__name__}")
    elif not math.isfinite(scale):
        _fail(ValueError, f"scale must be finite, got {scale}")
    if found_inf is not None and not isinstance(found_inf, torch.Tensor):
        _fail(TypeError, f"found_inf must be a tensor or None, got {type(found_inf).__name__}")
    if not dst:
        return

    _check_pairs(dst, src)
    device = dst[0].device
    if scale_tensor is not None:
        _check_device_scalar("scale", scale_tensor, device)
    if found_inf is not None:
        _check_device_scalar("found_inf", found_inf, device)
    if not torch.compiler.is_compiling():  # data_ptr() is not traceable
        _check_dst_aliasing(dst)
    name = backends.resolve(backend, device)
    if _plain_eager():  # nothing to trace or functionalise: skip the dispatcher's per-call cost
        _accumulate_impl(dst, src, float(scale), scale_tensor, overwrite, found_inf, name)
    else:
        torch.ops.accumkernels.accumulate_(
            dst, src, float(scale), scale_tensor, overwrite, found_inf, name
        )


def _plain_eager() -> bool:
    """No compiler, dispatch mode (FakeTensorMode, make_fx) or functorch transform is active."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._are_functorch_transforms_active())
