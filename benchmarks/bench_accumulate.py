"""pytest-benchmark suite for accumulate_: provider x gradient dtype x workload.

GPU: the full GPT-2-124M parameter list and a 256M-element flat buffer. CPU: a 148-tensor
GPT-2 list shrunk to ~0.7M elements and a 65539-element buffer, so that CI (pyproject sets
--benchmark-disable: each test runs once, after its float64 check) takes seconds. Numbers:
``pytest benchmarks --benchmark-enable``; the bandwidth report is ``python -m accumkernels.bench``.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from accumkernels import bench

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
GPU = DEVICE.type == "cuda"
FLAT_NUMEL = 256 << 20 if GPU else bench.QUICK_FLAT_NUMEL
N_SETS = 2  # alternate buffer sets; on GPU each set is far larger than L2
PROVIDERS = list(bench.make_providers(DEVICE))


def _rotating(fn, dsts: list, srcs: list):
    """A no-argument call for the benchmark fixture, alternating buffer sets."""
    counter = itertools.count()

    def step() -> None:
        i = next(counter) % len(dsts)
        fn(dsts[i], srcs[i])
        if GPU:
            torch.cuda.synchronize(DEVICE)  # pytest-benchmark times with a host clock

    return step


@pytest.mark.parametrize("workload", ["gpt2", "flat"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("provider", PROVIDERS)
def test_accumulate(benchmark, provider, dtype, workload):
    w = bench.make_workload(workload, FLAT_NUMEL, quick=not GPU)
    fn = bench.make_providers(DEVICE)[provider]
    dsts = [bench.random_tensors(w.shapes, torch.float32, DEVICE) for _ in range(N_SETS)]
    srcs = [bench.random_tensors(w.shapes, bench.DTYPES[dtype], DEVICE) for _ in range(N_SETS)]
    idx = bench.sample_indices(w.shapes, DEVICE)
    try:
        ok, rel = bench.check_provider(fn, dsts[0], srcs[0], idx, bench.SCALE, overwrite=False)
    except RuntimeError as exc:
        if provider in bench.BASELINES:  # torch refusing mixed dtypes is a finding
            pytest.skip(f"torch refuses {provider}: {exc}")
        raise
    assert ok, f"{provider} differs from the float64 reference (max rel err {rel:.2e})"
    benchmark.group = f"{w.label} {dtype}"
    benchmark.extra_info.update(numel=w.numel, n_tensors=len(w.shapes),
                                bytes=bench.bytes_per_element(bench.DTYPES[dtype]) * w.numel)
    benchmark(_rotating(fn, dsts, srcs))


def test_copy(benchmark):
    """The fp32 copy_ that the bandwidth fractions are relative to (8 bytes/element)."""
    dsts = [[torch.empty(FLAT_NUMEL, device=DEVICE)] for _ in range(N_SETS)]
    srcs = [[torch.empty(FLAT_NUMEL, device=DEVICE).normal_()] for _ in range(N_SETS)]
    benchmark.group = "copy_"
    benchmark.extra_info.update(numel=FLAT_NUMEL, bytes=8 * FLAT_NUMEL)
    benchmark(_rotating(torch._foreach_copy_, dsts, srcs))
    assert torch.equal(dsts[0][0], srcs[0][0])
