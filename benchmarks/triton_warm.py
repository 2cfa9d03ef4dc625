"""Compile the Triton kernels the GPU tests launch, in parallel, before the tests run in order.

    python -m benchmarks.triton_warm [--jobs 16] [--out FILE] [--with-sanitize-cases] TEST...

A Triton kernel compiles at its first launch with each new signature (dtypes, constexprs,
alignment of its pointers): ~140 distinct compiles across the GPU tests (issue 41's estimate),
seconds each, so a serial test run spends minutes compiling. This collects the tests' ids
(``pytest --collect-only``), deals them round-robin into JOBS shards and runs the shards as
concurrent pytest processes sharing Triton's on-disk cache (``TRITON_CACHE_DIR``, else
~/.triton/cache): the compiles spread over the cores, and the ordered test stage after this
finds every kernel in the cache. With ``--with-sanitize-cases`` one more job runs
benchmarks/sanitize_cases.py (both kernels' cases) for their signatures, so compute-sanitizer
never compiles under instrumentation. The shards' test results are informational (the ordered
stage is the judge). Prints and records (``--out``) the number of kernels compiled: new
``__grp__*.json`` entries of the cache. On a CPU host (interpreter) nothing compiles: 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def compiled_kernels(cache: Path) -> int:
    """Kernels in Triton's cache: one ``__grp__<name>.json`` per compiled kernel."""
    return sum(1 for _ in cache.glob("*/__grp__*.json")) if cache.is_dir() else 0


def collect(tests: list[str], pytest_args: list[str]) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider", *pytest_args, *tests],
                          capture_output=True, text=True, check=False)
    ids = [ln.strip() for ln in proc.stdout.splitlines() if "::" in ln and " " not in ln.strip()]
    if not ids:
        print(proc.stdout[-2000:], proc.stderr[-2000:], file=sys.stderr)
    return ids


def shards(ids: list[str], jobs: int) -> list[list[str]]:
    """Round-robin: neighbouring parametrizations (often the same kernel signature) land in
    different shards only as often as they must."""
    out = [ids[i::jobs] for i in range(jobs)]
    return [s for s in out if s]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", nargs="+", help="test files (or node ids)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    p.add_argument("--with-sanitize-cases", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    started = time.perf_counter()
    cache = cache_dir()
    before = compiled_kernels(cache)
    extra = args.pytest_args.split()
    ids = collect(args.tests, extra)
    work = shards(ids, max(1, args.jobs - int(args.with_sanitize_cases)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = Path(os.environ.get("AK_WARM_LOGS", "/tmp/ak-triton-warm"))
    logs.mkdir(parents=True, exist_ok=True)
    cmds = [[sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *s]
            for s in work]
    if args.with_sanitize_cases:
        cmds.append([sys.executable, "-m", "benchmarks.sanitize_cases", "--kernels",
                     "accumulate,master"])
    procs = []
    for i, cmd in enumerate(cmds):  # each in its own session: a timeout here ends them all
        with open(logs / f"job{i}.log", "w") as log:
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                          start_new_session=True))

    def stop(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        print(f"triton-warm: stopped by signal {signum}, {compiled_kernels(cache) - before} "
              "compiles so far", flush=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    results = []
    for i, proc in enumerate(procs):
        proc.wait()
        lines = [ln for ln in (logs / f"job{i}.log").read_text().splitlines() if ln.strip()]
        results.append({"rc": proc.returncode, "last_line": (lines[-1:] or [""])[0][:200]})
        print(f"  job {i}: rc {proc.returncode}: {results[-1]['last_line']} "
              f"({compiled_kernels(cache) - before} compiles so far)", flush=True)
    after = compiled_kernels(cache)
    record = {"tests": len(ids), "shards": len(work), "jobs": args.jobs, "cache": str(cache),
              "cached_before": before, "compiles": after - before,
              "seconds": round(time.perf_counter() - started, 1), "results": results}
    print(f"triton-warm: {after - before} compiles ({before} cached before), {len(ids)} tests "
          f"in {len(work)} shards, {record['seconds']} s")
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))
    return 0 if ids else 1


if __name__ == "__main__":
    sys.exit(main())
