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


# The NVIDIA driver a CUDA major version's runtime needs (the runtime is linked statically: the
# driver is all a CUDA build of _C needs at run time). CUDA 12: minor-version compatibility.
_CUDA_DRIVERS = {13: "R580", 12: "R525"}


def cuda_driver_needed(cuda_version: str | None) -> str | None:
    """The oldest NVIDIA driver branch (``"R580"``) that runs a build with ``cuda_version``
    ("13.0"); None without a CUDA build or for a version not in the table."""
    if not cuda_version:
        return None
    try:
        major = int(str(cuda_version).split(".")[0])
    except ValueError:
        return None
    return _CUDA_DRIVERS.get(major)


def _devices() -> list[str]:
    """The CPU and every GPU torch sees."""
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return devices


def available_backends(device: str) -> list[str]:
    """``accumkernels.available_backends(device)`` (imported when asked)."""
    from accumkernels.ops.accumulate import available_backends as backends

    return backends(device)


def _auto(device: str) -> dict[str, str]:
    """What ``backend="auto"`` resolves to on ``device``: for ``accumulate_`` and for the fused
    master step (the wrapper's ``backend`` option is given to both)."""
    from accumkernels.ops import master_step_backends
    from accumkernels.ops.backends import resolve

    dev = torch.device(device)
    return {"accumulate": resolve("auto", dev),
            "master_step": master_step_backends.resolve_backend("auto", dev)}


def build_info() -> dict[str, Any]:
    """The versions, what ``accumkernels._C`` was built with (``native`` False and
    ``native_error`` saying why when it cannot be loaded; ``cuda_driver``: the NVIDIA driver its
    CUDA kernels need), the backends usable on the CPU and on each visible GPU (``backends``,
    fastest first, as ``available_backends`` lists them), what ``backend="auto"`` picks there
    (``auto``), and the GPUs where the compiled CUDA kernels cannot run, with why
    (``cuda_unusable``). ``python -m accumkernels --help`` explains every field."""
    from accumkernels._version import __version__
    from accumkernels.ops.backends import native

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
    info["cuda_driver"] = cuda_driver_needed(info["cuda_version"]) if info["cuda"] else None
    devices = _devices()
    info["backends"] = {d: available_backends(d) for d in devices}
    info["auto"] = {d: _auto(d) for d in devices}
    info["cuda_unusable"] = _cuda_problems(devices)
    return info


def _cuda_problems(devices: list[str]) -> dict[str, str]:
    """Why the compiled CUDA kernels cannot run on a GPU, for the GPUs probed (by resolving a
    backend there) and found unusable."""
    from accumkernels.ops.backends import native

    problems = {}
    for device in devices:
        if device.startswith("cuda:"):
            why = native._CUDA_PROBLEMS.get(int(device.split(":")[1]))
            if why:
                problems[device] = why
    return problems


def _simd_line(info: dict[str, Any]) -> str:
    """Which SIMD path the CPU kernels run here, and why when it is not the CPU's widest."""
    if not info["native"]:
        return "none (accumkernels._C not loaded)"
    line = f"{info['simd']} (this CPU and OS support {info['simd_detected']}"
    if info["simd"] != info["simd_detected"]:
        line += "; capped by ACCUMKERNELS_CPU_SIMD"
    return line + ")"


def _cuda_line(info: dict[str, Any]) -> str:
    if not info["cuda"]:
        return "not built (no nvcc at build time): on a GPU, backend 'auto' uses triton or torch"
    driver = info.get("cuda_driver")
    needs = (f"NVIDIA driver {driver} or newer" if driver else
             f"the NVIDIA driver of CUDA {info['cuda_version']} or newer")
    return (f"built for sm {info['cuda_archs']} with CUDA {info['cuda_version']} "
            f"({info['cuda_runtime']} runtime: needs {needs}, no CUDA toolkit)")


def _auto_line(device: str, auto: dict[str, str], problem: str | None) -> str:
    accumulate, step = auto["accumulate"], auto["master_step"]
    line = accumulate if accumulate == step else \
        f"{accumulate} for accumulate_, {step} for the master step"
    if problem:
        line += f" (the CUDA kernels cannot run here: {problem})"
    return line


