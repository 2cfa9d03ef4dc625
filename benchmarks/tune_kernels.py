"""Kernel tuning runs: GB/s of the accumkernels backends under several kernel settings, as a
fraction of a device-to-device copy_ measured in the same run.

    python -m benchmarks.tune_kernels --label stwb                  # the cuda backend as built
    python -m benchmarks.tune_kernels --backends triton --triton-grid sweep
    python -m benchmarks.tune_kernels --quick --out /tmp/t.json     # a smoke test (CPU too)

The cuda backend runs as built (rebuild with ACCUMKERNELS_CUDA_STORE=ptx to time the other
store; ``--label`` names the build in the record). The Triton backend runs once per setting of
its module knobs (BLOCK, NUM_WARPS, HALF_SRC_VEC, TAIL in accumkernels/ops/backends/triton.py):
``--triton-grid default`` (the committed values) or ``sweep`` (a small grid around them).
Every setting is first checked against float64 (sampled elements, as in accumbench), then
timed with accumbench's timer, by default over CUDA-graph replays (device time only). Prints a
table, writes a JSON record (default: benchmarks/results/tune-<device-slug>-<date>.json).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
import time
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench.env import default_out_path, environment
from benchmarks.accumbench.measure import (
    check_provider,
    measure_copy,
    num_buffer_sets,
    random_tensors,
    sample_indices,
    time_calls,
)
from benchmarks.accumbench.report import json_safe
from benchmarks.accumbench.workloads import (
    DTYPES,
    SCALE,
    bytes_per_element,
    fit_llama_layers,
    make_workload,
)

# (BLOCK, NUM_WARPS, HALF_SRC_VEC, TAIL) of the Triton kernel
TRITON_GRIDS = {
    "default": [None],
    "sweep": [None, (4096, 4, 4, 512), (4096, 8, 8, 512), (4096, 8, 4, 512), (8192, 8, 8, 1024),
              (8192, 8, 4, 1024), (2048, 4, 8, 512), (16384, 16, 8, 1024)],
}


def _log(msg: str) -> None:
    print(f"[tune] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def triton_knobs(setting: tuple[int, int, int, int] | None):
    """The Triton backend's module knobs set to ``setting`` for the block (None: as committed)."""
    from accumkernels.ops.backends import triton as tb

    names = ("BLOCK", "NUM_WARPS", "HALF_SRC_VEC", "TAIL")
    saved = tuple(getattr(tb, n) for n in names)
    try:
        if setting is not None:
            for n, v in zip(names, setting):
                setattr(tb, n, v)
        yield "block={} warps={} half_vec={} tail={}".format(*(getattr(tb, n) for n in names))
    finally:
        for n, v in zip(names, saved):
            setattr(tb, n, v)


def measure(backend: str, w, dname: str, dsts, srcs, idx, device, args, copy_gbps: float
            ) -> dict:
    """Check one backend setting against float64, then time it: one row."""
    nbytes = bytes_per_element(DTYPES[dname]) * w.numel
    row = {"workload": w.label, "n_tensors": len(w.shapes), "numel": w.numel, "dtype": dname,
           "backend": backend, "bytes": nbytes, "status": "ok", "error": None}

    def fn(d, s):
        accumkernels.accumulate_(d, s, SCALE, backend=backend)

    try:
        ok, rel = check_provider(fn, dsts[0], srcs[0], idx, SCALE, False)
        (med, p20, p80), timer = time_calls(lambda i: fn(dsts[i], srcs[i]), len(dsts), device,
                                            args.reps, warmup=False,
                                            graph=args.timer == "graph")
    except Exception as exc:  # noqa: BLE001 - recorded, the sweep goes on
        row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:300])
        return row
    gbps = nbytes / med / 1e6
    row.update(status="ok" if ok else "MISMATCH", max_rel_err=rel, median_ms=med, p20_ms=p20,
               p80_ms=p80, gbps=gbps, frac_copy=gbps / copy_gbps, timer=timer)
    return row


def main(argv: list[str] | None = None) -> int:
    gpu = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--label", default="", help="names this build in the record (e.g. stwb)")
    p.add_argument("--backends", default="cuda,triton" if gpu else "cpu")
    p.add_argument("--triton-grid", choices=tuple(TRITON_GRIDS), default="default")
    p.add_argument("--workloads", default="flat,gpt2,llama7b")
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--flat-numel", type=int, default=(256 << 20) if gpu else (1 << 20))
    p.add_argument("--timer", choices=("graph", "eager"), default="graph")
    p.add_argument("--reps", type=int, default=100 if gpu else 3)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda" if gpu else "cpu")
    if args.quick:
        args.flat_numel, args.reps = 65539, 3
    usable = accumkernels.available_backends(device)
    backends = [b for b in args.backends.split(",") if b in usable]
    torch.manual_seed(0)
    started = time.perf_counter()
    copy = measure_copy(args.flat_numel, device, args.reps, graph=args.timer == "graph")
    _log(f"copy_ {copy['gbps']:.1f} GB/s ({copy['timer']})")
    rows = []
    for wname in args.workloads.split(","):
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            if wname == "llama7b" and gpu and not args.quick:
                w = make_workload(wname, llama_layers=fit_llama_layers(device, dtype.itemsize))
            else:
                w = make_workload(wname, args.flat_numel, quick=args.quick or not gpu)
            n_sets = num_buffer_sets((4 + dtype.itemsize) * w.numel, device)
            dsts = [random_tensors(w.shapes, torch.float32, device) for _ in range(n_sets)]
            srcs = [random_tensors(w.shapes, dtype, device) for _ in range(n_sets)]
            idx = sample_indices(w.shapes, device)
            for backend in backends:
                grid = TRITON_GRIDS[args.triton_grid] if backend == "triton" else [None]
                for setting in grid:
                    knobs = triton_knobs(setting) if backend == "triton" \
                        else contextlib.nullcontext(args.label or "as built")
                    with knobs as config:
                        row = measure(backend, w, dname, dsts, srcs, idx, device, args,
                                      copy["gbps"])
                    row["config"] = config
                    rows.append(row)
                    _log(f"{w.label} {dname} {backend} {config}: "
                         + (f"{row['gbps']:.1f} GB/s {row['frac_copy']:.3f}x copy"
                            if row.get("gbps") else f"{row['status']} {row['error'] or ''}"))
                    for t in dsts[0]:  # keep values bounded across many settings
                        t.normal_()
            del dsts, srcs, idx
            if gpu:
                torch.cuda.empty_cache()
    env = environment(device)
    record = {"benchmark": "tune", "schema_version": 1, "environment": env,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv), "label": args.label,
              "config": {"timer": args.timer, "reps": args.reps, "flat_numel": args.flat_numel,
                         "triton_grid": args.triton_grid, "scale": SCALE},
              "copy": copy, "rows": rows, "elapsed_s": time.perf_counter() - started}
    out = args.out or default_out_path("tune-" + env["device_slug"], datetime.date.today(),
                                       False, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(record), indent=1) + "\n")
    print(f"{'workload':22} {'dtype':5} {'backend':7} {'config':44} {'GB/s':>8} {'x copy':>7}")
    for r in rows:
        gbps = f"{r['gbps']:8.1f} {r['frac_copy']:7.3f}" if r.get("gbps") else f"{'':16}"
        gbps += "" if r["status"] == "ok" else f"  {r['status']} {r['error'] or ''}"
        print(f"{r['workload']:22} {r['dtype']:5} {r['backend']:7} {r['config']:44} {gbps}")
    print(f"copy_ {copy['gbps']:.1f} GB/s; wrote {out}")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
