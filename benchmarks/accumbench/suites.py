"""``python -m benchmarks.accumbench [step|train] ...``: which benchmark the command line runs.

No suite name: the kernel benchmark (cli.py). ``step``: benchmarks/bench_step.py (the optimizer
step against the inner optimizer's own); ``train``: benchmarks/bench_train.py (the end-to-end
table). The rest of the arguments go to that suite (``step --help``).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from pathlib import Path

SUITES = {"step": "bench_step", "train": "bench_train"}
BENCH_DIR = Path(__file__).resolve().parents[1]


def load_suite(name: str):
    """The suite's script as a module; the scripts import ``accumbench`` from benchmarks/."""
    if str(BENCH_DIR) not in sys.path:
        sys.path.insert(0, str(BENCH_DIR))
    return importlib.import_module(SUITES[name])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in SUITES:
        return load_suite(argv[0]).main(argv[1:])
    from .cli import main as kernel_main
    return kernel_main(argv)
