"""MasterGradBuffer (views, buckets, validation) and how the wrapper uses it: partial buckets,
params without a gradient, the zero-copy p.grad at the boundary, memory released in backward."""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from test_optim import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    rel_err,
)
from torch import nn

from accumkernels import AccumulatingOptimizer, MasterGradBuffer

SHAPES = [(3,), (1,), (5, 7), (33,), (64, 9), (2, 3, 4), (100,), (4097,)]


def make_params(frozen=(2,)):
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    for i in frozen:
        params[i].requires_grad_(False)
    return params


def offset(view, flat):
    return (view.data_ptr() - flat.data_ptr()) // flat.element_size()


def test_views_are_disjoint_cover_every_trainable_param_and_are_main_grad():
    params = make_params()
    trainable = [p for p in params if p.requires_grad]
    buf = MasterGradBuffer(params, bucket_size_mb=SMALL_BUCKET)
    flat = buf.buffers[torch.device("cpu")]
    assert flat.dtype == torch.float32 and buf.numel >= sum(p.numel() for p in trainable)
    assert params[2] not in buf and not hasattr(params[2], "main_grad")
    spans = []
    for p in trainable:
        v = buf.view(p)
        assert p in buf
        assert v.shape == p.shape and v.dtype == torch.float32 and v.is_contiguous()
        assert p.main_grad.data_ptr() == v.data_ptr() and p.main_grad.shape == p.shape
        assert v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # zero-copy
        spans.append((offset(v, flat), offset(v, flat) + v.numel()))
        assert 0 <= spans[-1][0] and spans[-1][1] <= flat.numel()
    for (a0, a1), (b0, b1) in itertools.combinations(spans, 2):
        assert a1 <= b0 or b1 <= a0
    flat.fill_(math.nan)  # and by writing: every view keeps its own values
    for i, p in enumerate(trainable):
        buf.view(p).fill_(i + 1)
    for i, p in enumerate(trainable):
        assert (p.main_grad == i + 1).all()
    buf.zero_()
    assert all((p.main_grad == 0).all() for p in trainable)


@pytest.mark.parametrize("bucket_size_mb", [0.0003, SMALL_BUCKET, 0.01, 25])
def test_buckets_reverse_order_and_size(bucket_size_mb):
    params = make_params()
    trainable = [p for p in params if p.requires_grad]
    buf = MasterGradBuffer(params, bucket_size_mb=bucket_size_mb)
    flat = buf.buffers[torch.device("cpu")]
    order = [p for b in buf.buckets for p in b.params]
    assert [id(p) for p in order] == [id(p) for p in reversed(trainable)]
    capacity = bucket_size_mb * 2**20 / 4  # fp32 elements
    if bucket_size_mb <= SMALL_BUCKET:
        assert len(buf.buckets) > 2
    if bucket_size_mb == 25:
        assert len(buf.buckets) == 1
    end = 0
    for i, b in enumerate(buf.buckets):
        assert b.index == i and buf.buckets[i] is b
        assert len(b.params) == 1 or sum(p.numel() for p in b.params) <= capacity
        start = offset(b.flat, flat)
        assert start >= end  # buckets are disjoint, contiguous ranges, in order
        end = start + b.flat.numel()
        for p in b.params:
            assert buf.bucket_of(p) is b
            o = offset(buf.view(p), flat)
            assert start <= o and o + p.numel() <= end
    if bucket_size_mb >= SMALL_BUCKET:  # small params share a bucket (not one per param)
        assert any(len(b.params) > 1 for b in buf.buckets)


