"""Guards: batch-size arithmetic and models for which accumulation != a larger batch."""

from __future__ import annotations

import warnings

import torch

from accumkernels._util import positive_int

__all__ = ["check_model", "validate_batch_sizes"]


def validate_batch_sizes(global_batch_size: int, micro_batch_size: int, world_size: int = 1) -> int:
    """Number of accumulation steps, or a ValueError saying what to change."""
    g = positive_int("global_batch_size", global_batch_size)
    m = positive_int("micro_batch_size", micro_batch_size)
    w = positive_int("world_size", world_size)
    per_step = m * w
    if g % per_step:
        lower, upper = g // per_step * per_step, (g // per_step + 1) * per_step
        sizes = f"{lower} or {upper}" if lower else f"{upper}"
        if g % w:
            hint = f"; no micro_batch_size helps while it is not a multiple of world_size={w}"
        else:
            fitting = [d for d in range(1, g // w + 1) if (g // w) % d == 0]
            hint = f", or a micro_batch_size that divides {g // w}: {fitting}"
        raise ValueError(
            f"global_batch_size={g} is not a multiple of micro_batch_size x world_size = "
            f"{m} x {w} = {per_step}: use a global batch of {sizes}{hint}"
        )
    return g // per_step


def check_model(model: torch.nn.Module, *, raise_error: bool = False) -> list[str]:
    """Warn (or raise ValueError) for modules whose statistics are non-linear across the batch.

    BatchNorm in training mode normalises each micro-batch with its own statistics, so N
    accumulated micro-batches are not equivalent to one batch N times larger. Returns the names
    of the offending modules.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"check_model expects an nn.Module, got {type(model).__name__}")
    offending = [
        name or type(module).__name__
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm) and module.training
    ]
    if offending:
        message = (
            f"{len(offending)} BatchNorm layer(s) in training mode ({', '.join(offending[:5])}"
            f"{', ...' if len(offending) > 5 else ''}): each micro-batch is normalised with its own "
            "statistics, so gradient accumulation is not equivalent to a larger batch. Consider "
            "GroupNorm/LayerNorm, SyncBatchNorm-style statistics, or eval-mode BatchNorm."
        )
        if raise_error:
            raise ValueError(message)
        warnings.warn(message, UserWarning, stacklevel=2)
    return offending
