"""Benchmark accumkernels.accumulate_ against the loops people write today.

Every provider (per-param loops, torch._foreach_add_, native grad_dtype=float32 accumulation,
each accumkernels backend) is run once and compared with a float64 reference, then timed on
random data, rotating buffer sets so no call hits in cache. Results are effective bandwidth,
also as a multiple of the limit measured in the same run ('x limit': on the CPU a plain fused C
loop with the same bytes per element over one flat buffer of each list's size, see limit.py; on
a GPU a fp32 device-to-device copy_), and speed-ups over each baseline. A 300-tensor list then
measures host overhead per call. Prints a table and a summary to stdout, progress to stderr,
appends the run as a tagged row to benchmarks/results/kernels.jsonl (see
benchmarks/results/README.md) and draws the plot (kernels.png beside it) from that file. Exit
status 1 if any row is MISMATCH or error. Other suites: ``python -m benchmarks.accumbench
step|host|train|wrapper|summary|plot ...`` (see suites.py).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.accumbench import limit as limit_loop
from benchmarks.accumbench import results, summary
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.measure import (
    check_provider,
    measure_copy,
    num_buffer_sets,
    random_tensors,
    sample_indices,
    time_calls,
)
from benchmarks.accumbench.overhead import measure_overhead
from benchmarks.accumbench.providers import (
    BASELINES,
    Provider,
    make_providers,
    provider_code,
    provider_scale,
    select_providers,
)
from benchmarks.accumbench.report import (
    PLOT_SKIPPED,
    can_plot,
    format_table,
    plot_from_suite,
    write_plot,
)
from benchmarks.accumbench.workloads import (
    DTYPES,
    QUICK_FLAT_NUMEL,
    REL_TOL,
    SCALE,
    WORKLOADS,
    Shape,
    Workload,
    bytes_per_element,
    fit_llama_layers,
    format_count,
    make_workload,
    parse_count,
)

DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                 "float": "fp32"}
WORKLOAD_ALIASES = {"llama": "llama7b"}
# The flat sizes of the size sweep (the plot's lower panels), from cache-resident to DRAM-bound.
CPU_SWEEP = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
GPU_SWEEP = (64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20)
QUICK_SWEEP = (4097, QUICK_FLAT_NUMEL)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- measuring --------------------------------------------------------------------------------

def measure_provider(name: str, fn: Provider, w: Workload, dtype: str, dsts: list, srcs: list,
                     idx: list, device: torch.device, args: argparse.Namespace, copy_gbps: float
                     ) -> dict:
    """Check once against float64, then time: one result row."""
    nbytes = bytes_per_element(DTYPES[dtype], args.overwrite) * w.numel
    scale = provider_scale(fn)
    row = {"workload": w.name, "label": w.label, "n_tensors": len(w.shapes), "numel": w.numel,
           "workload_scale": w.scale, "dtype": dtype, "provider": name,
           "overwrite": args.overwrite, "scale": scale, "note": getattr(fn, "note", None),
           "bytes": nbytes, "reps": args.reps, "buffer_sets": len(dsts), "status": None,
           "error": None, "max_rel_err": None, "median_ms": None, "p20_ms": None, "p80_ms": None,
           "gbps": None, "frac_copy": None, "timer": None, "speedup_vs_best_baseline": None,
           "best_baseline": None, **{f"speedup_vs_{b}": None for b in BASELINES}}
    try:
        ok, rel = check_provider(fn, dsts[0], srcs[0], idx, scale, args.overwrite)
        row.update(status="ok" if ok else "MISMATCH", max_rel_err=rel)
        (med, p20, p80), timer = time_calls(lambda i: fn(dsts[i], srcs[i]), len(dsts), device,
                                            args.reps, warmup=False,
                                            max_seconds=args.row_seconds,
                                            graph=args.timer == "graph")
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the run goes on
        # torch refusing a baseline (e.g. mixed dtypes) is a finding, not a crash
        row["status"] = "unsupported" if name in BASELINES and row["status"] is None else "error"
        msg = (str(exc).strip().splitlines() or [""])[0][:300]
        row["error"] = f"{type(exc).__name__}: {msg}"
        return row
    gbps = nbytes / med / 1e6
    row.update(median_ms=med, p20_ms=p20, p80_ms=p80, gbps=gbps, frac_copy=gbps / copy_gbps,
               timer=timer)
    return row


LIMIT = "limit"  # the provider name of the limit rows


def measure_limit(loop: limit_loop.LimitLoop, w: Workload, dtype: str, n_sets: int,
                  device: torch.device, args: argparse.Namespace, copy_gbps: float) -> dict:
    """The limit row of one list and dtype: the C loop over one flat buffer of its total size."""
    flat: tuple[Shape, ...] = ((w.numel,),)
    dsts = [random_tensors(flat, torch.float32, device) for _ in range(n_sets)]
    srcs = [random_tensors(flat, DTYPES[dtype], device) for _ in range(n_sets)]
    idx = sample_indices(flat, device, seed=args.seed)
    as_flat = Workload(w.name, w.label, flat, w.scale)
    row = measure_provider(LIMIT, loop.provider(SCALE, args.overwrite), as_flat, dtype, dsts,
                           srcs, idx, device, args, copy_gbps)
    row.update(n_tensors=len(w.shapes), kind="limit", threads=loop.threads)
    return row


def add_limits(rows: list[dict], copy_gbps: float, device: torch.device) -> None:
    """Every row's ``x_limit`` = GB/s / the limit's GB/s (its list and dtype's limit row on the
    CPU, the copy_ of this run on a GPU)."""
    limits = {(r["label"], r["dtype"]): r["gbps"] for r in rows
              if r["provider"] == LIMIT and r["status"] == "ok" and r["gbps"]}
    for r in rows:
        lim = copy_gbps if device.type == "cuda" else limits.get((r["label"], r["dtype"]))
        r["limit_gbps"] = lim
        r["x_limit"] = r["gbps"] / lim if r.get("gbps") and lim else None


def add_speedups(rows: list[dict]) -> None:
    """Speed-up vs every baseline, and vs the faster of loop_add/foreach, per workload and dtype."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["provider"] == LIMIT:
            continue  # the limit is a yardstick, not a way to accumulate a list
        groups.setdefault((r["workload"], r["label"], r["dtype"]), []).append(r)
    for group in groups.values():
        ms = {r["provider"]: r["median_ms"] for r in group
              if r["status"] == "ok" and r["median_ms"]}
        best = min((p for p in ("loop_add", "foreach") if p in ms), key=ms.get, default=None)
        for r in group:
            if not r["median_ms"]:
                continue
            for b in BASELINES:
                r[f"speedup_vs_{b}"] = ms[b] / r["median_ms"] if b in ms else None
            r["speedup_vs_best_baseline"] = ms[best] / r["median_ms"] if best else None
            r["best_baseline"] = best


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, getattr(torch, "OutOfMemoryError", ())) or (
        isinstance(exc, RuntimeError) and "out of memory" in str(exc))


