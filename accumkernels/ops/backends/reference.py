"""Reference backend in plain PyTorch: the readable specification, and the fallback.

``dst[i] = (0 if overwrite else dst[i]) + scale * float32(src[i])`` computed in fp32,
one kernel per tensor (no fusion), no host synchronisation; ``norm_sq[norm_slots[i]]`` =
``sum(dst[i]**2)`` in fp32 (torch's own reduction: short partial sums, then a tree).
"""

from __future__ import annotations

import torch


def is_available(device: torch.device) -> bool:
    return True


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
    s = scale_tensor.reshape(()) if scale_tensor is not None else scale
    any_bad = None
    for i, (d, x) in enumerate(zip(dst, src)):
        x32 = x.float()
        if overwrite:
            torch.mul(x32, s, out=d)
        else:
            d.add_(x32 * s)
        if found_inf is not None:
            bad = ~torch.isfinite(d).all()  # the result: a non-finite src or an overflow
            any_bad = bad if any_bad is None else any_bad | bad
        if norm_sq is not None:
            norm_sq[norm_slots[i]].copy_(torch.sum(torch.square(d)))
    if any_bad is not None:
        found_inf.masked_fill_(any_bad, 1.0)
