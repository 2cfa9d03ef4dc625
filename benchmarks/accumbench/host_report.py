"""Reporting a host-time record (benchmarks/bench_host.py): medians, ratios, the text tables.

Pure functions of the numbers in the record, so that a test can recompute every derived figure
from the raw timing lists the record keeps.
"""

from __future__ import annotations

from collections.abc import Sequence

BACKWARD_GOAL = 1.20  # wrapper backward / native backward (DESIGN.md, performance targets)
STEP_GOAL = 1.35  # wrapper step / the inner fused step
GOAL_LINE = (f"goal: wrapper backward <= {BACKWARD_GOAL:.2f}x native, "
             f"step <= {STEP_GOAL:.2f}x the inner fused step")


def median(xs: Sequence[float]) -> float | None:
    """The middle value (the mean of the two middle ones for an even count); None if empty."""
    if not xs:
        return None
    s = sorted(xs)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def ratio(x: float | None, ref: float | None) -> float | None:
    """``x / ref``, None where either is missing or the reference is not positive."""
    if x is None or ref is None or ref <= 0:
        return None
    return x / ref


def per_param(x: float | None, ref: float | None, n_params: int) -> float | None:
    """What ``x`` adds over ``ref`` per param tensor: ``(x - ref) / n_params`` (µs/param)."""
    if x is None or ref is None:
        return None
    return (x - ref) / n_params


def derive(rows: list[dict], n_params: int) -> list[dict]:
    """The table's rows: each row's medians against its references (``backward_ref``,
    ``step_ref``: names of other rows; None where the row has no such column)."""
    by_name = {r["row"]: r for r in rows}
    out = []
    for r in rows:
        entry = {"row": r["row"]}
        for phase in ("backward", "step"):
            ref_name = r[f"{phase}_ref"]
            mine = r[f"{phase}_median_us"] if ref_name else None
            ref = by_name[ref_name][f"{phase}_median_us"] if ref_name in by_name else None
            entry[f"{phase}_us"] = mine
            entry[f"{phase}_ref"] = ref_name
            entry[f"{phase}_ratio"] = ratio(mine, ref)
            entry[f"{phase}_us_per_param"] = per_param(mine, ref, n_params)
        also = r.get("step_also_ref")
        if also in by_name:
            ref = by_name[also]["step_median_us"]
            entry["step_also_ref"] = also
            entry["step_also_ratio"] = ratio(r["step_median_us"], ref)
            entry["step_also_us_per_param"] = per_param(r["step_median_us"], ref, n_params)
        out.append(entry)
    return out


def goals(derived: list[dict], floor: str = "floor") -> list[dict]:
    """Per wrapper row: whether each goal is met, and the ratio of the µs/param its backward
    adds to what the floor row's backward adds (None where the floor adds nothing measurable)."""
    by_name = {d["row"]: d for d in derived}
    floor_added = by_name.get(floor, {}).get("backward_us_per_param")
    out = []
    for d in derived:
        if not d["row"].startswith("wrapper"):
            continue
        b, s = d["backward_ratio"], d["step_ratio"]
        added = d["backward_us_per_param"]
        out.append({
            "row": d["row"],
            "backward_ratio": b, "backward_met": None if b is None else b <= BACKWARD_GOAL,
            "step_ratio": s, "step_met": None if s is None else s <= STEP_GOAL,
            "backward_added_vs_floor": (added / floor_added if added is not None
                                        and floor_added is not None and floor_added > 0
                                        else None)})
    return out


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _met(flag: bool | None) -> str:
    return "n/a" if flag is None else ("met" if flag else "NOT met")


def format_table(table: dict) -> str:
    """One model's table: the rows, the clip-vs-clip line, the goal lines."""
    lines = [
        (f"host time, {table['model']}: {table['n_params']} param tensors, {table['numel']} "
         f"elements; {table['micro_batches']} micro-batches per step; medians of "
         f"{table['reps']} interleaved repetitions after {table['warmup']} warm-up"),
        "",
        (f"{'row':<18} {'dtype':>5} {'backward µs':>11} {'× native':>8} {'+µs/param':>9} "
         f"{'step µs':>9} {'× ref':>6} {'+µs/param':>9}  {'ref':<11} verified"),
    ]
    raw = {r["row"]: r for r in table["rows"]}
    for d in table["derived"]:
        r = raw[d["row"]]
        verified = "-" if r["verified"] is None else ("yes" if r["verified"] else "NO")
        status = f"  error: {r['error']}" if r["error"] else ""
        lines.append(
            f"{d['row']:<18} {r['dtype']:>5} {_f(d['backward_us'], '11.1f'):>11} "
            f"{_f(d['backward_ratio'], '8.2f'):>8} {_f(d['backward_us_per_param'], '+9.3f'):>9} "
            f"{_f(d['step_us'], '9.1f'):>9} {_f(d['step_ratio'], '6.2f'):>6} "
            f"{_f(d['step_us_per_param'], '+9.3f'):>9}  {d['step_ref'] or '-':<11} "
            f"{verified}{status}")
    lines.append("× native: against the native row of the row's dtype (bf16: native_bf16); "
                 "× ref: the step row named in ref")
    for d in table["derived"]:
        if "step_also_ref" in d:
            lines.append(f"{d['row']} step vs {d['step_also_ref']}: "
                         f"{_f(d['step_also_ratio'], '.2f')}x "
                         f"({_f(d['step_also_us_per_param'], '+.3f')} µs/param)")
    lines.append(GOAL_LINE)
    for g in table["goals"]:
        vs_floor = g["backward_added_vs_floor"]
        lines.append(
            f"  {g['row']:<18} backward {_f(g['backward_ratio'], '.2f')}x "
            f"{_met(g['backward_met'])}, step {_f(g['step_ratio'], '.2f')}x "
            f"{_met(g['step_met'])}; backward adds "
            + ("n/a (no floor figure, or the floor adds <= 0 µs/param)" if vs_floor is None
               else f"{vs_floor:.1f}x the floor's µs/param"))
    return "\n".join(lines)


def format_critical_path(cp: dict) -> str:
    """The GPU table (host vs device time of the backward and the step), or its pending line."""
    title = "critical path, GPT-2-124M bf16"
    if cp.get("status") != "measured":
        return f"{title}: {cp.get('status')}"
    lines = [(f"{title} (host: call to return, not synchronised; device: CUDA events around "
              f"the call; medians of {cp['reps']})"), "",
             (f"{'batch':>5} {'row':<14} {'phase':<8} {'host µs':>10} {'device µs':>10}  "
              "critical path")]
    for e in cp["entries"]:
        lines.append(f"{e['batch']:>5} {e['row']:<14} {e['phase']:<8} "
                     f"{_f(e['host_us'], '10.1f'):>10} {_f(e['device_us'], '10.1f'):>10}  "
                     f"{e['critical_path'] or '-'}" + (f"  error: {e['error']}" if e.get('error')
                                                       else ""))
    return "\n".join(lines)


def critical_path(host_us: float | None, device_us: float | None) -> str | None:
    """Which side bounds the call: "host" when its host time exceeds its device time."""
    if host_us is None or device_us is None:
        return None
    return "host" if host_us > device_us else "device"