def build_workloads(args: argparse.Namespace, device: torch.device) -> list[Workload | str]:
    """The workloads in run order; a GPU Llama sized by free memory stays a name until then."""
    out: list[Workload | str] = []
    for name in args.workloads:
        if name == "flat":
            out += [make_workload("flat", n) for n in args.flat_numel]
        elif name == "llama7b" and args.llama_layers is None:
            out.append(name)  # sized right before allocation, from the memory free then
        else:
            out.append(make_workload(name, quick=args.quick, llama_layers=args.llama_layers or 32,
                                     llama_dim_divisor=args.llama_dim_divisor))
    return out


def _resolve(w: Workload | str, args: argparse.Namespace, device: torch.device) -> Workload:
    if isinstance(w, Workload):
        return w
    itemsize = max(DTYPES[d].itemsize for d in args.dtypes)
    layers = fit_llama_layers(device, itemsize, n_sets=2)
    return make_workload("llama7b", llama_layers=layers, llama_dim_divisor=args.llama_dim_divisor)


def _skipped_rows(w: Workload, args: argparse.Namespace, names: list[str], exc: BaseException
                  ) -> list[dict]:
    err = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return [{"workload": w.name, "label": w.label, "n_tensors": len(w.shapes), "numel": w.numel,
             "workload_scale": w.scale, "dtype": d, "provider": n, "overwrite": args.overwrite,
             "status": "skipped", "error": err, "median_ms": None, "gbps": None,
             "frac_copy": None} for d in args.dtypes for n in names]


