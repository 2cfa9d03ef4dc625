"""``python -m benchmarks.accumbench [step|host|train|wrapper|summary|plot] ...``: which
benchmark the command line runs.

No suite name: the kernel benchmark (cli.py). ``step``: benchmarks/bench_step.py (the optimizer
step against the inner optimizer's own); ``host``: benchmarks/bench_host.py (the host time the
wrapper adds per micro-batch and per step); ``train``: benchmarks/bench_train.py (the end-to-end
table); ``wrapper``: benchmarks/bench_wrapper.py (per-micro-batch cost and peak memory of the
window). ``summary``: the plain-words summary of the latest rows of this machine in the suite
files (summary.py); ``plot``: the kernel plot redrawn from benchmarks/results/kernels.jsonl.
The rest of the arguments go to that command (``step --help``).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

SUITES = {"step": "benchmarks.bench_step", "train": "benchmarks.bench_train",
          "host": "benchmarks.bench_host", "wrapper": "benchmarks.bench_wrapper",
          "summary": "benchmarks.accumbench.summary", "plot": "benchmarks.accumbench.suites"}


def load_suite(name: str):
    """The suite's module (``benchmarks.bench_step``, ``benchmarks.bench_train``, ...)."""
    return importlib.import_module(SUITES[name])


def plot_main(argv: Sequence[str]) -> int:
    """``plot [--results FILE] [--out PNG] [--device SLUG]``: redraw the kernel plot."""
    from benchmarks.accumbench.report import plot_from_suite
    from benchmarks.accumbench.results import suite_path
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench plot",
                                description="the kernel plot from the latest row of a suite file")
    p.add_argument("--results", type=Path, help="default: benchmarks/results/kernels.jsonl")
    p.add_argument("--out", type=Path, help="default: the suite file's name with .png")
    p.add_argument("--device", help="a device slug (default: the latest row of any device)")
    args = p.parse_args(list(argv))
    src = args.results or suite_path("kernels")
    path, msg = plot_from_suite(src, args.out or src.with_suffix(".png"), args.device)
    print(msg, file=sys.stderr)
    return 0 if path else 1


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "plot":
        return plot_main(argv[1:])
    if argv and argv[0] in SUITES:
        return load_suite(argv[0]).main(argv[1:])
    from benchmarks.accumbench.cli import main as kernel_main
    return kernel_main(argv)
