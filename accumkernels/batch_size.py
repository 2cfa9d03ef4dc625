"""find_micro_batch_size: the fastest micro-batch size that fits, by trying them."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from accumkernels._util import positive_int
from accumkernels.checks import validate_batch_sizes

__all__ = ["MicroBatchSearch", "find_micro_batch_size"]


@dataclass
class MicroBatchSearch:
    """The chosen micro-batch size and what was measured for every candidate."""

    micro_batch_size: int
    accumulation_steps: int
    table: list[dict] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{'micro':>6} {'accum':>6} {'fits':>5} {'samples/s':>10} {'peak MiB':>9}"]
        for row in self.table:
            peak = row["peak_memory_bytes"]
            rate = row["samples_per_s"]
            lines.append(
                f"{row['micro_batch_size']:>6} {row['accumulation_steps']:>6} "
                f"{str(row['fits']):>5} {rate if rate is not None else float('nan'):>10.1f} "
                f"{peak / 2**20 if peak is not None else float('nan'):>9.1f}"
                + ("  <- chosen" if row["micro_batch_size"] == self.micro_batch_size else "")
                + (f"  ({row['note']})" if row.get("note") else ""))
        return "\n".join(lines)


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def find_micro_batch_size(
    train_step: Callable[[int], object],
    global_batch_size: int,
    *,
    candidates: Iterable[int] | None = None,
    world_size: int = 1,
    repeats: int = 3,
) -> MicroBatchSearch:
    """Try micro-batch sizes with ``train_step(size)`` (one forward+backward); pick the fastest.

    Candidates default to the divisors of ``global_batch_size / world_size``; given ones that do
    not divide it are dropped (none left: ValueError). They are tried from small to large;
    ``torch.OutOfMemoryError`` means "does not fit" (memory is freed before the next try) and
    larger sizes are then not tried. Each fitting size is timed over ``repeats`` calls after a
    warm-up one; the result holds the size with the most samples/s and the whole table.
    """
    if not callable(train_step):
        raise TypeError(f"train_step must be callable, got {type(train_step).__name__}")
    g = positive_int("global_batch_size", global_batch_size)
    w = positive_int("world_size", world_size)
    repeats = positive_int("repeats", repeats)
    if g % w:
        raise ValueError(f"global_batch_size={g} is not a multiple of world_size={w}")
    per_rank = g // w
    if candidates is None:
        sizes = [d for d in range(1, per_rank + 1) if per_rank % d == 0]
    else:
        if isinstance(candidates, (int, str)):
            raise TypeError("candidates must be an iterable of ints")
        sizes = sorted({positive_int("candidate", c) for c in candidates})
        sizes = [s for s in sizes if per_rank % s == 0]
        if not sizes:
            raise ValueError(f"no candidate divides global_batch_size / world_size = {per_rank}; "
                             f"divisors are {[d for d in range(1, per_rank + 1) if per_rank % d == 0]}")

    table, too_big = [], None
    for size in sizes:
        row = {"micro_batch_size": size, "accumulation_steps": validate_batch_sizes(g, size, w),
               "fits": False, "samples_per_s": None, "peak_memory_bytes": None, "note": ""}
        table.append(row)
        if too_big is not None:
            row["note"] = f"not tried: {too_big} did not fit"
            continue
        _free_memory()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        try:
            train_step(size)  # warm-up: allocator, autotuning, lazy init
            _sync()
            start = time.perf_counter()
            for _ in range(repeats):
                train_step(size)
            _sync()
            elapsed = time.perf_counter() - start
        except torch.OutOfMemoryError as exc:
            too_big = size
            row["note"] = f"out of memory: {str(exc).splitlines()[0][:80]}" if str(exc) else "out of memory"
            del exc
            _free_memory()
            continue
        row["fits"] = True
        row["samples_per_s"] = size * repeats / elapsed if elapsed > 0 else float("inf")
        if torch.cuda.is_available():
            row["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
    fitting = [r for r in table if r["fits"]]
    if not fitting:
        raise RuntimeError(f"no micro-batch size fits in memory (tried {sizes[0]} first)")
    best = max(fitting, key=lambda r: r["samples_per_s"])
    return MicroBatchSearch(best["micro_batch_size"], best["accumulation_steps"], table)
