"""The summary in plain words that ends ``make bench``: a few lines from the suites' records.

    python -m benchmarks.accumbench summary [--device cpu|cuda] [--results-dir DIR]

reads the latest row of this machine (its device slug) in each suite file (kernels, step, host,
train, wrapper) and prints what it says: the GPT-2-124M list against the best naive loop and
the limit; the wrapper's step against its floor; the host time it adds; the memory a bf16
model pays per param; the accumulated gradients' error against the float64 sum (fp32 sums
against bf16 ones). Each suite also prints its own lines at the end of its run. Every figure is
a ratio of two measurements made side by side in one run, as its record says.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

LIMIT = "limit"
DTYPE_ORDER = ("bf16", "fp16", "fp32")
SUITES = ("kernels", "step", "host", "train", "wrapper")


def _x(v: float | None, spec: str = ".2f") -> str:
    return "-" if v is None else f"{v:{spec}}x"


# --- kernels -----------------------------------------------------------------------------------

def _ours(rows: list[dict], label: str, dtype: str) -> dict | None:
    """The fastest accumkernels backend on one list and dtype."""
    mine = [r for r in rows if r["label"] == label and r["dtype"] == dtype and r["gbps"]
            and r["provider"].startswith("accumkernels") and r["status"] == "ok"]
    return max(mine, key=lambda r: r["gbps"], default=None)


def _vs_limit(r: dict) -> str:
    if r.get("x_limit") is not None:
        return f"{r['x_limit']:.2f}x the same-run limit"
    if r.get("frac_copy") is not None:  # a record older than the limit row
        return f"{r['frac_copy']:.2f}x a copy_ (no limit row)"
    return "- of the limit"


def kernel_lines(record: dict) -> list[str]:
    rows = record["rows"]
    gpt2 = next((r["label"] for r in rows if r["workload"] == "gpt2"), None)
    out = []
    if gpt2 is not None:
        parts = []
        provider = None
        for dtype in DTYPE_ORDER:
            r = _ours(rows, gpt2, dtype)
            if r is None or r.get("speedup_vs_best_baseline") is None:
                continue
            if provider is None:
                provider = r["provider"]
                parts.append(f"{r['speedup_vs_best_baseline']:.2f}x the best naive loop "
                             f"({r['best_baseline']}) at {_vs_limit(r)} with {dtype} gradients")
            else:
                lim = r.get("x_limit") if r.get("x_limit") is not None else r.get("frac_copy")
                parts.append(f"{dtype} {r['speedup_vs_best_baseline']:.2f}x "
                             f"({r['best_baseline']}) at {_x(lim)}")
        n = next(r["n_tensors"] for r in rows if r["label"] == gpt2)
        if parts:
            out.append(f"kernels: on the {gpt2} list ({n} tensors) {provider} runs "
                       + "; ".join(parts))
    others = []
    for label in dict.fromkeys(r["label"] for r in rows if r["workload"] not in ("gpt2", "flat")):
        r = next((_ours(rows, label, d) for d in DTYPE_ORDER if _ours(rows, label, d)), None)
        if r is not None and r.get("speedup_vs_best_baseline") is not None:
            others.append(f"{label} {r['speedup_vs_best_baseline']:.2f}x at "
                          f"{_x(r.get('x_limit') or r.get('frac_copy'))}")
    if others:
        dtype = next((d for d in DTYPE_ORDER if any(r["dtype"] == d for r in rows)), "")
        out.append(f"kernels, the other lists ({dtype}; vs the best naive loop, at x the limit): "
                   + ", ".join(others))
    lim = record["config"].get("limit")
    if out and lim:
        out.append(f"  (the limit: {lim})")
    return out or ["kernels: no GPT-2 or other list rows in this record"]


# --- step --------------------------------------------------------------------------------------

def step_lines(record: dict) -> list[str]:
    rows = {r["row"]: r for r in record["rows"] if r["status"] == "ok"}
    wrappers = [r for r in rows.values() if r["kind"] == "wrapper" and not
                r["row"].endswith("_separate") and r.get("ratio_vs_floor") is not None]
    if not wrappers:
        return ["step: no wrapper row with a floor in this record"]
    bf16, fp32 = rows.get("wrapper_bf16_sum", {}), rows.get("wrapper_fp32_sum", {})
    lo = min(wrappers, key=lambda r: r["ratio_vs_floor"])
    hi = max(wrappers, key=lambda r: r["ratio_vs_floor"])
    c = record["config"]
    return [(f"step: the wrapper's step is {_x(bf16.get('ratio_vs_floor'))} its floor for a bf16 "
             f"model and {_x(fp32.get('ratio_vs_floor'))} for an fp32 one (defaults); "
             f"{len(wrappers)} wrapper rows {lo['ratio_vs_floor']:.2f}x ({lo['row']}) to "
             f"{hi['ratio_vs_floor']:.2f}x ({hi['row']}); floor = the read pass + the inner "
             f"optimizer's own pass, same run ({c['workload']}, median of {c['reps']}, "
             f"{c['clock']} clock)")]


# --- host --------------------------------------------------------------------------------------

def host_lines(record: dict) -> list[str]:
    out = []
    for name, table in record["tables"].items():
        d = {x["row"]: x for x in table["derived"]}
        parts = []
        for row, what in (("wrapper_fp32", "fp32"), ("wrapper_bf16", "bf16")):
            x = d.get(row)
            if x is None or x["backward_ratio"] is None:
                continue
            parts.append(f"{what}: backward {x['backward_ratio']:.2f}x native "
                         f"({x['backward_us_per_param']:+.2f} us per param tensor), step "
                         f"{_x(x['step_ratio'])} {x['step_ref']}'s step")
        if parts:
            out.append(f"host ({name}, {table['n_params']} tiny tensors, "
                       f"{table['micro_batches']} micro-batches): " + "; ".join(parts))
    return out or ["host: no wrapper rows in this record"]


# --- train and wrapper: memory, precision, the accumulation's share ----------------------------

def _share(r: dict) -> str:
    verdict = r.get("accum_verdict")
    if verdict == "below noise":
        return "below noise"
    if verdict == "below reference":
        return "below the reference (cheaper than a plain backward)"
    if r.get("accum_share") is None:
        return "-"
    return f"{r['accum_share']:.1%} (noise {r['noise_share']:.1%})"


def train_lines(record: dict) -> list[str]:
    rows = {r["row"]: r for r in record["rows"] if r["status"] == "ok"}
    c = record["config"]
    n = c["params"]
    ak, nb, mg = rows.get("accumkernels"), rows.get("native_bf16"), rows.get("main_grad_fp32")
    what = f"{c['model']} {n / 1e6:.1f}M params, bf16, {c['optimizer']}"
    out = []

    def per_param(r: dict | None) -> str:
        return "-" if not r or r.get("peak_mem_bytes") is None else \
            f"{r['peak_mem_bytes'] / n:.1f}"

    if ak is not None:
        extra = (ak["peak_mem_bytes"] - nb["peak_mem_bytes"]) / n if nb and ak.get(
            "peak_mem_bytes") is not None and nb.get("peak_mem_bytes") is not None else None
        out.append(f"memory (train, {what}): the wrapper peaks at {per_param(ak)} B/param, "
                   f"native bf16 accumulation at {per_param(nb)} ("
                   + ("-" if extra is None else f"{extra:+.1f}") + " B/param: the fp32 window, "
                   f"the fp32 master weights and their fp32 AdamW state), the fp32 main_grad "
                   f"loop at {per_param(mg)}")
        errs = [(name, rows[name].get("rel_err_hooks")) for name in
                ("accumkernels", "main_grad_fp32", "native_bf16") if name in rows]
        text = {name: "-" if e is None else "0 (exact)" if e == 0 else f"{e:.1e}"
                for name, e in errs}
        worse = (nb["rel_err_hooks"] / ak["rel_err_hooks"]
                 if nb and nb.get("rel_err_hooks") and ak.get("rel_err_hooks") else None)
        out.append(f"precision: the accumulated gradients against the float64 sum of "
                   f"{c['accumulation_steps']} micro-batches' gradients (relative error): the "
                   f"wrapper {text.get('accumkernels', '-')}, native bf16 "
                   f"{text.get('native_bf16', '-')}"
                   + (f" ({worse:.0f}x the wrapper's)" if worse else "")
                   + f"; fp32 accumulation by hand (main_grad loop) "
                   f"{text.get('main_grad_fp32', '-')}")
        out.append(f"accumulation's share of a micro-batch (train): the wrapper {_share(ak)}"
                   + (f", native bf16 {_share(nb)}" if nb else "")
                   + (f", the fp32 main_grad loop {_share(mg)}" if mg else ""))
    return out or ["train: no accumkernels row in this record"]


def wrapper_lines(record: dict) -> list[str]:
    rows = {r["provider"]: r for r in record["rows"]}
    c = record["config"]
    ak, mg = rows.get("accumkernels", {}), rows.get("main_grad_loop", {})
    extra = ak.get("extra_bytes_per_param_vs_native")
    if extra is None:
        return ["memory (wrapper table): no peak-memory figure in this record"]
    goal = "" if extra is None else (" (goal <= 4: met)" if extra <= 4 else " (goal <= 4: NOT met)")
    how = ("peak RSS growth, a fresh process per row" if "RSS" in c.get("peak_method", "")
           else "max_memory_allocated")
    return [(f"memory (wrapper table, {c['layers']} MLP blocks d={c['width']}, bf16, no master "
             f"weights): the wrapper's fp32 window costs {extra:+.2f} B/param at peak over "
             f"native bf16{goal}, the fp32 main_grad loop "
             f"{mg.get('extra_bytes_per_param_vs_native') or 0:+.2f} ({how}); per micro-batch "
             f"{ak.get('overhead_vs_native', 0):+.1%} time")]


LINES: dict[str, Callable[[dict], list[str]]] = {
    "kernels": kernel_lines, "step": step_lines, "host": host_lines, "train": train_lines,
    "wrapper": wrapper_lines}


def _env(record: dict) -> dict:
    return record.get("environment") or record


def format_summary(records: dict[str, dict], tags: dict[str, dict] | None = None,
                   missing: dict[str, str] | None = None) -> str:
    """The summary of one or more suites' records (suite -> record), in SUITES order."""
    tags = tags or {}
    first = next(iter(records.values()), None)
    head_tags = next(iter(tags.values()), None)
    if first is None:
        return "summary: no results"
    env = _env(first)
    commit = (head_tags or {}).get("commit") or env.get("git_commit") or "unknown"
    note = (head_tags or {}).get("note") or (first.get("config") or {}).get("note") or ""
    lines = [f"summary ({env.get('device_name')}, commit {commit[:10]}, torch "
             f"{env.get('torch')}" + (f"; {note}" if note else "") + "):"]
    for suite in SUITES:
        if suite in (missing or {}):
            lines.append(f"  {suite}: {missing[suite]}")
        if suite not in records:
            continue
        t = tags.get(suite)
        other = (t and head_tags and (t.get("commit") != head_tags.get("commit")
                                      or (t.get("date") or "")[:10]
                                      != (head_tags.get("date") or "")[:10]))
        stamp = f" [row of {(t['date'] or '')[:10]}, {(t['commit'] or 'unknown')[:10]}]" \
            if other else ""
        try:
            got = LINES[suite](records[suite])
        except (KeyError, TypeError, ZeroDivisionError) as exc:  # an older record's shape
            got = [f"{suite}: cannot summarise this record ({type(exc).__name__}: {exc})"]
        lines += [f"  {line}" + (stamp if i == 0 else "") for i, line in enumerate(got)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from benchmarks.accumbench import results
    from benchmarks.accumbench.env import device_slug

    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench summary",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--results-dir", type=Path,
                   help="the folder of the suite files (default: benchmarks/results)")
    args = p.parse_args(argv)
    slug = device_slug(torch.device(args.device))
    folder = args.results_dir or results.results_dir()
    records, tags, missing = {}, {}, {}
    for suite in SUITES:
        path = folder / f"{suite}.jsonl"
        row = results.latest(results.load_rows(path), slug)
        if row is None:
            missing[suite] = f"no row for {slug} in {path}"
            continue
        records[suite], tags[suite] = row["record"], row["tags"]
    print(format_summary(records, tags, missing) if records else
          f"summary: no results for {slug} in {folder}")
    return 0 if records else 1


if __name__ == "__main__":
    raise SystemExit(main())
