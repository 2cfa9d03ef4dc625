"""Intake and visibility (DESIGN: "Window", "Visibility — the invariant"): how a backward's
gradients reach the fp32 window -- post-accumulate-grad hooks and one fused launch per bucket, or
``accumulate()`` -- with partial buckets, params without a gradient and frozen params, what is
released during the backward, and what ``p.grad`` shows: the zero-copy fp32 view of the window,
whose in-place edits the step uses. The same invariant against native PyTorch, frameworks
included: test_native_equivalence.py.
"""

from __future__ import annotations

import copy

import weakref

import pytest
import torch
import torch.nn.functional as F
from _optim_common import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    rel_err,
)
from torch import nn

from accumkernels import AccumulatingOptimizer

# -- backends and buckets --------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_wrapper_backends_agree(backend):
    """The wrapper's backend argument reaches the op; every CPU backend gives the fp32 window."""
    N = 3
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                reduction="mean", backend=backend, bucket_size_mb=SMALL_BUCKET)
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4, torch.bfloat16):
        mse(model, x, y).backward()
    for h in handles:
        h.remove()
    assert opt.sync_step
    for name, p in model.named_parameters():  # fp32 sum of 3 scaled bf16 grads: rel ~1e-7
        assert rel_err(p.main_grad, sum(g.double() for g in caps[name]) / N) < 1e-6


class Heads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(12, 16)
        self.a, self.b, self.c = nn.Linear(16, 3), nn.Linear(16, 3), nn.Linear(16, 3)

    def forward(self, x, heads):
        h = torch.tanh(self.trunk(x))
        return sum(getattr(self, name)(h) for name in heads)


# Window 1: head c is used once; window 2: c is never used (its master gradient must be 0,
# not window 1's data). Every micro-batch leaves some params without a gradient.
WINDOWS = [["a", "b", "c", "ab"], ["a", "b", "a", "b"]]


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("bucket_size_mb", [0.0003, SMALL_BUCKET, 25])
def test_partial_buckets_and_params_without_gradient(bucket_size_mb, in_backward):
    model = Heads()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4,
                                accumulate_in_backward=in_backward, bucket_size_mb=bucket_size_mb)
    if bucket_size_mb < 25:
        assert len(opt._parts.window.storage.buckets) > 2
    for window in WINDOWS:
        caps, handles = capture_grads(model)
        for heads in window:
            x, y = torch.randn(4, 12), torch.randn(4, 3)
            F.mse_loss(model(x, heads), y).backward()
            opt.accumulate()
        for h in handles:
            h.remove()
        assert opt.sync_step
        for name, p in model.named_parameters():
            ref = sum((g.double() for g in caps[name]), torch.zeros(p.shape, dtype=torch.float64))
            if not caps[name]:
                assert torch.equal(p.main_grad, torch.zeros_like(p)), name
            else:  # fp32 sum of <= 4 fp32 grads vs float64: relative ~1e-7
                assert rel_err(p.main_grad, ref) < 1e-6, name
                assert p.grad.data_ptr() == p.main_grad.data_ptr()
        opt.step()
        opt.zero_grad()


def test_param_unused_in_window_is_not_stepped_like_native():
    model = Heads()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
                                accumulation_steps=4, bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for window in WINDOWS:
        data = [(torch.randn(4, 12), torch.randn(4, 3)) for _ in window]
        for mod, o in ((model, opt), (ref, ref_opt)):
            for heads, (x, y) in zip(window, data):
                F.mse_loss(mod(x, heads), y).backward()
            o.step()
            o.zero_grad()
    # Head c: window 1 hands both sides the same single fp32 gradient (equal to rounding); in
    # window 2 it gets none, so native AdamW leaves it alone.
    for p, q in zip(model.c.parameters(), ref.c.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_frozen_params_are_left_out_by_the_wrapper():
    model = make_model(torch.bfloat16)
    model[2].weight.requires_grad_(False)
    frozen = model[2].weight.detach().clone()
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=2, bucket_size_mb=SMALL_BUCKET)
    assert not hasattr(model[2].weight, "main_grad")
    inner = [p for g in opt.param_groups for p in g["params"]]
    assert any(p is model[2].weight for p in inner)  # not re-targeted to an fp32 master
    start = params_of(model)
    for x, y in batches(4, 4, torch.bfloat16):
        mse(model, x, y).backward()
        opt.step()
    assert torch.equal(model[2].weight, frozen) and model[2].weight.grad is None
    assert sum(not torch.equal(p, s) for p, s in zip(model.parameters(), start)) == 5


# -- memory and visibility -------------------------------------------------------------------------


