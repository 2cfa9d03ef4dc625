"""The weight-gradient GEMMs, the probe that checks one works, and the choice among them.

Every GEMM has the signature ``gemm(view, dy2, x2, scale, overwrite, found_inf) -> bool``:
``view`` (out, in) fp32, dense in its weight's layout (row-major, or transposed for a weight built
from a transposed view: every GEMM writes through the view's strides), ``dy2`` (K, out) and ``x2``
(K, in) in one dtype. It
computes ``view = (0 if overwrite else view) + scale * dy2^T x2`` in fp32 and returns True if it
already set ``found_inf`` for a non-finite result (else the caller runs :func:`flag_nonfinite`).
"""

from __future__ import annotations

import torch

from accumkernels._util import LOW_PRECISION, triton_usable

from .triton_gemm import gemm_triton

__all__ = ["AUTO_ORDER", "GEMMS", "GEMM_BACKENDS", "LOW_PRECISION", "available_gemm_backends",
           "flag_nonfinite", "resolve", "supported"]

GEMM_BACKENDS = ("addmm_out_dtype", "triton", "mm_out_dtype", "fp32")
AUTO_ORDER = {"cuda": ("addmm_out_dtype", "triton", "mm_out_dtype", "fp32")}


def gemm_addmm_out_dtype(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    """cuBLAS in place: ``addmm(out_dtype=float32)`` with an fp32 ``self`` (recent PyTorch)."""
    torch.addmm(view, dy2.t(), x2, out_dtype=torch.float32, beta=0.0 if overwrite else 1.0,
                alpha=scale, out=view)
    return False


def gemm_mm_out_dtype(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    """An fp32-output ``mm`` into a temporary, then one pass into the view."""
    tmp = torch.mm(dy2.t(), x2, out_dtype=torch.float32)
    if overwrite:
        torch.mul(tmp, scale, out=view)
    else:
        view.add_(tmp, alpha=scale)
    return False


def gemm_fp32(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    """An fp32 ``addmm`` in place on upcast inputs (bf16/fp16 values are exact in fp32)."""
    # beta=0 ignores view entirely (NaN/inf garbage from an earlier window included).
    torch.addmm(view, dy2.t().to(torch.float32), x2.to(torch.float32),
                beta=0.0 if overwrite else 1.0, alpha=scale, out=view)
    return False


GEMMS = {
    "addmm_out_dtype": gemm_addmm_out_dtype,
    "triton": gemm_triton,
    "mm_out_dtype": gemm_mm_out_dtype,
    "fp32": gemm_fp32,
}


def flag_nonfinite(view: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """found_inf = 1 if view holds inf/NaN; no host sync.

    Checking the accumulated view (not this micro-batch's gradient) is enough: inf and NaN
    survive every later addition (inf + -inf = NaN), and the first write of a window overwrites
    without reading, so a flag means this window's gradient is non-finite.
    """
    if found_inf is None or view.numel() == 0:
        return
    # max |v| is overflow-free and propagates NaN (CPU and CUDA reductions).
    bad = ~torch.isfinite(torch.linalg.vector_norm(view, float("inf")))
    found_inf.masked_fill_(bad.to(found_inf.device), 1.0)


# --- choosing an implementation -----------------------------------------------------------------

_support_cache: dict[tuple[str, str, torch.dtype], bool] = {}


def _probe(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Run ``name`` once on small data (both beta modes) and check it against float64."""
    gen = torch.Generator().manual_seed(0)
    k, m, n = 37, 20, 12
    dy = torch.randn(k, m, generator=gen).to(device, dtype)
    x = torch.randn(k, n, generator=gen).to(device, dtype)
    c0 = torch.randn(m, n, generator=gen).to(device)
    prod = dy.double().t() @ x.double()
    try:
        c = c0.clone()
        GEMMS[name](c, dy, x, 0.5, False, None)
        ok = torch.allclose(c.double(), c0.double() + 0.5 * prod, rtol=1e-5, atol=1e-5)
        c.fill_(float("nan"))
        GEMMS[name](c, dy, x, 0.5, True, None)
        ok = ok and torch.allclose(c.double(), 0.5 * prod, rtol=1e-5, atol=1e-5)
        return bool(ok)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def supported(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether GEMM ``name`` works for ``dtype`` inputs on ``device`` (probed once, cached)."""
    if name == "fp32":
        return True
    if dtype not in LOW_PRECISION:
        return False
    if name in ("addmm_out_dtype", "mm_out_dtype") and device.type != "cuda":
        return False
    if name == "triton" and not triton_usable(device):
        return False
    key = (name, str(device), dtype)
    if key not in _support_cache:
        _support_cache[key] = _probe(name, device, dtype)
    return _support_cache[key]


def resolve(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM used for inputs of ``dtype`` on ``device`` when ``requested`` is asked for."""
    if dtype not in LOW_PRECISION:
        return "fp32"  # fp32 (or fp64) inputs: a plain in-place fp32 addmm
    if requested != "auto":
        if not supported(requested, device, dtype):
            raise ValueError(f"fuse_wgrad_accumulation: backend {requested!r} is not usable for "
                             f"{dtype} on {device} (available: "
                             f"{', '.join(available_gemm_backends(device, dtype))})")
        return requested
    for name in AUTO_ORDER.get(device.type, ("fp32",)):
        if supported(name, device, dtype):
            return name
    return "fp32"


def available_gemm_backends(device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                            ) -> list[str]:
    """The GEMM implementations usable for ``dtype`` inputs on ``device``."""
    device = torch.device(device)
    return [name for name in GEMM_BACKENDS if supported(name, device, dtype)]
