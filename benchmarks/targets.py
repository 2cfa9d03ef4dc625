"""The design's performance targets next to what a benchmark record measured.

    python -m benchmarks.targets RECORD.json [TRAIN.json]

RECORD is an accumbench record (python -m benchmarks.accumbench), TRAIN a bench_train.py record.
One line per target (../shared/DESIGN.md, "Performance targets"): goal, measured value, and
whether it is met; "n/a" where the record lacks the rows (a provider not run, a CPU record).
Exit status 0 whatever the outcome: this is a report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GPU_BACKENDS = ("accumkernels:cuda", "accumkernels:triton")


def _rows(record: dict, **match) -> list[dict]:
    return [r for r in record.get("rows", [])
            if all(r.get(k) == v for k, v in match.items()) and r.get("status") == "ok"]


def _one(record: dict, **match) -> dict | None:
    rows = _rows(record, **match)
    return rows[0] if rows else None


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def kernel_targets(record: dict) -> list[tuple[str, str, str, bool | None]]:
    """(target, goal, measured, met) from an accumbench record."""
    out = []
    flat = max((r["numel"] for r in _rows(record, workload="flat")), default=None)
    for provider in GPU_BACKENDS:
        name = provider.split(":")[1]
        r = _one(record, workload="flat", numel=flat, dtype="bf16", provider=provider)
        frac = r and r["frac_copy"]
        label = r["label"] if r else "flat"
        out.append((f"{label} bf16->fp32, {name}", ">= 0.95 x copy",
                    _fmt(frac, ".3f") + (f" ({r['gbps']:.0f} GB/s)" if r else ""),
                    None if frac is None else frac >= 0.95))
        for wl in ("gpt2", "llama7b"):
            r = _one(record, workload=wl, dtype="bf16", provider=provider)
            frac = r and r["frac_copy"]
            out.append((f"{r['label'] if r else wl} bf16, {name}", ">= 0.90 x copy",
                        _fmt(frac, ".3f") + (f" ({r['gbps']:.0f} GB/s)" if r else ""),
                        None if frac is None else frac >= 0.90))
    for provider in GPU_BACKENDS:
        r = _one(record, workload="gpt2", dtype="bf16", provider=provider)
        for base in ("loop_literal", "loop_add"):
            x = r and r.get(f"speedup_vs_{base}")
            out.append((f"gpt2 bf16 vs {base}, {provider.split(':')[1]}", ">= 5x",
                        _fmt(x, ".2f"), None if x is None else x >= 5))
    for provider in GPU_BACKENDS:
        for base in ("foreach", "native_grad_dtype"):
            ratios = [(r["label"], r["dtype"], r.get(f"speedup_vs_{base}"))
                      for r in _rows(record, provider=provider)]
            ratios = [x for x in ratios if x[2] is not None]
            if not ratios:
                out.append((f"vs {base}, {provider.split(':')[1]}, every list", "> 1x", "n/a",
                            None))
                continue
            worst = min(ratios, key=lambda x: x[2])
            out.append((f"vs {base}, {provider.split(':')[1]}, every list", "> 1x",
                        f"min {worst[2]:.2f} ({worst[0]} {worst[1]})", worst[2] > 1))
    overhead = (record.get("overhead") or {}).get("rows", [])
    for provider, goal in (("accumkernels:cuda", 20.0), ("accumkernels:triton", 40.0)):
        r = next((x for x in overhead if x["provider"] == provider and x.get("host_us")), None)
        us = r and r["host_us"]
        out.append((f"host overhead, 300 tensors, {provider.split(':')[1]}", f"<= {goal:.0f} us",
                    _fmt(us, ".1f"), None if us is None else us <= goal))
    return out


def train_targets(record: dict) -> list[tuple[str, str, str, bool | None]]:
    rows = {r["row"]: r for r in record.get("rows", []) if r.get("status") == "ok"}
    params = record.get("config", {}).get("params")
    out = []
    for name in ("accumkernels", "accumkernels+fused_wgrad"):
        r = rows.get(name)
        share = r and r.get("accum_share")
        out.append((f"accumulation share of a micro-batch, {name}", "<= 1.5 %",
                    _fmt(None if share is None else 100 * share, ".2f"),
                    None if share is None else share <= 0.015))
        native = rows.get("native_bf16")
        if r and native and params and r.get("peak_mem_bytes") and native.get("peak_mem_bytes"):
            extra = (r["peak_mem_bytes"] - native["peak_mem_bytes"]) / params
            out.append((f"peak memory vs native bf16, {name}", "<= +4 B/param",
                        f"{extra:+.2f} B/param", extra <= 4))
        else:
            out.append((f"peak memory vs native bf16, {name}", "<= +4 B/param", "n/a", None))
    return out


def main(argv: list[str] | None = None) -> int:
    paths = [Path(p) for p in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    lines = []
    for path in paths:
        record = json.loads(path.read_text())
        env = record.get("environment", record)
        print(f"{path.name}: {env.get('device_name')}, torch {env.get('torch')}, triton "
              f"{env.get('triton')}, commit {str(env.get('git_commit'))[:12]}")
        lines += train_targets(record) if record.get("benchmark") == "train" \
            else kernel_targets(record)
    width = max(len(t) for t, *_ in lines)
    for target, goal, measured, met in lines:
        mark = {True: "met", False: "MISSED", None: "n/a"}[met]
        print(f"{target:{width}}  {goal:>15}  {measured:>28}  {mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
