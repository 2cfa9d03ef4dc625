"""Reporting a benchmark record: the plain-text tables, the bandwidth plot, JSON safety."""

from __future__ import annotations

import math
from pathlib import Path

from benchmarks.accumbench.workloads import format_count

SPEEDUP_COLUMNS = (("loop_literal", "vs literal"), ("loop_add", "vs add"),
                   ("foreach", "vs foreach"), ("native_grad_dtype", "vs native"))


def _fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


LIMIT = "limit"  # the provider name of the limit rows (cli.py)


def limit_line(record: dict) -> str:
    """What the 'x limit' column divides by, in this record."""
    if record["device"].startswith("cuda"):
        return "x limit: GB/s / the copy_ fp32 GB/s of this run"
    if any(r["provider"] == LIMIT for r in record["rows"]):
        return ("x limit: GB/s / the limit row's GB/s of the same list and dtype: a plain fused C "
                "loop (OpenMP, -O3, no -march) doing dst += s * src with the same bytes per "
                "element over one flat buffer of the list's total size, timed in this run")
    return "x limit: - (no limit row in this record)"


def format_table(record: dict) -> str:
    """The plain-text table printed at the end of a run (bandwidth rows, then overhead)."""
    copy = record["copy"]
    mode = "overwrite" if record["config"]["overwrite"] else "accumulate"
    lines = [
        (f"accumbench: {record['device_name']} ({record['device']}), torch "
         f"{record['torch']}, triton {record['triton']}, {record['torch_threads']} threads, "
         f"{mode}, scale {record['config']['scale']}"
         + (f"; {record['config']['note']}" if record["config"].get("note") else "")),
        (f"copy_ fp32 {format_count(copy['numel'])} elements: {copy['median_ms']:.3f} ms, "
         f"{copy['gbps']:.1f} GB/s"),
        limit_line(record),
        "",
        (f"{'workload':<20} {'dtype':<5} {'provider':<20} {'median ms':>10} {'GB/s':>7} "
         f"{'x limit':>7} " + " ".join(f"{h:>10}" for _, h in SPEEDUP_COLUMNS) + "  check"),
    ]
    for r in record["rows"]:
        speedups = " ".join(f"{_fmt(r.get('speedup_vs_' + b), '.2f', 'x'):>10}"
                            for b, _ in SPEEDUP_COLUMNS)
        note = f" ({r['note']})" if r.get("note") and r["provider"] != LIMIT else ""
        lines.append(
            f"{r['label']:<20} {r['dtype']:<5} {r['provider']:<20} "
            f"{_fmt(r['median_ms'], '10.3f'):>10} {_fmt(r['gbps'], '7.1f'):>7} "
            f"{_fmt(r.get('x_limit'), '7.2f'):>7} {speedups}  {r['status']}{note}")
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


PLOT_SKIPPED = "plot skipped: matplotlib is not installed (pip install 'accumkernels[bench]')"
LIST_ORDER = ("gpt2", "llama7b", "small", "moe")


def can_plot() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _limits(record: dict) -> dict[tuple[str, str], float]:
    """(label, dtype) -> the limit's GB/s: the limit rows (CPU), else the copy_ (GPU, old)."""
    got = {(r["label"], r["dtype"]): r["gbps"] for r in record["rows"]
           if r["provider"] == LIMIT and r.get("gbps")}
    if got or not record["device"].startswith("cuda"):
        return got  # a CPU record without limit rows (older than the limit loop) has none
    return {(r["label"], r["dtype"]): record["copy"]["gbps"] for r in record["rows"]}


