"""The Triton backend's own machinery, on the CPU: the launch table (offsets from aligned bases,
alignment flags), both kernel paths (16-byte full blocks, masked tails and unaligned views) under
the interpreter, the device guard around upload and launch, the lifetime of tables captured in
CUDA graphs, and the SASS of an ahead-of-time sm_90 compile (no GPU needed)."""

from __future__ import annotations

import contextlib
import gc
import os
import re
import shutil
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA
from reference import Reference

import accumkernels
from accumkernels import _util
from accumkernels.ops.backends import cuda_host

tb = pytest.importorskip("accumkernels.ops.backends.triton")
if tb.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]  # the repository
interpreter_only = pytest.mark.skipif(HAS_CUDA, reason="the interpreter runs only on CPU-only hosts")


def rand(numel, dtype=torch.float32):
    x = torch.randn(numel) * torch.exp2(torch.randint(-6, 6, (numel,)).float())
    return x.to(dtype)


def test_table_offsets_and_alignment_flags():
    """Offsets from the bases give back every address; a pair is flagged aligned exactly when
    both its pointers are 16-byte aligned (and the bases are)."""
    dst_store, src_store = torch.randn(40000), rand(40000, torch.bfloat16)
    # dst[0] starts 1 element in (unaligned), so the base is another tensor, and tensors below
    # the base get negative offsets.
    pairs = [(dst_store[1:5001], src_store[8:5008]), (dst_store[8:9008], src_store[16:9016]),
             (dst_store[10000:10003], src_store[10001:10004]),
             (torch.randn(4097), rand(4097, torch.bfloat16))]
    rows, b_dst, b_src, total = tb._table(pairs, 4096)
    assert pairs[b_dst][0].data_ptr() % 16 == 0 and pairs[b_src][1].data_ptr() % 16 == 0
    base_d, base_s = pairs[b_dst][0].data_ptr(), pairs[b_src][1].data_ptr()
    for i, (d, x) in enumerate(pairs):
        assert base_d + 4 * rows[0][i] == d.data_ptr()
        assert base_s + x.element_size() * rows[1][i] == x.data_ptr()
        assert rows[2][i] == d.numel()
        assert rows[4][i] == int(d.data_ptr() % 16 == 0 and x.data_ptr() % 16 == 0)
    assert rows[4] == [0, 1, 0, 1]
    assert min(rows[0]) < 0
    assert rows[3] == [0, 2, 5, 6] and total == 8


def test_table_without_an_aligned_tensor_flags_nothing():
    """No aligned dst: the base is unaligned, so no pair may take the hinted path."""
    store = torch.randn(9000)
    src = rand(9000, torch.bfloat16)
    pairs = [(store[1:4001], src[0:4000]), (store[4005:8005], src[4000:8000])]
    rows, _, _, _ = tb._table(pairs, 4096)
    assert rows[4] == [0, 0]


@interpreter_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_aligned_unaligned_and_mixed_views(dtype, overwrite):
    """Full aligned blocks, tails, and views longer than 8192 elements at every misalignment of
    dst and src (each alone and both) in one launch, against the float64 reference."""
    dst_store = torch.randn(80000)
    src_store = rand(80000, dtype)
    views = [(0, 0, 8192 + 4096), (1, 0, 8193), (0, 3, 8195), (5, 7, 9001), (16, 8, 4096),
             (24, 16, 12345)]
    dst, src, at = [], [], 0
    for dshift, sshift, n in views:
        dst.append(dst_store[at + dshift:at + dshift + n])
        src.append(src_store[at + sshift:at + sshift + n])
        at += n + 32
    dst.append(torch.randn(3))  # a separate allocation, possibly below the base
    src.append(rand(3, dtype))
    if overwrite:
        for d in dst:
            d.fill_(float("nan"))
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, 0.375, overwrite=overwrite)
    found_inf = torch.zeros(1)
    accumkernels.accumulate_(dst, src, 0.375, overwrite=overwrite, found_inf=found_inf,
                             backend="triton")
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"dst[{i}]")
    assert found_inf.item() == 0.0


