"""Buffers, the float64 correctness check, and the timers."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence

import torch

from benchmarks.accumbench.providers import Provider
from benchmarks.accumbench.workloads import REL_TOL, Shape

# --- buffers and the correctness check ---------------------------------------------------------

def random_tensors(shapes: Sequence[Shape], dtype: torch.dtype, device: torch.device
                   ) -> list[torch.Tensor]:
    """One separate allocation per param (like real grads), filled with N(0, 1) data."""
    return [torch.empty(s, dtype=dtype, device=device).normal_() for s in shapes]


def num_buffer_sets(set_bytes: int, device: torch.device, max_sets: int = 16) -> int:
    """How many (dst, src) sets to rotate through so that consecutive calls miss in cache."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        target = 2 * getattr(props, "L2_cache_size", 50 * 2**20)
    else:
        target = 64 * 2**20  # > the last-level cache of common desktop/server CPUs
    return max(2, min(max_sets, math.ceil(target / max(set_bytes, 1))))


def sample_indices(shapes: Sequence[Shape], device: torch.device, per_tensor: int = 256,
                   seed: int = 0) -> list[torch.Tensor]:
    """Per tensor: the first and last ``per_tensor`` elements and as many random ones."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        n = math.prod(shape)
        k = min(n, per_tensor)
        idx = torch.cat([torch.arange(k), torch.arange(n - k, n),
                         torch.randint(max(n, 1), (k,), generator=gen)])
        out.append(idx.to(device))
    return out


def _gather(tensors: Sequence[torch.Tensor], idx: Sequence[torch.Tensor]) -> torch.Tensor:
    parts = [t.reshape(-1).index_select(0, i) for t, i in zip(tensors, idx, strict=True)]
    if not parts:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat(parts).to("cpu", torch.float64)


def check_provider(fn: Provider, dst: list[torch.Tensor], src: list[torch.Tensor],
                   idx: Sequence[torch.Tensor], scale: float, overwrite: bool
                   ) -> tuple[bool, float]:
    """Run fn once; compare sampled elements with a float64 reference. -> (ok, max rel error).

    With ``overwrite`` dst is poisoned with NaN first (the op must not read it); without, dst
    holds random data. Any non-finite element anywhere in dst fails the check.
    """
    if overwrite:
        for t in dst:
            t.fill_(float("nan"))
    before = torch.zeros(0, dtype=torch.float64) if overwrite else _gather(dst, idx)
    scaled = _gather(src, idx) * scale
    fn(dst, src)
    after = _gather(dst, idx)
    expected = scaled if overwrite else before + scaled
    bound = scaled.abs() if overwrite else before.abs() + scaled.abs()
    err = (after - expected).abs()
    # Any inf/NaN makes its tensor's sum non-finite (and N(0, 1)-sized data cannot overflow):
    # one fast reduction per tensor instead of a boolean copy of every element.
    finite = bool(torch.isfinite(torch.stack([t.sum() for t in dst])).all()) if dst else True
    ok = finite and bool((err <= REL_TOL * bound + 1e-30).all())
    rel = float((err / bound.clamp_min(1e-30)).max()) if err.numel() else 0.0
    return ok, rel


# --- timing -----------------------------------------------------------------------------------

def quantiles(times: Sequence[float], qs: Sequence[float] = (0.5, 0.2, 0.8)) -> list[float]:
    """Linear-interpolated quantiles (median, p20, p80 by default)."""
    xs = sorted(times)
    out = []
    for q in qs:
        pos = q * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))
    return out


def _cuda_ms(fn: Callable[[], object], n: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / n


MIN_CPU_REPS = 3


def capture_graphs(call: Callable[[int], object], n_sets: int, device: torch.device
                   ) -> list[torch.cuda.CUDAGraph]:
    """One CUDA graph per buffer set replaying call(i), all sharing one memory pool. The call
    runs once more first, on a side stream (what torch asks before a capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        call(0)
    torch.cuda.current_stream(device).wait_stream(side)
    graphs: list[torch.cuda.CUDAGraph] = []
    for i in range(n_sets):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=graphs[0].pool() if graphs else None):
            call(i)
        graphs.append(graph)
    torch.cuda.synchronize(device)
    return graphs


