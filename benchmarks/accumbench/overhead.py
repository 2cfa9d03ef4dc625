"""Host overhead per call: the time the host spends issuing one call on a list of short tensors.

A long list of tiny tensors (default 300 x 1,024 elements) makes the per-call and per-tensor
host work visible. Each provider is called N times back to back *without synchronising*, timed
with ``time.perf_counter``: on a GPU that is the host's issue rate (as long as the device keeps
up), on the CPU the whole call (the kernel runs on the calling thread). For accumkernels
backends the call is also timed layer by layer, so the layers' differences say where the time
goes: validation in ``accumulate_``, the ``torch.library`` custom-op dispatch, the backend's
argument marshalling in Python, and the compiled binding (C++ launch on GPU; launch + the
kernel itself on CPU).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

import accumkernels

from .measure import random_tensors, time_calls
from .providers import Provider, provider_scale
from .workloads import DTYPES

_SHORT = {v: k for k, v in DTYPES.items()}  # torch.bfloat16 -> "bf16"

TARGET_BATCH_S = 0.02  # host time per batch of back-to-back calls
BATCHES = 5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_times_us(fns: dict[str, Callable[[], object]], device: torch.device,
                  batches: int = BATCHES) -> dict[str, tuple[float, float, int]]:
    """name -> (host µs per call, wall µs per call incl. draining the device, calls per batch).

    Batches of the different functions are interleaved, so that a machine whose load drifts
    (a shared CPU) biases them all alike and their differences stay meaningful.
    """
    counts = {}
    for name, fn in fns.items():
        fn()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        fn()
        _sync(device)
        est = max((time.perf_counter() - t0) / 2, 1e-7)
        counts[name] = max(3, min(1000, int(TARGET_BATCH_S / est)))
    host: dict[str, list[float]] = {name: [] for name in fns}
    wall: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(batches):
        for name, fn in fns.items():
            n = counts[name]
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            t1 = time.perf_counter()
            _sync(device)
            t2 = time.perf_counter()
            host[name].append((t1 - t0) / n * 1e6)
            wall[name].append((t2 - t0) / n * 1e6)
    return {name: (statistics.median(host[name]), statistics.median(wall[name]), counts[name])
            for name in fns}


def backend_stages(backend: str, dst: list[torch.Tensor], src: list[torch.Tensor], scale: float,
                   overwrite: bool) -> dict[str, Callable[[], object]]:
    """The layers of one ``accumulate_`` call, outermost first; each skips the ones above it.

    Uses package internals (the custom op, the backend module, ``_C``); a layer whose internals
    moved is left out rather than guessed.
    """
    stages: dict[str, Callable[[], object]] = {
        "accumulate_": lambda: accumkernels.accumulate_(dst, src, scale, overwrite=overwrite,
                                                        backend=backend)}
    try:
        op = torch.ops.accumkernels.accumulate_
        stages["custom_op"] = lambda: op(dst, src, scale, None, overwrite, None, backend)
        from accumkernels import backends
        module = backends.get(backend)
        stages["backend"] = lambda: module.accumulate(dst, src, scale, None, overwrite, None)
    except (AttributeError, ImportError, KeyError, RuntimeError):
        return stages
    c_ext = getattr(module, "_C", None)
    codes = getattr(module, "_DTYPE_CODES", None)
    if backend in ("cpu", "cuda") and c_ext is not None and codes is not None:
        args = ([d.data_ptr() for d in dst], [x.data_ptr() for x in src],
                [d.numel() for d in dst], [codes[x.dtype] for x in src], float(scale), 0,
                bool(overwrite), 0)
        device = dst[0].device
        if backend == "cpu":
            threads = torch.get_num_threads()
            stages["binding"] = lambda: c_ext.accumulate_cpu(*args, threads)
        else:
            stream = torch.cuda.current_stream(device).cuda_stream
            stages["binding"] = lambda: c_ext.accumulate_cuda(*args, stream, device.index)
    return stages


def _split(us: dict[str, float]) -> dict[str, float | None]:
    """Differences of consecutive layers: what each layer adds on top of the ones below."""
    def diff(a: str, b: str) -> float | None:
        return us[a] - us[b] if a in us and b in us else None
    full, binding = us.get("accumulate_"), us.get("binding")
    return {"validation_us": diff("accumulate_", "custom_op"),
            "dispatch_us": diff("custom_op", "backend"),
            "marshal_us": diff("backend", "binding"),
            "binding_us": binding,
            "python_us": full - binding if full is not None and binding is not None else None}


def measure_overhead(name: str, fn: Provider, device: torch.device, n_tensors: int = 300,
                     numel: int = 1024, dtype: torch.dtype = torch.bfloat16,
                     overwrite: bool = False, device_reps: int = 100) -> dict:
    """One row: host/wall µs per call of ``fn`` on ``n_tensors`` x ``numel``, and its layers."""
    shapes = [(numel,)] * n_tensors
    dst = random_tensors(shapes, torch.float32, device)
    src = random_tensors(shapes, dtype, device)
    row = {"provider": name, "n_tensors": n_tensors, "numel_per_tensor": numel,
           "dtype": _SHORT.get(dtype, str(dtype)), "overwrite": overwrite, "status": "ok",
           "error": None, "calls_per_batch": None, "host_us": None, "wall_us": None,
           "device_us": None, "stages_us": None, "validation_us": None, "dispatch_us": None,
           "marshal_us": None, "binding_us": None, "python_us": None}
    try:
        fns: dict[str, Callable[[], object]] = {"call": lambda: fn(dst, src)}
        if name.startswith("accumkernels:"):
            fns.update(backend_stages(name.split(":", 1)[1], dst, src, provider_scale(fn),
                                      overwrite))
        times = host_times_us(fns, device)
        host, wall, n = times.pop("call")
        row.update(host_us=host, wall_us=wall, calls_per_batch=n)
        if times:
            us = {k: v[0] for k, v in times.items()}
            row["stages_us"] = us
            row.update(_split(us))
        if device.type == "cuda":  # device time alone, L2 flushed: is the call host-bound?
            (med, _, _), _ = time_calls(lambda i: fn(dst, src), 1, device, device_reps)
            row["device_us"] = med * 1e3
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        msg = (str(exc).strip().splitlines() or [""])[0][:300]
        row.update(status="error", error=f"{type(exc).__name__}: {msg}")
    return row
