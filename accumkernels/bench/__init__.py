"""Benchmark helpers for ``accumulate_``: workloads, providers, checks, timers.

The CLI built from them is ``python -m accumkernels.bench`` (see cli.py); the pytest-benchmark
suite in benchmarks/bench_accumulate.py reuses them. Performance is reported as effective
bandwidth (bytes read + written per second) next to a device-to-device ``copy_``.
"""

from __future__ import annotations

import fnmatch
import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

import accumkernels

Shape = tuple[int, ...]
Provider = Callable[[list[torch.Tensor], list[torch.Tensor]], None]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# 1/N for N = 8 micro-batches. A power of two, so scale * src is exact and dst stays finite.
SCALE = 1.0 / 8
QUICK_FLAT_NUMEL = 2**16 + 3  # odd: exercises the masked tail paths
REL_TOL = 1e-6  # DESIGN.md: fp32 results within fp32 rounding of the float64 reference


# --- workloads ------------------------------------------------------------------------------

def gpt2_shapes(
    vocab_size: int = 50257, n_embd: int = 768, n_positions: int = 1024, n_layer: int = 12
) -> list[tuple[str, Shape]]:
    """Named parameter shapes of a GPT-2 model, in HF order (Conv1D weights are (in, out))."""
    e = n_embd
    shapes: list[tuple[str, Shape]] = [
        ("wte.weight", (vocab_size, e)), ("wpe.weight", (n_positions, e))]
    for i in range(n_layer):
        shapes += [
            (f"h.{i}.ln_1.weight", (e,)), (f"h.{i}.ln_1.bias", (e,)),
            (f"h.{i}.attn.c_attn.weight", (e, 3 * e)), (f"h.{i}.attn.c_attn.bias", (3 * e,)),
            (f"h.{i}.attn.c_proj.weight", (e, e)), (f"h.{i}.attn.c_proj.bias", (e,)),
            (f"h.{i}.ln_2.weight", (e,)), (f"h.{i}.ln_2.bias", (e,)),
            (f"h.{i}.mlp.c_fc.weight", (e, 4 * e)), (f"h.{i}.mlp.c_fc.bias", (4 * e,)),
            (f"h.{i}.mlp.c_proj.weight", (4 * e, e)), (f"h.{i}.mlp.c_proj.bias", (e,)),
        ]
    return shapes + [("ln_f.weight", (e,)), ("ln_f.bias", (e,))]


def gpt2_124m_shapes() -> list[tuple[str, Shape]]:
    """GPT-2 small (124M, tied lm_head): 148 tensors, 124,439,808 elements."""
    return gpt2_shapes()


@dataclass(frozen=True)
class Workload:
    name: str  # what --workloads selects: "gpt2" | "flat"
    label: str  # what the table shows: "gpt2-124m", "flat-256M", ...
    shapes: tuple[Shape, ...]

    @property
    def numel(self) -> int:
        return sum(math.prod(s) for s in self.shapes)


def make_workload(name: str, flat_numel: int, quick: bool = False) -> Workload:
    """The parameter list of a named workload; ``quick`` shrinks GPT-2 but keeps its 148 tensors."""
    if name == "gpt2":
        if quick:
            shapes = gpt2_shapes(vocab_size=1000, n_embd=64, n_positions=128)
            return Workload("gpt2", "gpt2-tiny", tuple(s for _, s in shapes))
        return Workload("gpt2", "gpt2-124m", tuple(s for _, s in gpt2_124m_shapes()))
    if name == "flat":
        return Workload("flat", f"flat-{format_count(flat_numel)}", ((flat_numel,),))
    raise ValueError(f"unknown workload {name!r} (choose from gpt2, flat)")


def bytes_per_element(src_dtype: torch.dtype, overwrite: bool = False) -> int:
    """Minimum traffic per element: read src, read dst (unless overwrite), write dst (fp32)."""
    return src_dtype.itemsize + (0 if overwrite else 4) + 4


def parse_count(text: str) -> int:
    """'256M' -> 268435456 (binary K/M/G suffixes), '65539' -> 65539."""
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise ValueError(f"not an element count: {text!r} (e.g. 65539, 16M, 1G)")
    return int(m[1]) << {"": 0, "k": 10, "m": 20, "g": 30}[m[2].lower()]


def format_count(n: int) -> str:
    for shift, suffix in ((30, "G"), (20, "M"), (10, "K")):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


# --- providers ------------------------------------------------------------------------------

