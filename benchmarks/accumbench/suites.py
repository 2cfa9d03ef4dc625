"""``python -m benchmarks.accumbench [step|train|host] ...``: which benchmark the command line
runs.

No suite name: the kernel benchmark (cli.py). ``step``: benchmarks/bench_step.py (the optimizer
step against the inner optimizer's own); ``train``: benchmarks/bench_train.py (the end-to-end
table); ``host``: benchmarks/bench_host.py (the host time the wrapper adds per micro-batch and
per step). The rest of the arguments go to that suite (``step --help``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

SUITES = {"step": "benchmarks.bench_step", "train": "benchmarks.bench_train",
          "host": "benchmarks.bench_host"}


def load_suite(name: str):
    """The suite's module (``benchmarks.bench_step``, ``benchmarks.bench_train``, ...)."""
    return importlib.import_module(SUITES[name])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUITES:
        return load_suite(argv[0]).main(argv[1:])
    from benchmarks.accumbench.cli import main as kernel_main
    return kernel_main(argv)
