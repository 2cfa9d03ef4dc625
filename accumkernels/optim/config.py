"""Every constructor argument of AccumulatingOptimizer, checked once, before any state is built."""

from __future__ import annotations

import math
import numbers
import dataclasses
from dataclasses import dataclass

import torch

from accumkernels.ops import host
from accumkernels._util import LOW_PRECISION, check_choice, finite_positive, positive_int

REDUCTIONS = ("sum", "mean", "weighted")
NONFINITE_POLICIES = ("skip_step", "skip_microbatch", "raise")


@dataclass(frozen=True)
class Config:
    """The wrapper's options after validation (see AccumulatingOptimizer for their meaning)."""

    accumulation_steps: int | None
    reduction: str
    master_weights: bool | str
    accumulate_in_backward: bool
    max_grad_norm: float | None
    nonfinite: str
    loss_scale: float | str | None
    bucket_size_mb: float
    backend: str
    independent_ranks: bool

    @property
    def weighted(self) -> bool:
        """``reduction="weighted"``: the window is divided by the reported weights."""
        return self.reduction == "weighted"

    def with_masters(self, params) -> Config:
        """This config with ``master_weights="auto"`` resolved for ``params`` (True when any is
        bf16/fp16): what ``opt.master_weights`` answers."""
        if self.master_weights != "auto":
            return self
        low = any(p.dtype in LOW_PRECISION for p in params)
        return dataclasses.replace(self, master_weights=low)


def make_config(*, accumulation_steps, reduction, master_weights, accumulate_in_backward,
                max_grad_norm, nonfinite, loss_scale, bucket_size_mb, backend,
                independent_ranks) -> Config:
    """Validate every argument; raise TypeError/ValueError naming the first bad one."""
    if accumulation_steps is not None:
        accumulation_steps = positive_int("accumulation_steps", accumulation_steps)
    check_choice("reduction", reduction, REDUCTIONS)
    check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    if not (master_weights is True or master_weights is False or master_weights == "auto"):
        raise ValueError(f"master_weights must be 'auto', True or False; got {master_weights!r}")
    check_choice("backend", backend, ("auto",) + host.BACKENDS)
    if not isinstance(accumulate_in_backward, bool):
        raise TypeError(f"accumulate_in_backward must be a bool, got {accumulate_in_backward!r}")
    if not isinstance(independent_ranks, bool):
        raise TypeError(f"independent_ranks must be a bool, got {independent_ranks!r}")
    if max_grad_norm is not None:
        if isinstance(max_grad_norm, (bool, str)):
            raise TypeError(f"max_grad_norm must be a float or None, got {max_grad_norm!r}")
        max_grad_norm = finite_positive("max_grad_norm", max_grad_norm)
    if loss_scale is not None and loss_scale != "dynamic":
        if isinstance(loss_scale, (bool, str)):
            raise TypeError(f"loss_scale must be None, a float or 'dynamic', got {loss_scale!r}")
        loss_scale = finite_positive("loss_scale", loss_scale)
        if not math.isfinite(float(torch.tensor(loss_scale, dtype=torch.float32))):
            raise ValueError(f"loss_scale {loss_scale} overflows float32")
    if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, numbers.Real):
        raise TypeError(f"bucket_size_mb must be a number, got {type(bucket_size_mb).__name__}")
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be > 0, got {bucket_size_mb!r}")
    return Config(accumulation_steps, reduction, master_weights, accumulate_in_backward,
                  max_grad_norm, nonfinite, loss_scale, float(bucket_size_mb), backend,
                  independent_ranks)
