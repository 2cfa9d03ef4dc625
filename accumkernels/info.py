"""What this install can run: ``build_info()`` and the ``python -m accumkernels`` report.

A wheel built without nvcc, or an install whose ``_C`` did not build, still imports: the missing
kernels show up here and in ``available_backends``, nowhere else.
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
from typing import Any

import torch

# _C.build_info()'s keys, with what they read when the extension is absent.
_NATIVE_DEFAULTS: dict[str, Any] = {"cuda": False, "cuda_archs": "", "cuda_version": None,
                                    "cuda_vec_store": None, "cuda_runtime": None,
                                    "openmp": None, "simd": None, "simd_detected": None}


def _version(dist: str) -> str | None:
    """An installed distribution's version, without importing it (Triton's import is slow)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def build_info() -> dict[str, Any]:
    """The versions, what ``accumkernels._C`` was built with (``native`` False and
    ``native_error`` saying why when it cannot be loaded), and the backends usable on the CPU and
    on each visible GPU (``backends``, fastest first, as ``available_backends`` lists them)."""
    from accumkernels._version import __version__
    from accumkernels.ops.backends import native
    from accumkernels.ops.accumulate import available_backends

    C = native._C
    info: dict[str, Any] = {
        "version": __version__,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "native": C is not None,
        "native_error": None if C is not None else str(native.IMPORT_ERROR),
        **_NATIVE_DEFAULTS,
        **(C.build_info() if C is not None else {}),
        "tensor_reader": bool(native.READER),
    }
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    info["backends"] = {d: available_backends(d) for d in devices}
    return info


def _simd_line(info: dict[str, Any]) -> str:
    """Which SIMD path the CPU kernels run here, and why when it is not the CPU's widest."""
    if not info["native"]:
        return "none (accumkernels._C not loaded)"
    line = f"{info['simd']} (this CPU and OS support {info['simd_detected']}"
    if info["simd"] != info["simd_detected"]:
        line += "; capped by ACCUMKERNELS_CPU_SIMD"
    return line + ")"


def _lines(info: dict[str, Any]) -> list[str]:
    if not info["native"]:
        native = f"not loaded ({info['native_error']}): the torch and triton backends only"
    else:
        native = f"CPU kernels ({'OpenMP' if info['openmp'] else 'no OpenMP'})"
    if info["cuda"]:
        cuda = (f"built for sm {info['cuda_archs']} with CUDA {info['cuda_version']} "
                f"({info['cuda_runtime']} runtime)")
    else:
        cuda = "not built (no nvcc at build time): on a GPU, backend 'auto' uses triton or torch"
    rows = [("accumkernels", info["version"]), ("torch", info["torch"]),
            ("triton", info["triton"] or "not installed"), ("_C", native),
            ("CPU SIMD", _simd_line(info)),
            ("CUDA kernels", cuda),
            ("GPUs", str(torch.cuda.device_count()) if torch.cuda.is_available()
             else "none visible to torch")]
    rows += [(f"backends on {d}", ", ".join(b)) for d, b in info["backends"].items()]
    return [f"{name:<18} {value}" for name, value in rows]


def main(argv: list[str] | None = None) -> int:
    """``python -m accumkernels [--json]``: print ``build_info()``."""
    args = sys.argv[1:] if argv is None else argv
    if args not in ([], ["--json"]):
        print("usage: python -m accumkernels [--json]", file=sys.stderr)
        return 2
    info = build_info()
    print(json.dumps(info, indent=1) if args else "\n".join(_lines(info)))
    return 0
