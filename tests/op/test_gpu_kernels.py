"""The CUDA and Triton kernels on a GPU: table sizes around every capacity, captured
and not; unaligned views longer than a chunk; found_inf from the vector part; a scale tensor;
overwrite; a non-default stream; kernels preloaded before a first capture; captured Triton
tables freed with their graph; launches on the tensors' device. Every case is checked against
the float64 reference (tests/gpu_cases.py; benchmarks/sanitize_cases.py runs the same cases under
compute-sanitizer). On a CPU-only host only the last test runs: the cases' own logic, on the CPU
backends."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from pathlib import Path

import gpu_cases
import pytest
import torch
from conftest import HAS_CUDA

import accumkernels

BACKENDS = ["cuda", "triton"]
CUDA = torch.device("cuda", 0)


def gpu(test):
    """Marked ``gpu`` (``pytest -m gpu``) and skipped without one."""
    return pytest.mark.gpu(pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU")(test))


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("n", gpu_cases.TABLE_SIZES)
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
def test_table_sizes(backend, n, captured):
    if captured:
        gpu_cases.table_captured(backend, CUDA, n)
    else:
        gpu_cases.table(backend, CUDA, n)


@gpu
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(gpu_cases.CASES))
def test_case(backend, case):
    fn, _ = gpu_cases.CASES[case]
    fn(backend, CUDA)


@gpu
def test_kernels_are_loaded_before_a_first_capture():
    """In a fresh process with lazy module loading, resolving the cuda backend loads every kernel
    instantiation: lists of 257 and 1001 tensors captured with no eager call of those kernels
    (captured, 1001 tensors run as parameter-table groups of 1000 + 1) replay correctly."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, %r)
        import accumkernels, gpu_cases
        from accumkernels.ops.backends import native
        assert "cuda" in accumkernels.available_backends("cuda")
        assert native._CUDA_PROBLEMS == {0: None}, native._CUDA_PROBLEMS
        dev = torch.device("cuda", 0)
        for n in (257, 1001):
            dst, src = gpu_cases._table_list(n, dev, quick=True)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                accumkernels.accumulate_(dst, src, 0.5, backend="cuda")
            refs = gpu_cases._expect(dst, src, 0.5)
            graph.replay()
            torch.cuda.synchronize()
            gpu_cases._check(refs, dst, f"first capture of {n}")
        print("ok")
    """) % str(Path(__file__).resolve().parents[1])  # tests/, where gpu_cases.py is
    env = {**os.environ, "CUDA_MODULE_LOADING": "LAZY"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


@gpu
def test_captured_triton_tables_are_freed_with_their_graph():
    tb = pytest.importorskip("accumkernels.ops.backends.triton")
    if not hasattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph"):
        pytest.skip("this torch cannot name the graph being captured")
    unowned = len(tb._UNOWNED)
    graph = gpu_cases.table_captured("triton", CUDA, 65, quick=True, replays=1)
    kept = graph.__dict__.get(tb._GRAPH_ATTR)
    assert kept and len(kept) == 3, "one (host, device) table per dtype group"
    refs = [weakref.ref(t) for pair in kept for t in pair]
    del kept, graph
    gc.collect()
    assert all(r() is None for r in refs)
    assert len(tb._UNOWNED) == unowned


@gpu
def test_cuda_backend_is_prepared():
    from accumkernels.ops.backends import native

    assert "cuda" in accumkernels.available_backends(CUDA)
    assert native._CUDA_PROBLEMS.get(0, "unprobed") is None
    assert native._C.cuda_prepare(0) == ""


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("backend", BACKENDS)
def test_launch_on_the_tensors_device_not_the_current_one(backend):
    """Tensors on cuda:1 while cuda:0 is current: the kernel runs on cuda:1, on its current
    stream, and the current device is left as it was."""
    dev = torch.device("cuda", 1)
    with torch.cuda.device(0):
        dst, src = gpu_cases._table_list(65, dev, quick=True)
        refs = gpu_cases._expect(dst, src, 0.75)
        accumkernels.accumulate_(dst, src, 0.75, backend=backend)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    gpu_cases._check(refs, dst, "on cuda:1")


@pytest.mark.skipif(HAS_CUDA, reason="the GPU tests above run the cases themselves")
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_cases_hold_on_the_cpu_backends(backend):
    """The cases' own logic (sizes, views, references) on the CPU backends, Triton through its
    interpreter, small sizes: so that the GPU session meets no bug of the tests themselves."""
    cpu = torch.device("cpu")
    gpu_cases.table(backend, cpu, 65, quick=True)
    if backend == "cpu":
        gpu_cases.table(backend, cpu, 1001, quick=True)
    for fn, needs_cuda in gpu_cases.CASES.values():
        if not needs_cuda:
            fn(backend, cpu, quick=True)