def run_benchmarks(args: argparse.Namespace, device: torch.device, names: list[str]
                   ) -> tuple[dict, list[dict], list[dict], list[dict]]:
    """The copy_ ceiling, every (workload, dtype, provider) row, then host overhead rows."""
    providers = make_providers(device, SCALE, args.overwrite)
    workloads = build_workloads(args, device)
    overhead_names = names if args.overhead else []
    loop = args.limit_loop
    per_group = len(names) + (loop is not None)
    total = 1 + len(workloads) * len(args.dtypes) * per_group + len(overhead_names)
    step = itertools.count(1)
    copy = measure_copy(args.copy_numel, device, args.reps, args.max_sets,
                        graph=args.timer == "graph")
    _free(device)
    _log(f"[{next(step)}/{total}] copy_ fp32 {format_count(args.copy_numel)}: "
         f"{copy['median_ms']:.3f} ms {copy['gbps']:.1f} GB/s")
    rows: list[dict] = []
    ran: list[dict] = []
    for w in workloads:
        w = _resolve(w, args, device)
        ran.append(w.describe())
        try:
            n_sets = num_buffer_sets(6 * w.numel, device, args.max_sets)
            dsts = [random_tensors(w.shapes, torch.float32, device) for _ in range(n_sets)]
            idx = sample_indices(w.shapes, device, seed=args.seed)
        except Exception as exc:
            if not _is_oom(exc):
                raise
            dsts = idx = None
            _free(device)
            _log(f"{w.label}: skipped, out of memory ({exc})")
            rows += _skipped_rows(w, args, names, exc)
            for _ in range(len(args.dtypes) * per_group):
                next(step)
            continue
        for dtype in args.dtypes:
            if loop is not None:  # first, so that the group's rows follow their yardstick
                row = measure_limit(loop, w, dtype, n_sets, device, args, copy["gbps"])
                rows.append(row)
                _log(f"[{next(step)}/{total}] {w.label} {dtype} {LIMIT} (C loop, "
                     f"{format_count(w.numel)} flat): "
                     + (f"{row['median_ms']:.3f} ms {row['gbps']:.1f} GB/s " if row["median_ms"]
                        else "") + row["status"] + (f" ({row['error']})" if row["error"] else ""))
            srcs = [random_tensors(w.shapes, DTYPES[dtype], device) for _ in range(n_sets)]
            for name in names:
                row = measure_provider(name, providers[name], w, dtype, dsts, srcs, idx, device,
                                       args, copy["gbps"])
                rows.append(row)
                timing = (f"{row['median_ms']:.3f} ms {row['gbps']:.1f} GB/s "
                          if row["median_ms"] else "")
                _log(f"[{next(step)}/{total}] {w.label} {dtype} {name}: {timing}{row['status']}"
                     + (f" ({row['error']})" if row["error"] else ""))
                if row["status"] != "ok":  # it may have left NaN behind for the next provider
                    for t in itertools.chain.from_iterable(dsts):
                        t.normal_()
            del srcs
            providers = make_providers(device, SCALE, args.overwrite)  # drop bound params
            _free(device)
        del dsts, idx
        _free(device)
    add_speedups(rows)
    add_limits(rows, copy["gbps"], device)
    overhead = []
    for name in overhead_names:
        row = measure_overhead(name, make_providers(device, SCALE, args.overwrite)[name], device,
                               args.overhead_tensors, args.overhead_numel, torch.bfloat16,
                               args.overwrite)
        overhead.append(row)
        _log(f"[{next(step)}/{total}] overhead {args.overhead_tensors}x"
             f"{format_count(args.overhead_numel)} {name}: "
             + (f"{row['host_us']:.1f} us/call" if row["host_us"] else row["status"]))
        _free(device)
    return copy, rows, overhead, ran


# --- command line -----------------------------------------------------------------------------

