"""Non-finite gradients: the device-side flag, the policy, and the counters."""

from __future__ import annotations

import math

import torch

from accumkernels.optim.config import Config


class NonFinite:
    """Owns ``found_inf`` (set by the kernels, never reset by them), the policy and counters.

    * ``skip_step``: a window with any non-finite input gradient, or whose fp32 sum overflowed,
      is dropped whole (``skipped_steps``);
    * ``skip_microbatch``: a micro-batch with a non-finite gradient is dropped before it
      reaches the window (``skipped_microbatches``); a window that overflows in its sum is
      still dropped whole;
    * ``raise``: ``FloatingPointError`` naming the first bad param.
    """

    def __init__(self, config: Config, device: torch.device):
        self.policy = config.nonfinite
        self.found_inf = torch.zeros(1, device=device)
        self.skipped_steps = 0
        self.skipped_microbatches = 0

    @property
    def per_microbatch(self) -> bool:
        return self.policy == "skip_microbatch"

    def launch_flag(self) -> torch.Tensor:
        """The flag each fused launch sets: the kernels flag a non-finite result, so it reports a
        non-finite gradient and an overflowed fp32 sum alike (with ``skip_microbatch`` the
        gradients are checked before they are launched: the flag then means an overflow)."""
        return self.found_inf

    def reset(self) -> None:
        self.found_inf.zero_()

    @staticmethod
    def all_finite(grads: list[torch.Tensor]) -> bool:
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def window_finite(self, flats: list[torch.Tensor], norm: torch.Tensor | None,
                      exact: bool = False) -> bool:
        """Whether the window can be stepped: no non-finite value reached it, no sum overflowed.

        The kernels that wrote the window flagged both (``found_inf``), so this is one flag read.
        ``exact``: the window was also changed by passes without the flag (a sum across ranks, a
        rescale by more than 1): ``norm`` (the global 2-norm, when clipping computed it) answers
        it when finite; otherwise a max-abs pass tells overflowed squares from non-finite values.
        """
        if bool(self.found_inf.item()):
            return False
        if not exact or (norm is not None and bool(torch.isfinite(norm))):
            return True
        return all(bool(torch.isfinite(torch.linalg.vector_norm(f, math.inf)))
                   for f in flats if f.numel())

    def state_dict(self) -> dict:
        return {"found_inf": self.found_inf.detach().clone(),
                "skipped_steps": self.skipped_steps,
                "skipped_microbatches": self.skipped_microbatches}

    def parse(self, state: dict) -> dict:
        flag = state.get("found_inf")
        if not isinstance(flag, torch.Tensor) or flag.numel() != 1:
            raise ValueError("load_state_dict: 'found_inf' must be a 1-element tensor")
        try:
            return {"found_inf": flag.detach().clone(),
                    "skipped_steps": int(state["skipped_steps"]),
                    "skipped_microbatches": int(state["skipped_microbatches"])}
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"load_state_dict: malformed non-finite counters ({exc})") from None

    def load(self, parsed: dict) -> None:
        self.found_inf.copy_(parsed["found_inf"].reshape(1))
        self.skipped_steps = parsed["skipped_steps"]
        self.skipped_microbatches = parsed["skipped_microbatches"]
