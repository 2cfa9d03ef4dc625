"""Non-finite gradients: the device-side flag, the policy, and the counters."""

from __future__ import annotations

import torch

from accumkernels.ops import host
from accumkernels.optim.config import Config


class NonFinite:
    """Owns the policy, the counters and ``found_inf`` (set by the kernels, never reset by them).

    * ``skip_step``: a window that holds a non-finite value at ``step()`` (a non-finite
      gradient, an fp32 sum that overflowed, a value written by the user) is dropped whole
      (``skipped_steps``);
    * ``skip_microbatch``: a micro-batch with a non-finite gradient is dropped before it
      reaches the window (``skipped_microbatches``); a window that is non-finite at the step
      is still dropped whole;
    * ``raise``: ``FloatingPointError`` naming the first bad param.

    The step decides from the window itself (:func:`grad_norm`), never from ``found_inf``:
    a write through ``p.grad``, ``.data``, numpy or the storage changes the window without
    setting the flag, and a user's fix of a bad value is as native. The kernels' flag is kept in
    the state dict for older readers.
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

    def follow(self, device: torch.device) -> None:
        """The window moved to ``device``: the flag moves with it (from meta: a fresh zero)."""
        if self.found_inf.device == device:
            return
        flag = torch.zeros(1, device=device)
        if self.found_inf.device.type != "meta" and device.type != "meta":
            flag.copy_(self.found_inf)
        self.found_inf = flag

    @staticmethod
    def all_finite(grads: list[torch.Tensor]) -> bool:
        if not grads:
            return True
        return bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())

    def state_dict(self) -> dict:
        return {"found_inf": self.found_inf.detach().clone(),
                "skipped_steps": self.skipped_steps,
                "skipped_microbatches": self.skipped_microbatches}

    def parse(self, state: dict) -> dict:
        flag = state.get("found_inf")
        if isinstance(flag, (int, float)) and not isinstance(flag, bool):
            flag = torch.tensor([float(flag)])
        if not isinstance(flag, torch.Tensor) or flag.numel() != 1:
            raise ValueError("load_state_dict: 'found_inf' must be a number or 1-element tensor")
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


def grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads`` as ``clip_grad_norm_`` computes it (``get_total_norm``: fp32
    per-tensor norms, then the norm of those): one read pass (4 B/element).

    It is finite exactly when every element is. Where fp32 overflows with finite elements
    (squares past FLT_MAX) it is computed again in float64 (:func:`sum_of_squares`) and returned
    in float64; a finite fp32 square never overflows float64.
    """
    grads = [g for g in grads if g.numel()]
    if not grads:
        return torch.zeros(())
    if host.lists_plain([grads], [host.LIST_FP32]):  # one device, fp32: get_total_norm's
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
    else:  # one group, whose per-tensor norms it computes alike, less its grouping and moves
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if bool(torch.isfinite(norm)):
        return norm
    return sum_of_squares(grads, norm.device).sqrt()


def sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σx² over every element of ``grads`` (DTensors: their local shard) in float64, a 0-dim
    tensor on ``device``: finite exactly when every element is."""
    grads = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    parts = [torch.linalg.vector_norm(g, dtype=torch.float64).to(device).square()
             for g in grads if g.numel()]
    return torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64,
                                                              device=device)
