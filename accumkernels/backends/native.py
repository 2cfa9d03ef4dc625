"""Loader for the compiled module ``accumkernels._C``: the ``cpu`` and ``cuda`` backends.

The extension takes raw addresses, element counts and dtype codes (it does not link
libtorch), so this module turns tensor lists into those.
"""

from __future__ import annotations

import torch

try:
    from accumkernels import _C
except ImportError as exc:  # not built: only the torch/triton backends are usable
    _C = None
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def is_available(device: torch.device) -> bool:
    if _C is None:
        return False
    if device.type == "cpu":
        return True
    return device.type == "cuda" and _C.has_cuda() and torch.cuda.is_available()


def accumulate(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
) -> None:
    codes = _DTYPE_CODES
    args = (
        [d.data_ptr() for d in dst],
        [x.data_ptr() for x in src],
        [d.numel() for d in dst],
        [codes[x.dtype] for x in src],
        float(scale),
        scale_tensor.data_ptr() if scale_tensor is not None else 0,
        bool(overwrite),
        found_inf.data_ptr() if found_inf is not None else 0,
    )
    device = dst[0].device
    if device.type == "cpu":
        _C.accumulate_cpu(*args, torch.get_num_threads())
    else:
        stream = torch.cuda.current_stream(device).cuda_stream
        _C.accumulate_cuda(*args, stream, device.index)
