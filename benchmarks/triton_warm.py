"""Compile the Triton kernels the GPU tests launch, in parallel, before the tests run in order.

    python -m benchmarks.triton_warm [--jobs 16] [--out FILE] [--logs DIR] [--match triton]
                                     [--with-sanitize-cases] TEST...

A Triton kernel compiles at its first launch with each new signature (dtypes, constexprs,
alignment of its pointers): ~140 distinct compiles across the GPU tests (issue 41's estimate),
seconds each, so a serial test run spends minutes compiling. This collects the tests' ids
(``pytest --collect-only``), keeps those that launch Triton kernels (ids containing ``--match``,
default "triton": the backend's parametrisations and the Triton files; the other backends compile
nothing, so running them here would only test), cuts them into JOBS contiguous shards (a test
function's parametrisations together: one kernel signature compiles in one process, not in
several at once) and runs the shards as concurrent pytest processes sharing Triton's on-disk
cache (``TRITON_CACHE_DIR``, else ~/.triton/cache): the compiles spread over the cores, and the
ordered test stage after this finds every kernel in the cache. Each shard's log goes to
``--logs`` and its last lines to stdout; on SIGTERM (a stage timeout) the shards are stopped and
a partial record is still written. With ``--with-sanitize-cases`` one more job runs
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
    """At most ``jobs`` contiguous runs of ``ids`` of about equal length, each cut where a test
    function ends when one ends within half a shard: neighbouring parametrisations (often the
    same kernel signature) compile in one process."""
    if not ids:
        return []
    jobs = max(1, min(jobs, len(ids)))
    target = -(-len(ids) // jobs)
    out: list[list[str]] = [[]]
    for node in ids:
        cur = out[-1]
        same_function = bool(cur) and cur[-1].split("[")[0] == node.split("[")[0]
        full = len(cur) >= target and not same_function
        if cur and len(out) < jobs and (full or len(cur) >= target + target // 2):
            out.append([])
        out[-1].append(node)
    return out


def matching(ids: list[str], match: str) -> list[str]:
    """The ids containing ``match`` (case-insensitive); all of them for an empty ``match``."""
    return [i for i in ids if match.lower() in i.lower()] if match else ids


def tail(path: Path, lines: int = 3) -> list[str]:
    """The last non-empty lines of a log (none if it is missing)."""
    if not path.is_file():
        return []
    return [ln[:200] for ln in path.read_text(errors="replace").splitlines() if ln.strip()][-lines:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("tests", nargs="+", help="test files (or node ids)")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    p.add_argument("--with-sanitize-cases", action="store_true")
    p.add_argument("--match", default="triton",
                   help="keep the test ids containing this (default triton; '' keeps all)")
    p.add_argument("--logs", type=Path,
                   default=Path(os.environ.get("AK_WARM_LOGS", "/tmp/ak-triton-warm")),
                   help="the shards' logs (put it under the device tool's $OUT to get them back)")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    started = time.perf_counter()
    cache = cache_dir()
    before = compiled_kernels(cache)
    extra = args.pytest_args.split()
    collected = collect(args.tests, extra)
    ids = matching(collected, args.match)
    work = shards(ids, max(1, args.jobs - int(args.with_sanitize_cases)))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    logs = args.logs
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

    results: list[dict] = []

    def record(partial: str | None = None) -> dict:
        rec = {"tests": len(ids), "collected": len(collected), "match": args.match,
               "shards": len(work), "jobs": args.jobs, "cache": str(cache),
               "cached_before": before, "compiles": compiled_kernels(cache) - before,
               "seconds": round(time.perf_counter() - started, 1), "results": results,
               "logs": str(logs)}
        if partial:
            rec["partial"] = partial
        if args.out:
            args.out.write_text(json.dumps(rec, indent=1))
        return rec

    def stop(signum, _frame):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
        for i in range(len(results), len(procs)):
            print(f"  job {i}: stopped: " + " | ".join(tail(logs / f"job{i}.log", 2)), flush=True)
        rec = record(f"stopped by signal {signum}")
        print(f"triton-warm: stopped by signal {signum}, {rec['compiles']} compiles so far "
              f"(partial record written)", flush=True)
        sys.exit(124)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    for i, proc in enumerate(procs):
        proc.wait()
        last = tail(logs / f"job{i}.log")
        results.append({"rc": proc.returncode, "last_line": (last[-1:] or [""])[0]})
        print(f"  job {i}: rc {proc.returncode} ({compiled_kernels(cache) - before} compiles so "
              "far):", flush=True)
        for ln in last:
            print(f"    {ln}", flush=True)
    rec = record()
    print(f"triton-warm: {rec['compiles']} compiles ({before} cached before), {len(ids)} of "
          f"{len(collected)} tests (matching {args.match!r}) in {len(work)} shards, "
          f"{rec['seconds']} s")
    return 0 if ids else 1


if __name__ == "__main__":
    sys.exit(main())
