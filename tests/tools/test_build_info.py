"""``accumkernels.build_info()`` and ``python -m accumkernels``: what the install was built with
and which backends it runs, also when ``_C`` is missing (a wheel built without CUDA, or no
extension at all, imports and says so here rather than failing)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import accumkernels
from accumkernels.ops.backends import native
from accumkernels.info import main

ROOT = Path(__file__).resolve().parents[2]


def test_build_info_reports_the_extension_and_the_backends() -> None:
    """The native keys are _C's own, the backends are available_backends' answer per device."""
    info = accumkernels.build_info()
    assert info["version"] == accumkernels.__version__
    assert info["torch"] == __import__("torch").__version__
    assert info["native"] is (native._C is not None)
    if native._C is not None:
        assert info["native_error"] is None
        assert {k: info[k] for k in native._C.build_info()} == native._C.build_info()
    assert info["backends"]["cpu"] == accumkernels.available_backends("cpu")
    assert info["cuda"] is (native._C is not None and native._C.has_cuda())


def test_build_info_without_the_extension(monkeypatch) -> None:
    """No _C: native False with the import error, no CUDA kernels, torch still a CPU backend."""
    from accumkernels.ops import backends

    monkeypatch.setattr(native, "_C", None)
    monkeypatch.setattr(native, "IMPORT_ERROR", ImportError("no module named accumkernels._C"))
    monkeypatch.setattr(native, "READER", False)
    monkeypatch.setattr(backends, "_RESOLVED", {})
    info = accumkernels.build_info()
    assert info["native"] is False and "accumkernels._C" in info["native_error"]
    assert info["cuda"] is False and info["cuda_version"] is None and info["openmp"] is None
    assert "cpu" not in info["backends"]["cpu"] and "torch" in info["backends"]["cpu"]


def test_main_prints_a_report_and_json(capsys) -> None:
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("accumkernels ") and "CUDA kernels" in out and "backends on cpu" in out
    assert main(["--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == accumkernels.__version__
    assert main(["--bogus"]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize("args", [[], ["--json"]])
def test_python_m_accumkernels_runs(args) -> None:
    """The entry a user tries first exits 0 (run as a process, from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "accumkernels", *args], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backends on cpu" in proc.stdout or '"backends"' in proc.stdout


@pytest.mark.skipif(native._C is None, reason="accumkernels._C is not built")
def test_the_report_names_the_simd_level_and_a_cap(capsys) -> None:
    """`python -m accumkernels` says which SIMD path the CPU kernels run and what the CPU
    supports, and names the cap when ACCUMKERNELS_CPU_SIMD narrowed it."""
    detected = native._C.cpu_simd()["detected"]
    before = native._C.set_cpu_simd_cap("generic")
    try:
        assert main([]) == 0
        line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("CPU SIMD"))
    finally:
        native._C.set_cpu_simd_cap(before)
    assert f"generic (this CPU and OS support {detected}" in line
    assert ("capped by ACCUMKERNELS_CPU_SIMD" in line) is (detected != "generic")
    assert main([]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("CPU SIMD"))
    assert line.split()[2] == native._C.cpu_simd()["level"] and "capped" not in line or \
        native._C.cpu_simd()["cap"] != "avx512"
