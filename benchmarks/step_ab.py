"""Two checkouts' step tables, interleaved in one run: is a change slower?

    python -m benchmarks.step_ab --before /path/to/old/checkout [--after .] [--rounds 3]
        [--variants sum,clip] [--out benchmarks/results/step-ab-<date>.json]

Each checkout must have its extension built in place (``python setup.py build_ext --inplace``).
A round runs ``python -m benchmarks.accumbench step`` once per checkout (``PYTHONPATH`` set to the
checkout, the order alternating between rounds), each a fresh process on the same machine and
arguments. The figure per row is the median over the rounds of each run's ``ratio_vs_adamw_fused``
(the ratio is measured side by side inside one process, so load that changes between rounds
cancels out); the raw rows of every run are kept in the output.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_table(checkout: Path, variants: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        env = {**os.environ, "PYTHONPATH": str(checkout)}
        subprocess.run([sys.executable, "-m", "benchmarks.accumbench", "step", "--variants",
                        variants, "--no-tally", "--out", str(out), *extra],
                       cwd=checkout, env=env, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def commit_of(checkout: Path) -> str:
    return subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_ab", description=__doc__)
    p.add_argument("--before", type=Path, required=True)
    p.add_argument("--after", type=Path, default=ROOT)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default="sum,clip")
    p.add_argument("--out", type=Path)
    args, extra = p.parse_known_args(argv)
    sides = {"before": args.before.resolve(), "after": args.after.resolve()}
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ("before", "after") if r % 2 == 0 else ("after", "before")
        for side in order:
            runs[side].append(run_table(sides[side], args.variants, extra))
            print(f"round {r + 1}/{args.rounds}: {side} done", file=sys.stderr)
    table = {}
    for side, tables in runs.items():
        for t in tables:
            for row in t["rows"]:
                table.setdefault(row["row"], {}).setdefault(side, []).append(
                    row["ratio_vs_adamw_fused"])
    summary = {name: {side: statistics.median(v) for side, v in sides_.items()}
               for name, sides_ in table.items()}
    for name, s in summary.items():
        if "before" in s and "after" in s:
            s["after_over_before"] = s["after"] / s["before"]
    result = {
        "benchmark": "step_ab", "date": datetime.date.today().isoformat(),
        "argv": sys.argv, "rounds": args.rounds, "variants": args.variants, "extra": extra,
        "checkouts": {side: {"path": str(path), "commit": commit_of(path)}
                      for side, path in sides.items()},
        "environment": runs["after"][0].get("environment"),
        "summary_ratio_vs_adamw_fused": summary, "runs": runs,
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"step-ab-{result['date']}.json"
    out.write_text(json.dumps(result, indent=1))
    width = max(len(n) for n in summary)
    print(f"{'row':<{width}}  before  after  after/before")
    for name, s in summary.items():
        print(f"{name:<{width}}  {s.get('before', float('nan')):6.3f}  "
              f"{s.get('after', float('nan')):5.3f}  {s.get('after_over_before', float('nan')):.3f}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
