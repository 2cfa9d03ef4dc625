"""Where a wrapper step's time goes, phase by phase (issue 43).

    python -m benchmarks.step_phases [--rows wrapper_fp32_sum,wrapper_bf16_clip] [--reps 15]
                                     [--workload gpt2-24m] [--clock thread|wall] [--out PATH]

Builds the rows of benchmarks/bench_step.py (same list, same window of 2 micro-batches) and times
``step()`` while ``accumkernels.optim.step.step.Step``'s phases are wrapped with the same clock:
``window`` (``Step.end_window``: everything the wrapper does below its ``step()`` entry),
of it ``take_in`` (what ``.grad`` holds taken into the window), ``gather`` (stale views zeroed,
ranks), ``decide`` (target, the read pass, the finiteness decision), ``apply`` (clip/fold,
hand-over, the inner step, copy-back, expose), of it ``inner`` (the inner optimizer's step with
its hooks), and ``finish``. ``step - window`` is the entry (hooks, checks). The read pass (in
``decide``) and ``inner`` are the floor; the rest is what the step adds. Median per phase over
``--reps`` steps per row, rows interleaved (``adamw_fused``/``read_pass`` rows: ``step`` only).
"""

from __future__ import annotations

import argparse
import datetime
import math
import statistics
import sys
import time
from pathlib import Path

import torch

from accumkernels.optim.intake import intake as intake_mod
from accumkernels.optim import protocol
from accumkernels.optim.step import step as step_mod
from benchmarks import bench_step
from benchmarks.accumbench import results
from benchmarks.accumbench.env import environment

DEFAULT_ROWS = "adamw_fused,read_pass,wrapper_fp32_sum,wrapper_fp32_clip,wrapper_bf16_sum," \
               "wrapper_bf16_clip"


class PhaseTimer:
    """Wraps the Step phases (and protocol.inner_step) while active; sums per phase."""

    def __init__(self, clock):
        self.clock = clock
        self.spent: dict[str, float] = {}
        self.saved: list[tuple[object, str, object]] = []

    def _wrap(self, owner, attr: str, label: str) -> None:
        fn = getattr(owner, attr)
        clock, spent = self.clock, self.spent

        def timed(*args, **kwargs):
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + clock() - start
        self.saved.append((owner, attr, fn))
        setattr(owner, attr, timed)

    def __enter__(self) -> PhaseTimer:
        for phase in ("gather", "decide", "apply", "finish"):
            self._wrap(step_mod.Step, phase, phase)
        self._wrap(step_mod.Step, "end_window", "window")
        self._wrap(intake_mod.Intake, "take_in", "take_in")
        self._wrap(protocol, "inner_step", "inner")
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, fn in reversed(self.saved):
            setattr(owner, attr, fn)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--workload", default="gpt2-24m", choices=tuple(bench_step.WORKLOADS))
    p.add_argument("--clock", choices=("thread", "wall"), default="thread")
    p.add_argument("--note", default="")
    p.add_argument("--out", type=Path, help="also write the record as JSON here")
    results.add_arguments(p, "phases", note=False)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    names = args.rows.split(",")
    specs = [s for s in bench_step.row_specs(list(bench_step.DEFAULT_VARIANTS)) if s.name in names]
    shapes = [s for _, s in bench_step.WORKLOADS[args.workload]()]
    ns = argparse.Namespace(seed=0, micro_batches=2, declare_n=False)
    rows, rsets = bench_step.build_rows(specs, shapes, ns, torch.device("cpu"))
    samples: dict[str, dict[str, list[float]]] = {r.spec.name: {} for r in rows}
    for rep in range(args.reps + 1):  # the first: warm-up
        k = rep % len(rows)
        for row in rows[k:] + rows[:k]:
            row.prepare(rsets[row.model_dtype], rep)
            with PhaseTimer(clock) as timer:
                start = clock()
                row.step()
                total = clock() - start
            if rep:
                spent = dict(timer.spent, step=total)
                for key, value in spent.items():
                    samples[row.spec.name].setdefault(key, []).append(value * 1e3)
    table = {name: {k: statistics.median(v) for k, v in d.items()} for name, d in samples.items()}
    cols = ("step", "window", "take_in", "gather", "decide", "apply", "inner", "finish")
    lines = [f"step phases, median ms ({args.clock} clock, {args.reps} reps, {args.workload}, "
             f"{sum(math.prod(s) for s in shapes) / 1e6:.1f}M params)" +
             (f"; {args.note}" if args.note else ""),
             f"{'row':<24}" + "".join(f"{c:>9}" for c in cols)]
    for name, med in table.items():
        lines.append(f"{name:<24}" + "".join(f"{med.get(c, float('nan')):9.2f}" for c in cols))
    lines.append("window: Step.end_window (take_in + gather + decide + apply + finish + "
                 "checks); decide: the read pass and the finiteness decision; apply: hand-over, "
                 "inner (the inner optimizer's step), copy-back, expose; step - window: the "
                 "wrapper's step() entry")
    print("\n".join(lines))
    env = environment(torch.device("cpu"))
    record = {"benchmark": "step_phases",
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": env, "argv": list(sys.argv[1:] if argv is None else argv),
              "clock": args.clock, "note": args.note, "median_ms": table, "samples_ms": samples}
    results.save("phases", record, args)
    for row in rows:
        row.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
