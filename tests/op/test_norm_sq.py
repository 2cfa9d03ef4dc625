"""accumulate_(..., norm_sq=...): the squared L2 norm of each written dst, fused into the pass.

Every backend (cpu C++ with AVX2 and, in a subprocess, the generic loop; torch; Triton under its
interpreter; cuda_host, the CUDA kernel's code on the CPU) against float64 sums of squares of the
fp32 values written, within gamma(n+1) (gpu_cases.check_norm_sq). The norm vector is always
poisoned first: every element must be overwritten, not added to.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import DEVICE_BACKENDS
from gpu_cases import CHUNK, check_norm_sq
from reference import Reference

import accumkernels
from accumkernels import MasterGradBuffer
from accumkernels.ops.backends import cuda_host, native
from accumkernels.ops.plan import LaunchPlan

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

NAN = float("nan")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BACKENDS = [*DEVICE_BACKENDS, pytest.param(
    "cpu", "cuda_host", id="cpu-cuda_host",
    marks=pytest.mark.skipif(not cuda_host.is_available(torch.device("cpu")),
                             reason="accumkernels._C is not built"))]
CPU_BACKENDS = [p for p in BACKENDS if p.values[0] == "cpu"]


def rand_src(numel, dtype, device):
    """Random gradients spread over several binades (never zeros)."""
    x = torch.randn(numel) * torch.exp2(torch.randint(-6, 6, (numel,)).float())
    return x.to(dtype).to(device)


def rand_dst(numel, device):
    return torch.randn(numel).to(device)


def poisoned(n, device, value=NAN):
    return torch.full((n,), value, device=device)


def run(dst, src, scale, backend, overwrite=False, found_inf=None, norm=None):
    """One call checked against the float64 reference (dst) and check_norm_sq (norm)."""
    value = float(scale)
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, value, overwrite=overwrite)
    norm = poisoned(len(dst), dst[0].device) if norm is None else norm
    accumkernels.accumulate_(dst, src, scale, overwrite=overwrite, found_inf=found_inf,
                             norm_sq=norm, backend=backend)
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"dst[{i}]")
    check_norm_sq(norm, dst, backend)
    return norm


@pytest.mark.parametrize("device,backend", BACKENDS)
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("scale_kind", ["float", "tensor"])
def test_matches_float64(device, backend, overwrite, scale_kind):
    """Sizes around every vector width and chunk (tails), all three src dtypes, an empty dst and
    views at odd offsets, in one call; a float and a tensor scale; add and overwrite."""
    sizes = [1, 3, 7, 8, 15, 16, 17, 0, 4097, CHUNK + 1, 2 * CHUNK + 5]
    dst = [rand_dst(n, device) for n in sizes]
    src = [rand_src(n, DTYPES[i % 3], device) for i, n in enumerate(sizes)]
    store_d, store_s = rand_dst(CHUNK + 40, device), rand_src(CHUNK + 40, torch.float16, device)
    dst += [store_d[1:CHUNK + 2], store_d[CHUNK + 7:CHUNK + 30]]
    src += [store_s[3:CHUNK + 4], store_s[CHUNK + 9:CHUNK + 32]]
    scale = -0.71875 if scale_kind == "float" else torch.tensor(-0.71875, device=device)
    norm = run(dst, src, scale, backend, overwrite=overwrite)
    assert norm[7].item() == 0.0  # the empty dst


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_every_element_counted_once(device, backend):
    """A needle (2**20 times the rest) at one position per tensor: the first element, both sides
    of every vector width and of a chunk, the tail. Missing it, or counting it twice, is off by
    ~100%, far outside the bound."""
    n = 2 * CHUNK + 5
    spots = [0, 7, 8, 15, 16, 4095, 4096, CHUNK - 1, CHUNK, CHUNK + 1, 2 * CHUNK - 1,
             2 * CHUNK, n - 1]
    dst = [rand_dst(n, device) * 2.0**-10 for _ in spots]
    src = [rand_src(n, DTYPES[i % 3], device) * 2.0**-10 for i in range(len(spots))]
    for d, x, p in zip(dst, src, spots):
        x[p] = 2.0**10
        d[p] = 2.0**9
    run(dst, src, 1.0, backend)


def test_bound_rejects_a_missing_or_doubled_element():
    """The check is tight enough to fail: one element left out, or counted twice."""
    d = rand_dst(2 * CHUNK + 5, "cpu") * 2.0**-10
    d[CHUNK] = 2.0**10
    exact = d.double().square().sum()
    for wrong in (exact - d[CHUNK].double() ** 2, exact + d[CHUNK].double() ** 2):
        with pytest.raises(AssertionError, match="bound"):
            check_norm_sq(wrong.float().reshape(1), [d], "wrong")


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_many_tensors_one_call(device, backend):
    """300 tensors of mixed sizes and dtypes: each norm lands in its own slot."""
    numels = torch.randint(0, 300, (300,)).tolist()
    dst = [rand_dst(k, device) for k in numels]
    src = [rand_src(k, DTYPES[i % 3], device) for i, k in enumerate(numels)]
    run(dst, src, 0.375, backend)


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_non_finite_results(device, backend):
    """A NaN src makes its norm NaN, an inf makes it inf, finite values whose squares overflow
    fp32 make it inf; the other norms stay right; found_inf still flags the call."""
    dst = [rand_dst(n, device) for n in (4097, 300, 33, 21)]
    src = [rand_src(d.numel(), torch.float32, device) for d in dst]
    src[0][4096] = NAN
    src[1][17] = float("-inf")
    src[2][5] = 2.0**70  # finite, its square is not
    found_inf = torch.zeros(1, device=device)
    norm = run(dst, src, 1.0, backend, found_inf=found_inf)
    assert norm[0].isnan() and norm[1].item() == float("inf") and norm[2].item() == float("inf")
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_only_empty_tensors(device, backend):
    """A list of empty tensors still writes its slots (0), and nothing else."""
    dst = [torch.empty(0, device=device), torch.empty(0, 3, device=device)]
    src = [torch.empty(0, dtype=torch.bfloat16, device=device), torch.empty(0, 3, device=device)]
    norm = poisoned(2, device, 7.0)
    accumkernels.accumulate_(dst, src, 2.0, norm_sq=norm, backend=backend)
    assert norm.tolist() == [0.0, 0.0]


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_cpu_serial_and_parallel_paths(overwrite):
    """The CPU kernel's serial path (pieces of a chunk) and its threaded path (chunk partials
    added per tensor afterwards) both hold the bound, and write the same dst bit for bit."""
    from accumkernels import _C

    numels = [1, 4097, 70001, 3, 140003]
    src = [rand_src(n, torch.bfloat16, "cpu") for n in numels]
    start = [rand_dst(n, "cpu") for n in numels]
    outs = []
    old, threads = _C.cpu_parallel_threshold(), torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for threshold in (1 << 62, 0):
            _C.set_cpu_parallel_threshold(threshold)
            dst = [d.clone() for d in start]
            run(dst, src, 0.3, "cpu", overwrite=overwrite)
            outs.append(dst)
    finally:
        _C.set_cpu_parallel_threshold(old)
        torch.set_num_threads(threads)
    for a, b in zip(*outs):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.simd_once
def test_cpu_generic_loop():
    """The portable loop (ACCUMKERNELS_CPU_SIMD=generic, read once per process): a subprocess
    runs the tail/needle tests on it."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "ACCUMKERNELS_CPU_SIMD": "generic", "PYTHONPATH": str(root)}
    # tests/conftest.py puts every folder of tests/ on sys.path, as under pytest
    code = ("import sys; sys.path.insert(0, 'tests');"
            "import conftest, accumkernels, test_norm_sq as t;"
            "assert accumkernels._C.build_info()['simd'] == 'generic';"
            "t.test_matches_float64('cpu', 'cpu', False, 'float');"
            "t.test_every_element_counted_once('cpu', 'cpu'); print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


@pytest.mark.parametrize("device,backend", CPU_BACKENDS)
def test_portable_path(monkeypatch, device, backend):
    """Without the C++ tensor reader: the Python checks and the raw entry points."""
    monkeypatch.setattr(native, "READER", False)
    test_matches_float64(device, backend, False, "tensor")
    test_only_empty_tensors(device, backend)


def test_norm_sq_version_bumped():
    """Like found_inf, norm_sq is declared written: its version counter moves."""
    norm = torch.zeros(2)
    before = norm._version
    accumkernels.accumulate_([rand_dst(5, "cpu"), rand_dst(9, "cpu")],
                             [rand_src(5, torch.bfloat16, "cpu"), rand_src(9, torch.float16, "cpu")],
                             norm_sq=norm)
    assert norm._version > before


def test_compiled_and_opcheck():
    """Through the custom op: torch.compile(fullgraph) and opcheck with norm_sq."""
    def step(dst, src, norm):
        accumkernels.accumulate_(dst, src, 0.5, norm_sq=norm, backend="cpu")
        return norm * 2

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    dst = [rand_dst(4097, "cpu"), rand_dst(9, "cpu")]
    src = [rand_src(4097, torch.bfloat16, "cpu"), rand_src(9, torch.float16, "cpu")]
    norm = poisoned(2, "cpu")
    out = compiled(dst, src, norm)
    check_norm_sq(norm, dst, "compiled")
    assert torch.equal(out, norm * 2)
    op = torch.ops.accumkernels.accumulate_.default
    assert "Tensor(a7!)? norm_sq" in str(op._schema)
    torch.library.opcheck(op, ([rand_dst(37, "cpu")], [rand_src(37, torch.bfloat16, "cpu")], 0.25,
                               None, False, None, "cpu"),
                           {"norm_sq": torch.zeros(1), "norm_slots": None})


def _call_parts(device):
    """dst as views of one store, src with a float32 view of another, found_inf and a scale."""
    store, src_store = rand_dst(40, device), rand_src(40, torch.float32, device)
    dst = [store[0:5], store[8:17]]
    src = [rand_src(5, torch.bfloat16, device), src_store[0:9]]
    return store, src_store, dst, src


def _bad_norms(device):
    """(name, build(store, src_store) -> (norm_sq, found_inf, scale), exception, message)."""
    zeros = torch.zeros
    shared = zeros(3, device=device)
    return [
        ("dtype", lambda s, x: (zeros(2, dtype=torch.float64), None, 1.0), TypeError,
         "norm_sq has dtype torch.float64"),
        ("length", lambda s, x: (zeros(3), None, 1.0), ValueError, "1-D tensor of 2 elements"),
        ("2-D", lambda s, x: (zeros(1, 2), None, 1.0), ValueError, r"shape \(1, 2\)"),
        ("strided", lambda s, x: (zeros(4)[::2], None, 1.0), ValueError, "not contiguous"),
        ("device", lambda s, x: (zeros(2, device="meta"), None, 1.0), ValueError, "is on meta"),
        ("neg", lambda s, x: (torch._neg_view(zeros(2)), None, 1.0), ValueError, "negative view"),
        ("list", lambda s, x: ([0.0, 0.0], None, 1.0), TypeError, "norm_sq must be a tensor"),
        ("dst", lambda s, x: (s[3:5], None, 1.0), ValueError, r"norm_sq overlaps dst\[0\]"),
        ("src", lambda s, x: (x[2:4], None, 1.0), ValueError, r"norm_sq overlaps src\[1\]"),
        ("found_inf", lambda s, x: (shared[0:2], shared[1:2], 1.0), ValueError,
         "norm_sq overlaps found_inf"),
        ("scale", lambda s, x: (shared[1:3], None, shared[1:2]), ValueError,
         "norm_sq overlaps scale"),
        ("grad", lambda s, x: (zeros(2, requires_grad=True), None, 1.0), RuntimeError,
         "norm_sq is a leaf that requires grad"),
    ]


@pytest.mark.parametrize("reader", [True, False], ids=["reader", "portable"])
@pytest.mark.parametrize("device,backend", CPU_BACKENDS)
def test_bad_norm_sq_is_refused_before_any_write(monkeypatch, device, backend, reader):
    """Each broken rule raises an error naming norm_sq; dst and norm_sq keep every bit."""
    if not reader:
        monkeypatch.setattr(native, "READER", False)
    cases = _bad_norms(device)
    with torch.inference_mode():
        frozen = torch.zeros(2)
    cases.append(("inference", lambda s, x: (frozen, None, 1.0), RuntimeError,
                  "norm_sq is an inference tensor"))
    for name, build, exc, match in cases:
        store, src_store, dst, src = _call_parts(device)
        norm, found_inf, scale = build(store, src_store)
        before = [t.clone() for t in (store, *([norm] if isinstance(norm, torch.Tensor) else []))]
        with pytest.raises(exc, match=match):
            accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, norm_sq=norm,
                                     backend=backend)
        after = (store, *([norm] if isinstance(norm, torch.Tensor) else []))
        for a, b in zip(before, after):
            if b.device.type != "meta":  # no NaN here: equal values are equal bits
                assert torch.equal(a.resolve_neg(), b.resolve_neg()), name


