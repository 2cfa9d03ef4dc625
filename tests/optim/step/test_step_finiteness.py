"""The step's finiteness decision (DESIGN: "The step steps what is in the window", "nonfinite"): the
kernels flag a non-finite *result* as they write it, so every way a non-finite value can reach the
window must end in the non-finite policy (``skip_step``: the window is dropped, the params are
untouched; ``raise``: FloatingPointError), and finite windows must step. Each case against its
control: the same loop with finite values steps."""

from __future__ import annotations

import pytest
import torch

from accumkernels import AccumulatingOptimizer

BIG = torch.finfo(torch.float32).max


def model_and_opt(policy: str, **kwargs):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = torch.nn.Linear(6, 3)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), nonfinite=policy,
                                **kwargs)
    return model, opt


def backward_with(model, grad_scale: float) -> None:
    """A backward of 4 samples of 0.5: the bias gradient is 4 * grad_scale, the weight's
    2 * grad_scale (finite for grad_scale = 6e37; two of them sum past FLT_MAX for the bias)."""
    x = torch.full((4, 6), 0.5)
    (model(x).sum() * grad_scale).backward()


def outcome(model, opt, before) -> str:
    try:
        opt.step()
    except FloatingPointError:
        return "raised"
    same = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    if same and opt.skipped_steps == 1:
        return "skipped"
    assert not same and opt.skipped_steps == 0, "neither stepped nor skipped"
    return "stepped"


CASES = {
    # two finite micro-batches whose fp32 sum overflows: only the result is non-finite
    "overflowed_sum": lambda model, opt, bad: [backward_with(model, 6e37 if bad else 1.0)
                                                for _ in range(2)],
    # a gradient assigned by the user (not written by a kernel)
    "assigned": lambda model, opt, bad: setattr(
        model.weight, "grad", torch.full_like(model.weight, float("inf") if bad else 0.5)),
    # a plain non-finite gradient from the backward
    "backward_nan": lambda model, opt, bad: backward_with(model, float("nan") if bad else 1.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("policy", ["skip_step", "raise"])
def test_every_way_in_ends_in_the_policy(case, policy):
    for bad in (False, True):
        model, opt = model_and_opt(policy)
        before = [p.detach().clone() for p in model.parameters()]
        CASES[case](model, opt, bad)
        got = outcome(model, opt, before)
        want = ("skipped" if policy == "skip_step" else "raised") if bad else "stepped"
        assert got == want, f"{case}, bad={bad}: {got}"


def test_weighted_rescale_above_one_that_overflows_is_caught():
    """reduction='weighted' with weights summing below 1 multiplies the window up at the step
    (after the kernels flagged it): a finite sum that overflows there is still dropped."""
    for huge in (False, True):
        model, opt = model_and_opt("skip_step", reduction="weighted")
        before = [p.detach().clone() for p in model.parameters()]
        backward_with(model, 6e37 if huge else 1.0)  # finite window: bias 2.4e38
        opt.add_weight(0.5)  # the step divides by 0.5: the bias overflows
        got = outcome(model, opt, before)
        assert got == ("skipped" if huge else "stepped"), (huge, got)


def test_float64_param_outside_the_window_is_checked():
    """A float64 param trains natively beside the window; its non-finite gradient drops the
    step too."""
    for bad in (False, True):
        torch.manual_seed(1)
        a = torch.nn.Parameter(torch.randn(3))
        b = torch.nn.Parameter(torch.randn(3, dtype=torch.float64))
        opt = AccumulatingOptimizer(torch.optim.SGD([a, b], lr=0.1))
        before = [a.detach().clone(), b.detach().clone()]
        scale = float("inf") if bad else 1.0
        ((a * 2).sum() + (b * scale).sum()).backward()
        opt.step()
        same = torch.equal(a, before[0]) and torch.equal(b, before[1])
        assert same == bad and opt.skipped_steps == int(bad)