@interpreter_only
@pytest.mark.parametrize("where", [17, 4096 + 100, 8192 + 4095], ids=["block0", "block1", "tail"])
def test_found_inf_in_the_vector_part(where):
    """found_inf is raised from a full aligned block (the unmasked path) and from a tail."""
    dst = [torch.randn(8192 + 4096 + 7)]
    src = [rand(dst[0].numel(), torch.bfloat16)]
    src[0][where] = float("inf")
    scale = torch.tensor(0.5)
    ref = Reference(dst[0])
    ref.add(src[0], 0.5)
    found_inf = torch.zeros(1)
    accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend="triton")
    assert found_inf.item() == 1.0
    ref.check(dst[0])


def _interpreter_fma_rounds_once() -> bool:
    """Whether this Triton's interpreter evaluates ``tl.fma`` with one rounding, as the GPU does
    (Triton 3.6's multiplies, then adds: two roundings), on a case where the two differ."""
    import triton
    import triton.language as tl

    @triton.jit
    def fma_kernel(x_ptr, out_ptr):
        x = tl.load(x_ptr)
        tl.store(out_ptr, tl.fma(x, x, -(x * x)))  # one rounding: the product's error; two: 0

    x = torch.tensor([1.0 + 2.0 ** -12])  # x*x needs 25 significant bits: fp32 rounds it
    out = torch.full((1,), float("nan"))
    fma_kernel[(1,)](x, out)
    return out.item() != 0.0


@interpreter_only
@pytest.mark.skipif(not cuda_host.is_available(torch.device("cpu")), reason="no _C")
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_accumulate_bits_match_the_cuda_kernels_fma(src_dtype):
    """dst + src * scale rounds once, as the CUDA kernel's fmaf (played on the host): the same
    bits at every element, in full aligned blocks, a tail and an unaligned view, on inputs where
    a rounded product then a rounded sum differ in the last bit (the test could fail). Where
    this Triton's interpreter rounds ``tl.fma`` twice (3.6), the kernel's result is held to that
    instead: exactly ``dst + src * scale`` in fp32, element by element (compiled for a GPU,
    ``tl.fma`` is the hardware's one-rounding fma whatever the Triton version)."""
    gen = torch.Generator().manual_seed(51)
    n = 2 * 4096 + 300
    dst = [torch.randn(n, generator=gen), torch.randn(n + 1, generator=gen)[1:]]
    src = [(torch.randn(n, generator=gen) * 3).to(src_dtype) for _ in dst]
    scale = 0.1  # not a power of two: products carry bits below the sum's last place
    two_roundings = [(d + x.float() * torch.tensor(scale)).clone() for d, x in zip(dst, src)]
    expected = [d.clone() for d in dst]
    accumkernels.accumulate_(expected, src, scale, backend="cuda_host")
    assert any(not torch.equal(a, b) for a, b in zip(expected, two_roundings))
    accumkernels.accumulate_(dst, src, scale, backend="triton")
    if not _interpreter_fma_rounds_once():
        expected = two_roundings
    for got, want in zip(dst, expected):
        diff = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
        assert diff.numel() == 0, f"{diff.numel()} elements differ, first at {diff[:4].tolist()}"