class _Key:
    """A plan key (plans match keys by identity)."""


@pytest.mark.parametrize("device,backend", BACKENDS)
def test_plan_writes_only_the_slots_of_its_keys(device, backend):
    """A LaunchPlan launch on some keys, in any order, writes the norms of those dst only, at
    their plan index, or at norm_slots[index] with a layout of its own."""
    numels = [5, 0, 4097, CHUNK + 3, 33]
    flat = rand_dst(sum(numels), device)
    dst = list(flat.split(numels))
    keys = [_Key() for _ in numels]
    layout = ([6, 2, 0, 4, 1], 8)
    for slots, size in ((None, None), layout):
        plan = LaunchPlan(dst, keys=keys, backend=backend, norm_slots=slots, norm_size=size)
        slot_of = list(range(len(numels))) if slots is None else slots
        for launched in ([3, 1, 0], list(range(len(numels)))):
            norm = poisoned(size or len(numels), device, 7.0)
            src = [rand_src(numels[k], DTYPES[k % 3], device) for k in launched]
            refs = [Reference(dst[k]) for k in launched]
            for r, x in zip(refs, src):
                r.add(x, 0.5)
            plan(src, 0.5, keys=[keys[k] for k in launched], norm_sq=norm)
            for r, k in zip(refs, launched):
                r.check(dst[k])
            written = [slot_of[k] for k in launched]
            check_norm_sq(norm[written], [dst[k] for k in launched], f"plan {backend}")
            untouched = [s for s in range(norm.numel()) if s not in written]
            assert (norm[untouched] == 7.0).all()
        with pytest.raises(ValueError, match=f"1-D tensor of {size or len(numels)} elements"):
            plan([rand_src(5, torch.float32, device)], keys=[keys[0]],
                 norm_sq=torch.zeros(norm.numel() + 1, device=device))


