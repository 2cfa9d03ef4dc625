"""Run the single-process part of the conformance matrix outside pytest and print, per case,
PASS (with the largest relative difference seen) or FAIL (the departure), then the generator's
coverage and the runtime. ``--known`` prints the KNOWN_BUGS entries the failures call for
(each must be explained by a label of _matrix_labels; an unexplained failure is printed as such).

    PYTHONPATH=$PWD python tests/conformance/matrix_report.py [--known] [--clean] [case ids...]
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "distributed")]
os.environ.setdefault("TRITON_INTERPRET", "1")

import _matrix_axes as axes  # noqa: E402
from _matrix_labels import labels  # noqa: E402
from _matrix_run import run_case  # noqa: E402


def main(argv: list[str]) -> int:
    known = "--known" in argv
    plan = axes.CLEAN if "--clean" in argv else axes.SINGLE
    only = [a for a in argv if not a.startswith("--")]
    rows, stats = axes.generate(plan)
    start, failed, entries = time.monotonic(), 0, []
    for k, case in enumerate(rows):
        cid = axes.case_id(plan, k)
        if only and cid not in only:
            continue
        t = time.monotonic()
        try:
            worst = run_case(case, cid)
            print(f"PASS {cid} worst={worst:.2g} {time.monotonic() - t:.2f}s", flush=True)
        except AssertionError as exc:
            failed += 1
            print(f"FAIL {cid} {str(exc)[:700]}", flush=True)
            why = labels(case)
            if not why:
                print(f"UNEXPLAINED {cid}")
            entries.append(f'    "{cid}": {tuple(why)!r},')
    print(f"{len(rows)} cases, {failed} failed; pairs: {stats['total_pairs']} total, "
          f"{stats['pruned_pairs']} excluded by constraints, {stats['covered_pairs']} covered, "
          f"{len(stats['uncovered_pairs'])} uncovered; {time.monotonic() - start:.1f} s")
    if known:
        print("\n".join(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
