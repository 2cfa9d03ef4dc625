"""Host overhead per call: the time the host spends issuing one call on a list of short tensors.

A long list of tiny tensors (default 300 x 1,024 elements) makes the per-call and per-tensor
host work visible. Each function is called N times back to back *without synchronising*, timed
with ``time.perf_counter``: on a GPU that is the host's issue rate (as long as the device keeps
up), on the CPU the whole call (the kernel runs on the calling thread). Batches of all the
functions of one row are interleaved, so a shared machine's drifting load biases them alike.

For accumkernels providers a row also times, through the library's private layers (layers.py):

* the layers of the public call: ``accumulate_`` (argument checks in Python, then one C++ call
  that checks every tensor, bumps version counters and launches), ``backend`` (the op's
  implementation), ``binding`` (the extension's entry point alone), and ``custom_op`` (the
  torch.library op: the path compiled graphs take; eager calls skip its dispatcher);
* the launch of a MasterGradBuffer bucket holding the same shapes, as the optimizer wrapper
  calls it (``buffer.accumulate``), its bucket's launch plan (``plan``: the dst side was checked
  when the plan was built) and the plan's entry point (``plan_binding``);
* ``torch._foreach_add_`` on the same list with fp32 src (``foreach_us``), the yardstick of the
  host-overhead targets, and the ratios to it.

``python -m benchmarks.accumbench.overhead`` measures the host-path record on the CPU (one
thread, 300 one-element tensors, plus the serial/parallel crossover of the CPU kernel and the
staging-area numbers) and appends it as a tagged row to benchmarks/results/overhead.jsonl.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench import results
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.layers import call_layers, plan_layers
from benchmarks.accumbench.measure import random_tensors, time_calls
from benchmarks.accumbench.providers import Provider, provider_scale
from benchmarks.accumbench.workloads import DTYPES

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
    """The layers of one ``accumulate_`` call (layers.call_layers), outermost first."""
    return dict(call_layers(dst, src, scale, overwrite=overwrite, backend=backend))


def plan_stages(backend: str, dst: list[torch.Tensor], src: list[torch.Tensor], scale: float,
                overwrite: bool) -> dict[str, Callable[[], object]]:
    """A bucket launch on the shapes of ``dst``: MasterGradBuffer.accumulate and its plan's layers.

    The buffer holds its own fp32 views (one bucket); ``src`` are the incoming gradients.
    """
    params = [torch.nn.Parameter(torch.empty(d.shape, device=d.device)) for d in dst]
    buffer = accumkernels.MasterGradBuffer(params, bucket_size_mb=math.inf)
    (bucket,) = buffer.buckets
    stages: dict[str, Callable[[], object]] = {
        "buffer.accumulate": lambda: buffer.accumulate(params, src, scale, overwrite=overwrite,
                                                       backend=backend)}
    stages.update(plan_layers(bucket.plan(backend), src, scale, keys=params, overwrite=overwrite))
    return stages


def _split(us: dict[str, float]) -> dict[str, float | None]:
    """What each layer of the public call adds on top of the one below it."""
    def diff(a: str, b: str) -> float | None:
        return us[a] - us[b] if a in us and b in us else None
    full, binding = us.get("accumulate_"), us.get("binding")
    return {"validation_us": diff("accumulate_", "backend"),  # argument checks in Python
            "dispatch_us": diff("custom_op", "backend"),  # the op's dispatcher (compiled code)
            "marshal_us": diff("backend", "binding"),
            "binding_us": binding,
            "python_us": full - binding if full is not None and binding is not None else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def measure_overhead(name: str, fn: Provider, device: torch.device, n_tensors: int = 300,
                     numel: int = 1024, dtype: torch.dtype = torch.bfloat16,
                     overwrite: bool = False, device_reps: int = 100,
                     batches: int = BATCHES) -> dict:
    """One row: host/wall µs per call of ``fn`` on ``n_tensors`` x ``numel``, and its layers."""
    shapes = [(numel,)] * n_tensors
    dst = random_tensors(shapes, torch.float32, device)
    src = random_tensors(shapes, dtype, device)
    row = {"provider": name, "n_tensors": n_tensors, "numel_per_tensor": numel,
           "dtype": _SHORT.get(dtype, str(dtype)), "overwrite": overwrite, "status": "ok",
           "error": None, "calls_per_batch": None, "host_us": None, "wall_us": None,
           "device_us": None, "stages_us": None, "validation_us": None, "dispatch_us": None,
           "marshal_us": None, "binding_us": None, "python_us": None, "plan_us": None,
           "plan_stages_us": None, "foreach_us": None, "ratio_vs_foreach": None,
           "plan_ratio_vs_foreach": None}
    try:
        fns: dict[str, Callable[[], object]] = {"call": lambda: fn(dst, src)}
        stage_names: list[str] = []
        plan_names: list[str] = []
        if name.startswith("accumkernels:"):
            backend, scale = name.split(":", 1)[1], provider_scale(fn)
            stages = backend_stages(backend, dst, src, scale, overwrite)
            plans = plan_stages(backend, dst, src, scale, overwrite)
            stage_names, plan_names = list(stages), list(plans)
            src32 = [x.float() for x in src]
            fns.update(stages)
            fns.update(plans)
            fns["foreach"] = lambda: torch._foreach_add_(dst, src32, alpha=scale)
        times = host_times_us(fns, device, batches)
        host, wall, n = times.pop("call")
        row.update(host_us=host, wall_us=wall, calls_per_batch=n)
        if stage_names:
            us = {k: times[k][0] for k in stage_names}
            row["stages_us"] = us
            row.update(_split(us))
            row["plan_stages_us"] = {k: times[k][0] for k in plan_names}
            row["plan_us"] = row["plan_stages_us"]["buffer.accumulate"]
            row["foreach_us"] = times["foreach"][0]
            row["ratio_vs_foreach"] = _ratio(us["accumulate_"], row["foreach_us"])
            row["plan_ratio_vs_foreach"] = _ratio(row["plan_us"], row["foreach_us"])
        if device.type == "cuda":  # device time alone, L2 flushed: is the call host-bound?
            (med, _, _), _ = time_calls(lambda i: fn(dst, src), 1, device, device_reps)
            row["device_us"] = med * 1e3
    except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
        msg = (str(exc).strip().splitlines() or [""])[0][:300]
        row.update(status="error", error=f"{type(exc).__name__}: {msg}")
    return row


# -- the CPU kernel's serial/parallel crossover -------------------------------------------------

def cpu_crossover(sizes: tuple[int, ...] = (16384, 24576, 32768, 36864, 40960, 45056, 49152,
                                             65539, 131072), threads: int = 2,
                  batches: int = 15) -> list[dict]:
    """Per size and src dtype: one ``accumulate_`` call with the CPU kernel run serially vs
    split over ``threads`` (its threshold forced each way), next to ``add_``; the minimum over
    interleaved batches (the least disturbed by a shared machine's load)."""
    from accumkernels.ops.backends import native

    knob = getattr(native, "cpu_parallel_threshold", None)
    if knob is None or knob() is None:
        return []
    rows = []
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    old = knob()
    try:
        for dtype in (torch.float32, torch.bfloat16):
            for numel in sizes:
                d, s = torch.randn(numel), torch.randn(numel).to(dtype)
                inner = max(5, int(4e6 / numel))
                thresholds = {"serial": 1 << 62, "parallel": 0, "add_": old}
                best = dict.fromkeys(thresholds, math.inf)
                for _ in range(batches):
                    for k, threshold in thresholds.items():
                        knob(threshold)
                        if k == "add_":
                            fn = lambda d=d, s=s: d.add_(s, alpha=0.5)  # noqa: E731
                        else:
                            fn = lambda d=d, s=s: accumkernels.accumulate_(  # noqa: E731
                                [d], [s], 0.5, backend="cpu")
                        t0 = time.perf_counter()
                        for _ in range(inner):
                            fn()
                        best[k] = min(best[k], (time.perf_counter() - t0) / inner * 1e6)
                rows.append({"src_dtype": _SHORT[dtype], "numel": numel,
                             **{f"{k}_us": v for k, v in best.items()},
                             "parallel_over_serial": best["parallel"] / best["serial"]})
    finally:
        knob(old)
        torch.set_num_threads(old_threads)
    return rows


# -- a persistent bf16 staging area per bucket: worth it? ----------------------------------------

def staging_numbers(n_tensors: int = 300, numel: int = 1, batches: int = BATCHES) -> dict:
    """What stable src pointers would save per launch, against what filling them costs.

    A staging area (one flat bf16 buffer per bucket whose views are the src) makes a launch
    one flat call. But autograd allocates every gradient itself: the gradients must be copied
    in (``_foreach_copy_``, or a per-param ``copy_`` in hooks), which is an extra pass over
    them and per-tensor host work again.
    """
    shapes = [(numel,)] * n_tensors
    params = [torch.nn.Parameter(torch.empty(s)) for s in shapes]
    buffer = accumkernels.MasterGradBuffer(params, bucket_size_mb=math.inf)
    (bucket,) = buffer.buckets
    grads = random_tensors(shapes, torch.bfloat16, torch.device("cpu"))
    staging = torch.zeros(bucket.flat.numel(), dtype=torch.bfloat16)
    offsets = [v.data_ptr() - bucket.flat.data_ptr() for v in bucket.views]
    staged = [staging[o // 4:o // 4 + g.numel()].view(g.shape) for o, g in zip(offsets, grads)]
    grads32 = [g.float() for g in grads]
    views = bucket.views
    fns = {
        "plan_launch": lambda: buffer.accumulate(params, grads, 0.5),
        "flat_launch": lambda: accumkernels.accumulate_([bucket.flat], [staging], 0.5),
        "foreach_copy_in": lambda: torch._foreach_copy_(staged, grads),
        "per_param_copy_in": lambda: [s.copy_(g) for s, g in zip(staged, grads)],
        "foreach_add": lambda: torch._foreach_add_(views, grads32, alpha=0.5),
    }
    us = {k: v[0] for k, v in host_times_us(fns, torch.device("cpu"), batches).items()}
    return {"n_tensors": n_tensors, "numel_per_tensor": numel, "host_us": us,
            "staged_launch_us": us["flat_launch"] + us["foreach_copy_in"],
            "extra_bytes_per_param": 2, "extra_traffic_bytes_per_element": 4,
            "kernel_traffic_bytes_per_element": 10}


# -- the record ----------------------------------------------------------------------------------

def host_path_record(n_tensors: int = 300, numel: int = 1, threads: int = 1,
                     batches: int = 9) -> dict:
    """The host-path measurement on the CPU (see the module docstring)."""
    from accumkernels.ops.backends import native
    from benchmarks.accumbench.providers import make_providers

    cpu = torch.device("cpu")
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        env = environment(cpu)
        name = "accumkernels:cpu"
        row = measure_overhead(name, make_providers(cpu, 0.5, False)[name], cpu, n_tensors, numel,
                               torch.bfloat16, False, batches=batches)
        staging = staging_numbers(n_tensors, numel, batches)
    finally:
        torch.set_num_threads(old)
    knob = getattr(native, "cpu_parallel_threshold", lambda: None)
    return {
        "what": "host time of one validated call on many tiny tensors, CPU, interleaved batches",
        "date": datetime.date.today().isoformat(), **env,
        "threads": threads, "tensor_reader": native.READER_NOTE if native.READER else None,
        "row": row,
        "public_call_over_foreach": row["ratio_vs_foreach"],
        "public_call_goal": 1.0,
        "plan_launch_over_foreach": row["plan_ratio_vs_foreach"],
        "plan_launch_goal": 0.2,
        "staging": staging,
        "crossover": cpu_crossover(),
        "cpu_parallel_threshold": knob(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench.overhead",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=300)
    p.add_argument("--numel", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batches", type=int, default=9)
    p.add_argument("--out", type=Path, default=None,
                   help="also write this run's record as JSON here")
    results.add_arguments(p, "overhead")
    args = p.parse_args(argv)
    record = json.loads(json.dumps(host_path_record(args.tensors, args.numel, args.threads,
                                                    args.batches), default=str))
    saved = results.save("overhead", record, args)
    row = record["row"]
    print(f"{args.tensors} x {args.numel} elements, bf16 src, {args.threads} thread(s), "
          f"us per call (median of interleaved batches)")
    print(f"  foreach_add_ (fp32 src)       {row['foreach_us']:8.1f}")
    for k, v in (row["stages_us"] or {}).items():
        print(f"  public   {k:<20} {v:8.1f}")
    for k, v in (row["plan_stages_us"] or {}).items():
        print(f"  bucket   {k:<20} {v:8.1f}")
    print(f"  public call / foreach  {record['public_call_over_foreach']:.3f} (goal <= 1.0)")
    print(f"  plan launch / foreach  {record['plan_launch_over_foreach']:.3f} (goal <= 0.2)")
    print((f"appended a row to {saved}" if saved else "no row appended")
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
