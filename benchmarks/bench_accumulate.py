"""pytest-benchmark suite for accumulate_: provider x gradient dtype x workload, and host overhead.

GPU: the GPT-2-124M parameter list, Llama-7B's list with as many layers as fit in 40% of free
memory, 5,000 tensors of 1K elements, and flat buffers of 1M, 16M and 256M elements. CPU: the
same lists at the CLI's --quick sizes (148- and 291-tensor lists under 1M elements, 1,000 x 65,
one 65539-element buffer), so that CI (pyproject sets --benchmark-disable: each test runs once,
after its float64 check) takes seconds. Numbers: ``pytest benchmarks --benchmark-enable``; the
bandwidth report is ``python -m benchmarks.accumbench``.
"""

from __future__ import annotations

import functools
import itertools

import pytest
import torch

from benchmarks import accumbench as bench

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
FLAT_SIZES = [1 << 20, 16 << 20, 256 << 20] if GPU else [bench.QUICK_FLAT_NUMEL]
WORKLOADS = ["gpt2", "llama7b", "small"] + [f"flat-{bench.format_count(n)}" for n in FLAT_SIZES]
DTYPES = list(bench.DTYPES)
N_SETS = 2  # alternate buffer sets; on GPU the large sets are far larger than L2
PROVIDERS = list(bench.make_providers(DEVICE))


@functools.cache
def _llama_layers() -> int:
    """Sized once, from the memory free before the first Llama test (the same list for all)."""
    torch.cuda.empty_cache()
    return bench.fit_llama_layers(DEVICE, max(d.itemsize for d in bench.DTYPES.values()))


def _workload(name: str) -> bench.Workload:
    if name.startswith("flat-"):
        return bench.make_workload("flat", bench.parse_count(name.removeprefix("flat-")))
    if name == "llama7b" and GPU:
        return bench.make_workload(name, llama_layers=_llama_layers())
    return bench.make_workload(name, quick=not GPU)


def _rotating(fn, dsts: list, srcs: list):
    """A no-argument call for the benchmark fixture, alternating buffer sets."""
    counter = itertools.count()

    def step() -> None:
        i = next(counter) % len(dsts)
        fn(dsts[i], srcs[i])
        if GPU:
            torch.cuda.synchronize(DEVICE)  # pytest-benchmark times with a host clock

    return step


@pytest.mark.parametrize("workload", WORKLOADS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("provider", PROVIDERS)
def test_accumulate(benchmark, provider, dtype, workload):
    w = _workload(workload)
    fn = bench.make_providers(DEVICE)[provider]
    dsts = [bench.random_tensors(w.shapes, torch.float32, DEVICE) for _ in range(N_SETS)]
    srcs = [bench.random_tensors(w.shapes, bench.DTYPES[dtype], DEVICE) for _ in range(N_SETS)]
    idx = bench.sample_indices(w.shapes, DEVICE)
    scale = bench.provider_scale(fn)
    try:
        ok, rel = bench.check_provider(fn, dsts[0], srcs[0], idx, scale, overwrite=False)
    except (RuntimeError, NotImplementedError) as exc:
        if provider in bench.BASELINES:  # torch refusing mixed dtypes / lacking grad_dtype
            pytest.skip(f"torch refuses {provider}: {exc}")
        raise
    assert ok, f"{provider} differs from the float64 reference (max rel err {rel:.2e})"
    benchmark.group = f"{w.label} {dtype}"
    benchmark.extra_info.update(numel=w.numel, n_tensors=len(w.shapes), scale=scale,
                                bytes=bench.bytes_per_element(bench.DTYPES[dtype]) * w.numel)
    benchmark(_rotating(fn, dsts, srcs))


@pytest.mark.parametrize("provider", PROVIDERS)
def test_host_overhead_300(benchmark, provider):
    """One call on 300 x 1K bf16 tensors, no synchronisation: the host's cost of a call."""
    shapes = [(1024,)] * 300
    dst = bench.random_tensors(shapes, torch.float32, DEVICE)
    src = bench.random_tensors(shapes, torch.bfloat16, DEVICE)
    fn = bench.make_providers(DEVICE)[provider]
    if provider == "native_grad_dtype" and not bench.NativeGradDtype.supported():
        pytest.skip(f"torch {torch.__version__} has no Tensor.grad_dtype")
    benchmark.group = "host overhead, 300 x 1K bf16"
    benchmark(fn, dst, src)
    if GPU:
        torch.cuda.synchronize(DEVICE)
    assert all(torch.isfinite(d).all() for d in dst)


def test_copy(benchmark):
    """The fp32 copy_ that the bandwidth fractions are relative to (8 bytes/element)."""
    n = max(FLAT_SIZES)
    dsts = [[torch.empty(n, device=DEVICE)] for _ in range(N_SETS)]
    srcs = [[torch.empty(n, device=DEVICE).normal_()] for _ in range(N_SETS)]
    benchmark.group = "copy_"
    benchmark.extra_info.update(numel=n, bytes=8 * n)
    benchmark(_rotating(torch._foreach_copy_, dsts, srcs))
    assert torch.equal(dsts[0][0], srcs[0][0])
