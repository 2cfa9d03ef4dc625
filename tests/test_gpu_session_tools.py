"""The scripts a GPU session runs (benchmarks/gpu_session.sh and what it calls) work on the CPU:
so that a session's scarce device minutes are not spent on their bugs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, check=False)


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_gpu_session_script_parses():
    proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_session.sh")],
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_tune_kernels_smoke(tmp_path):
    out = tmp_path / "tune.json"
    proc = run("-m", "benchmarks.tune_kernels", "--quick", "--workloads", "flat,gpt2",
               "--dtypes", "bf16", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["rows"] and all(r["status"] == "ok" for r in record["rows"])
    assert record["copy"]["gbps"] > 0


def test_find_batch_smoke(tmp_path):
    out = tmp_path / "find.json"
    proc = run("-m", "benchmarks.find_batch", "--candidates", "1,2", "--global-batch", "2",
               "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(out.read_text())
    assert record["micro_batch_size"] in (1, 2) and len(record["table"]) == 2


def test_targets_reads_a_gpu_record(tmp_path):
    """Every design target gets a line; met and missed are told apart."""
    def row(provider, workload, label, frac, **speedups):
        return {"provider": provider, "workload": workload, "label": label, "dtype": "bf16",
                "numel": 1 << 28 if workload == "flat" else 1, "status": "ok", "frac_copy": frac,
                "gbps": 3000 * frac, **{f"speedup_vs_{k}": v for k, v in speedups.items()}}
    rows = [row("accumkernels:cuda", "flat", "flat-256M", 0.97, foreach=3.0,
                native_grad_dtype=2.0),
            row("accumkernels:cuda", "gpt2", "gpt2-124m", 0.85, loop_literal=8.0, loop_add=4.0,
                foreach=0.9, native_grad_dtype=2.5)]
    record = {"device_name": "NVIDIA H100", "rows": rows,
              "overhead": {"rows": [{"provider": "accumkernels:cuda", "host_us": 12.0}]}}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    proc = run("-m", "benchmarks.targets", str(path))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()

    def mark(prefix):
        hit = [ln for ln in lines if ln.startswith(prefix)]
        assert len(hit) == 1, (prefix, lines)
        return hit[0].split()[-1]

    assert mark("flat-256M bf16->fp32, cuda") == "met"
    assert mark("gpt2-124m bf16, cuda") == "MISSED"
    assert mark("gpt2 bf16 vs loop_literal, cuda") == "met"
    assert mark("gpt2 bf16 vs loop_add, cuda") == "MISSED"
    assert mark("vs foreach, cuda") == "MISSED"
    assert mark("vs native_grad_dtype, cuda") == "met"
    assert mark("host overhead, 300 tensors, cuda") == "met"
    assert mark("flat bf16->fp32, triton") == "n/a"


def test_sanitize_cases_cover_the_issue():
    """Both backends, every table size eager and captured, and every other case."""
    if str(ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
        sys.path.insert(0, str(ROOT))
    import gpu_cases

    from benchmarks import sanitize_cases

    names = [n for n, _ in sanitize_cases.cases(["cuda", "triton"], True, True)]
    for backend in ("cuda", "triton"):
        for n in (64, 65, 256, 257, 1000, 1001):
            assert f"{backend} table {n}" in names and f"{backend} table {n} captured" in names
        for case in ("unaligned_views", "found_inf_vector", "found_inf_overflow", "scale_tensor",
                     "overwrite", "side_stream", "norm_sq"):
            assert f"{backend} {case}" in names
    assert set(gpu_cases.CASES) == {"unaligned_views", "found_inf_vector", "found_inf_overflow",
                                    "scale_tensor", "overwrite", "side_stream", "norm_sq"}
    no_capture = [n for n, _ in sanitize_cases.cases(["cuda"], True, False)]
    assert not any("captured" in n for n in no_capture)


def test_sanitize_cases_include_the_master_step():
    """--kernels master: both backends, every table size (eager and captured), the extras."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import sanitize_cases

    names = [n for n, _ in sanitize_cases.cases(["cuda", "triton"], True, True, ["master"])]
    for backend in ("cuda", "triton"):
        for n in (64, 65, 400, 401, 1000):
            for kind in ("adamw", "sgd"):
                assert f"master {backend} {kind} {n}" in names
            assert f"master {backend} adamw {n} captured" in names
        for case in ("adam_amsgrad extras", "sgd extras", "found_inf"):
            assert f"master {backend} {case}" in names
    both = [n for n, _ in sanitize_cases.cases(["cuda"], True, False, ["accumulate", "master"])]
    assert any(n.startswith("master ") for n in both) and "cuda table 64" in both
    assert not any("captured" in n for n in both)


