"""The CUDA kernel's own code, run on the CPU (backend "cuda_host", tests only): the GPU kernel
cases of tests/gpu_cases.py and the float64-reference tests of test_accumulate.py, with every
tensor they create surrounded by poisoned guard bytes that must be untouched afterwards.

csrc/accumulate_kernel.h is compiled twice: by nvcc into the GPU kernel and by the host compiler
into a driver that plays each launch block by block, thread by thread
(csrc/accumulate_cuda_host.cpp), after the same table building (parameter tables of 64/256/1000
entries, longer lists as groups of 1000, captured or not). So these tests execute the kernel's
chunking, table search, aligned 16-byte path, scalar tail, overwrite, scale pointer and found_inf
reduction, and the launch marshalling, on every CI run. The guards are NaN: an out-of-bounds
write changes them, an out-of-bounds read of src raises found_inf or puts a NaN where the
reference has none.
"""

from __future__ import annotations

import gpu_cases
import pytest
import test_accumulate as acc_tests
import torch
from reference import Reference

import accumkernels
from accumkernels.ops.backends import cuda_host, native
from accumkernels.ops.plan import LaunchPlan

pytestmark = pytest.mark.skipif(not cuda_host.is_available(torch.device("cpu")),
                                reason="accumkernels._C is not built")

BACKEND = "cuda_host"
GUARD_BYTES = 64  # a multiple of 16: guarded tensors keep the alignment of a fresh allocation
# dtype -> (integer view, NaN bit pattern the guards hold)
POISON = {torch.float32: (torch.int32, 0x7FA5A5A5), torch.bfloat16: (torch.int16, 0x7FA5),
          torch.float16: (torch.int16, 0x7E5A)}


class Guards:
    """Copies tensors into the middle of NaN-poisoned buffers and checks the poison later."""

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, int, int]] = []

    def wrap(self, t: object) -> object:
        if not isinstance(t, torch.Tensor) or t.dtype not in POISON or t.device.type != "cpu":
            return t
        g, n = GUARD_BYTES // t.element_size(), t.numel()
        buf = torch.empty(n + 2 * g, dtype=t.dtype)
        buf.view(POISON[t.dtype][0]).fill_(POISON[t.dtype][1])
        inner = buf[g:g + n]
        inner.copy_(t.reshape(-1))
        self.buffers.append((buf, g, n))
        return inner.view(t.shape)

    def check(self) -> None:
        assert self.buffers, "no tensor was guarded: the test ran unguarded"
        for k, (buf, g, n) in enumerate(self.buffers):
            itype, bits = POISON[buf.dtype]
            raw = buf.view(itype)
            for side, part in (("before", raw[:g]), ("after", raw[g + n:])):
                assert bool((part == bits).all()), \
                    f"guard bytes {side} tensor {k} ({buf.dtype}, {n} elements) were written"


class _GuardedTorch:
    """``torch`` for a case module: tensors made by zeros/full/tensor/empty come guarded."""

    def __init__(self, guards: Guards) -> None:
        self._guards = guards

    def __getattr__(self, name: str) -> object:
        value = getattr(torch, name)
        if name in ("zeros", "full", "tensor", "empty"):
            return lambda *a, **k: self._guards.wrap(value(*a, **k))
        return value


@pytest.fixture
def guards(monkeypatch) -> Guards:
    """Every tensor the case modules create is guarded; the emulated device is an H100."""
    g = Guards()
    for module in (gpu_cases, acc_tests):
        monkeypatch.setattr(module, "torch", _GuardedTorch(g))
        for name in ("rand_src", "rand_dst"):
            make = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, _make=make, **k: g.wrap(_make(*a, **k)))
    cuda_host.configure(132, False)
    yield g
    cuda_host.configure(132, False)


def _param(p) -> object:
    return p.values[0] if hasattr(p, "values") else p


# Table sizes around every capacity -> the launches (table kind, tensors) they must make.
TABLES = {64: [("param64", 64)], 65: [("param256", 65)], 256: [("param256", 256)],
          257: [("param1000", 257)], 1000: [("param1000", 1000)],
          1001: [("param1000", 1000), ("param64", 1)]}