@interpreter_only
@pytest.mark.parametrize("weights", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_resync_full_blocks_tails_and_unaligned_views(weights):
    """resync_masters_ on the hinted full-block path (aligned pairs, 1024-element blocks), the
    masked tail and unaligned views: the master takes the weight exactly where they differ."""
    store_m, store_w = torch.randn(9000), torch.randn(9000).to(weights)
    masters = [torch.randn(2048 + 5), store_m[1:3001], torch.randn(1024), store_m[4000:8100]]
    ws = [m.to(weights) for m in masters[:2]] + [torch.randn(1024).to(weights),
                                                  store_w[4000:8100]]
    ws[0][::5] = torch.randn(ws[0][::5].shape).to(weights)
    ws[1][3::7] = torch.randn(ws[1][3::7].shape).to(weights)
    want = [torch.where(w != m.to(weights), w.float(), m) for m, w in zip(masters, ws)]
    rows, *_ = tb._table(list(zip(masters, ws)), 1024)
    assert rows[4] == [1, 0, 1, 1]
    tb.resync_masters(masters, ws)
    for got, w in zip(masters, want):
        assert torch.equal(got, w)


class _Recorder:
    """A context manager that records entries, and whether a launch happened inside it."""

    def __init__(self):
        self.devices, self.inside, self.launched_inside = [], False, []

    def __call__(self, device):
        self.devices.append(device)

        @contextlib.contextmanager
        def ctx():
            self.inside = True
            try:
                yield
            finally:
                self.inside = False
        return ctx()


class _FakeKernel:
    def __init__(self, recorder):
        self.recorder = recorder

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.recorder.launched_inside.append(self.recorder.inside)


def test_launch_runs_under_the_tensors_device(monkeypatch):
    """The table upload and the launch run inside on_device(the tensors' device)."""
    rec = _Recorder()
    monkeypatch.setattr(tb, "on_device", rec)
    monkeypatch.setattr(tb, "_accumulate_kernel", _FakeKernel(rec))
    tb.accumulate([torch.zeros(5), torch.zeros(3)],
                  [torch.ones(5), torch.ones(3, dtype=torch.bfloat16)], 1.0, None, False, None)
    assert rec.devices == [torch.device("cpu")] * 2 and rec.launched_inside == [True, True]


def test_wgrad_triton_gemm_runs_under_the_tensors_device(monkeypatch):
    from accumkernels.wgrad import triton_gemm

    rec = _Recorder()
    monkeypatch.setattr(triton_gemm, "on_device", rec)
    monkeypatch.setattr(triton_gemm, "_kernel", _FakeKernel(rec))
    view = torch.zeros(4, 3)
    triton_gemm.gemm_triton(view, torch.ones(2, 4), torch.ones(2, 3), 1.0, False, None)
    assert rec.devices == [view.device] and rec.launched_inside == [True]


def test_on_device_names_the_tensors_cuda_device():
    """For a CUDA tensor the guard is torch.cuda.device of its index (built without a GPU)."""
    guard = _util.on_device(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(_util.on_device(torch.device("cpu")), contextlib.nullcontext)


class _FakeGraph:
    """Stands for the torch.cuda.CUDAGraph being captured."""


def test_captured_tables_live_exactly_as_long_as_their_graph(monkeypatch):
    graph = _FakeGraph()
    graph_ref = weakref.ref(graph)
    monkeypatch.setattr(tb, "_capturing_graph", lambda: graph_ref())
    host = torch.arange(10, dtype=torch.int64).reshape(5, 2)
    table = tb._captured_table(host, torch.device("cpu"))
    assert torch.equal(table, host) and not tb._UNOWNED
    alive = [weakref.ref(host), weakref.ref(table)]
    del host, table
    gc.collect()
    assert all(r() is not None for r in alive), "freed while the graph lives"
    del graph
    gc.collect()
    assert all(r() is None for r in alive), "kept after the graph died"


def test_tables_of_foreign_captures_are_shared_and_bounded(monkeypatch):
    """A capture torch did not start: the same table content is kept once, and the total is
    capped with a clear error."""
    monkeypatch.setattr(tb, "_capturing_graph", lambda: None)
    monkeypatch.setattr(tb, "_UNOWNED", {})
    cpu = torch.device("cpu")
    a = torch.arange(10, dtype=torch.int64).reshape(5, 2)
    first = tb._captured_table(a, cpu)
    again = tb._captured_table(a.clone(), cpu)
    assert again is first and len(tb._UNOWNED) == 1
    monkeypatch.setattr(tb, "_UNOWNED_LIMIT", 2 * a.nbytes)
    tb._captured_table(a + 1, cpu)
    with pytest.raises(RuntimeError, match="torch.cuda.graph"):
        tb._captured_table(a + 2, cpu)
    assert len(tb._UNOWNED) == 2


def _cuobjdump() -> str | None:
    found = shutil.which("cuobjdump")
    bundled = Path(tb.triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return found or (str(bundled) if bundled.is_file() else None)


@pytest.mark.skipif(_cuobjdump() is None, reason="no cuobjdump")
def test_aot_sm90_compile_uses_16_byte_accesses():
    """Compiled ahead of time for sm_90 (no GPU), the kernel's full-block path issues 128-bit
    loads and stores, with no spills. Skips where this Triton cannot compile without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "sass_check.py"), "--triton", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
                          check=False)
    if proc.returncode == 3:
        pytest.skip(f"no ahead-of-time compile here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    variants = json.loads(proc.stdout)
    assert len(variants) == 6
    for v in variants:
        ops = v["ops"]
        assert ops.get("STG.E.128", 0) > 0 and ops.get("LDG.E.128", 0) > 0, v
        assert v["registers"] <= 64 and v["spill_bytes"] == 0, v
    assert not any(re.search("LDL|STL", " ".join(v["ops"])) for v in variants)
