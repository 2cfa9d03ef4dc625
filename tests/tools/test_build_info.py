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
from accumkernels.info import main
from accumkernels.ops.backends import native

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
    err = capsys.readouterr().err
    assert "usage" in err and "--help" in err


@pytest.mark.parametrize("args", [[], ["--json"], ["--help"]])
def test_python_m_accumkernels_runs(args) -> None:
    """The entry a user tries first exits 0 (run as a process, from this checkout)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "accumkernels", *args], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "backends on " in proc.stdout or '"backends"' in proc.stdout


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


def _report(capsys, *args: str) -> str:
    assert main(list(args)) == 0
    return capsys.readouterr().out


def _row(out: str, name: str) -> str:
    """The value of the report's row ``name``."""
    rows = [ln for ln in out.splitlines() if ln.startswith(name + " ")]
    assert len(rows) == 1, (name, out)
    return rows[0][len(name):].strip()


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_explains_every_field_of_the_report(capsys, flag) -> None:
    """Every row the report prints is explained by --help (row names read from a real report),
    the CPU SIMD line with its three parts, the driver a CUDA build needs, the Triton extra."""
    report = _report(capsys)
    help_text = _report(capsys, flag)
    names = {ln[:18].strip() for ln in report.splitlines()}
    names = {"backends on <device>" if n.startswith("backends on") else
             "auto on <device>" if n.startswith("auto on") else n for n in names}
    for name in names:
        assert name in help_text, f"--help does not explain the row {name!r}"
    simd = help_text[help_text.index("CPU SIMD"):]
    simd = simd[:simd.index("\n\n")] if "\n\n" in simd else simd
    assert "ACCUMKERNELS_CPU_SIMD" in simd and "support" in simd and "run" in simd
    for needed in ("--json", "build_info()", "R580", "static", "pip install accumkernels[triton]",
                   'backend="auto"'):
        assert needed in help_text, needed
    assert not help_text.startswith("accumkernels ") and "usage" in help_text.lower()


def test_the_report_says_what_auto_picks_on_the_cpu(capsys) -> None:
    """The ``auto on cpu`` row and build_info()["auto"] are what the wrapper's backend="auto"
    resolves to: accumulate_'s backend and the fused master step's."""
    import torch

    from accumkernels.ops import master_step_backends
    from accumkernels.ops.backends import resolve

    cpu = torch.device("cpu")
    expected = {"accumulate": resolve("auto", cpu),
                "master_step": master_step_backends.resolve_backend("auto", cpu)}
    assert accumkernels.build_info()["auto"]["cpu"] == expected
    row = _row(_report(capsys), "auto on cpu")
    assert row.startswith(expected["accumulate"]), row
    assert json.loads(_report(capsys, "--json"))["auto"]["cpu"] == expected


def test_auto_without_the_extension_is_torch(monkeypatch, capsys) -> None:
    from accumkernels.ops import backends, master_step_backends

    monkeypatch.setattr(native, "_C", None)
    monkeypatch.setattr(native, "IMPORT_ERROR", ImportError("no module named accumkernels._C"))
    monkeypatch.setattr(native, "READER", False)
    monkeypatch.setattr(backends, "_RESOLVED", {})
    monkeypatch.setattr(master_step_backends, "_RESOLVED", {})
    monkeypatch.setattr(master_step_backends.master_step_cpu, "is_available", lambda d: False)
    assert accumkernels.build_info()["auto"]["cpu"]["accumulate"] == "torch"
    assert _row(_report(capsys), "auto on cpu").startswith("torch")


def test_the_report_has_an_auto_row_per_visible_gpu(monkeypatch, capsys) -> None:
    """Two GPUs (simulated): one ``backends on`` and one ``auto on`` row each; a GPU where the
    compiled CUDA kernels cannot run says why next to the backend auto picks instead."""
    import torch

    from accumkernels import info as info_module

    picks = {"cpu": ("cpu", "cpu"), "cuda:0": ("cuda", "cuda"), "cuda:1": ("triton", "triton")}
    monkeypatch.setattr(info_module, "_devices", lambda: list(picks))
    monkeypatch.setattr(info_module, "available_backends",
                        lambda d: {"cpu": ["cpu", "torch"], "cuda:0": ["cuda", "triton", "torch"],
                                   "cuda:1": ["triton", "torch"]}[str(d)])
    monkeypatch.setattr(info_module, "_auto", lambda d: dict(zip(("accumulate", "master_step"),
                                                                  picks[str(d)])))
    monkeypatch.setattr(native, "_CUDA_PROBLEMS", {1: "CUDA driver version is insufficient"})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    out = _report(capsys)
    assert _row(out, "auto on cuda:0").startswith("cuda")
    row = _row(out, "auto on cuda:1")
    assert row.startswith("triton") and "CUDA driver version is insufficient" in row, row
    assert _row(out, "backends on cuda:1") == "triton, torch"
    assert set(json.loads(_report(capsys, "--json"))["auto"]) == set(picks)


@pytest.mark.parametrize("version, driver", [("13.0", "R580"), ("13.1", "R580"),
                                             ("12.4", "R525")])
def test_the_report_names_the_driver_a_cuda_build_needs(monkeypatch, capsys, version,
                                                        driver) -> None:
    from accumkernels import info as info_module

    real = info_module.build_info()
    monkeypatch.setattr(info_module, "build_info", lambda: {
        **real, "native": True, "cuda": True, "cuda_archs": "80;90", "cuda_version": version,
        "cuda_runtime": "static", "cuda_driver": info_module.cuda_driver_needed(version)})
    row = _row(_report(capsys), "CUDA kernels")
    assert f"NVIDIA driver {driver} or newer" in row and version in row, row
    assert info_module.cuda_driver_needed(version) == driver
    assert info_module.cuda_driver_needed(None) is None


def test_build_info_names_the_driver_of_this_build() -> None:
    from accumkernels import info as info_module

    info = accumkernels.build_info()
    assert info["cuda_driver"] == (info_module.cuda_driver_needed(info["cuda_version"])
                                   if info["cuda"] else None)


def test_triton_missing_says_how_to_install_it(monkeypatch, capsys) -> None:
    from accumkernels import info as info_module

    real = info_module._version
    monkeypatch.setattr(info_module, "_version", lambda d: None if d == "triton" else real(d))
    row = _row(_report(capsys), "triton")
    assert row.startswith("not installed") and "pip install accumkernels[triton]" in row, row
    assert json.loads(_report(capsys, "--json"))["triton"] is None  # the JSON stays data
