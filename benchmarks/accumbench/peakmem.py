"""Peak memory on the CPU: the growth of the peak resident set of a fresh process.

The CPU has no allocator statistics like ``torch.cuda.max_memory_allocated``, so a row whose
peak memory is wanted runs alone in a fresh Python process (:func:`run_child`): it builds its
model and inputs, calls :func:`mark` (which resets the kernel's high-water mark ``VmHWM`` to the
current RSS by writing 5 to ``/proc/self/clear_refs`` and returns that RSS), runs, and reports
:func:`growth` = ``VmHWM`` - the mark: the most memory it ever held above its model and inputs,
as the RSS saw it. The child runs with ``MALLOC_MMAP_THRESHOLD_=65536``, which fixes glibc's
mmap threshold (otherwise it rises after each free of a large block) so that every tensor of
64 KiB or more is its own mapping, returned to the system when freed, and the RSS follows the
live tensors instead of malloc's free lists. What the figure includes besides tensors: memory
the row's first calls initialise lazily (kernel caches, thread stacks) and page granularity;
both are alike for rows of the same model, and the tables compare rows with each other. Where
``clear_refs`` cannot be written the mark falls back to the RSS and the peak to ``ru_maxrss``
(the process's lifetime peak), and the method says so.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path

from benchmarks.accumbench.env import REPO_ROOT

CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536"}
RESULT_PREFIX = "PEAKMEM-RESULT "
METHOD = ("peak RSS growth of a fresh process per row (VmHWM reset through /proc/self/clear_refs "
          "after the model and inputs were built; glibc MALLOC_MMAP_THRESHOLD_=65536)")
FALLBACK = ("peak RSS growth of a fresh process per row (ru_maxrss - the RSS after the model and "
            "inputs were built: /proc/self/clear_refs not writable here)")


def _status_kb(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def mark() -> dict:
    """Reset the high-water mark to now; returns what :func:`growth` needs."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    rss = _status_kb("VmRSS")
    if rss is None:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"rss_kb": rss, "reset": reset}


def growth(m: dict) -> tuple[int, str]:
    """(bytes the peak RSS grew since :func:`mark`, the method's description)."""
    peak = _status_kb("VmHWM") if m["reset"] else None
    if peak is None:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return max(0, peak - m["rss_kb"]) * 1024, METHOD if m["reset"] else FALLBACK


def emit(result: dict) -> None:
    """The child's answer: one tagged line on stdout, whatever else it printed."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_child(module: str, args: list[str], timeout: float = 600.0) -> dict:
    """``python -m module *args`` in a fresh process (this checkout first on its path, the
    allocator setting of the module docstring); returns the dict it :func:`emit`-ted."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout, check=False)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    tail = (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]
    raise RuntimeError(f"peak-memory child {module} {' '.join(args)} exited {proc.returncode}: "
                       f"{tail}")
