"""Reporting a step-benchmark record (benchmarks/bench_step.py): ratios and the text table."""

from __future__ import annotations


def add_ratios(rows: list[dict]) -> None:
    """Median / adamw_fused's median, and / the row's fair baseline's; extra bytes vs fair."""
    by_name = {r["row"]: r for r in rows}
    fused = by_name.get("adamw_fused", {}).get("median_ms")
    for r in rows:
        fair = by_name.get(r["fair_baseline"], {})
        r["model_bytes_vs_fair"] = (r["model_bytes"] - fair["model_bytes"]
                                    if "model_bytes" in fair else None)
        counted, fair_counted = r.get("counted"), fair.get("counted")
        r["counted_bytes_vs_fair"] = (counted["bytes"] - fair_counted["bytes"]
                                      if counted and fair_counted else None)
        if r["median_ms"] is None:
            continue
        r["ratio_vs_adamw_fused"] = r["median_ms"] / fused if fused else None
        r["ratio_vs_fair"] = r["median_ms"] / fair["median_ms"] if fair.get("median_ms") else None
        inner = by_name.get(r.get("inner_baseline", "adamw_fused"), {}).get("median_ms")
        r["ratio_vs_inner"] = r["median_ms"] / inner if inner else None
        add_floor(r, inner, by_name.get("read_pass", {}).get("median_ms"))


def add_floor(r: dict, inner: float | None, read: float | None) -> None:
    """A wrapper row's floor, measured in the same run: ``read_pass + floor_factor x inner``
    (the inner optimizer alone on fp32 params); the inner optimizers and the read pass are
    their own floor. ``ratio_vs_floor`` = median / floor."""
    factor = r.get("floor_factor")
    if r.get("kind") == "read" or (r.get("kind") == "inner" and r["row"] == r["inner_baseline"]):
        r["floor_ms"] = r["median_ms"]
    elif factor is not None and inner and read:
        r["floor_ms"] = read + factor * inner
    else:
        return
    r["ratio_vs_floor"] = r["median_ms"] / r["floor_ms"]


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _div(x: float | None, d: float) -> float | None:
    return None if x is None else x / d


def format_table(record: dict) -> str:
    """The plain-text table: time, ratios, bytes (model and counted), ops, scalar reads."""
    c, env = record["config"], record["environment"]
    mb = 1e6
    lines = [
        (f"step: {env['device_name']} ({env['device']}), torch {env['torch']}, triton "
         f"{env['triton']}, {env['torch_threads']} thread(s), commit "
         f"{(env['git_commit'] or 'unknown')[:10]}{' (dirty)' if env['git_dirty'] else ''}"),
        (f"{c['workload']}: {c['n_tensors']} tensors, {c['numel'] / 1e6:.2f}M params; window "
         f"of {c['micro_batches']} micro-batch(es), accumulation_steps="
         f"{c['micro_batches'] if c['declare_n'] else None}; median of {c['reps']} interleaved "
         f"repetitions after {c['warmup']} warm-up; {c['optimizer']}"),
        f"timer: {c['timer']}" + (f"; {c['note']}" if c.get("note") else ""),
        "",
        (f"{'row':<32} {'model':>5} {'median ms':>10} {'p20':>8} {'p80':>8} {'x fused':>7} "
         f"{'x fair':>6} {'x inner':>7} {'floor':>7} {'x floor':>7} {'model MB':>9} "
         f"{'+MB fair':>8} {'GB/s':>6} {'counted MB':>10} "
         f"{'+MB fair':>8} {'ops':>5} {'items':>5}  status"),
    ]
    for r in record["rows"]:
        counted = r.get("counted") or {}
        lines.append(
            f"{r['row']:<32} {r['model_dtype']:>5} {_f(r['median_ms'], '10.2f'):>10} "
            f"{_f(r['p20_ms'], '8.2f'):>8} {_f(r['p80_ms'], '8.2f'):>8} "
            f"{_f(r['ratio_vs_adamw_fused'], '7.2f'):>7} {_f(r['ratio_vs_fair'], '6.2f'):>6} "
            f"{_f(r.get('ratio_vs_inner'), '7.2f'):>7} {_f(r.get('floor_ms'), '7.2f'):>7} "
            f"{_f(r.get('ratio_vs_floor'), '7.2f'):>7} "
            f"{r['model_bytes'] / mb:9.1f} {_f(_div(r['model_bytes_vs_fair'], mb), '8.1f'):>8} "
            f"{_f(r['model_gbps'], '6.1f'):>6} "
            f"{_f(_div(counted.get('bytes'), mb), '10.1f'):>10} "
            f"{_f(_div(r.get('counted_bytes_vs_fair'), mb), '8.1f'):>8} "
            f"{_f(counted.get('ops'), 'd'):>5} {_f(counted.get('scalar_reads'), 'd'):>5}  "
            f"{r['status']}" + (f" ({r['error']})" if r["error"] else ""))
    lines += ["", ("x fused: median / adamw_fused's; x fair: / the row's fair baseline's "
                   "(adamw_fused for fp32 models, adamw_fused+copy_back for bf16, the sgd_ rows' "
                   "for SGD); x inner: / the row's inner optimizer alone on fp32 params "
                   "(adamw_fused or sgd_fused: the goal's ratio); floor (ms): what the row's "
                   "step cannot avoid, measured in this run: read_pass + inner for an fp32 "
                   "model, read_pass + 32/28 x inner for a bf16 one (the fused master step's "
                   "bytes; 24/20 for SGD); x floor: median / floor; _separate: the fused master "
                   "step off (re-sync, step, copy-back); model MB: "
                   "the byte model (see bench_step.py); counted MB, ops, items: one step's aten "
                   "ops under TrafficTally (items: .item()-style reads by the host, each a "
                   "device sync where the tensor is on a GPU); MB = 1e6 bytes")]
    return "\n".join(lines)
