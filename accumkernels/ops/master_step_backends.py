"""Which backend runs the fused master step on a device (master_step.py): the names, ``"auto"``
resolved once per (backend, device), availability, and each backend's entry points."""

from __future__ import annotations

import torch

from accumkernels.ops.backends import master_step_cpu, master_step_ref

try:  # the other device backends are optional: without them their routes are unavailable
    from accumkernels.ops.backends import master_step_cuda
except ImportError:  # pragma: no cover
    master_step_cuda = None
try:
    from accumkernels.ops.backends import master_step_triton
except ImportError:  # pragma: no cover
    master_step_triton = None

BACKENDS = ("cpu", "cuda", "triton", "torch")
KNOWN_BACKENDS = ("auto", *BACKENDS, "cuda_host")  # cuda_host: the CUDA kernel played on the CPU (tests)

_RESOLVED: dict[tuple[str, torch.device], str] = {}


def resolve_backend(backend: str, device: torch.device, op: str = "master step") -> str:
    """The backend that runs on ``device``: ``"auto"`` resolved, an explicit name checked."""
    key = (backend, device)
    if key not in _RESOLVED:
        if backend == "auto":
            order = ("cpu",) if device.type == "cpu" else ("cuda", "triton")
            _RESOLVED[key] = next((b for b in order if _available(b, device)), "torch")
        elif _available(backend, device):
            _RESOLVED[key] = backend
        else:
            raise ValueError(f"{op}: backend {backend!r} is not available on device {device}; "
                             f"available there: {available_backends(device)}")
    return _RESOLVED[key]


def available_backends(device: torch.device | str) -> list[str]:
    """The fused master step's backends usable on ``device``, fastest first."""
    device = torch.device(device)
    return [b for b in BACKENDS if _available(b, device)]


def _available(name: str, device: torch.device) -> bool:
    if name == "torch":
        return True
    if name == "cpu":
        return master_step_cpu.is_available(device)
    if name in ("cuda", "cuda_host"):
        if master_step_cuda is None:
            return False
        if name == "cuda_host":
            return device.type == "cpu" and master_step_cuda.host_available()
        return device.type == "cuda" and master_step_cuda.is_available(device)
    return name == "triton" and master_step_triton is not None \
        and master_step_triton.is_available(device)


def backend_fn(name: str, algo: str):
    if name == "torch":
        return getattr(master_step_ref, algo)
    if name == "triton":
        return getattr(master_step_triton, algo)
    return getattr(master_step_cuda, algo + ("_host" if name == "cuda_host" else ""))