def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _counts(text: str) -> list[int]:
    try:
        return [parse_count(s) for s in _csv(text)]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtypes", type=_csv, default="bf16,fp16,fp32",
                   help="gradient (src) dtypes: bf16, fp16, fp32 (default: all three)")
    p.add_argument("--workloads", type=_csv, default=",".join(WORKLOADS),
                   help="gpt2 (GPT-2-124M list), llama7b (Llama-7B list, scaled), small "
                        "(5000 x 1K tensors), moe (20000 x 256 + 4 x 4M tensors), flat (one "
                        "buffer per --flat-numel size: the size sweep) (default: all)")
    p.add_argument("--flat-numel", type=_counts, metavar="N[,N...]",
                   help="flat buffer sizes, K/M/G = 2^10/2^20/2^30 (default: the sweep "
                        f"{','.join(map(format_count, GPU_SWEEP))} on GPU, "
                        f"{','.join(map(format_count, CPU_SWEEP))} on CPU, "
                        f"{','.join(map(format_count, QUICK_SWEEP))} with --quick)")
    p.add_argument("--copy-numel", type=parse_count, metavar="N",
                   help="copy_ ceiling size (default: the largest flat size)")
    p.add_argument("--llama-layers", type=int, metavar="L",
                   help="Llama-7B layers to keep, 1..32 (default: as many as fit in 40%% of free "
                        "GPU memory; 32 on CPU)")
    p.add_argument("--llama-dim-divisor", type=int, metavar="D",
                   help="divide Llama's hidden/intermediate/vocab sizes by D, keeping all 291 "
                        "tensors (default: 1 on GPU, 16 on CPU, 128 with --quick)")
    p.add_argument("--providers", type=_csv, default=[],
                   help="only these, comma-separated names or globs: loop_literal, loop_add, "
                        "foreach, native_grad_dtype, accumkernels:<backend>, accumkernels "
                        "(= all backends)")
    p.add_argument("--reps", type=int,
                   help="timed calls per measurement (default: 100 GPU, 5 CPU, 3 with --quick)")
    p.add_argument("--timer", choices=("eager", "graph"), default="eager",
                   help="GPU: time each call as issued (eager, default: host time shows where it "
                        "exceeds the device time, as users see it) or the replay of a CUDA graph "
                        "of it (graph: device time only; a call that cannot be captured is timed "
                        "eagerly and its row's timer says so)")
    p.add_argument("--row-seconds", type=float, metavar="S",
                   help="CPU: stop timing a row after S seconds (>= 3 calls; default 2, 0 = "
                        "never)")
    p.add_argument("--overhead", action=argparse.BooleanOptionalAction, default=True,
                   help="measure host overhead per call on a short-tensor list (default: on)")
    p.add_argument("--overhead-tensors", type=int, default=300, metavar="N",
                   help="tensors in the host-overhead list (default: 300)")
    p.add_argument("--overhead-numel", type=parse_count, default=1024, metavar="N",
                   help="elements per tensor in the host-overhead list (default: 1K)")
    p.add_argument("--limit", action=argparse.BooleanOptionalAction, default=True,
                   help="CPU: time the limit row (a plain fused C loop, compiled now with the "
                        "system g++) for each list and dtype (default: on)")
    p.add_argument("--plot", action=argparse.BooleanOptionalAction, default=True,
                   help="draw the PNG (the lists and the size sweep against the limit) from the "
                        "suite file, beside it (from the record, beside --out, when no row was "
                        "appended); needs matplotlib")
    p.add_argument("--out", type=Path, help="also write this run's record as JSON here")
    results.add_arguments(p, "kernels")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test in seconds")
    p.add_argument("--overwrite", action="store_true",
                   help="time overwrite=True (first micro-batch of a window)")
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch.set_num_threads(N) first; the CPU backend uses the same count "
                        "(default: torch's). On a shared machine, 1 keeps torch's per-op "
                        "thread wake-ups from inflating the baselines")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    return p


