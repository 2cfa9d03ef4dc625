"""Test-only backend ``"cuda_host"``: the CUDA kernel's own code, run on the CPU.

csrc/accumulate_cuda_host.cpp plays each launch of the CUDA kernel (the same source as the GPU
build, csrc/accumulate_kernel.h) block by block and thread by thread on host memory, through the
same table building as a real launch. It is slow and never offered by ``available_backends`` or
``"auto"``; tests name it explicitly (tests/op/test_cuda_host.py). With the C++ tensor reader the
call goes through the extension's checked path (``native.KERNELS``); this module's
``accumulate`` is the portable path.
"""

from __future__ import annotations

import torch

from accumkernels.ops.backends import native


def is_available(device: torch.device) -> bool:
    return (device.type == "cpu" and native._C is not None
            and hasattr(native._C, "accumulate_cuda_host"))


def accumulate(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
    norm_sq: torch.Tensor | None = None,
    norm_slots: list[int] | None = None,
) -> None:
    """The portable path: already-checked, non-empty lists as raw addresses and sizes."""
    codes = native.DTYPE_CODES
    native._C.accumulate_cuda_host(
        [d.data_ptr() for d in dst], [x.data_ptr() for x in src], [d.numel() for d in dst],
        [codes[x.dtype] for x in src], float(scale),
        scale_tensor.data_ptr() if scale_tensor is not None else 0, bool(overwrite),
        found_inf.data_ptr() if found_inf is not None else 0,
        norm_sq.data_ptr() if norm_sq is not None else 0, norm_slots)


def configure(sm_count: int = 132, capturing: bool = False) -> None:
    """The emulated device: its SM count (the grid is 4 blocks per SM, at most one per chunk) and
    whether its stream counts as captured (no launch depends on it: lists over 1000 tensors
    launch in groups either way)."""
    native._C.cuda_host_configure(sm_count, capturing)


def launches() -> list[str]:
    """The last call's launches: table kind, grid, chunks and tensors of each."""
    return native._C.cuda_host_launches()