@pytest.mark.parametrize("sms", [1, 132], ids=["1sm", "132sm"])
@pytest.mark.parametrize("n", gpu_cases.TABLE_SIZES)
def test_table_sizes(guards, n, sms):
    """n tensors of mixed dtypes (two longer than a chunk) in one call, float and tensor scale;
    one SM makes every block stride over many chunks."""
    cuda_host.configure(sms, False)
    gpu_cases.table(BACKEND, "cpu", n, quick=True)
    launched = [[f.split("=")[-1] for f in line.split()] for line in cuda_host.launches()]
    assert [(kind, int(tensors)) for kind, _, _, tensors in launched] == TABLES[n], launched
    for _, grid, chunks, _ in launched:
        assert int(grid) == min(int(chunks), 4 * sms), launched
    guards.check()


@pytest.mark.parametrize("capturing", [True, False], ids=["captured", "not-captured"])
def test_long_list_launches_in_groups(guards, capturing):
    """1001 tensors go as parameter tables of 1000 + 1 whether or not the stream is captured:
    no table is copied from pageable host memory (a copy that may stall the host)."""
    cuda_host.configure(132, capturing)
    gpu_cases.table(BACKEND, "cpu", 1001, quick=True)
    kinds = [(line.split()[0], line.split()[-1]) for line in cuda_host.launches()]
    assert kinds == [("param1000", "tensors=1000"), ("param64", "tensors=1")]
    guards.check()


@pytest.mark.parametrize("case", [c for c, (_, needs_cuda) in gpu_cases.CASES.items()
                                  if not needs_cuda])
def test_gpu_case(guards, case):
    """unaligned views longer than a chunk, found_inf in the vector part and the tail, a scale
    tensor, overwrite (tests/gpu_cases.py)."""
    gpu_cases.CASES[case][0](BACKEND, "cpu")
    guards.check()


REFERENCE_TESTS = {
    "matches_reference": [
        (acc_tests.test_matches_reference, {"dtype": _param(d), "numel": n})
        for d in acc_tests.DTYPES for n in acc_tests.SIZES],
    "many_tensors_mixed_dtypes": [(acc_tests.test_many_tensors_mixed_dtypes_one_call, {})],
    "chain_of_64_microbatches": [(acc_tests.test_chain_of_64_microbatches, {"dtype": _param(d)})
                                 for d in acc_tests.DTYPES],
    "tensor_scale": [(acc_tests.test_tensor_scale, {"shape": s}) for s in ((), (1,))],
    "overwrite_never_reads_dst": [(acc_tests.test_overwrite_never_reads_dst, {"dtype": _param(d)})
                                  for d in acc_tests.DTYPES],
    "found_inf": [(acc_tests.test_found_inf, {"dtype": _param(d), "bad": b})
                  for d in acc_tests.DTYPES for b in (float("inf"), float("-inf"), float("nan"))],
    "empty_inputs": [(acc_tests.test_empty_inputs_are_noops, {})],
}


@pytest.mark.parametrize("name", list(REFERENCE_TESTS))
def test_reference_suite(guards, name):
    """The float64-reference tests of test_accumulate.py, every parametrisation, on cuda_host."""
    for fn, kwargs in REFERENCE_TESTS[name]:
        fn(device="cpu", backend=BACKEND, **kwargs)
    guards.check()


@pytest.mark.parametrize("n", [257, 1001])
def test_portable_path(guards, monkeypatch, n):
    """Without the C++ tensor reader the call reaches the same kernel through raw addresses."""
    monkeypatch.setattr(native, "READER", False)
    gpu_cases.table(BACKEND, "cpu", n, quick=True)
    assert cuda_host.launches()[0].split()[0] == TABLES[n][0][0]
    gpu_cases.found_inf_vector(BACKEND, "cpu")
    guards.check()


def test_launch_plan(guards):
    """A LaunchPlan over views of one flat buffer launches the emulated kernel (Plan::run)."""
    numels = [3, 8192, 8193, 17, 40000]
    flat = guards.wrap(torch.randn(sum(numels)))
    dst = list(flat.split(numels))
    plan = LaunchPlan(dst, backend=BACKEND)
    assert plan._native is not None
    for step in range(2):
        src = [gpu_cases.rand_src(k, gpu_cases.DTYPES[(k + step) % 3], "cpu")
               for k in numels]
        refs = [Reference(d) for d in dst]
        for r, x in zip(refs, src):
            r.add(x, 0.75)
        plan(src, 0.75)
        for i, (r, d) in enumerate(zip(refs, dst)):
            r.check(d, f"step {step}: dst[{i}]")
    assert cuda_host.launches()[0].startswith("param64")
    guards.check()


@pytest.mark.parametrize("n,capturing,kinds", [
    (64, False, ["zero_norm param64", "param64"]),
    (257, False, ["zero_norm param1000", "param1000"]),
    (1001, False, ["zero_norm param1000", "param1000", "zero_norm param64", "param64"]),
    (1001, True, ["zero_norm param1000", "param1000", "zero_norm param64", "param64"])],
    ids=["64", "257", "1001", "1001-captured"])
