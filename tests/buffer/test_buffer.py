"""MasterGradBuffer (DESIGN: "accumkernels.MasterGradBuffer"): disjoint fp32 views that cover
every trainable param and are its ``main_grad``, buckets in reverse order and of the asked size,
accumulate/overwrite of given params only, validation of its input. How the wrapper feeds it
during backward: tests/optim/intake/test_intake.py."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch import nn

from accumkernels import MasterGradBuffer

# ~0.001 MB = 262 fp32 elements: several buckets for the shapes below, some of them partial.
SMALL_BUCKET = 0.001
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