def _check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Normalise aliases and reject out-of-range values (p.error exits)."""
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")

    args.dtypes = [DTYPE_ALIASES.get(d, d) for d in args.dtypes]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    args.workloads = [WORKLOAD_ALIASES.get(w, w) for w in args.workloads]
    for w in args.workloads:
        if w not in WORKLOADS:
            p.error(f"unknown workload {w!r} (choose from {', '.join(WORKLOADS)})")
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be at least 1")
    if args.llama_layers is not None and not 1 <= args.llama_layers <= 32:
        p.error("--llama-layers must be in 1..32")
    if args.llama_dim_divisor is not None and args.llama_dim_divisor < 1:
        p.error("--llama-dim-divisor must be at least 1")
    if args.overhead_tensors < 1 or args.overhead_numel < 1:
        p.error("--overhead-tensors and --overhead-numel must be at least 1")


def _pick_device(p: argparse.ArgumentParser, name: str | None) -> torch.device:
    try:
        device = torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as exc:
        p.error(str(exc))
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("--device cuda: CUDA is not available")
        device = torch.device("cuda", torch.cuda.current_device() if device.index is None
                              else device.index)
        torch.cuda.set_device(device)
    elif device.type != "cpu":
        p.error(f"--device {device}: only cuda and cpu are supported")
    return device


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, torch.device]:
    p = _build_parser()
    args = p.parse_args(argv)
    _check_args(p, args)
    device = _pick_device(p, args.device)
    gpu = device.type == "cuda"
    if args.flat_numel is None:
        args.flat_numel = list(QUICK_SWEEP if args.quick else GPU_SWEEP if gpu else CPU_SWEEP)
    if not args.flat_numel or min(args.flat_numel) < 1:
        p.error("--flat-numel needs sizes of at least 1 element")
    if args.copy_numel is None:
        args.copy_numel = max(args.flat_numel)
    if args.llama_dim_divisor is None:
        args.llama_dim_divisor = 128 if args.quick else (1 if gpu else 16)
    if args.llama_layers is None and (not gpu or args.quick):
        args.llama_layers = 32
    if args.reps is None:
        args.reps = 3 if args.quick else (100 if gpu else 5)
    if args.row_seconds is None:
        args.row_seconds = 2.0
    args.max_sets = 2 if args.quick else 16
    return args, device


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args, device = parse_args(argv)
    all_names = list(make_providers(device, SCALE, args.overwrite))
    names = select_providers(all_names, args.providers)
    for pattern in args.providers:
        if not select_providers(all_names, [pattern]):
            _log(f"warning: no provider matches {pattern!r} on {device} "
                 f"(available: {', '.join(all_names)})")
    if not names:
        _log("error: no provider selected")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    args.limit_loop = None
    if device.type == "cpu" and args.limit:
        try:
            args.limit_loop = limit_loop.load(torch.get_num_threads())
        except limit_loop.NoCompiler as exc:
            _log(f"error: {exc}")
            return 2
    torch.manual_seed(args.seed)
    env = environment(device)
    now = datetime.datetime.now(datetime.timezone.utc)
    started = time.perf_counter()
    copy, rows, overhead, ran = run_benchmarks(args, device, names)
    target = results.results_target("kernels", args)
    plot_path = (target.with_suffix(".png") if target is not None
                 else args.out.with_suffix(".png") if args.out is not None else None)
    if not args.plot:
        plot_path = None
    elif plot_path is not None and not can_plot():
        _log(PLOT_SKIPPED)
        plot_path = None
    record = {
        "benchmark": "kernels", "schema_version": 3, "date": now.isoformat(timespec="seconds"),
        "argv": argv, **env,
        "config": {
            "workloads": ran, "dtypes": args.dtypes, "flat_sizes": args.flat_numel,
            "copy_numel": args.copy_numel, "llama_layers": args.llama_layers,
            "llama_dim_divisor": args.llama_dim_divisor, "reps": args.reps,
            "row_seconds": args.row_seconds if device.type == "cpu" else None,
            "threads": args.threads, "overwrite": args.overwrite, "quick": args.quick,
            "scale": SCALE, "seed": args.seed, "timer": args.timer,
            "rel_tol": REL_TOL, "providers_filter": args.providers, "note": args.note,
            "limit": ((f"a {limit_loop.LimitLoop.note}, {args.limit_loop.threads} thread(s), "
                       "timed in this run") if args.limit_loop else
                      "copy_ fp32 of this run" if device.type == "cuda" else None),
        },
        "providers": {n: provider_code(n, args.overwrite) for n in names},
        "copy": copy, "rows": rows,
        "overhead": {"config": {"n_tensors": args.overhead_tensors,
                                "numel_per_tensor": args.overhead_numel, "dtype": "bf16",
                                "batches": 5}, "rows": overhead} if args.overhead else None,
        "plot": plot_path.name if plot_path else None,
        "elapsed_s": time.perf_counter() - started,
    }
    saved = results.save("kernels", record, args)
    if plot_path is not None:
        plot, msg = (plot_from_suite(saved, plot_path) if saved is not None
                     else write_plot(record, plot_path))
        if plot is None:
            record["plot"] = None
        _log(msg)
    print(format_table(record), flush=True)
    print("\n" + summary.format_summary({"kernels": record}), flush=True)
    _log((f"appended a row to {saved}" if saved else "no row appended (--quick/--no-results)")
         + (f"; wrote {args.out}" if args.out else "") + f" ({record['elapsed_s']:.1f} s)")
    bad = [r for r in rows + overhead if r["status"] in ("MISMATCH", "error")]
    return 1 if bad else 0
