"""Reporting a benchmark record: the plain-text tables, the bandwidth plot, JSON safety."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.accumbench.workloads import format_count

SPEEDUP_COLUMNS = (("loop_literal", "vs literal"), ("loop_add", "vs add"),
                   ("foreach", "vs foreach"), ("native_grad_dtype", "vs native"))


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def format_table(record: dict) -> str:
    """The plain-text table printed at the end of a run (bandwidth rows, then overhead)."""
    copy = record["copy"]
    mode = "overwrite" if record["config"]["overwrite"] else "accumulate"
    lines = [
        (f"accumbench: {record['device_name']} ({record['device']}), torch "
         f"{record['torch']}, triton {record['triton']}, {record['torch_threads']} threads, "
         f"{mode}, scale {record['config']['scale']}"),
        (f"copy_ fp32 {format_count(copy['numel'])} elements: {copy['median_ms']:.3f} ms, "
         f"{copy['gbps']:.1f} GB/s"),
        "",
        (f"{'workload':<20} {'dtype':<5} {'provider':<20} {'median ms':>10} {'GB/s':>7} "
         f"{'of copy':>7} " + " ".join(f"{h:>10}" for _, h in SPEEDUP_COLUMNS) + "  check"),
    ]
    for r in record["rows"]:
        speedups = " ".join(f"{_fmt(r.get('speedup_vs_' + b), '.2f', 'x'):>10}"
                            for b, _ in SPEEDUP_COLUMNS)
        note = f" ({r['note']})" if r.get("note") else ""
        lines.append(
            f"{r['label']:<20} {r['dtype']:<5} {r['provider']:<20} "
            f"{_fmt(r['median_ms'], '10.3f'):>10} {_fmt(r['gbps'], '7.1f'):>7} "
            f"{_fmt(r['frac_copy'], '7.2f'):>7} {speedups}  {r['status']}{note}")
    overhead = record.get("overhead")
    if overhead and overhead.get("rows"):
        lines += ["", format_overhead(overhead, record["device"])]
    return "\n".join(lines)


def format_overhead(overhead: dict, device: str) -> str:
    """Host µs per call on the short-tensor list, and where accumkernels spends it."""
    cfg = overhead["config"]
    cpu = device == "cpu"
    lines = [
        (f"host overhead per call: {cfg['n_tensors']} tensors x {cfg['numel_per_tensor']} "
         f"elements, {cfg['dtype']} (us per call, {BATCH_NOTE})"),
        ("  layers of accumulate_: validation = accumulate_ - backend module; dispatch = custom "
         "op - backend module (the path compiled graphs take); marshal = backend module - "
         "compiled binding; binding = the C++ call"
         + (" (on the CPU it includes the kernel's work)" if cpu else " (launch only)")),
        ("  bucket plan = MasterGradBuffer.accumulate on one bucket (the wrapper's launch); "
         "foreach = torch._foreach_add_ on the same list in fp32; x = ratio to foreach"),
        (f"{'provider':<20} {'host us':>9} {'wall us':>9} {'device us':>9} {'validation':>10} "
         f"{'dispatch':>9} {'marshal':>8} {'binding':>8} {'plan us':>8} {'foreach':>8} "
         f"{'call x':>6} {'plan x':>6}  status"),
    ]
    for r in overhead["rows"]:
        lines.append(
            f"{r['provider']:<20} {_fmt(r['host_us'], '9.1f'):>9} {_fmt(r['wall_us'], '9.1f'):>9} "
            f"{_fmt(r['device_us'], '9.1f'):>9} {_fmt(r['validation_us'], '10.1f'):>10} "
            f"{_fmt(r['dispatch_us'], '9.1f'):>9} {_fmt(r['marshal_us'], '8.1f'):>8} "
            f"{_fmt(r['binding_us'], '8.1f'):>8} {_fmt(r.get('plan_us'), '8.1f'):>8} "
            f"{_fmt(r.get('foreach_us'), '8.1f'):>8} "
            f"{_fmt(r.get('ratio_vs_foreach'), '6.2f'):>6} "
            f"{_fmt(r.get('plan_ratio_vs_foreach'), '6.2f'):>6}  {r['status']}"
            + (f" ({r['error']})" if r["error"] else ""))
    return "\n".join(lines)


BATCH_NOTE = "median of 5 batches of back-to-back calls, no synchronisation inside a batch"


def write_plot(record: dict, path: Path) -> tuple[Path | None, str]:
    """GB/s vs flat-buffer size per provider (one panel per dtype), with the copy_ line.

    Returns (path or None, message). Needs matplotlib (the ``bench`` extra); skipped without.
    """
    flat = [r for r in record["rows"] if r["workload"] == "flat" and r["gbps"]]
    if not flat:
        return None, "plot skipped: no flat-buffer rows to plot"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, ("plot skipped: matplotlib is not installed "
                      "(pip install 'accumkernels[bench]')")
    dtypes = list(dict.fromkeys(r["dtype"] for r in flat))
    providers = list(dict.fromkeys(r["provider"] for r in flat))
    sizes = sorted({r["numel"] for r in flat})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 4.5), sharey=True,
                             squeeze=False)
    copy = record["copy"]
    for ax, dtype in zip(axes[0], dtypes):
        for provider in providers:
            pts = sorted((r["numel"], r["gbps"]) for r in flat
                         if r["dtype"] == dtype and r["provider"] == provider)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=provider)
        ax.axhline(copy["gbps"], color="black", linestyle="--", linewidth=1,
                   label=f"copy_ fp32 {format_count(copy['numel'])}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [format_count(n) for n in sizes])
        ax.set_xlabel("elements (one flat buffer)")
        ax.set_title(f"{dtype} -> fp32")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("GB/s (bytes read + written)")
    axes[0][-1].legend(fontsize="small")
    mode = "overwrite" if record["config"]["overwrite"] else "accumulate"
    fig.suptitle(f"accumulate_ ({mode}) on {record['device_name']}, torch {record['torch']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, f"wrote {path}"


def json_safe(x: object) -> object:
    """NaN/inf are not JSON: write null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
