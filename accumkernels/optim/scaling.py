"""Loss scaling for fp16 training: static or dynamic (backs off and grows like GradScaler)."""

from __future__ import annotations

import math

import torch

__all__ = ["LossScaler"]

# The dynamic scale stays positive and finite however long overflow lasts: it never backs off
# below 1 (Megatron's and DeepSpeed's min_loss_scale; a smaller one would only flush fp16
# gradients to zero, and gradients that overflow unscaled are skipped anyway) nor grows past
# the largest power of two fp32 holds.
_MIN_SCALE = 1.0
_MAX_SCALE = 2.0**127


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
        else:  # checked by optim.config
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
            self.scale = max(self.scale * self.backoff_factor, _MIN_SCALE)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale = min(self.scale * self.growth_factor, _MAX_SCALE)
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker, "dynamic": self.dynamic}

    def parse(self, state: object) -> dict:
        """Check a saved scaler state (ValueError) before anything is changed."""
        try:
            dynamic, scale = bool(state["dynamic"]), float(state["scale"])
            tracker = int(state["growth_tracker"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"load_state_dict: malformed loss-scale state ({exc})") from None
        if dynamic != self.dynamic:
            raise ValueError("load_state_dict: the loss-scale state is for a different mode "
                             "(static vs dynamic)")
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError(
                f"load_state_dict: saved loss scale {scale} is not finite and positive")
        return {"scale": scale, "growth_tracker": tracker}

    def load(self, parsed: dict) -> None:
        self.scale = parsed["scale"]
        self.growth_tracker = parsed["growth_tracker"]

    def load_state_dict(self, state: dict) -> None:
        self.load(self.parse(state))
