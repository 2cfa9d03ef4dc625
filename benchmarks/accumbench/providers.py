"""What is timed: the loops people write, torch's own paths, and every accumkernels backend.

A provider is ``fn(dst, src)``; an optional ``fn.scale`` attribute says which scale it applies
(default :data:`SCALE`) and ``fn.note`` what a reader must know about it.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence
from functools import partial

import torch

import accumkernels
from benchmarks.accumbench.workloads import SCALE

Provider = Callable[[list[torch.Tensor], list[torch.Tensor]], None]


def loop_literal(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """What people write: an upcast copy, a scaled copy and an add per param."""
    if overwrite:
        for m, g in zip(dst, src):
            m.copy_(g.float() * s)
    else:
        for m, g in zip(dst, src):
            m += g.float() * s


def loop_add(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """The best single-kernel-per-param loop (two kernels with overwrite)."""
    if overwrite:
        for m, g in zip(dst, src):
            m.copy_(g).mul_(s)
    else:
        for m, g in zip(dst, src):
            m.add_(g, alpha=s)


def foreach(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """torch's multi-tensor ops; mixed dtypes may take a per-tensor slow path or be refused."""
    if overwrite:
        torch._foreach_copy_(dst, src)
        torch._foreach_mul_(dst, s)
    else:
        torch._foreach_add_(dst, src, alpha=s)


class NativeGradDtype:
    """PyTorch's own fp32 accumulation: ``p.grad_dtype = torch.float32`` on low-precision params.

    Modelled as autograd does it in a real backward: each ``src[i]`` is the incoming gradient of
    a leaf param of ``src[i]``'s dtype whose ``.grad`` is the fp32 ``dst[i]``, and
    ``torch.autograd.backward(params, src)`` runs one AccumulateGrad per param (upcast of the
    incoming gradient, then an in-place fp32 add), engine overhead included. The params are
    detached aliases of ``src`` (nothing reads their values), built once per (dst, src) lists.
    AccumulateGrad has no scale: this provider applies 1.0. It has no overwrite either:
    ``overwrite=True`` times ``zero_grad(set_to_none=False)`` + backward.
    """

    scale = 1.0
    note = "scale 1 (AccumulateGrad has none)"

    def __init__(self, overwrite: bool = False):
        self.overwrite = overwrite
        self._bound: dict[tuple[int, int], tuple[list, list, list[torch.Tensor]]] = {}
        if overwrite:
            self.note += "; overwrite = zero_grad(set_to_none=False) + backward"

    @staticmethod
    def supported() -> bool:
        return hasattr(torch.Tensor, "grad_dtype")

    def _params(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> list[torch.Tensor]:
        entry = self._bound.get((id(dst), id(src)))
        if entry is None or entry[0] is not dst or entry[1] is not src:
            params = []
            for d, g in zip(dst, src, strict=True):
                p = g.detach().requires_grad_(True)
                p.grad_dtype = torch.float32
                p.grad = d
                params.append(p)
            entry = (dst, src, params)  # holding the lists keeps their ids from being reused
            self._bound[(id(dst), id(src))] = entry
        return entry[2]

    def __call__(self, dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
        if not self.supported():
            raise NotImplementedError(f"torch {torch.__version__} has no Tensor.grad_dtype")
        params = self._params(dst, src)
        if self.overwrite:
            torch._foreach_zero_(dst)
        torch.autograd.backward(params, src)


def native_grad_dtype(dst: list, src: list, s: float = 1.0, overwrite: bool = False) -> None:
    """One-shot form of :class:`NativeGradDtype` (binds fresh params every call)."""
    NativeGradDtype(overwrite)(dst, src)


BASELINES: dict[str, Callable[..., None]] = {
    "loop_literal": loop_literal, "loop_add": loop_add, "foreach": foreach,
    "native_grad_dtype": native_grad_dtype,
}
BASELINE_CODE = {  # (accumulate, overwrite), recorded in the JSON
    "loop_literal": ("for m, g in zip(dst, src): m += g.float() * s",
                     "for m, g in zip(dst, src): m.copy_(g.float() * s)"),
    "loop_add": ("for m, g in zip(dst, src): m.add_(g, alpha=s)",
                 "for m, g in zip(dst, src): m.copy_(g).mul_(s)"),
    "foreach": ("torch._foreach_add_(dst, src, alpha=s)",
                "torch._foreach_copy_(dst, src); torch._foreach_mul_(dst, s)"),
    "native_grad_dtype": (
        ("params[i] = src[i].detach().requires_grad_(); params[i].grad_dtype = torch.float32; "
         "params[i].grad = dst[i]  (once); torch.autograd.backward(params, src)  # scale 1"),
        "torch._foreach_zero_(dst); torch.autograd.backward(params, src)  # scale 1"),
}


def accumkernels_backends(device: torch.device) -> list[str]:
    """Backends worth timing: all available ones, except Triton on CPU (interpreter only)."""
    backends = accumkernels.available_backends(device)
    return [b for b in backends if not (device.type == "cpu" and b == "triton")]


def make_providers(device: torch.device, scale: float = SCALE, overwrite: bool = False
                   ) -> dict[str, Provider]:
    """name -> fn(dst, src): the baselines, then ``accumkernels:<backend>`` per backend."""
    providers: dict[str, Provider] = {
        name: partial(fn, s=scale, overwrite=overwrite) for name, fn in BASELINES.items()
        if name != "native_grad_dtype"
    }
    providers["native_grad_dtype"] = NativeGradDtype(overwrite)
    for b in accumkernels_backends(device):
        providers[f"accumkernels:{b}"] = partial(
            accumkernels.accumulate_, scale=scale, overwrite=overwrite, backend=b)
    return providers


def provider_scale(fn: Provider, default: float = SCALE) -> float:
    """The scale ``fn`` applies (the native provider has none: 1.0)."""
    return getattr(fn, "scale", default)


def provider_code(name: str, overwrite: bool) -> str:
    if name in BASELINE_CODE:
        return BASELINE_CODE[name][overwrite]
    backend = name.split(":", 1)[1]
    return f"accumkernels.accumulate_(dst, src, s, overwrite={overwrite}, backend={backend!r})"


def select_providers(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """Names matching any pattern (exact, fnmatch glob, or bare "accumkernels")."""
    if not patterns:
        return list(names)
    return [n for n in names
            if any(fnmatch.fnmatchcase(n, p) or n.split(":")[0] == p for p in patterns)]
