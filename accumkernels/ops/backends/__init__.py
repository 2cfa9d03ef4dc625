"""Backend registry for ``accumulate_``.

Each backend module exposes ``is_available(device) -> bool`` and
``accumulate(dst, src, scale, scale_tensor, overwrite, found_inf, norm_sq, norm_slots) -> None``,
which receives already-validated, non-empty, same-device lists (see ``accumkernels.ops.accumulate``); with
``norm_sq``, dst i's squared L2 norm goes to ``norm_sq[norm_slots[i]]`` (overwritten).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

BACKENDS = ("cuda", "triton", "cpu", "torch")
# Accepted by name but never offered (available_backends, "auto"): for tests only.
TEST_BACKENDS = ("cuda_host",)

# Preference order of ``backend="auto"`` per device type: fastest first.
_AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}

# "cuda" and "cpu" are two faces of the same compiled module.
# Module names differ from "torch" so a submodule never shadows the torch import here.
_MODULES = {"cuda": "native", "cpu": "native", "triton": "triton", "torch": "reference",
            "cuda_host": "cuda_host"}


def get(name: str) -> ModuleType:
    """The module implementing backend ``name`` (imported lazily: triton is optional)."""
    return importlib.import_module(f"{__name__}.{_MODULES[name]}")


def is_available(name: str, device: torch.device) -> bool:
    """Whether backend ``name`` can run on ``device``."""
    if name == "cuda" and device.type != "cuda":
        return False
    if name == "cpu" and device.type != "cpu":
        return False
    return get(name).is_available(device)


def available_backends(device: torch.device | str) -> list[str]:
    """Backends usable on ``device``, fastest first (the order ``"auto"`` tries them in)."""
    device = torch.device(device)
    order = _AUTO_ORDER.get(device.type, ("torch",))
    usable = [b for b in order if is_available(b, device)]
    # Triton also runs on the CPU under TRITON_INTERPRET=1, but only for testing: never "auto".
    usable += [b for b in BACKENDS if b not in order and is_available(b, device)]
    return usable


# (name, device) -> backend: availability depends only on the process (what is built and
# installed), so the answer is kept, and torch.compile may treat it as a constant.
_RESOLVED: dict[tuple[str, torch.device], str] = {}


@torch.compiler.assume_constant_result
def resolve(name: str, device: torch.device) -> str:
    """Map ``"auto"`` to the fastest backend on ``device``; check an explicit name is usable."""
    key = (name, device)
    found = _RESOLVED.get(key)
    if found is None:
        found = _RESOLVED[key] = _resolve(name, device)
    return found


def _resolve(name: str, device: torch.device) -> str:
    if name == "auto":
        for candidate in _AUTO_ORDER.get(device.type, ("torch",)):
            if is_available(candidate, device):
                return candidate
        return "torch"
    if not is_available(name, device):
        why = ""
        if name == "cuda" and device.type == "cuda" and get("cuda")._C is not None:
            problem = get("cuda")._CUDA_PROBLEMS.get(device.index)
            why = f" ({problem})" if problem else ""
        raise ValueError(
            f"accumulate_: backend {name!r} is not available on device {device}{why}; "
            f"available: {available_backends(device)}"
        )
    return name
