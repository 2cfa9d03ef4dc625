"""Params the inner optimizer steps that are not in the fp32 window: they keep native ``.grad``.

These are float64 params (their native float64 sum is already exact to fp32 rounding), params
frozen when the window was built (trained natively once unfrozen: progressive unfreezing), and
params added to ``param_groups`` behind the wrapper's back. Autograd sums their gradients in
``.grad`` as usual; the wrapper treats them like the window's params everywhere else:

* ``zero_grad()`` keeps or clears their ``.grad`` on the window's rule (a window still filling
  with ``accumulation_steps=N`` is kept, so they get every micro-batch, not only the last);
* at the step their ``.grad`` is normalised like the window (``mean``/``weighted``, the loss
  scale's 1/S) and takes part in clipping and the non-finite check.

The list is re-read when the inner optimizer's param groups change (an O(groups) check).
"""

from __future__ import annotations

import torch


class OutsideParams:
    """The inner optimizer's params outside the window, re-read when its groups change."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.params: list[torch.Tensor] = []
        self._shape: tuple = ()
        self._managed: set[int] = set()

    def rebuild(self, managed: set[int]) -> None:
        """``managed``: ids of the params (model params and their masters) in the window."""
        self._managed = managed
        self._shape = ()
        self.refresh()

    def refresh(self) -> list[torch.Tensor]:
        """The current list; O(number of groups) unless a group changed."""
        groups = self.optimizer.param_groups
        shape = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if shape != self._shape:
            self._shape = shape
            self.params = [p for g in groups for p in g["params"] if id(p) not in self._managed]
        return self.params

    def check_unfrozen(self, nonfinite: str, names: dict[int, str]) -> None:
        """A param outside the window (frozen when it was built, float64, added behind its
        back) now gets a gradient: it trains natively, its ``.grad`` normalised at the step like
        the window (DDP averages it natively). A micro-batch cannot be dropped from a native
        ``.grad``: with ``nonfinite="skip_microbatch"`` this raises, naming the fix."""
        if nonfinite != "skip_microbatch":
            return
        for p in self.refresh():
            if p.requires_grad:
                name = names.get(id(p), f"a param of shape {tuple(p.shape)}")
                raise ValueError(
                    f"{name} is outside the fp32 window (frozen when the AccumulatingOptimizer "
                    "was built, float64, or added to param_groups directly) and now has a "
                    "gradient that nonfinite='skip_microbatch' cannot drop; unfreeze it "
                    "before wrapping, or pass its params to add_param_group() between windows")

    def with_grad(self) -> list[torch.Tensor]:
        return [p for p in self.refresh() if p.grad is not None]

    def clear(self, set_to_none: bool) -> None:
        """Native ``zero_grad`` on these params."""
        for p in self.refresh():
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()

    @torch.no_grad()
    def scale(self, factor: float) -> None:
        """Multiply every ``.grad`` by ``factor`` (the window's normalisation)."""
        if factor != 1.0:
            grads = [p.grad for p in self.with_grad() if not p.grad.is_sparse]
            if grads:
                torch._foreach_mul_(grads, factor)
