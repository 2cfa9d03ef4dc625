"""accumulate_ on every backend against a float64 reference (see reference.py for the bound)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_BACKENDS
from reference import Reference

import accumkernels

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.bfloat16, id="bf16"),
    pytest.param(torch.float16, id="fp16"),
]
SIZES = [0, 1, 3, 4097, 65537, 65538]
NAN = float("nan")


def rand_src(numel, dtype, device, shape=None):
    """Random gradients spread over several binades (never zeros)."""
    x = torch.randn(numel, dtype=torch.float32) * torch.exp2(torch.randint(-6, 6, (numel,)).float())
    return x.to(dtype).reshape(shape if shape is not None else (numel,)).to(device)


def rand_dst(numel, device, shape=None):
    return torch.randn(numel, dtype=torch.float32).reshape(shape or (numel,)).to(device)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", SIZES)
def test_matches_reference(device, backend, dtype, numel):
    dst = [rand_dst(numel, device), rand_dst(7, device, (7, 1))]
    src = [rand_src(numel, dtype, device), rand_src(7, dtype, device, (7, 1))]
    scale = torch.rand(()).item() * 4 - 2
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, scale)
    accumkernels.accumulate_(dst, src, scale, backend=backend)
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"dst[{i}]")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_many_tensors_mixed_dtypes_one_call(device, backend):
    n = 1200
    numels = torch.randint(1, 200, (n,)).tolist()
    dtypes = [torch.float32, torch.bfloat16, torch.float16]
    dst = [rand_dst(k, device) for k in numels]
    src = [rand_src(k, dtypes[i % 3], device) for i, k in enumerate(numels)]
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, 0.375)
    accumkernels.accumulate_(dst, src, 0.375, backend=backend)
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"dst[{i}]")


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_chain_of_64_microbatches(device, backend, dtype):
    """64 micro-batches of 1/64-scaled gradients: fp32 accumulation within 1e-6 relative."""
    numel, steps, scale = 4099, 64, 1.0 / 64
    dst = [torch.full((numel,), NAN, device=device)]  # poisoned: overwrite must not read it
    ref = Reference(dst[0])
    for k in range(steps):
        src = [rand_src(numel, dtype, device)]
        accumkernels.accumulate_(dst, src, scale, overwrite=(k == 0), backend=backend)
        ref.add(src[0], scale, overwrite=(k == 0))
    ref.check(dst[0], "chain")
    rel = (dst[0].cpu().double() - ref.value).abs().max() / ref.value.abs().max()
    assert rel <= 1e-6


def test_reference_bound_rejects_low_precision_accumulation():
    """The bound is tight enough to fail: bf16 accumulation of the same chain violates it."""
    numel, scale = 4099, 1.0 / 64
    acc = torch.zeros(numel, dtype=torch.bfloat16)
    ref = Reference(acc.float())
    for _ in range(64):
        x = rand_src(numel, torch.bfloat16, "cpu")
        acc += x * scale
        ref.add(x, scale)
    with pytest.raises(AssertionError, match="exceeds fp32 bound"):
        ref.check(acc.float())


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("shape", [(), (1,)], ids=["0dim", "1elem"])
def test_tensor_scale(device, backend, shape):
    scale_value = -0.7109375
    scale = torch.full(shape, scale_value, device=device)
    dst = [rand_dst(4097, device), rand_dst(3, device)]
    src = [rand_src(4097, torch.bfloat16, device), rand_src(3, torch.float32, device)]
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, scale_value)
    accumkernels.accumulate_(dst, src, scale, backend=backend)
    for r, d in zip(refs, dst):
        r.check(d)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_overwrite_never_reads_dst(device, backend, dtype):
    dst = [torch.full((n,), NAN, device=device) for n in (1, 4097, 65538)]
    src = [rand_src(d.numel(), dtype, device) for d in dst]
    accumkernels.accumulate_(dst, src, 0.25, overwrite=True, backend=backend)
    for d, x in zip(dst, src):
        ref = Reference(d)
        ref.add(x, 0.25, overwrite=True)
        ref.check(d)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), NAN], ids=["inf", "-inf", "nan"])
def test_found_inf(device, backend, dtype, bad):
    dst = [rand_dst(n, device) for n in (5, 4097, 300)]
    src = [rand_src(d.numel(), dtype, device) for d in dst]
    src[1][4096] = bad  # last element of the middle tensor: a tail position
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, 0.5)
    found_inf = torch.zeros(1, device=device)
    accumkernels.accumulate_(dst, src, 0.5, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0
    for r, d in zip(refs, dst):  # dst is still written, bad element included
        r.check(d)

    # A clean call never resets the flag, and never raises a clear one.
    clean = [rand_src(d.numel(), dtype, device) for d in dst]
    accumkernels.accumulate_(dst, clean, 0.5, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0
    fresh = torch.zeros((), device=device)
    clean_dst = [rand_dst(d.numel(), device) for d in dst]
    accumkernels.accumulate_(clean_dst, clean, 0.5, found_inf=fresh, backend=backend)
    assert fresh.item() == 0.0
    # A dst already holding the bad value stays non-finite: the flag reports the result.
    accumkernels.accumulate_(dst, clean, 0.5, found_inf=fresh, backend=backend)
    assert fresh.item() == 1.0


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("where", [0, 17, 4096], ids=["first", "vector-body", "tail"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_found_inf_flags_an_overflowed_sum(device, backend, dtype, where, overwrite):
    """Every src element finite, one fp32 result overflows (dst + s*x past FLT_MAX, or s*x alone
    with overwrite): the flag is set, so a window's sum needs no separate finiteness pass. The
    same call one binade lower stays finite and leaves the flag clear. Scale 2**115: the other
    elements (|x| < 2**9) stay below 2**124."""
    big, scale = torch.finfo(torch.float32).max, 2.0 ** 115
    results = []
    for high in (False, True):
        src = [rand_src(4097, dtype, device)]
        dst = [rand_dst(4097, device)]
        if overwrite:  # s * 2**12 = 2**127 is finite, s * 2**13 = 2**128 is not
            src[0][where] = 2.0 ** (13 if high else 12)
        else:  # 2**127 + 0.75 * FLT_MAX overflows, 2**127 + 0.25 * FLT_MAX does not
            src[0][where] = 2.0 ** 12
            dst[0][where] = big * (0.75 if high else 0.25)
        found_inf = torch.zeros(1, device=device)
        accumkernels.accumulate_(dst, src, scale, overwrite=overwrite, found_inf=found_inf,
                                 backend=backend)
        assert bool(torch.isinf(dst[0][where])) == high, "test setup: wrong overflow"
        assert bool(torch.isfinite(dst[0][:where]).all() and torch.isfinite(dst[0][where + 1:]).all())
        results.append(found_inf.item())
    assert results == [0.0, 1.0]


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_empty_inputs_are_noops(device, backend):
    accumkernels.accumulate_([], [], 2.0, backend=backend)
    dst = [torch.empty(0, device=device), torch.empty(0, 3, device=device)]
    src = [torch.empty(0, device=device, dtype=torch.bfloat16), torch.empty(0, 3, device=device)]
    found_inf = torch.zeros(1, device=device)
    accumkernels.accumulate_(dst, src, 2.0, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 0.0


def test_available_backends_on_cpu():
    backends = accumkernels.available_backends("cpu")
    assert backends[:2] == ["cpu", "torch"], "the compiled CPU backend must be built and preferred"
    assert accumkernels.available_backends(torch.device("cpu")) == backends
    assert "cuda" not in backends


def test_auto_matches_explicit_cpu_backend():
    dst = [rand_dst(4097, "cpu")]
    src = [rand_src(4097, torch.bfloat16, "cpu")]
    expected = [dst[0].clone()]
    accumkernels.accumulate_(expected, src, 0.125, backend="cpu")
    accumkernels.accumulate_(dst, src, 0.125)
    assert torch.equal(dst[0], expected[0])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_cpu_serial_and_parallel_paths_agree_bitwise(dtype, overwrite):
    """The CPU kernel splits calls above its threshold into chunks over threads; both paths do
    the same fp32 arithmetic per element, and both raise found_inf."""
    from accumkernels import _C

    numels = [1, 4097, 70001, 3, 12345]
    src = [rand_src(n, dtype, "cpu") for n in numels]
    src[2][69999] = float("nan")  # in the last chunk of the biggest tensor
    start = [rand_dst(n, "cpu") for n in numels]
    results = []
    old = _C.cpu_parallel_threshold()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for threshold in (1 << 62, 0):  # serial, then parallel whatever the size
            _C.set_cpu_parallel_threshold(threshold)
            dst = [d.clone() for d in start]
            found_inf = torch.zeros(1)
            accumkernels.accumulate_(dst, src, 0.3, overwrite=overwrite, found_inf=found_inf,
                                     backend="cpu")
            assert found_inf.item() == 1.0
            results.append(dst)
    finally:
        _C.set_cpu_parallel_threshold(old)
        torch.set_num_threads(threads)
    for a, b, d, x in zip(*results, start, src):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        ref = Reference(d)
        ref.add(x, 0.3, overwrite=overwrite)
        ref.check(a)
