"""Loss scaling for fp16 training: static or dynamic (backs off and grows like GradScaler)."""

from __future__ import annotations

import math

import torch

__all__ = ["LossScaler"]


class LossScaler:
    """Holds the loss scale S. The wrapper multiplies losses by S and fuses 1/S into accumulation.

    ``"dynamic"`` starts at 2**16, halves on every non-finite gradient and doubles after
    ``growth_interval`` consecutive finite steps, with torch.amp.GradScaler's defaults.
    """

    def __init__(self, loss_scale: float | str | None, *, init_scale: float = 2.0**16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000):
        self.dynamic = loss_scale == "dynamic"
        if self.dynamic:
            self.scale = float(init_scale)
        elif loss_scale is None:
            self.scale = 1.0
        elif isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
            raise TypeError(f"loss_scale must be None, a float or 'dynamic', got {loss_scale!r}")
        elif not (math.isfinite(loss_scale) and loss_scale > 0):
            raise ValueError(f"loss_scale must be a finite positive number, got {loss_scale}")
        else:
            self.scale = float(loss_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.growth_tracker = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.scale != 1.0 else loss

    def update(self, found_inf: bool) -> None:
        """After a step (or a dropped micro-batch): back off on overflow, grow after a streak."""
        if not self.dynamic:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        if bool(state["dynamic"]) != self.dynamic:
            raise ValueError("loss_scale state is for a different mode (static vs dynamic)")
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