def write_plot(record: dict, path: Path, tags: dict | None = None) -> tuple[Path | None, str]:
    """GB/s per provider against the limit of the same run, one column of panels per dtype:
    the parameter lists as grouped bars (the limit a dashed bar across each group), then the
    flat-buffer size sweep as lines (the limit a dashed black line).

    Returns (path or None, message). Needs matplotlib (the ``bench`` extra); skipped without.
    """
    rows = [r for r in record["rows"] if r.get("gbps")]
    lists = [r for r in rows if r["workload"] != "flat" and r["provider"] != LIMIT]
    flat = [r for r in rows if r["workload"] == "flat" and r["provider"] != LIMIT]
    if not lists and not flat:
        return None, "plot skipped: no rows with a bandwidth to plot"
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, PLOT_SKIPPED
    limits = _limits(record)
    gpu = record["device"].startswith("cuda")
    limit_label = "limit: copy_ fp32, this run" if gpu else "limit: C loop, same bytes, this run"
    dtypes = list(dict.fromkeys(r["dtype"] for r in lists + flat))
    providers = list(dict.fromkeys(r["provider"] for r in lists + flat))
    colors = {p: f"C{i}" for i, p in enumerate(providers)}
    by_key = {(r["label"], r["dtype"], r["provider"]): r for r in lists + flat}
    panels = [kind for kind, have in (("lists", lists), ("sweep", flat)) if have]
    fig, axes = plt.subplots(len(panels), len(dtypes), squeeze=False, sharey="row",
                             figsize=(6.2 * len(dtypes), 4.6 * len(panels)))
    for col, dtype in enumerate(dtypes):
        for row_i, kind in enumerate(panels):
            ax = axes[row_i][col]
            if kind == "lists":
                _plot_lists(ax, lists, dtype, providers, colors, by_key, limits, limit_label)
            else:
                _plot_sweep(ax, flat, dtype, providers, colors, by_key, limits, limit_label)
            ax.grid(True, axis="y", alpha=0.3)
        axes[0][col].set_title(f"{dtype} gradients -> fp32: parameter lists")
        if "sweep" in panels:
            axes[panels.index("sweep")][col].set_title(f"{dtype} -> fp32: one flat buffer")
    for row_i in range(len(panels)):
        axes[row_i][0].set_ylabel("GB/s (bytes read + written)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 4), fontsize="small")
    mode = "overwrite" if record["config"]["overwrite"] else "accumulate"
    tags = tags or {}
    when = ", ".join(x for x in ((tags.get("commit") or record.get("git_commit") or "")[:10],
                                 (tags.get("date") or record.get("date") or "")[:10],
                                 tags.get("note") or record["config"].get("note") or "") if x)
    fig.suptitle(f"accumulate_ ({mode}) on {record['device_name']}, torch {record['torch']}"
                 + (f" ({when})" if when else ""))
    fig.tight_layout(rect=(0, 0.04 + 0.02 * ((len(labels) - 1) // 4), 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, f"wrote {path}"


def _plot_lists(ax, rows, dtype, providers, colors, by_key, limits, limit_label) -> None:
    labels = sorted(dict.fromkeys(r["label"] for r in rows if r["dtype"] == dtype),
                    key=lambda lb: next((LIST_ORDER.index(r["workload"]) for r in rows
                                         if r["label"] == lb and r["workload"] in LIST_ORDER),
                                        len(LIST_ORDER)))
    width = 0.8 / max(len(providers), 1)
    for j, p in enumerate(providers):
        pts = [(i - 0.4 + width * (j + 0.5), by_key[(lb, dtype, p)]["gbps"])
               for i, lb in enumerate(labels) if (lb, dtype, p) in by_key]
        if pts:
            ax.bar(*zip(*pts), width, color=colors[p], label=p)
    for i, lb in enumerate(labels):
        if (lb, dtype) in limits:
            ax.hlines(limits[(lb, dtype)], i - 0.45, i + 0.45, colors="black", linestyles="--",
                      linewidth=1.5, label=limit_label if i == 0 else None)
    ax.set_xticks(range(len(labels)), labels, fontsize="small", rotation=12)
    ax.set_yscale("log")  # the many-small-tensor lists run orders of magnitude apart


def _plot_sweep(ax, rows, dtype, providers, colors, by_key, limits, limit_label) -> None:
    sizes = sorted({r["numel"] for r in rows if r["dtype"] == dtype})
    for p in providers:
        pts = sorted((r["numel"], r["gbps"]) for r in rows
                     if r["dtype"] == dtype and r["provider"] == p)
        if pts:
            ax.plot(*zip(*pts), marker="o", color=colors[p], label=p)
    lim = sorted({r["numel"]: limits[(r["label"], dtype)] for r in rows
                  if r["dtype"] == dtype and (r["label"], dtype) in limits}.items())
    if lim:
        ax.plot(*zip(*lim), color="black", linestyle="--", marker="s", label=limit_label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")  # cache-resident and DRAM-bound sizes run an order of magnitude apart
    ax.set_xticks(sizes, [format_count(n) for n in sizes])
    ax.set_xlabel("elements (one flat buffer)")


def plot_from_suite(suite_file: Path, path: Path, device: str | None = None
                    ) -> tuple[Path | None, str]:
    """The plot of the latest row of a kernels suite file (of ``device``, a slug, if given)."""
    from benchmarks.accumbench.results import latest, load_rows  # results imports this module
    row = latest(load_rows(suite_file), device)
    if row is None:
        return None, f"plot skipped: no row in {suite_file}" + (f" for {device}" if device else "")
    return write_plot(row["record"], path, row.get("tags"))


def json_safe(x: object) -> object:
    """NaN/inf are not JSON: write null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    return x