def time_calls(call: Callable[[int], object], n_sets: int, device: torch.device, reps: int,
               *, warmup: bool = True, max_seconds: float | None = None, graph: bool = False
               ) -> tuple[list[float], str]:
    """([median, p20, p80] ms of call(i), timer name), rotating i over the buffer sets.

    GPU: triton.testing.do_bench (CUDA events, L2 flushed before every call). It is
    time-based, so ``reps`` becomes its time budget via a per-call estimate. Without Triton: a
    CUDA-event loop doing the same. With ``graph``, each set's call is captured in a CUDA graph
    and the replays are timed, so host time (Python, launches) stays out of the numbers; a call
    that cannot be captured is timed as is, and the timer name says why. CPU: time.perf_counter
    per call; ``max_seconds`` caps the timed calls (at least 3) so that slow loops do not
    dominate a run. ``warmup=False`` when the caller has just run the call (e.g. its
    correctness check).
    """
    counter = itertools.count(0 if warmup else 1)  # the caller's call used set 0
    graphs: list[torch.cuda.CUDAGraph] = []
    no_graph = ""
    if graph and device.type == "cuda":
        try:
            graphs = capture_graphs(call, n_sets, device)
        except Exception as exc:  # noqa: BLE001 - timed eagerly instead, and said so
            torch.cuda.synchronize(device)
            no_graph = f" (eager: capture failed: {type(exc).__name__}: {str(exc)[:120]})"

    def fn() -> None:
        i = next(counter) % n_sets
        if graphs:
            graphs[i].replay()
        else:
            call(i)

    if device.type != "cuda":
        if warmup:
            fn()
        times = []
        for _ in range(reps):
            if max_seconds and len(times) >= MIN_CPU_REPS and sum(times) > 1e3 * max_seconds:
                break
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return quantiles(times), "time.perf_counter"
    fn()  # warm-up (caching allocator, Triton autotuning, lazy init)
    torch.cuda.synchronize(device)
    est_ms = _cuda_ms(fn, 3)
    try:
        from triton import runtime
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        try:  # do_bench's own estimate includes its L2 flush: budget for it too
            driver = runtime.driver.active
            cache = driver.get_empty_cache_for_benchmark()
            flush_ms = _cuda_ms(lambda: driver.clear_cache(cache), 3)
            del cache
        except (AttributeError, TypeError):  # internals moved: the rep count gets less exact
            flush_ms = 0.0
        q = do_bench(fn, rep=reps * (est_ms + flush_ms), quantiles=[0.5, 0.2, 0.8])
        name = "triton.testing.do_bench" + (" of CUDA-graph replays" if graphs else no_graph)
        return list(q), name
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20)
    flush = torch.empty(2 * l2, dtype=torch.int8, device=device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    name = "cuda events" + (" of CUDA-graph replays" if graphs else no_graph)
    return quantiles([s.elapsed_time(e) for s, e in events]), name


def measure_copy(numel: int, device: torch.device, reps: int, max_sets: int = 16,
                 graph: bool = False) -> dict:
    """Bandwidth of a large fp32 device-to-device ``copy_``: the ceiling we compare with."""
    n_sets = num_buffer_sets(8 * numel, device, max_sets)
    sets = [(torch.empty(numel, device=device), torch.empty(numel, device=device).normal_())
            for _ in range(n_sets)]
    (med, p20, p80), timer = time_calls(lambda i: sets[i][0].copy_(sets[i][1]), n_sets, device,
                                        reps, graph=graph)
    return {"numel": numel, "bytes": 8 * numel, "median_ms": med, "p20_ms": p20, "p80_ms": p80,
            "gbps": 8 * numel / med / 1e6, "buffer_sets": n_sets, "timer": timer}
