"""Run metadata for benchmark records: device, versions, git state, default output path."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

import accumkernels

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout (benchmarks/accumbench/../..)
RESULTS_PATH = "benchmarks/results"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def slugify(text: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'; drops (R)/(TM)."""
    text = re.sub(r"\((r|tm|c)\)", "", text.lower())
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-") or "unknown"


def device_slug(device: torch.device) -> str:
    if device.type == "cuda":
        return slugify(torch.cuda.get_device_name(device))
    return "cpu-" + slugify(cpu_name())


def git_info(root: Path = REPO_ROOT) -> tuple[str | None, bool | None]:
    """(HEAD commit, tracked files modified) of the checkout holding this package, else Nones.
    Changes under benchmarks/results/ (the suite files) do not count as modified.

    A copy of the tree without git (a device machine) names its commit in
    ACCUMKERNELS_GIT_COMMIT; its dirty state is then unknown (None)."""
    told = os.environ.get("ACCUMKERNELS_GIT_COMMIT", "").strip() or None
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() != root:
            return told, None  # installed inside some other repository
        # the suite files take a row after every run: a changed one says nothing about the code
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".",
                         f":(exclude){RESULTS_PATH}"))
        return git("rev-parse", "HEAD"), dirty
    except (OSError, subprocess.SubprocessError):
        return told, None


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def environment(device: torch.device) -> dict:
    """Everything needed to compare this record with another one."""
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {"name": props.name, "total_memory": props.total_memory,
               "multi_processor_count": props.multi_processor_count,
               "l2_cache_size": getattr(props, "L2_cache_size", None),
               "capability": f"{props.major}.{props.minor}"}
    commit, dirty = git_info()
    return {
        "device": str(device), "device_name": gpu["name"] if gpu else cpu_name(),
        "device_slug": device_slug(device), "gpu_name": gpu["name"] if gpu else None, "gpu": gpu,
        "cpu_name": cpu_name(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__, "triton": _triton_version(), "cuda": torch.version.cuda,
        "python": platform.python_version(), "platform": platform.platform(),
        "accumkernels": getattr(accumkernels, "__version__", None),
        "available_backends": list(accumkernels.available_backends(device)),
        "native_build": _native_build(),
        # torch's own CPU kernels' vector level (ATEN_CPU_CAPABILITY caps it): the inner
        # optimizer's pass, the floors' and the baselines' code; "simd" above is ours
        "aten_cpu_capability": _aten_cpu_capability(),
        "git_commit": commit, "git_dirty": dirty,
    }


def _aten_cpu_capability() -> str | None:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        return None


def _native_build() -> dict | None:
    """What accumkernels._C was built with (CUDA archs, vector store, ...), None if not built."""
    try:
        from accumkernels import _C
    except ImportError:
        return None
    return dict(_C.build_info())


def default_out_path(slug: str, date: datetime.date, overwrite: bool, quick: bool) -> Path:
    """benchmarks/results/<slug>-<date>[-overwrite][-quick].json, in the checkout if any."""
    base = REPO_ROOT if git_info()[0] is not None else Path.cwd()
    suffix = ("-overwrite" if overwrite else "") + ("-quick" if quick else "")
    return base / "benchmarks" / "results" / f"{slug}-{date.isoformat()}{suffix}.json"
