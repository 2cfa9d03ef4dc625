"""The wrapper's ``max_grad_norm`` reads the window's norm from the kernels that wrote it
(``accumulate_(..., norm_sq=...)``, accumkernels.optim.window_norm) instead of a pass over the
window. Judge: the float64 2-norm of the fp32 window the step clips (what
``torch.nn.utils.clip_grad_norm_`` measures), also after every kind of write the slots do not
see, which must make the step measure the window itself. Tolerance: the slots and torch sum the
squares in fp32 in different orders; per param (<= 208 elements here) the relative error is at
most gamma(209) ~ 1.3e-5 on the squares, so 1e-5 on the norm."""

from __future__ import annotations

import pytest
import torch

from accumkernels import AccumulatingOptimizer

MAX_NORM = 0.3


def setup(reduction: str = "sum"):
    torch.manual_seed(int(torch.randint(0, 2**31 - 1, ()).item()))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                                torch.nn.Linear(4, 4))
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                max_grad_norm=MAX_NORM, reduction=reduction)
    return model, opt


def backward(model, use_last: bool = True) -> None:
    x = torch.randn(5, 8)
    h = model[2](model[1](model[0](x)))
    (model[3](h) if use_last else h).pow(2).sum().backward()


def window_norm(opt) -> float:
    """float64 2-norm of what the step normalises and clips (the views, after normalising)."""
    return float(torch.linalg.vector_norm(torch.cat([p.grad.double().flatten()
                                                     for p in opt._params
                                                     if p.grad is not None])))


WRITES = {
    "none": lambda model, opt: None,
    "user_scales_one_grad": lambda model, opt: model[0].weight.grad.mul_(3.0),
    "model_zero_grad_in_place_then_more": lambda model, opt: (
        model.zero_grad(set_to_none=False), backward(model, use_last=False)),
    "opt_zero_grad_then_more": lambda model, opt: (opt.zero_grad(), backward(model)),
    "assigned_grad": lambda model, opt: setattr(model[2].bias, "grad",
                                                torch.randn_like(model[2].bias) * 5),
    "param_unused_in_last": lambda model, opt: backward(model, use_last=False),
}


@pytest.mark.parametrize("write", sorted(WRITES))
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_clip_norm_is_the_windows_norm(write, reduction):
    model, opt = setup(reduction)
    for _ in range(3):
        backward(model)
    WRITES[write](model, opt)
    opt._settle()
    expected = window_norm(opt)
    if reduction == "mean":
        expected /= opt.micro_steps  # the step divides the window by N before clipping
    tracked = opt._norm.norm([p for p in opt._params if id(p) in opt._window.touched])
    trusted = ("none", "param_unused_in_last", "opt_zero_grad_then_more")  # (a fresh window)
    assert (tracked is not None) == (write in trusted), \
        "the slots were trusted after a write they did not see (or distrusted for nothing)"
    opt.step()
    got = float(opt.last_grad_norm)
    assert abs(got - expected) <= 1e-5 * expected, (got, expected)
    assert expected > MAX_NORM, "test too weak: the window was not clipped"


def test_clipped_step_matches_native_clip_grad_norm():
    """Native loop (fused AdamW, clip_grad_norm_ before step) against the wrapper with
    max_grad_norm: the same params to fp32 rounding of the clip coefficient (the wrapper
    divides by 1/coef inside fused AdamW, native multiplies by coef)."""
    model, opt = setup()
    native_model = torch.nn.Sequential(*(torch.nn.Linear(m.in_features, m.out_features)
                                         if isinstance(m, torch.nn.Linear) else torch.nn.Tanh()
                                         for m in model))
    native_model.load_state_dict(model.state_dict())
    native = torch.optim.AdamW(native_model.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        state = torch.get_rng_state()
        for _ in range(3):
            backward(model)
        torch.set_rng_state(state)
        for _ in range(3):
            backward(native_model)
        native_norm = torch.nn.utils.clip_grad_norm_(native_model.parameters(), MAX_NORM)
        native.step()
        native.zero_grad()
        opt.step()
        opt.zero_grad()
        assert abs(float(opt.last_grad_norm) - float(native_norm)) <= 1e-5 * float(native_norm)
    for a, b in zip(model.parameters(), native_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