def test_master_sanitize_cases_run_on_the_cpu():
    """The master step's cases themselves (Triton's interpreter for the backend, the torch
    reference as judge), so that a broken case cannot cost device minutes; a poisoned step is
    caught."""
    pytest.importorskip("triton")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    from accumkernels.ops.backends import master_step_triton as mst
    from benchmarks import sanitize_master as sm

    if not mst.is_available(torch.device("cpu")):
        pytest.skip("no Triton interpreter (TRITON_INTERPRET=1) here")
    cpu = torch.device("cpu")
    sm.step_case("triton", cpu, 65, "adamw", True)
    sm.step_case("triton", cpu, 64, "adam_amsgrad", True, extras=True)
    sm.step_case("triton", cpu, 65, "sgd", True, extras=True)
    sm.found_inf_writes_nothing("triton", cpu)
    s = sm._lists(64, cpu, True, "sgd", seed=1)
    want = sm._clone(s)
    sm._step(s, "sgd", "triton")
    sm._step(want, "sgd", "torch")
    s["masters"][5][0] += 1.0
    with pytest.raises(AssertionError, match=r"masters\[5\]"):
        sm._compare(s, want, "poisoned")


def test_triton_warm_shards_and_counts(tmp_path, monkeypatch):
    """Shards deal every test id once, in order, in contiguous runs: a test function's
    parametrisations (one kernel signature) stay in one shard unless it is longer than one and a
    half shards; only the ids that launch Triton are kept; the compile count reads Triton's cache
    layout."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks import triton_warm

    ids = [f"t.py::test_{i}" for i in range(10)]
    parts = triton_warm.shards(ids, 4)
    assert [x for p in parts for x in p] == ids and len(parts) == 4
    assert triton_warm.shards(ids[:2], 16) == [[ids[0]], [ids[1]]]
    assert triton_warm.shards([], 4) == []
    params = [f"t.py::test_a[{k}]" for k in range(5)] + [f"t.py::test_b[{k}]" for k in range(5)]
    parts = triton_warm.shards(params, 3)
    assert [x for p in parts for x in p] == params
    for part in parts:  # 10 ids over 3 shards: neither function is cut
        assert len({x.split("[")[0] for x in part}) == 1, parts
    assert triton_warm.matching(["a.py::t[cuda]", "a.py::t[triton]", "test_triton_x.py::u"],
                                "triton") == ["a.py::t[triton]", "test_triton_x.py::u"]
    assert triton_warm.matching(ids, "") == ids
    for key in ("a1", "b2"):
        (tmp_path / key).mkdir()
        (tmp_path / key / f"__grp__kernel_{key}.json").write_text("{}")
        (tmp_path / key / "kernel.json").write_text("{}")
    assert triton_warm.compiled_kernels(tmp_path) == 2
    assert triton_warm.compiled_kernels(tmp_path / "missing") == 0


def test_triton_warm_writes_a_partial_record_on_sigterm(tmp_path):
    """A warm-up stopped by its stage's cap (SIGTERM) stops its shards and still writes its
    record, marked partial, with the shards' logs where it was told (under $OUT)."""
    tests = tmp_path / "test_sleepy_triton.py"
    tests.write_text("import time\n\ndef test_triton_sleeps():\n    time.sleep(60)\n")
    out, logs = tmp_path / "warm.json", tmp_path / "logs"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.triton_warm", "--jobs", "1",
                             "--out", str(out), "--logs", str(logs), str(tests)], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while not (logs / "job0.log").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    text, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124, text
    record = json.loads(out.read_text())
    assert record["partial"].startswith("stopped by signal") and record["tests"] == 1, record
    assert "partial record written" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_first_mode_stage_plan():
    """`first` runs its stages in order, every one under `stage` with its cap from FIRST_PLAN:
    the master step's GPU tests first, then the benchmarks (not the stages a long early one
    cuts), then the kernel tests and memcheck on both kernels' cases, both with the caching
    allocator off (out-of-bounds accesses inside a pooled block are invisible otherwise). The
    worst case, every stage to its cap and then killed, plus the summary, fits 450 s."""
    text = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    body = text[text.index("run_first() {"):text.index("bench_out() {")]
    plan_line = re.search(r'FIRST_PLAN="([^"]*)"', text).group(1).replace("\\\n", " ")
    plan = [(e.split(":")[0], int(e.split(":")[1])) for e in plan_line.split()]
    names = [n for n, _ in plan]
    assert names == ["env", "build", "triton-warm", "pytest-master", "bench-headline",
                     "bench-step-master", "pytest-kernels", "sanitize-memcheck",
                     "sanitize-memcheck-master"]
    at = [body.index(f'stage {n} "$(cap {n})"') for n in names[1:]]
    assert at == sorted(at), names
    assert 'stage env "$(cap env)"' in text
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", text, re.M).group(1))
    summary_s = int(re.search(r"^FIRST_SUMMARY_S=(\d+)", text, re.M).group(1))
    assert "--kill-after=$KILL_AFTER" in text and "--kill-after=15" not in text
    worst = sum(c for _, c in plan) + len(plan) * kill_after + summary_s
    assert worst <= 450, (worst, plan)
    assert re.search(rf"worst case.*\n?.*= {worst} s", text), "the header's worst case is stale"
    for kernels in ("accumulate", "master_step"):
        start = body.index(f"kns={kernels}")
        stage_start = body.rindex("stage sanitize-memcheck", 0, start)
        assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1" in body[stage_start:start], kernels
    assert '--logs "$OUT/triton-warm-logs"' in body
    assert "BUDGET=${AK_BUDGET:-$((450 * SCALE))}" in text  # 7.5 minutes on the GPU
    assert "first)\n      run_first" in text


