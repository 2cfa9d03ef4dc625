"""max_grad_norm: fused global-norm clipping at the boundary (DESIGN: "max_grad_norm") against
``clip_grad_norm_`` on native fp32 ``.grad`` (the norm and the params), active and idle, and on the
fp32 master gradients of a bf16 model. What the norm sees after user writes to the window:
test_step_measures.py.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    wrap_sgd,
)

from accumkernels import AccumulatingOptimizer


@pytest.mark.parametrize("active", [True, False])
def test_fused_clipping_matches_clip_grad_norm(active):
    N, lr = 3, 0.1
    model = make_model()
    native = copy.deepcopy(model)
    data = batches(N, 4)
    for x, y in data:  # native fp32 accumulation in .grad
        mse(native, x, y).backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in native.parameters()]))
    max_norm = 0.3 * norm.item() if active else 3.0 * norm.item()
    native_norm = torch.nn.utils.clip_grad_norm_(native.parameters(), max_norm)
    torch.optim.SGD(native.parameters(), lr=lr).step()

    opt = wrap_sgd(model, accumulation_steps=N, max_grad_norm=max_norm)
    for x, y in data:
        mse(model, x, y).backward()
    opt.step()
    # Both sides sum the same 3 fp32 grads in fp32: the norms agree to fp32 rounding (rel 1e-6)
    # and the params to a few fp32 ulps of the O(1) values.
    torch.testing.assert_close(opt.last_grad_norm, native_norm, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), native.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_fused_clipping_bf16_acts_on_fp32_master_grads():
    N, lr = 3, 0.1
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                max_grad_norm=0.05, bucket_size_mb=SMALL_BUCKET)
    masters = opt.master_params
    start = [q.detach().double() for q in masters]
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4, torch.bfloat16):
        mse(model, x, y).backward()
    for h in handles:
        h.remove()
    ref = [sum(g.double() for g in caps[n]) for n, _ in model.named_parameters()]
    ref_norm = math.sqrt(sum((r ** 2).sum().item() for r in ref))
    assert ref_norm > 0.05
    opt.step()
    # Pre-clip norm of the fp32 sum of bf16 grads vs float64: relative ~1e-7.
    assert math.isclose(opt.last_grad_norm.item(), ref_norm, rel_tol=1e-6)
    coef = 0.05 / ref_norm
    for q, s, r in zip(masters, start, ref):
        torch.testing.assert_close(q.detach().double(), s - lr * coef * r, rtol=0, atol=1e-6)
