"""Float64 reference for accumulate_ and the fp32 rounding bound tests compare against."""

from __future__ import annotations

import torch

U32 = 2.0**-24  # unit roundoff of float32


def fp32_scale(scale: float) -> float:
    """The scale as the kernels use it: rounded to float32."""
    return float(torch.tensor(scale, dtype=torch.float32))


class Reference:
    """Accumulates in float64 and tracks sum(|terms|) for the rounding bound of each element.

    A chain of k steps ``dst = dst + s*x`` in fp32 rounds each product and each sum once, so
    the error of every element is at most (k + 1) * u * sum(|terms|) (Higham, recursive
    summation), with u the fp32 unit roundoff. That bound is what the tests assert.
    """

    def __init__(self, dst: torch.Tensor):
        self.value = dst.detach().to("cpu", torch.float64)
        self.magnitude = self.value.abs()
        self.steps = 0

    def add(self, src: torch.Tensor, scale: float, overwrite: bool = False) -> None:
        term = src.detach().to("cpu", torch.float64) * fp32_scale(scale)
        if overwrite:
            self.value = term.clone()
            self.magnitude = term.abs()
            self.steps = 1
        else:
            self.value = self.value + term
            self.magnitude = self.magnitude + term.abs()
            self.steps += 1

    def bound(self) -> torch.Tensor:
        return (self.steps + 1) * U32 * self.magnitude * 1.0001 + 1e-45

    def check(self, out: torch.Tensor, what: str = "") -> None:
        """Assert ``out`` is within the fp32 bound; non-finite values must match exactly."""
        got = out.detach().to("cpu", torch.float64)
        ref = self.value
        assert got.shape == ref.shape, what
        finite = torch.isfinite(ref)
        assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{what}: NaN pattern differs"
        inf = torch.isinf(ref)
        assert torch.equal(got[inf], ref[inf]), f"{what}: inf values differ"
        err = (got[finite] - ref[finite]).abs()
        bound = self.bound()[finite]
        worst = (err - bound).argmax() if err.numel() else None
        assert bool((err <= bound).all()), (
            f"{what}: error {err[worst].item():.3e} exceeds fp32 bound {bound[worst].item():.3e}"
        )