def test_accumulate_overwrite_touches_only_the_given_params():
    params = [nn.Parameter(torch.randn(s)) for s in [(7,), (3, 5), (11,)]]
    buf = MasterGradBuffer(params)
    (bucket,) = buf.buckets
    bucket.flat.fill_(math.nan)  # poisoned: overwrite must not read it
    g = [torch.randn(p.shape).to(torch.bfloat16) for p in params]
    buf.accumulate([params[1]], [g[1]], 0.5, overwrite=True)
    assert torch.equal(buf.view(params[1]), g[1].float() * 0.5)  # exact: power-of-two scale
    assert buf.view(params[0]).isnan().all() and buf.view(params[2]).isnan().all()
    buf.accumulate([params[0], params[2]], [g[0], g[2]], 0.5, overwrite=True)
    buf.accumulate(params, g, 0.25)
    for i, p in enumerate(params):  # each element: at most two fp32 roundings of bf16 values
        ref = g[i].double() * 0.75
        torch.testing.assert_close(buf.view(p).double(), ref, rtol=2 ** -23, atol=0)
    bucket.flat.fill_(math.nan)
    buf.accumulate(params, g, 1.0, overwrite=True)
    for i, p in enumerate(params):
        assert torch.equal(buf.view(p), g[i].float())


def test_buffer_rejects_bad_input():
    p = nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="more than once"):
        MasterGradBuffer([p, nn.Parameter(torch.randn(2)), p])
    with pytest.raises(ValueError, match="meta device"):
        MasterGradBuffer([nn.Parameter(torch.randn(3, device="meta"))])
    with pytest.raises(ValueError, match="float32"):
        MasterGradBuffer([p], dtype=torch.float16)
    for size in (0, -1.0, math.nan, True):
        with pytest.raises(ValueError, match="bucket_size_mb"):
            MasterGradBuffer([p], bucket_size_mb=size)
    with pytest.raises(TypeError, match="iterable"):
        MasterGradBuffer(p)
    with pytest.raises(KeyError, match="not managed"):
        MasterGradBuffer([p]).view(nn.Parameter(torch.randn(4)))


def test_buffer_rejects_non_tensor_element():
    with pytest.raises(TypeError, match=r"params\[1\]"):
        MasterGradBuffer([nn.Parameter(torch.randn(4)), 1.0])


def test_buffer_infinite_bucket_size():
    try:
        buf = MasterGradBuffer([nn.Parameter(torch.randn(4))], bucket_size_mb=math.inf)
    except (TypeError, ValueError):
        return
    assert len(buf.buckets) == 1


# -- the wrapper's bucket logic ------------------------------------------------------------------

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


# -- memory and visibility ------------------------------------------------------------------------

def test_no_low_precision_grad_left_after_backward():
    N = 3
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3),
                                accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    seen = []  # dtypes autograd produced (the hooks see bf16: the check below is not vacuous)
    released = []  # during backward, when the first layer's grad arrives (it comes last) ...

    def first_layer_hook(g):
        seen.append(g.dtype)  # ... the later layers' buckets are complete: moved and released
        released.append(all(p.grad is None for layer in (model[2], model[4])
                            for p in layer.parameters()))

    h = model[0].weight.register_hook(first_layer_hook)
    for i, (x, y) in enumerate(batches(2 * N, 4, torch.bfloat16)):
        mse(model, x, y).backward()
        for p in model.parameters():  # the running window: the fp32 view, nothing in bf16
            assert p.grad is not None and p.grad.dtype == torch.float32
            assert p.grad.data_ptr() == p.main_grad.data_ptr()
        opt.step()
    h.remove()
    assert seen == [torch.bfloat16] * (2 * N)
    assert released == [True] * (2 * N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_boundary_grad_is_a_view_and_edits_are_used(dtype):
    N, lr = 3, 0.5
    model = make_model(dtype)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                reduction="mean", bucket_size_mb=SMALL_BUCKET)
    inner_params = [p for g in opt.param_groups for p in g["params"]]
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


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_backward_after_complete_window_keeps_accumulating_like_native(in_backward):
    """No step() after N micro-batches: like native PyTorch, the next backward adds on."""
    N = 2
    model = make_model()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(N + 1, 4):
        for mod, o in ((model, opt), (ref, ref_opt)):
            mse(mod, x, y).backward()
        opt.accumulate()
    assert opt.micro_steps == N + 1 and opt.sync_step
    for p, q in zip(model.parameters(), ref.parameters()):  # 3 fp32 terms: rounding ~1e-7
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