def test_plan_norm_layout_is_checked():
    dst = [torch.zeros(3), torch.zeros(4)]
    for slots, size in (([0, 0], 2), ([0, 2], 2), ([0, -1], 2), (None, 3), ([0, 1.0], 2)):
        with pytest.raises(ValueError, match="norm_s"):
            LaunchPlan(dst, norm_slots=slots, norm_size=size)


@pytest.mark.parametrize("device,backend", CPU_BACKENDS)
def test_buffer_norm_index_is_the_params_order(device, backend):
    """MasterGradBuffer.accumulate(norm_sq=...): element norm_index(p) = p's index in
    buffer.params; a bucket's launch (its plan) writes its params' elements only; a launch
    over several buckets (the general path) writes every launched one."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (300, 5000, 7, 12000, 64, 2)]
    buf = MasterGradBuffer(params, bucket_size_mb=0.03)
    assert len(buf.buckets) >= 3
    assert [buf.norm_index(p) for p in params] == list(range(len(params)))
    norm = poisoned(len(params), device, 7.0)
    bucket = buf.buckets[1]
    grads = [rand_src(p.numel(), torch.bfloat16, device) for p in bucket.params]
    buf.accumulate(bucket.params[::-1], grads[::-1], 0.5, overwrite=True, norm_sq=norm,
                   backend=backend)
    inside = [buf.norm_index(p) for p in bucket.params]
    check_norm_sq(norm[inside], [buf.view(p) for p in bucket.params], "one bucket")
    assert all(norm[i].item() == 7.0 for i in range(len(params)) if i not in inside)
    norm.fill_(NAN)
    grads = [rand_src(p.numel(), torch.float16, device) for p in params]
    buf.accumulate(params, grads, 0.25, norm_sq=norm, backend=backend)
    check_norm_sq(norm, [buf.view(p) for p in params], "every bucket")