def loop_literal(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """What people write: an upcast copy, a scaled copy and an add per param."""
    if overwrite:
        for m, g in zip(dst, src):
            m.copy_(g.float() * s)
    else:
        for m, g in zip(dst, src):
            m += g.float() * s


def loop_add(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """The best single-kernel-per-param loop (two kernels with overwrite)."""
    if overwrite:
        for m, g in zip(dst, src):
            m.copy_(g).mul_(s)
    else:
        for m, g in zip(dst, src):
            m.add_(g, alpha=s)


def foreach(dst: list, src: list, s: float, overwrite: bool = False) -> None:
    """torch's multi-tensor ops; mixed dtypes may take a per-tensor slow path or be refused."""
    if overwrite:
        torch._foreach_copy_(dst, src)
        torch._foreach_mul_(dst, s)
    else:
        torch._foreach_add_(dst, src, alpha=s)


BASELINES: dict[str, Callable[..., None]] = {
    "loop_literal": loop_literal, "loop_add": loop_add, "foreach": foreach,
}
BASELINE_CODE = {  # (accumulate, overwrite), recorded in the JSON
    "loop_literal": ("for m, g in zip(dst, src): m += g.float() * s",
                     "for m, g in zip(dst, src): m.copy_(g.float() * s)"),
    "loop_add": ("for m, g in zip(dst, src): m.add_(g, alpha=s)",
                 "for m, g in zip(dst, src): m.copy_(g).mul_(s)"),
    "foreach": ("torch._foreach_add_(dst, src, alpha=s)",
                "torch._foreach_copy_(dst, src); torch._foreach_mul_(dst, s)"),
}


def accumkernels_backends(device: torch.device) -> list[str]:
    """Backends worth timing: all available ones, except Triton on CPU (interpreter only)."""
    backends = accumkernels.available_backends(device)
    return [b for b in backends if not (device.type == "cpu" and b == "triton")]


def make_providers(device: torch.device, scale: float = SCALE, overwrite: bool = False
                   ) -> dict[str, Provider]:
    """name -> fn(dst, src): the baselines, then ``accumkernels:<backend>`` per backend."""
    providers: dict[str, Provider] = {
        name: partial(fn, s=scale, overwrite=overwrite) for name, fn in BASELINES.items()
    }
    for b in accumkernels_backends(device):
        providers[f"accumkernels:{b}"] = partial(
            accumkernels.accumulate_, scale=scale, overwrite=overwrite, backend=b)
    return providers


def provider_code(name: str, overwrite: bool) -> str:
    if name in BASELINE_CODE:
        return BASELINE_CODE[name][overwrite]
    backend = name.split(":", 1)[1]
    return f"accumkernels.accumulate_(dst, src, s, overwrite={overwrite}, backend={backend!r})"


def select_providers(names: Sequence[str], patterns: Sequence[str]) -> list[str]:
    """Names matching any pattern (exact, fnmatch glob, or bare "accumkernels")."""
    if not patterns:
        return list(names)
    return [n for n in names
            if any(fnmatch.fnmatchcase(n, p) or n.split(":")[0] == p for p in patterns)]


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
    finite = bool(torch.stack([torch.isfinite(t).all() for t in dst]).all()) if dst else True
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


def time_calls(call: Callable[[int], object], n_sets: int, device: torch.device, reps: int
               ) -> tuple[list[float], str]:
    """([median, p20, p80] ms of call(i), timer name), rotating i over the buffer sets.

    GPU: triton.testing.do_bench (CUDA events, L2 flushed before every call). It is
    time-based, so ``reps`` becomes its time budget via a per-call estimate. Without Triton: a
    CUDA-event loop doing the same. CPU: time.perf_counter per call.
    """
    counter = itertools.count()

    def fn() -> None:
        call(next(counter) % n_sets)

    fn()  # warm-up (caching allocator, Triton autotuning, lazy init)
    if device.type != "cuda":
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return quantiles(times), "time.perf_counter"
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
        return list(q), "triton.testing.do_bench"
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
    return quantiles([s.elapsed_time(e) for s, e in events]), "cuda events"


def measure_copy(numel: int, device: torch.device, reps: int, max_sets: int = 16) -> dict:
    """Bandwidth of a large fp32 device-to-device ``copy_``: the ceiling we compare with."""
    n_sets = num_buffer_sets(8 * numel, device, max_sets)
    sets = [(torch.empty(numel, device=device), torch.empty(numel, device=device).normal_())
            for _ in range(n_sets)]
    (med, p20, p80), timer = time_calls(lambda i: sets[i][0].copy_(sets[i][1]), n_sets, device,
                                        reps)
    return {"numel": numel, "bytes": 8 * numel, "median_ms": med, "p20_ms": p20, "p80_ms": p80,
            "gbps": 8 * numel / med / 1e6, "buffer_sets": n_sets, "timer": timer}