def test_no_low_precision_grad_left_after_backward():
    N = 3
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    seen = []  # dtypes autograd produced (the hooks see bf16: the check below is not vacuous)
    released = []  # during backward, when the first layer's grad arrives (it comes last) ...
    later = [p for layer in (model[2], model[4]) for p in layer.parameters()]
    arrived = []  # weak references to the later layers' bf16 gradients of this backward

    def first_layer_hook(g):
        seen.append(g.dtype)  # ... the later layers' buckets are complete: moved, and their
        released.append(len(arrived) == len(later)  # bf16 gradients released; .grad shows
                        and all(ref() is None for ref in arrived)  # the window or nothing
                        and all(p.grad is None or p.grad.data_ptr() == p.main_grad.data_ptr()
                                for p in later))
        arrived.clear()

    handles = [p.register_hook(lambda g: arrived.append(weakref.ref(g))) for p in later]
    h = model[0].weight.register_hook(first_layer_hook)
    for i, (x, y) in enumerate(batches(2 * N, 4, torch.bfloat16)):
        mse(model, x, y).backward()
        for p in model.parameters():  # the running window: the fp32 view, nothing in bf16
            assert p.grad is not None and p.grad.dtype == torch.float32
            assert p.grad.data_ptr() == p.main_grad.data_ptr()
        opt.step()
    h.remove()
    for handle in handles:
        handle.remove()
    assert seen == [torch.bfloat16] * (2 * N)
    assert released == [True] * (2 * N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_boundary_grad_is_a_view_and_edits_are_used(dtype):
    N, lr = 3, 0.5
    model = make_model(dtype)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                reduction="mean", bucket_size_mb=SMALL_BUCKET)
    inner_params = opt.master_params or [p for g in opt.param_groups for p in g["params"]]
    start = [p.detach().double() for p in inner_params]
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4, dtype):
        mse(model, x, y).backward()
    for h in handles:
        h.remove()
    for name, p in model.named_parameters():
        assert p.grad.dtype == torch.float32
        assert p.grad.data_ptr() == p.main_grad.data_ptr()
        # mean of 3 grads summed in fp32 vs float64: relative ~1e-7.
        assert rel_err(p.grad, sum(g.double() for g in caps[name]) / N) < 1e-6
    unclipped = [p.grad.double() for p in model.parameters()]
    norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in unclipped])).item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25 * norm)  # edits p.grad in place
    clipped = [p.grad.double() for p in model.parameters()]
    coef = 0.25 * norm / (norm + 1e-6)  # clip_grad_norm_'s documented coefficient
    for g, u in zip(clipped, unclipped):  # fp32 norm and product: relative rounding ~1e-7
        torch.testing.assert_close(g, coef * u, rtol=1e-6, atol=0)
    opt.step()
    for q, s, g in zip(inner_params, start, clipped):
        # fp32 SGD update (master weight for bf16): rounding of O(1) values, atol 1e-6.
        torch.testing.assert_close(q.detach().double(), s - lr * g, rtol=0, atol=1e-6)
    for p, q in zip(model.parameters(), inner_params):
        assert torch.equal(p, q.detach().to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_in_backward_false_grad_visibility(dtype):
    """accumulate_in_backward=False: after a backward p.grad holds the gradients of the backwards
    since the last accumulate(), in the param dtype, exactly as autograd left them (what native
    .grad holds over those backwards); accumulate() moves them and p.grad is the fp32 window
    view; the N-th backward moves them by itself."""
    N = 4
    model = make_model(dtype)
    twin = copy.deepcopy(model)  # native autograd, zeroed where the wrapper moves its grads
    moved = [0.0] * len(list(model.parameters()))
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=False, bucket_size_mb=SMALL_BUCKET)
    for k, (x, y) in enumerate(batches(N, 4, dtype)):
        mse(model, x, y).backward()
        mse(twin, x, y).backward()
        if k < N - 1:  # not moved yet: bit-equal to native's .grad over the same backwards
            for p, q in zip(model.parameters(), twin.parameters()):
                assert p.grad.dtype == dtype and torch.equal(p.grad, q.grad)
        if k == 1:
            opt.accumulate()
        if k in (1, N - 1):  # moved: autograd's sum of backwards 0-1, then 2-3 (param dtype)
            moved = [q.grad.double() + m for q, m in zip(twin.parameters(), moved)]
            twin.zero_grad()
            assert opt.micro_steps == k + 1
            for (name, p), ref in zip(model.named_parameters(), moved):  # the fp32 window view
                assert p.grad.dtype == torch.float32
                assert p.grad.data_ptr() == p.main_grad.data_ptr()
                # 2 terms summed in fp32 (bf16 terms are exact in fp32): relative ~6e-8.
                assert rel_err(p.grad, ref) < 1e-6, name
