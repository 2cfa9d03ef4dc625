"""Batch-size tools (DESIGN: "Batch-size tools and the classic training table"):
find_micro_batch_size (divisors, dropped candidates, out-of-memory handling, the table) and
validate_batch_sizes (the accumulation steps, or an error saying what to change)."""

from __future__ import annotations

import re
import time

import pytest
import torch

from accumkernels import validate_batch_sizes
from accumkernels.batch_size import find_micro_batch_size


class FakeStep:
    """Works like a forward+backward whose memory grows with the micro-batch size."""

    def __init__(self, max_fitting: int, seconds_per_call=lambda m: 1e-3):
        self.max_fitting = max_fitting
        self.calls: list[int] = []
        self.model = torch.nn.Linear(8, 8)
        self.seconds_per_call = seconds_per_call

    def __call__(self, m: int) -> None:
        self.calls.append(m)
        if m > self.max_fitting:
            raise torch.OutOfMemoryError(f"tried to allocate {m} GiB")
        self.model(torch.randn(m, 8)).sum().backward()
        # Busy-wait (not sleep) so the timing is real work of a known duration.
        end = time.perf_counter() + self.seconds_per_call(m)
        while time.perf_counter() < end:
            pass


def test_picks_the_fastest_fitting_size_and_skips_larger_after_oom():
    # Per-call cost grows slower than m up to 8, so samples/s grows with m: 8 is the fastest fit.
    step = FakeStep(max_fitting=8, seconds_per_call=lambda m: 2e-3 + 1e-4 * m)
    result = find_micro_batch_size(step, 64, world_size=2)
    assert result.micro_batch_size == 8 and result.accumulation_steps == 64 // (8 * 2)
    sizes = [r["micro_batch_size"] for r in result.table]
    assert sizes == [1, 2, 4, 8, 16, 32]  # the divisors of 64 / 2
    fits = {r["micro_batch_size"]: r["fits"] for r in result.table}
    assert fits == {1: True, 2: True, 4: True, 8: True, 16: False, 32: False}
    assert 32 not in step.calls  # never tried once 16 ran out of memory
    assert "out of memory" in result.table[4]["note"] and "not tried" in result.table[5]["note"]
    rates = [r["samples_per_s"] for r in result.table if r["fits"]]
    assert all(r > 0 for r in rates)
    assert "<- chosen" in str(result)


def test_candidates_that_do_not_divide_are_dropped():
    result = find_micro_batch_size(FakeStep(100), 48, candidates=[5, 6, 7, 12])
    assert [r["micro_batch_size"] for r in result.table] == [6, 12]
    assert result.accumulation_steps == 48 // result.micro_batch_size


@pytest.mark.parametrize("kwargs,error,match", [
    ({"candidates": [5, 7]}, ValueError, "no candidate divides"),
    ({"candidates": [0]}, ValueError, "candidate must be positive"),
    ({"candidates": 4}, TypeError, "iterable of ints"),
    ({"world_size": 5}, ValueError, "not a multiple of world_size"),
    ({"repeats": 0}, ValueError, "repeats must be positive"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        find_micro_batch_size(FakeStep(100), 48, **kwargs)


def test_not_callable_and_nothing_fits():
    with pytest.raises(TypeError, match="callable"):
        find_micro_batch_size(None, 8)
    with pytest.raises(RuntimeError, match="no micro-batch size fits"):
        find_micro_batch_size(FakeStep(0), 8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_real_out_of_memory_on_the_device():
    free, _ = torch.cuda.mem_get_info()
    row_bytes = free // 6  # 8 rows fit, 16 rows do not

    def step(m: int) -> None:
        x = torch.empty(m, row_bytes // 4, device="cuda")
        x.normal_()

    result = find_micro_batch_size(step, 16, candidates=[1, 2, 4, 16])
    fits = {r["micro_batch_size"]: r["fits"] for r in result.table}
    assert fits[1] and fits[2] and fits[4] and not fits[16]
    assert result.table[0]["peak_memory_bytes"] >= row_bytes


# -- validate_batch_sizes --------------------------------------------------------------------------


@pytest.mark.parametrize("g,m,w", [(64, 8, 1), (64, 64, 1), (96, 4, 3), (7, 1, 7), (1, 1, 1)])
def test_validate_batch_sizes_returns_the_accumulation_steps(g, m, w):
    n = validate_batch_sizes(g, m, w)
    assert isinstance(n, int) and n * m * w == g


@pytest.mark.parametrize("g,m,w", [(10, 4, 1), (100, 8, 2), (3, 4, 1), (64, 5, 3)])
def test_validate_batch_sizes_says_what_to_change(g, m, w):
    with pytest.raises(ValueError) as info:
        validate_batch_sizes(g, m, w)
    message = str(info.value)
    assert "micro_batch_size" in message and str(g) in message
    per_step = m * w
    found = re.search(r"global batch of (\d+)(?: or (\d+))?", message)
    suggested = {int(s) for s in found.groups() if s is not None}
    assert suggested and all(s % per_step == 0 and s > 0 for s in suggested)
    assert (g // per_step + 1) * per_step in suggested  # the next valid global batch


@pytest.mark.parametrize("args,error", [
    ((0, 4, 1), ValueError), ((64, 0, 1), ValueError), ((64, 4, 0), ValueError),
    ((64, -4, 1), ValueError), ((64.0, 4, 1), TypeError), ((64, True, 1), TypeError),
    ((64, 4, "2"), TypeError),
])
def test_validate_batch_sizes_bad_arguments(args, error):
    with pytest.raises(error, match="must be"):
        validate_batch_sizes(*args)