def test_norm_sq_launches(guards, n, capturing, kinds):
    """norm_sq: each table (parameter tables, groups of 1000, captured or not) gets a
    one-block launch that zeroes its slots before the accumulating launch; 3 SMs make every
    block add several chunks (and tensors) into the slots; the poisoned vector is overwritten."""
    cuda_host.configure(3, capturing)
    dst, src = gpu_cases._table_list(n, "cpu", quick=True)
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, 0.5)
    norm = torch.full((n,), float("nan"))
    accumkernels.accumulate_(dst, src, 0.5, norm_sq=norm, backend=BACKEND)
    launched = cuda_host.launches()
    assert [line.rsplit(" grid=", 1)[0] for line in launched] == kinds, launched
    assert all(" grid=1 " in line for line in launched if line.startswith("zero_norm"))
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"dst[{i}]")
    gpu_cases.check_norm_sq(norm, dst, f"{n} tensors")
    guards.check()


def test_raw_entry_marshalling(guards):
    """The raw entry point: empty pairs (even with null pointers) are skipped; a broken pair
    raises ValueError before any launch writes; an empty list launches nothing."""
    C = native._C
    dst = [guards.wrap(torch.randn(k)) for k in (5, 0, 9000)]
    src = [gpu_cases.rand_src(k, torch.float16, "cpu") for k in (5, 0, 9000)]
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, -2.5)
    ptrs = [[t.data_ptr() if t.numel() else 0 for t in ts] for ts in (dst, src)]
    C.accumulate_cuda_host(*ptrs, [5, 0, 9000], [2, 2, 2], -2.5, 0, False, 0)
    for r, d in zip(refs, dst):
        r.check(d)
    assert [line.split()[-1] for line in cuda_host.launches()] == ["tensors=2"]
    before = [d.clone() for d in dst]
    for numels, codes in (([5, -1, 9000], [2, 2, 2]), ([5, 0, 9000], [2, 2, 7])):
        with pytest.raises(ValueError, match="negative numel|dtype code"):
            C.accumulate_cuda_host(*ptrs, numels, codes, 1.0, 0, False, 0)
    with pytest.raises(ValueError, match="null data pointer"):
        C.accumulate_cuda_host([dst[0].data_ptr(), 0], [src[0].data_ptr(), 0], [5, 3], [2, 2],
                               1.0, 0, False, 0)
    assert all(torch.equal(a, b) for a, b in zip(before, dst))
    C.accumulate_cuda_host([], [], [], [], 1.0, 0, False, 0)
    assert cuda_host.launches() == []
    guards.check()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("offset", [0, 1], ids=["vector", "scalar"])
def test_every_half_value_converts_exactly(guards, dtype, offset):
    """Each of the 65536 bit patterns through the host definitions of the conversions (aligned:
    the paired 16-byte path; one element off: the scalar path) equals torch's float32 value."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    store = guards.wrap(torch.cat([torch.zeros(1, dtype=torch.int16), bits]).view(dtype))
    src = store[1 - offset:1 - offset + bits.numel()]
    src.view(torch.int16).copy_(bits)
    dst = guards.wrap(torch.full((bits.numel(),), 3.0))
    found_inf = guards.wrap(torch.zeros(1))
    accumkernels.accumulate_([dst], [src], 1.0, overwrite=True, found_inf=found_inf,
                             backend=BACKEND)
    want = src.float()
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(dst), nan)
    assert torch.equal(dst[~nan].view(torch.int32), want[~nan].view(torch.int32))
    assert found_inf.item() == 1.0
    guards.check()


def test_never_offered():
    """cuda_host is accepted by name only: never listed, never picked by auto, not on CUDA."""
    assert BACKEND not in accumkernels.available_backends("cpu")
    assert BACKEND not in accumkernels.available_backends("cuda")
    dst = [torch.zeros(3)]
    accumkernels.accumulate_(dst, [torch.ones(3)], 1.0)
    with pytest.raises(ValueError, match="choose from") as err:
        accumkernels.accumulate_(dst, [torch.ones(3)], 1.0, backend="cuda-host")
    assert BACKEND not in str(err.value)
    with pytest.raises(ValueError, match="not available"):
        accumkernels.accumulate_([torch.zeros(3, device="meta")], [torch.ones(3, device="meta")],
                                 backend=BACKEND)