@pytest.mark.skipif(shutil.which("bash") is None, reason="no bash")
def test_stage_timeout_writes_a_partial_json(tmp_path):
    """A stage stopped by its cap leaves $OUT/partial-NAME.json with its log's tail, and the
    summary folds the tails of failed stages into the session log."""
    text = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    funcs = text[text.index("# stage NAME CAP_SECONDS"):text.index("stage_env() {")]
    helpers = text[text.index("# The last lines of every stage"):text.index("# $OUT/stages-MODE")]
    script = tmp_path / "s.sh"
    script.write_text("set -u\nSCALE=1 BUDGET=100 KILL_AFTER=1 SUMMARY=() PY=" + sys.executable
                      + f" OUT={tmp_path} STAGES={tmp_path}\n" + funcs + helpers
                      + "stage slow 1 bash -c 'echo started; sleep 30'\n"
                      + "stage fails 5 bash -c 'echo broken; exit 3'\nfold_failed_tails\n")
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          check=False)
    record = json.loads((tmp_path / "partial-slow.json").read_text())
    assert record["rc"] == 124 and record["log_tail"] == ["started"], record
    assert not (tmp_path / "partial-fails.json").exists()
    assert "--- fails (rc 3): last lines\nbroken" in proc.stdout, proc.stdout
