"""Attacks on the op layer: memory overlap, compiled vs eager, meta/fake tensors,
autograd safety, odd scales. A refused call must leave every tensor bit-identical.

Each test runs on the C++ checks and on the Python spec (``reader``), and on every CPU backend.
"""

from __future__ import annotations

import fractions

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA
from reference import Reference
from torch import nn

import accumkernels
from accumkernels import MasterGradBuffer
from accumkernels.ops.plan import LaunchPlan

BACKENDS = ["cpu", "torch"] + ([] if HAS_CUDA else ["triton"])


def rand(n, dtype=torch.float32, shape=None):
    """Random values over several binades (never zeros)."""
    x = torch.randn(n) * torch.exp2(torch.randint(-4, 4, (n,)).float())
    return x.to(dtype).reshape(shape if shape is not None else (n,))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().reshape(-1).view(torch.uint8)


class Frozen:
    """Bit patterns of tensors before a call that must fail, to compare after it."""

    def __init__(self, *tensors):
        self.tensors = [t for t in tensors
                        if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        self.before = [bits(t) for t in self.tensors]

    def check(self):
        for i, (t, b) in enumerate(zip(self.tensors, self.before)):
            assert torch.equal(bits(t), b), f"tensor {i} was written by a call that failed"


def refused(exc, match, dst, src, *extra, **kwargs):
    """Call accumulate_, expect `exc` matching `match`, and check nothing changed."""
    frozen = Frozen(*dst, *src, *extra, *(v for v in kwargs.values()))
    with pytest.raises(exc, match=match):
        accumkernels.accumulate_(dst, src, **kwargs)
    frozen.check()


# -- dst overlapping src -----------------------------------------------------------------------

def _bf16_view_of_own_dst(dst, src):
    src[1] = dst[1].view(torch.bfloat16)[: dst[1].numel()]  # dst's own bytes, read as bf16
    return r"src\[1\] overlaps dst\[1\]"


def _src_is_another_dst(dst, src):
    src[2] = dst[0]
    return r"src\[2\] overlaps dst\[0\]"


def _src_shifted_over_dst(dst, src):
    flat = rand(2 * dst[1].numel())
    dst[1] = flat[: dst[1].numel()]
    src[1] = flat[1: dst[1].numel() + 1]
    return r"src\[1\] overlaps dst\[1\]"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("attack", [_bf16_view_of_own_dst, _src_is_another_dst,
                                    _src_shifted_over_dst],
                         ids=lambda f: f.__name__.strip("_"))
def test_src_overlapping_a_dst_is_refused(reader, backend, attack):
    dst = [rand(n) for n in (33, 64, 33)]
    src = [rand(d.numel(), torch.bfloat16) for d in dst]
    match = attack(dst, src)
    refused(ValueError, match, dst, src, scale=0.5, backend=backend)
    if attack is not _src_is_another_dst:  # torch refuses the same overlap in its own add_
        with pytest.raises(RuntimeError, match="memory location"):
            dst[1].add_(src[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_found_inf_and_scale_may_not_overlap_dst(reader, backend):
    dst = [rand(8), rand(5)]
    src = [rand(8, torch.float16), rand(5, torch.bfloat16)]
    refused(ValueError, r"found_inf overlaps dst\[1\]", dst, src, found_inf=dst[1][2:3],
            backend=backend)
    refused(ValueError, r"scale overlaps dst\[0\]", dst, src, scale=dst[0][4], backend=backend)
    src32 = [rand(8), src[1]]
    refused(ValueError, r"found_inf overlaps src\[0\]", dst, src32, found_inf=src32[0][3:4],
            backend=backend)
    flag = rand(1)
    refused(ValueError, "found_inf overlaps scale", dst, src, scale=flag, found_inf=flag,
            backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_src_exactly_its_own_dst_is_elementwise_like_torch(reader, backend):
    """dst[i] += s * dst[i] touches each element once: allowed, like torch's a.add_(a)."""
    dst = [rand(9), rand(4097)]
    src = [rand(9, torch.bfloat16), dst[1]]
    refs = [Reference(d) for d in dst]
    refs[0].add(src[0], 0.75)
    refs[1].add(dst[1], 0.75)
    accumkernels.accumulate_(dst, src, 0.75, backend=backend)
    for r, d in zip(refs, dst):
        r.check(d)


# -- compiled and eager agree on aliasing ----------------------------------------------------------

@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("alias", ["same_tensor", "overlapping_views"])
def test_compiled_refuses_aliased_dst_like_eager(compile_backend, alias):
    def step(dst, src):
        accumkernels.accumulate_(dst, src, 0.5, backend="cpu")

    compiled = torch.compile(step, backend=compile_backend, fullgraph=True)
    base = rand(70000)  # big enough for the CPU kernel to split it across threads
    if alias == "same_tensor":
        dst = [base[:65539], base[:65539]]
    else:
        dst = [base[:65539], base[4000:69539]]
    src = [rand(65539, torch.bfloat16) for _ in range(2)]
    for fn in (step, compiled):
        frozen = Frozen(base, *src)
        with pytest.raises(ValueError, match=r"dst\[1\] overlaps dst\[0\]"):
            fn(dst, src)
        frozen.check()


# -- meta tensors and FakeTensorMode: shape-only no-ops --------------------------------------------

def _meta_lists(n=4):
    dst = [torch.empty(5 + i, device="meta") for i in range(n)]
    src = [torch.empty(5 + i, device="meta", dtype=torch.bfloat16) for i in range(n)]
    return dst, src


def test_meta_tensors_are_shape_only_noops(reader):
    dst, src = _meta_lists()
    accumkernels.accumulate_(dst, src, 0.5, found_inf=torch.empty(1, device="meta"))
    accumkernels.accumulate_(dst, src, torch.empty((), device="meta"), overwrite=True)
    src[2] = torch.empty(3, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"src\[2\] has shape"):
        accumkernels.accumulate_(dst, src)
    dst, src = _meta_lists()
    src[1] = src[1].double()
    with pytest.raises(TypeError, match=r"src\[1\] has dtype"):
        accumkernels.accumulate_(dst, src)
    with pytest.raises(ValueError, match="not available on device meta"):
        accumkernels.accumulate_(*_meta_lists(), backend="cpu")


def test_fake_tensor_mode_is_a_shape_only_noop(reader):
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        dst = [torch.empty(6), torch.empty(2, 3)]
        src = [torch.empty(6, dtype=torch.bfloat16), torch.empty(2, 3, dtype=torch.float16)]
        accumkernels.accumulate_(dst, src, 0.5, found_inf=torch.zeros(1))
        torch.ops.accumkernels.accumulate_(dst, src, 0.5, None, False, None, "cpu", None, None)
        with pytest.raises(ValueError, match=r"src\[1\] has shape"):
            accumkernels.accumulate_(dst, [src[0], torch.empty(3, 2)])
        with pytest.raises(TypeError, match=r"dst\[0\] has dtype"):
            accumkernels.accumulate_([dst[0].half(), dst[1]], src)


# -- autograd safety -----------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_leaf_that_requires_grad_is_refused_in_grad_mode_like_torch(reader, backend):
    leaf = rand(6).requires_grad_()
    dst, src = [rand(3), leaf], [rand(3, torch.bfloat16), rand(6, torch.bfloat16)]
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.add_(src[1])  # what torch does
    refused(RuntimeError, r"dst\[1\] is a leaf that requires grad", dst, src, backend=backend)
    view = leaf[1:4]
    refused(RuntimeError, r"dst\[0\] is a view of a leaf", [view], [src[0]], backend=backend)
    with torch.no_grad():  # allowed there, as in torch
        ref = Reference(leaf)
        ref.add(src[1], 0.5)
        accumkernels.accumulate_(dst, src, 0.5, backend=backend)
        ref.check(leaf)


@pytest.mark.parametrize("backend", BACKENDS)
def test_version_counters_are_bumped_so_autograd_sees_the_write(reader, backend):
    w = rand(5).requires_grad_()
    d = rand(5)
    out = (w * d).sum()  # saves d for the backward
    found_inf = torch.zeros(1)
    versions = d._version, found_inf._version
    accumkernels.accumulate_([d], [rand(5, torch.bfloat16)], 0.5, found_inf=found_inf,
                             backend=backend)
    assert d._version > versions[0] and found_inf._version > versions[1]
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


def test_plan_launch_bumps_the_version_autograd_checks():
    params = [nn.Parameter(rand(4)), nn.Parameter(rand(6).reshape(3, 2))]
    buf = MasterGradBuffer(params)
    view = buf.view(params[1])
    view.copy_(rand(6).reshape(3, 2))
    w = rand(6).reshape(3, 2).requires_grad_()
    out = (w * view).sum()
    buf.accumulate(params, [rand(4, torch.bfloat16), rand(6, torch.bfloat16).reshape(3, 2)])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_tensor_is_refused_outside_inference_mode_like_torch(reader, backend):
    with torch.inference_mode():
        d = rand(7)
    src = [rand(7, torch.bfloat16)]
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        d.add_(src[0])  # what torch does
    refused(RuntimeError, r"dst\[0\] is an inference tensor", [d], src, backend=backend)
    with torch.inference_mode():  # allowed inside, as in torch
        ref = Reference(d)
        ref.add(src[0], 2.0)
        accumkernels.accumulate_([d], src, 2.0, backend=backend)
        ref.check(d)


def test_dispatcher_path_refuses_like_eager(reader):
    """torch.ops.accumkernels.accumulate_ (what compiled graphs call) makes the memory and
    inference checks itself; a compiled accumulate_ refuses a leaf that requires grad."""
    op = torch.ops.accumkernels.accumulate_
    x = rand(8)
    frozen = Frozen(x)
    with pytest.raises(ValueError, match=r"dst\[1\] overlaps dst\[0\]"):
        op([x, x], [rand(8), rand(8)], 1.0, None, False, None, "cpu", None, None)
    with torch.inference_mode():
        y = rand(8)
    with pytest.raises(RuntimeError, match="inference tensor"):
        op([y], [rand(8)], 1.0, None, False, None, "cpu", None, None)
    frozen.check()

    leaf = rand(4).requires_grad_()
    frozen = Frozen(leaf)
    compiled = torch.compile(lambda d, s: accumkernels.accumulate_(d, s, backend="cpu"),
                             backend="aot_eager", fullgraph=True)
    with pytest.raises(RuntimeError, match="leaf that requires grad"):
        compiled([leaf], [rand(4, torch.bfloat16)])
    frozen.check()


# -- scales ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("scale", [np.float32(0.375), np.float64(-1.25), np.int64(3),
                                   fractions.Fraction(3, 8), 2],
                         ids=["np.float32", "np.float64", "np.int64", "Fraction", "int"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_real_scalars_are_accepted(reader, backend, scale):
    dst = [rand(33), rand(4097)]
    src = [rand(33, torch.bfloat16), rand(4097, torch.float16)]
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, float(scale))
    accumkernels.accumulate_(dst, src, scale, backend=backend)
    for r, d in zip(refs, dst):
        r.check(d)


@pytest.mark.parametrize("scale", [1e39, -1e39, np.float64(3.5e38), 10**400, float("nan")],
                         ids=["1e39", "-1e39", "np3.5e38", "huge_int", "nan"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_infinite_in_fp32_is_refused(reader, backend, scale):
    dst, src = [rand(5)], [rand(5, torch.bfloat16)]
    refused(ValueError, "scale must be finite", dst, src, scale=scale, backend=backend)


def test_largest_fp32_scale_is_accepted(reader):
    dst = [rand(5)]
    src = [(rand(5) * 2.0**-100).bfloat16()]
    scale = 3.4028235e38  # rounds to FLT_MAX, still finite
    ref = Reference(dst[0])
    ref.add(src[0], scale)
    accumkernels.accumulate_(dst, src, scale, backend="cpu")
    ref.check(dst[0])


# -- launch plans (MasterGradBuffer's path) --------------------------------------------------------

def _buffer(shapes=((5,), (3, 4), (17,))):
    params = [nn.Parameter(rand(int(np.prod(s))).reshape(s)) for s in shapes]
    return params, MasterGradBuffer(params)


def test_plan_refuses_a_grad_inside_the_bucket(reader):
    params, buf = _buffer()
    buf.zero_()
    for p in params:
        buf.view(p).copy_(rand(p.numel()).reshape(p.shape))
    (bucket,) = buf.buckets
    grads = [rand(p.numel(), torch.bfloat16).reshape(p.shape) for p in params]
    grads[2] = bucket.flat.view(torch.bfloat16)[: params[2].numel()]  # reinterprets views
    frozen = Frozen(bucket.flat)
    with pytest.raises(ValueError, match=r"src\[2\] overlaps dst\[\d\]"):
        buf.accumulate(params, grads)
    frozen.check()


def test_plan_refuses_a_param_twice_and_takes_any_subset_in_any_order(reader):
    params, buf = _buffer()
    grads = [rand(p.numel(), torch.bfloat16).reshape(p.shape) for p in params]
    frozen = Frozen(*buf.buffers.values())
    with pytest.raises(ValueError, match=r"dst\[2\] overlaps dst\[0\]"):
        buf.accumulate([params[1], params[0], params[1]], [grads[1], grads[0], grads[1]])
    frozen.check()
    refs = {id(p): Reference(buf.view(p)) for p in params}
    order = [2, 0]
    for i in order:
        refs[id(params[i])].add(grads[i], 0.5)
    buf.accumulate([params[i] for i in order], [grads[i] for i in order], 0.5)
    for p in params:
        refs[id(p)].check(buf.view(p))
    with pytest.raises(KeyError, match="not managed"):
        buf.accumulate([params[0], nn.Parameter(rand(5))], [grads[0], rand(5)])


def test_plan_and_public_call_agree_on_bad_grads(reader):
    params, buf = _buffer()
    plan = buf.buckets[0].plan()
    assert isinstance(plan, LaunchPlan) and len(plan) == len(params)
    cases = [
        (lambda g: g.__setitem__(1, g[1].t()), ValueError, r"src\[1\] has shape"),
        (lambda g: g.__setitem__(0, g[0].double()), TypeError, r"src\[0\] has dtype"),
        (lambda g: g.__setitem__(2, rand(34, torch.bfloat16)[::2]), ValueError,
         r"src\[2\] is not dense"),
        (lambda g: g.__setitem__(2, g[2].to("meta")), ValueError, r"src\[2\] is on meta"),
    ]
    for mutate, exc, match in cases:
        grads = [rand(p.numel(), torch.bfloat16).reshape(p.shape) for p in params]
        mutate(grads)
        frozen = Frozen(*buf.buffers.values())
        with pytest.raises(exc, match=match):
            buf.accumulate(params, grads)
        with pytest.raises(exc, match=match):
            accumkernels.accumulate_([buf.view(p) for p in params], grads)
        frozen.check()