def _lines(info: dict[str, Any]) -> list[str]:
    if not info["native"]:
        native = f"not loaded ({info['native_error']}): the torch and triton backends only"
    else:
        native = f"CPU kernels ({'OpenMP' if info['openmp'] else 'no OpenMP'})"
    triton = info["triton"] or ("not installed (the Triton kernels for GPUs: "
                                "pip install accumkernels[triton])")
    rows = [("accumkernels", info["version"]), ("torch", info["torch"]),
            ("triton", triton), ("_C", native),
            ("CPU SIMD", _simd_line(info)),
            ("CUDA kernels", _cuda_line(info)),
            ("GPUs", str(torch.cuda.device_count()) if torch.cuda.is_available()
             else "none visible to torch")]
    problems = info.get("cuda_unusable", {})
    for device, backends in info["backends"].items():
        rows.append((f"backends on {device}", ", ".join(backends)))
        if device in info.get("auto", {}):
            rows.append((f"auto on {device}",
                         _auto_line(device, info["auto"][device], problems.get(device))))
    return [f"{name:<18} {value}" for name, value in rows]


USAGE = "usage: python -m accumkernels [--json | --help]"

HELP = USAGE + """

Says what this install of accumkernels was built with and what it runs here, one field a line.
--json prints the same as JSON (accumkernels.build_info()'s dict, for scripts and bug reports).

accumkernels          the installed version of accumkernels.
torch                 the version of the torch it runs on.
triton                the installed Triton's version (read from its metadata, not imported), or
                      "not installed": the Triton kernels (the GPU backend used when the CUDA
                      kernels are not built or cannot run, and Triton's master step) are
                      missing; pip install accumkernels[triton] adds them.
_C                    the compiled extension accumkernels._C: "CPU kernels" (with or without
                      OpenMP threads), or "not loaded" and why: then only the triton and torch
                      backends run.
CPU SIMD              the SIMD level the CPU kernels run (generic x86-64, avx2 for
                      AVX2/FMA/F16C, avx512), then, in parentheses, the widest one this CPU and
                      OS support (CPUID and XGETBV). They differ when ACCUMKERNELS_CPU_SIMD=
                      generic|avx2|avx512 caps the level (it never raises it above what the CPU
                      supports; read when the CPU kernels first run, so set it before starting
                      Python).
CUDA kernels          whether _C carries the CUDA kernels: the GPU architectures they were
                      built for (SASS, plus PTX that the driver compiles for newer GPUs), the
                      CUDA version, and the runtime: "static", linked into _C, so a CUDA build
                      needs only the NVIDIA driver, no CUDA toolkit and no libcudart from
                      torch's nvidia-* wheels. The driver: R580 or newer for a CUDA 13 build
                      (R525 or newer for CUDA 12, whose PTX, on a GPU without SASS in the build,
                      needs the driver of the build's own CUDA version). "not built": no nvcc
                      when it was built; on a GPU, backend="auto" then uses triton or torch.
GPUs                  how many CUDA devices torch sees.
backends on <device>  the backends accumulate_ can run on the CPU and on each visible GPU,
                      fastest first (accumkernels.available_backends(device)).
auto on <device>      the backend that backend="auto" (the default of AccumulatingOptimizer,
                      accumulate_ and the master step) picks there: the first of the row above
                      for accumulate_, and the fused master step's when it differs. On a GPU
                      where the compiled CUDA kernels cannot run (e.g. a driver older than the
                      build needs) the reason follows, and auto takes the next backend.

--json also holds what the lines fold together: cuda_archs, cuda_version, cuda_runtime,
cuda_vec_store (the CUDA kernel's 16-byte store), openmp, simd, simd_detected, cuda_driver,
tensor_reader (whether _C reads tensors through torch's C shim; ACCUMKERNELS_TENSOR_READER=python
switches it off), backends, auto ({"accumulate": ..., "master_step": ...} per device) and
cuda_unusable (device: why)."""


def main(argv: list[str] | None = None) -> int:
    """``python -m accumkernels [--json | --help]``: print ``build_info()``, or what it means."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["--help"], ["-h"]):
        print(HELP)
        return 0
    if args not in ([], ["--json"]):
        print(f"{USAGE}\n(--help explains every field)", file=sys.stderr)
        return 2
    info = build_info()
    print(json.dumps(info, indent=1) if args else "\n".join(_lines(info)))
    return 0
