"""Benchmark accumkernels.accumulate_ against the loops people write today.

Every provider (per-param loops, torch._foreach_add_, each accumkernels backend) is run once
and compared with a float64 reference, then timed on random data, rotating buffer sets so no
call hits in cache. Results are effective bandwidth, also as a fraction of a fp32 copy_
measured in the same run. Prints a table to stdout, progress to stderr, and writes a JSON
record (see benchmarks/results/README.md). Exit status 1 if any row is MISMATCH or error.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

import accumkernels

from . import (
    BASELINES,
    DTYPES,
    QUICK_FLAT_NUMEL,
    REL_TOL,
    SCALE,
    Provider,
    Workload,
    bytes_per_element,
    check_provider,
    format_count,
    make_providers,
    make_workload,
    measure_copy,
    num_buffer_sets,
    parse_count,
    provider_code,
    random_tensors,
    sample_indices,
    select_providers,
    time_calls,
)

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout, when run from one
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32",
                 "float": "fp32"}


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# --- where and what we run on ---------------------------------------------------------------

def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def slugify(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; drops (R)/(TM)."""
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return slugify(torch.cuda.get_device_name(device))
    return "cpu-" + slugify(cpu_name())


def git_info(root: Path = REPO_ROOT) -> tuple[str | None, bool | None]:
    """(HEAD commit, tracked files modified) of the checkout holding this package, else Nones."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return None, None  # installed inside some other repository
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        return git("rev-parse", "HEAD"), dirty
    except (OSError, subprocess.SubprocessError):
        return None, None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def environment(device: torch.device) -> dict:
    """Everything needed to compare this record with another one."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "total_memory": props.total_memory,
               "multi_processor_count": props.multi_processor_count,
               "l2_cache_size": getattr(props, "L2_cache_size", None),
               "capability": f"{props.major}.{props.minor}"}
    commit, dirty = git_info()
    return {
        "device": str(device), "device_name": gpu["name"] if gpu else cpu_name(),
        "device_slug": device_slug(device), "gpu_name": gpu["name"] if gpu else None, "gpu": gpu,
        "cpu_name": cpu_name(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda,
        "python": platform.python_version(), "platform": platform.platform(),
        "accumkernels": getattr(accumkernels, "__version__", None),
        "available_backends": list(accumkernels.available_backends(device)),
        "git_commit": commit, "git_dirty": dirty,
    }


def default_out_path(slug: str, date: datetime.date, overwrite: bool, quick: bool) -> Path:
    """benchmarks/results/<slug>-<date>[-overwrite][-quick].json, in the checkout if any."""
    base = REPO_ROOT if git_info()[0] is not None else Path.cwd()
    suffix = ("-overwrite" if overwrite else "") + ("-quick" if quick else "")
    return base / "benchmarks" / "results" / f"{slug}-{date.isoformat()}{suffix}.json"


# --- measuring --------------------------------------------------------------------------------

def measure_provider(name: str, fn: Provider, w: Workload, dtype: str, dsts: list, srcs: list,
                     idx: list, device: torch.device, args: argparse.Namespace, copy_gbps: float
                     ) -> dict:
    """Check once against float64, then time: one result row."""
    nbytes = bytes_per_element(DTYPES[dtype], args.overwrite) * w.numel
    row = {"workload": w.name, "label": w.label, "n_tensors": len(w.shapes), "numel": w.numel,
           "dtype": dtype, "provider": name, "overwrite": args.overwrite, "bytes": nbytes,
           "reps": args.reps, "buffer_sets": len(dsts), "status": None, "error": None,
           "max_rel_err": None, "median_ms": None, "p20_ms": None, "p80_ms": None, "gbps": None,
           "frac_copy": None, "timer": None, "speedup_vs_loop_literal": None,
           "speedup_vs_best_baseline": None, "best_baseline": None}
    try:
        ok, rel = check_provider(fn, dsts[0], srcs[0], idx, SCALE, args.overwrite)
        row.update(status="ok" if ok else "MISMATCH", max_rel_err=rel)
        (med, p20, p80), timer = time_calls(lambda i: fn(dsts[i], srcs[i]), len(dsts), device,
                                            args.reps)
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


def add_speedups(rows: list[dict]) -> None:
    """Speed-up vs loop_literal and vs the faster of loop_add/foreach, per workload and dtype."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], r["label"], r["dtype"]), []).append(r)
    for group in groups.values():
        ms = {r["provider"]: r["median_ms"] for r in group
              if r["status"] == "ok" and r["median_ms"]}
        literal = ms.get("loop_literal")
        best = min((p for p in ("loop_add", "foreach") if p in ms), key=ms.get, default=None)
        for r in group:
            if r["median_ms"]:
                r["speedup_vs_loop_literal"] = literal / r["median_ms"] if literal else None
                r["speedup_vs_best_baseline"] = ms[best] / r["median_ms"] if best else None
                r["best_baseline"] = best


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_benchmarks(args: argparse.Namespace, device: torch.device, names: list[str]
                   ) -> tuple[dict, list[dict]]:
    """The copy_ ceiling, then every (workload, dtype, provider) row."""
    providers = make_providers(device, SCALE, args.overwrite)
    workloads = [make_workload(n, args.flat_numel, args.quick) for n in args.workloads]
    total = 1 + len(workloads) * len(args.dtypes) * len(names)
    step = itertools.count(1)
    copy = measure_copy(args.flat_numel, device, args.reps, args.max_sets)
    _free(device)
    _log(f"[{next(step)}/{total}] copy_ fp32 {format_count(args.flat_numel)}: "
         f"{copy['median_ms']:.3f} ms {copy['gbps']:.1f} GB/s")
    rows = []
    for w in workloads:
        n_sets = num_buffer_sets(6 * w.numel, device, args.max_sets)
        dsts = [random_tensors(w.shapes, torch.float32, device) for _ in range(n_sets)]
        idx = sample_indices(w.shapes, device, seed=args.seed)
        for dtype in args.dtypes:
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
            _free(device)
        del dsts, idx
        _free(device)
    add_speedups(rows)
    return copy, rows


# --- reporting --------------------------------------------------------------------------------

def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(record: dict) -> str:
    """The plain-text table printed at the end of a run."""
    copy = record["copy"]
    mode = "overwrite" if record["config"]["overwrite"] else "accumulate"
    lines = [
        (f"accumkernels.bench: {record['device_name']} ({record['device']}), torch "
         f"{record['torch']}, triton {record['triton']}, {record['torch_threads']} threads, "
         f"{mode}, scale {record['config']['scale']}"),
        (f"copy_ fp32 {format_count(copy['numel'])} elements: {copy['median_ms']:.3f} ms, "
         f"{copy['gbps']:.1f} GB/s"),
        "",
        (f"{'workload':<14} {'dtype':<5} {'provider':<20} {'median ms':>10} {'GB/s':>7} "
         f"{'of copy':>7} {'vs literal':>10} {'vs add/foreach':>14}  check"),
    ]
    for r in record["rows"]:
        lines.append(
            f"{r['label']:<14} {r['dtype']:<5} {r['provider']:<20} "
            f"{_fmt(r['median_ms'], '10.3f'):>10} {_fmt(r['gbps'], '7.1f'):>7} "
            f"{_fmt(r['frac_copy'], '7.2f'):>7} "
            f"{_fmt(r['speedup_vs_loop_literal'], '.2f', 'x'):>10} "
            f"{_fmt(r['speedup_vs_best_baseline'], '.2f', 'x'):>14}  {r['status']}")
    return "\n".join(lines)


def _json_safe(x: object) -> object:
    """NaN/inf are not JSON: write null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


# --- command line -----------------------------------------------------------------------------

def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, torch.device]:
    p = argparse.ArgumentParser(prog="python -m accumkernels.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--dtypes", type=_csv, default="bf16,fp32",
                   help="gradient (src) dtypes: bf16, fp16, fp32 (default: bf16,fp32)")
    p.add_argument("--workloads", type=_csv, default="gpt2,flat",
                   help="gpt2 (GPT-2-124M parameter list), flat (one buffer) (default: both)")
    p.add_argument("--flat-numel", type=parse_count, metavar="N",
                   help="flat buffer and copy_ size, K/M/G = 2^10/2^20/2^30 "
                        "(default: 256M on GPU, 16M on CPU, 65539 with --quick)")
    p.add_argument("--providers", type=_csv, default=[],
                   help="only these, comma-separated names or globs: loop_literal, loop_add, "
                        "foreach, accumkernels:<backend>, accumkernels (= all backends)")
    p.add_argument("--reps", type=int,
                   help="timed calls per measurement (default: 100 GPU, 5 CPU, 3 with --quick)")
    p.add_argument("--out", type=Path, help="JSON path (default: "
                   "benchmarks/results/<device-slug>-<YYYY-MM-DD>[-overwrite][-quick].json)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test in seconds")
    p.add_argument("--overwrite", action="store_true",
                   help="time overwrite=True (first micro-batch of a window)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = p.parse_args(argv)

    args.dtypes = [DTYPE_ALIASES.get(d, d) for d in args.dtypes]
    for d in args.dtypes:
        if d not in DTYPES:
            p.error(f"unknown dtype {d!r} (choose from {', '.join(DTYPES)})")
    for w in args.workloads:
        if w not in ("gpt2", "flat"):
            p.error(f"unknown workload {w!r} (choose from gpt2, flat)")
    if args.reps is not None and args.reps < 1:
        p.error("--reps must be at least 1")
    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
    gpu = device.type == "cuda"
    if args.flat_numel is None:
        args.flat_numel = QUICK_FLAT_NUMEL if args.quick else (256 << 20 if gpu else 16 << 20)
    if args.reps is None:
        args.reps = 3 if args.quick else (100 if gpu else 5)
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
    torch.manual_seed(args.seed)
    env = environment(device)
    now = datetime.datetime.now(datetime.timezone.utc)
    out = args.out or default_out_path(env["device_slug"], now.date(), args.overwrite, args.quick)
    started = time.perf_counter()
    copy, rows = run_benchmarks(args, device, names)
    workloads = [make_workload(n, args.flat_numel, args.quick) for n in args.workloads]
    record = {
        "schema_version": 1, "date": now.isoformat(timespec="seconds"), "argv": argv, **env,
        "config": {
            "workloads": [{"name": w.name, "label": w.label, "n_tensors": len(w.shapes),
                           "numel": w.numel} for w in workloads],
            "dtypes": args.dtypes, "flat_numel": args.flat_numel, "reps": args.reps,
            "overwrite": args.overwrite, "quick": args.quick, "scale": SCALE, "seed": args.seed,
            "rel_tol": REL_TOL, "providers_filter": args.providers,
        },
        "providers": {n: provider_code(n, args.overwrite) for n in names},
        "copy": copy, "rows": rows, "elapsed_s": time.perf_counter() - started,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(_json_safe(record), indent=1) + "\n")
    print(format_table(record), flush=True)
    _log(f"wrote {out} ({record['elapsed_s']:.1f} s)")
    return 1 if any(r["status"] in ("MISMATCH", "error") for r in rows) else 0
