"""The suite files: one JSON-lines file per benchmark suite, one tagged row per run.

``benchmarks/results/<suite>.jsonl`` (``kernels``, ``step``, ``host``, ``train``, ``wrapper``:
``make bench``; ``fsdp2``, ``overhead``, ``phases``: bench_fsdp2.py, accumbench/overhead.py,
step_phases.py): every run appends one line ``{"suite", "tags", "record"}``, where
``record`` is the whole record the run made and ``tags`` say where and when it was measured
(``device`` slug, ``device_name``, ``commit``, ``dirty``, ``torch``, ``date``, ``note``,
``source``). Rows are never rewritten; readers take the latest row of a device
(:func:`latest`). ``--quick`` runs are smoke tests and append nothing unless ``--results`` is
given. ``ACCUMBENCH_RESULTS_DIR`` moves the default folder (the tests point it elsewhere).

    python -m benchmarks.accumbench.results list [SUITE]
    python -m benchmarks.accumbench.results import SUITE RECORD.json [--note TEXT] [--date D]

``import`` appends a record written by ``--out`` (a GPU session's, an old dated file) as a row
whose tags keep the record's own date and commit and say where it came from.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.accumbench.env import REPO_ROOT, git_info
from benchmarks.accumbench.report import json_safe

SUITES = ("kernels", "step", "host", "train", "wrapper", "fsdp2", "overhead", "phases")
TAG_KEYS = ("device", "device_name", "commit", "dirty", "torch", "date", "note", "source")


def results_dir() -> Path:
    """The folder of the suite files: $ACCUMBENCH_RESULTS_DIR, else benchmarks/results/ of the
    checkout (of the current directory outside one)."""
    told = os.environ.get("ACCUMBENCH_RESULTS_DIR", "").strip()
    if told:
        return Path(told)
    base = REPO_ROOT if git_info()[0] is not None else Path.cwd()
    return base / "benchmarks" / "results"


def suite_path(suite: str) -> Path:
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r} (choose from {', '.join(SUITES)})")
    return results_dir() / f"{suite}.jsonl"


def environment_of(record: dict) -> dict:
    """The run's environment: nested (``environment``) or, in kernel records, top level."""
    return record.get("environment") or record


def make_tags(record: dict, note: str = "", source: str = "measured", date: str | None = None
              ) -> dict:
    env = environment_of(record)
    return {"device": env.get("device_slug"), "device_name": env.get("device_name"),
            "commit": env.get("git_commit"), "dirty": env.get("git_dirty"),
            "torch": env.get("torch"), "date": record.get("date") or date, "note": note,
            "source": source}


def tagged_row(suite: str, record: dict, note: str = "", source: str = "measured",
               date: str | None = None) -> dict:
    """``date``: only where the record has none of its own (an old one)."""
    return {"suite": suite, "tags": make_tags(record, note, source, date), "record": record}


def append_row(path: Path, row: dict) -> None:
    """One line per row, appended: a half-written run never garbles earlier rows."""
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(json_safe(row), separators=(",", ":"), sort_keys=False)
    with path.open("a") as f:
        f.write(line + "\n")


def load_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def latest(rows: list[dict], device: str | None = None, measured_only: bool = False
           ) -> dict | None:
    """The last row (of ``device``, a slug, when given; measured here, not imported, with
    ``measured_only``)."""
    for row in reversed(rows):
        tags = row.get("tags", {})
        if device is not None and tags.get("device") != device:
            continue
        if measured_only and tags.get("source") != "measured":
            continue
        return row
    return None


# --- what the suites' command lines share ------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser, suite: str, note: bool = True) -> None:
    """``--results PATH`` / ``--no-results`` (and ``--note`` where the suite has none)."""
    p.add_argument("--results", type=Path, metavar="PATH",
                   help=f"the suite file to append this run's tagged row to (default: "
                        f"benchmarks/results/{suite}.jsonl; none with --quick)")
    p.add_argument("--no-results", action="store_true",
                   help="append nothing to the suite file")
    if note:
        p.add_argument("--note", default="",
                       help="the conditions of the run (e.g. 'loaded 2-core box'), kept in the "
                            "row's tags")


def results_target(suite: str, args: argparse.Namespace) -> Path | None:
    """Where this run's row goes: --results, else the suite file unless --quick/--no-results."""
    if getattr(args, "no_results", False):
        return None
    if getattr(args, "results", None) is not None:
        return args.results
    return None if getattr(args, "quick", False) else suite_path(suite)


def save(suite: str, record: dict, args: argparse.Namespace) -> Path | None:
    """Append the tagged row (see :func:`results_target`); write ``--out`` as JSON if given.
    Returns the suite file appended to, or None."""
    out = getattr(args, "out", None)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(json_safe(record), indent=1) + "\n")
    target = results_target(suite, args)
    if target is not None:
        append_row(target, tagged_row(suite, record, getattr(args, "note", "") or ""))
    return target


# --- command line ---------------------------------------------------------------------------

def _list(suites: list[str]) -> None:
    for suite in suites:
        rows = load_rows(suite_path(suite))
        print(f"{suite}.jsonl: {len(rows)} row(s)")
        for row in rows:
            t = row["tags"]
            print(f"  {t['date']}  {(t['commit'] or 'unknown')[:10]}  {t['device']}  "
                  f"torch {t['torch']}  {t['source']}" + (f"  ({t['note']})" if t["note"] else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench.results",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ls = sub.add_parser("list", help="the rows of each suite file")
    ls.add_argument("suite", nargs="?", choices=SUITES)
    imp = sub.add_parser("import", help="append a record (JSON) as a tagged row")
    imp.add_argument("suite", choices=SUITES)
    imp.add_argument("record", type=Path)
    imp.add_argument("--note", default="")
    imp.add_argument("--source", help="where the record came from (default: its file name)")
    imp.add_argument("--results", type=Path, help="the suite file (default: the suite's)")
    imp.add_argument("--date", help="the run's date where the record has none")
    args = p.parse_args(argv)
    if args.cmd == "list":
        _list([args.suite] if args.suite else list(SUITES))
        return 0
    record = json.loads(args.record.read_text())
    source = args.source or f"imported from {args.record.name}"
    target = args.results or suite_path(args.suite)
    append_row(target, tagged_row(args.suite, record, args.note, source, args.date))
    print(f"appended {args.record.name} to {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
