"""Loss scaling (DESIGN: "loss_scale"): a static scale is divided out in the fused accumulation;
``"dynamic"`` backs off on an overflowing window and grows after good steps like
``torch.amp.GradScaler``, through a real fp16 overflow and through 200 overflowing windows in a
row, after which training resumes.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _optim_common import (
    assert_params_close,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    total_rel_err,
    wrap_sgd,
)


def test_static_loss_scale_is_unscaled_in_accumulation():
    N, S = 3, 1024.0
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=N, loss_scale=S)
    assert opt.loss_scale == S
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4):
        loss = mse(model, x, y)
        scaled = opt.scale_loss(loss)
        assert torch.equal(scaled, loss * S)
        scaled.backward()
    for h in handles:
        h.remove()
    # The captured grads are S * g; the fused unscale must divide S out. S is a power of two, so
    # only the fp32 summation of 3 terms rounds: norm-wise relative error ~1e-7 (elementwise it
    # can be larger where the terms cancel).
    ref = [sum(g.double() for g in caps[n]) / S for n, _ in model.named_parameters()]
    assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
    assert total_rel_err([p.grad for p in model.parameters()], [r * S for r in ref]) > 0.5


def test_dynamic_loss_scale_backs_off_and_grows():
    N = 2
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=N, loss_scale="dynamic")
    opt._parts.scaler.growth_interval = 3
    scale0 = opt.loss_scale
    assert scale0 >= 2.0 ** 10

    def window(poison=False):
        before = params_of(model)
        scale = opt.loss_scale
        caps, handles = capture_grads(model)
        for i, (x, y) in enumerate(batches(N, 4)):
            if poison and i == 0:
                x[0, 0] = math.inf
            loss = mse(model, x, y)
            scaled = opt.scale_loss(loss)
            assert torch.equal(scaled, loss * scale)  # a power of two: exact
            scaled.backward()
        for h in handles:
            h.remove()
        if not poison:  # the boundary gradient is unscaled by the current S (fp32 sum: 1e-7)
            ref = [sum(g.double() for g in caps[n]) / scale for n, _ in model.named_parameters()]
            assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
        opt.step()
        opt.zero_grad()  # (a loop's clear: without it the next window adds to this one)
        return any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))

    assert not window(poison=True)  # overflow: the step is skipped ...
    assert opt.skipped_steps == 1 and opt.loss_scale == scale0 / 2  # ... and the scale halves
    assert window() and window() and opt.loss_scale == scale0 / 2
    assert window() and opt.loss_scale == scale0  # doubled after 3 good steps
    assert window() and opt.loss_scale == scale0


def test_dynamic_loss_scale_fp16_overflow_backs_off_until_finite():
    """A real fp16 overflow: the gradient times 2**16 exceeds 65504."""
    model = make_model(torch.float16)
    opt = wrap_sgd(model, accumulation_steps=1, loss_scale="dynamic")
    x, y = batches(1, 4, torch.float16)[0]
    start = params_of(model)
    steps = 0
    while True:
        opt.scale_loss(mse(model, x, y) * 64).backward()
        opt.step()
        steps += 1
        if opt.skipped_steps < steps:
            break
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert steps < 16
    assert steps > 1  # it did overflow at first
    assert opt.loss_scale < 2.0 ** 16
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_dynamic_loss_scale_survives_200_overflowing_windows(dtype):
    """200 windows in a row hold a non-finite micro-batch (each backs the scale off); then healthy
    windows: the scale stays positive and finite, and training resumes (like native for fp32)."""
    N, lr = 2, 0.1
    template = make_model(dtype)
    model, native = copy.deepcopy(template), copy.deepcopy(template)
    opt = wrap_sgd(model, lr=lr, accumulation_steps=N, loss_scale="dynamic")
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    start = params_of(model)
    x, y = batches(1, 4, dtype)[0]
    bad = x.clone()
    bad[0, 0] = math.inf
    for _ in range(200):
        for inp in (bad, x):
            opt.scale_loss(mse(model, inp, y)).backward()
            opt.step()
    assert opt.skipped_steps == 200
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    scale = float(opt.loss_scale)
    assert math.isfinite(scale) and scale > 0, f"loss scale {scale} after 200 overflows"
    for w in range(3):
        data = batches(N, 4, dtype)
        before = params_of(model)
        for xi, yi in data:
            opt.scale_loss(mse(model, xi, yi)).backward()
            opt.step()
        opt.zero_grad()  # (as the native loop clears)
        assert opt.skipped_steps == 200, f"healthy window {w} was skipped"
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"window {w}: not finite"
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), \
            f"healthy window {w} did not change the params"
        if dtype == torch.float32:
            for xi, yi in data:
                mse(native, xi, yi).backward()
            native_opt.step()
            native_opt.zero_grad()
            assert_params_close(model, native, atol=1e-5, what=f"window {w}: ")
        scale = float(opt.loss_scale)
        assert math.isfinite(scale) and scale > 0
