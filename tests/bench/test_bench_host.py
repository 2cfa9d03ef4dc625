"""benchmarks/bench_host.py on the CPU: the record's rows and derived figures recomputed from its
raw timings, the params check, the pure report helpers on hand-made inputs (no timing
assertions)."""

from __future__ import annotations

import contextlib
import io
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_host
from benchmarks.accumbench import host_report, suites

ROW_NAMES = ["native", "native_bf16", "native_clip", "floor", "floor_pre_post", "wrapper_fp32",
             "wrapper_fp32_clip", "wrapper_bf16"]
# the reference of each row's backward and step columns (None: no such column)
REFS = {"native": ("native", "native"), "native_bf16": ("native_bf16", "native_bf16"),
        "native_clip": (None, "native"), "floor": ("native", None),
        "floor_pre_post": ("native", None),
        "wrapper_fp32": ("native", "native"), "wrapper_fp32_clip": ("native", "native"),
        "wrapper_bf16": ("native_bf16", "native_bf16")}
N_PARAMS = 148
QUICK_REPS, MICRO = 3, 2


@pytest.fixture(scope="module", params=["probe", "gpt2-tiny"])
def quick(request, tmp_path_factory):
    """One quick run per model (the probe's through the suite dispatcher); its record and
    what it printed."""
    out = tmp_path_factory.mktemp("host") / f"{request.param}.json"
    argv = ["--quick", "--device", "cpu", "--model", request.param,
            "--micro-batches", str(MICRO), "--out", str(out)]
    buf = io.StringIO()  # a module-scoped fixture cannot use capsys
    with contextlib.redirect_stdout(buf):
        rc = (suites.main(["host", *argv]) if request.param == "probe"
              else bench_host.main(argv))
    record = json.loads(out.read_text())
    return request.param, rc, record, buf.getvalue()


def test_record_is_well_formed(quick):
    model, rc, record, _ = quick
    assert rc == 0
    assert record["benchmark"] == "host-time"
    env = record["environment"]
    assert env["torch"] == torch.__version__ and "triton" in env and "git_commit" in env
    assert (env["threads"], env["torch_threads"], env["clock"]) == (1, 1, "wall")
    assert record["config"]["models"] == [model]
    table = record["tables"][model]
    assert (table["n_params"], table["reps"], table["micro_batches"]) == (N_PARAMS, 3, MICRO)
    assert [r["row"] for r in table["rows"]] == ROW_NAMES
    for r in table["rows"]:
        assert r["error"] is None, r
        assert (r["backward_ref"], r["step_ref"]) == REFS[r["row"]]
        # every backward of every timed window, every timed step; both clocks kept
        assert len(r["backward_us"]) == QUICK_REPS * MICRO and len(r["step_us"]) == QUICK_REPS
        assert r["backward_us"] == r["samples_us"]["backward"]["wall"]
        assert len(r["samples_us"]["step"]["thread"]) == QUICK_REPS
        assert all(t > 0 for t in r["backward_us"] + r["step_us"])
    assert record["critical_path"] == {"status": "pending: no GPU"}


def test_derived_figures_recomputed_from_the_raw_lists(quick):
    """Ratios are the medians' ratios and µs/param the medians' difference over 148, both
    recomputed here from the raw lists in the file."""
    model, _, record, _ = quick
    table = record["tables"][model]
    med = {r["row"]: {phase: statistics.median(r[f"{phase}_us"]) for phase in ("backward", "step")}
           for r in table["rows"]}
    derived = {d["row"]: d for d in table["derived"]}
    assert list(derived) == ROW_NAMES
    for name, (bref, sref) in REFS.items():
        d = derived[name]
        for phase, ref in (("backward", bref), ("step", sref)):
            if ref is None:
                assert d[f"{phase}_us"] is None and d[f"{phase}_ratio"] is None
                continue
            mine, theirs = med[name][phase], med[ref][phase]
            assert d[f"{phase}_us"] == pytest.approx(mine, rel=1e-12)
            assert d[f"{phase}_ratio"] == pytest.approx(mine / theirs, rel=1e-12)
            assert d[f"{phase}_us_per_param"] == pytest.approx((mine - theirs) / N_PARAMS,
                                                               rel=1e-9, abs=1e-12)
    clip = derived["wrapper_fp32_clip"]
    assert clip["step_also_ref"] == "native_clip"
    assert clip["step_also_ratio"] == pytest.approx(
        med["wrapper_fp32_clip"]["step"] / med["native_clip"]["step"], rel=1e-12)
    floor_added = (med["floor"]["backward"] - med["native"]["backward"]) / N_PARAMS
    for g in table["goals"]:
        d = derived[g["row"]]
        assert g["backward_met"] == (d["backward_ratio"] <= 1.20)
        assert g["step_met"] == (d["step_ratio"] <= 1.35)
        if floor_added > 0:
            assert g["backward_added_vs_floor"] == pytest.approx(
                d["backward_us_per_param"] / floor_added, rel=1e-9)
    assert [g["row"] for g in table["goals"]] == ["wrapper_fp32", "wrapper_fp32_clip",
                                                  "wrapper_bf16"]


def test_params_check(quick):
    """The fp32 wrapper did the steps native did, to the bit; clipping within 1e-6."""
    model, _, record, _ = quick
    rows = {r["row"]: r for r in record["tables"][model]["rows"]}
    fp32 = rows["wrapper_fp32"]
    assert fp32["verify_ref"] == "native" and fp32["criterion"].startswith("exact")
    assert fp32["verified"] is True and fp32["max_abs_diff"] == 0.0
    assert rows["floor"]["verified"] is True and rows["floor"]["max_abs_diff"] == 0.0
    assert rows["floor_pre_post"]["verified"] is True
    assert rows["floor_pre_post"]["max_abs_diff"] == 0.0
    clip = rows["wrapper_fp32_clip"]
    assert clip["verify_ref"] == "native_clip" and clip["verified"] is True
    assert clip["max_abs_diff"] <= 1e-6 and "one window" in clip["criterion"]
    assert clip["max_abs_diff_after_timing"] is not None
    assert rows["wrapper_bf16"]["verified"] is None  # native sums in bf16: recorded only
    assert rows["wrapper_bf16"]["max_abs_diff"] is not None
    assert rows["native"]["verified"] is None


def test_printed_table(quick):
    model, _, record, printed = quick
    table = record["tables"][model]
    lines = printed.splitlines()
    for d in table["derived"]:
        line = next(ln for ln in lines if ln.startswith(d["row"] + " "))
        if d["backward_us"] is not None:
            assert f"{d['backward_us']:.1f}" in line and f"{d['backward_ratio']:.2f}" in line
        if d["step_us"] is not None:
            assert f"{d['step_us']:.1f}" in line and f"{d['step_us_per_param']:+.3f}" in line
    assert host_report.GOAL_LINE in lines
    assert "goal: wrapper backward <= 1.20x native, step <= 1.35x the inner fused step" in lines
    assert any(ln.startswith("wrapper_fp32_clip step vs native_clip: ") for ln in lines)
    assert "critical path, GPT-2-124M bf16: pending: no GPU" in lines


# --- the params check can fail --------------------------------------------------------------

def test_verify_catches_a_changed_param():
    workload = bench_host.probe_workload(torch.device("cpu"), seed=1)
    native = bench_host.Row(bench_host.SPECS["native"], workload)
    wrapper = bench_host.Row(bench_host.SPECS["wrapper_fp32"], workload)
    try:
        rows = {"native": native, "wrapper_fp32": wrapper}
        assert bench_host.verify(wrapper, rows)["verified"] is True  # the same initial values
        with torch.no_grad():
            wrapper.params[7][0] += 0.5
        check = bench_host.verify(wrapper, rows)
        assert check["verified"] is False and check["max_abs_diff"] == pytest.approx(0.5)
    finally:
        wrapper.close()


def test_close_check_can_fail():
    """The one-window check on fresh copies sees a reference that trained from other values."""
    base = bench_host.probe_workload(torch.device("cpu"), seed=2)
    made = []

    def make(dtype):
        model = base.make(dtype)
        made.append(model)
        if len(made) % 2 == 0:  # every second copy (the reference of a pair) starts elsewhere
            with torch.no_grad():
                next(iter(model.parameters()))[0, 0] += 0.25
        return model

    workload = bench_host.Workload("perturbed", make, base.loss)
    spec = bench_host.SPECS["wrapper_fp32_clip"]
    rows = {n: bench_host.Row(bench_host.SPECS[n], base) for n in ("native_clip",)}
    row = bench_host.Row(spec, base)
    try:
        check = bench_host.verify(row, rows, workload, 1, torch.device("cpu"))
        assert check["verified"] is False and check["max_abs_diff"] > 0.2
        assert check["max_abs_diff_after_timing"] == 0.0  # the untrained rows: equal
        check = bench_host.verify(row, rows, base, 1, torch.device("cpu"))
        assert check["verified"] is True
    finally:
        row.close()


def test_rows_run_round_robin(monkeypatch):
    """Each repetition runs every row once, starting one row later; warm-up windows are not
    kept; a row that raises is recorded and left out from then on."""
    calls = []

    def fake_repetition(row, workload, micro_batches, device, keep):
        calls.append((row.spec.name, keep))
        if row.spec.name == "c" and keep:
            raise RuntimeError("boom")

    monkeypatch.setattr(bench_host, "repetition", fake_repetition)
    rows = [SimpleNamespace(spec=SimpleNamespace(name=n), error=None) for n in "abc"]
    bench_host.time_rows(rows, SimpleNamespace(name="fake"), 2, torch.device("cpu"), 1, 3)
    assert calls == [("a", False), ("b", False), ("c", False),  # warm-up
                     ("b", True), ("c", True), ("a", True),  # c raises: left out after
                     ("a", True), ("b", True),  # live [a, b]: repetition 2 starts at 2 % 2
                     ("b", True), ("a", True)]
    assert rows[2].error == "RuntimeError: boom" and rows[0].error is None


def test_critical_path_bookkeeping_without_a_gpu(monkeypatch):
    """The GPU table's loop and entries, on the CPU: the tiny GPT-2 in place of GPT-2-124M and a
    fake timer (5 µs host, 3 µs device), since time_call needs CUDA events."""
    cpu = torch.device("cpu")
    real = bench_host.gpt2_workload
    monkeypatch.setattr(bench_host, "GPT2_124M", bench_host.TINY)
    monkeypatch.setattr(bench_host, "gpt2_workload",
                        lambda name, config, batch, micro, device, seed:
                        real(name, config, batch, micro, cpu, seed))

    def fake_time_call(fn, device):
        fn()
        return {"wall": 5.0, "thread": 4.0, "device": 3.0}

    monkeypatch.setattr(bench_host, "time_call", fake_time_call)
    args = bench_host.parse_args(["--device", "cpu", "--quick", "--micro-batches", "2"])
    cp = bench_host.measure_critical_path(args, SimpleNamespace(type="cuda"))
    assert cp["status"] == "measured" and cp["reps"] == 2
    assert [(e["batch"], e["row"], e["phase"]) for e in cp["entries"]] == [
        (b, r, p) for b in (1, 8) for r in ("native_bf16", "wrapper_bf16")
        for p in ("backward", "step")]
    for e in cp["entries"]:
        assert e["error"] is None and (e["host_us"], e["device_us"]) == (5.0, 3.0)
        assert e["critical_path"] == "host"
        # every timed backward (2 reps x 2 micro-batches) or step (2 reps)
        assert len(e["host_samples_us"]) == (4 if e["phase"] == "backward" else 2)
    assert host_report.format_critical_path(cp).splitlines()[-1].split() \
        == ["8", "wrapper_bf16", "step", "5.0", "3.0", "host"]
    assert bench_host.measure_critical_path(args, cpu) == {"status": "pending: no GPU"}


def test_probe_has_148_tiny_params():
    workload = bench_host.probe_workload(torch.device("cpu"), seed=0)
    params = list(workload.make("bf16").parameters())
    assert len(params) == N_PARAMS and all(p.dtype == torch.bfloat16 for p in params)
    assert all(4 <= p.numel() <= 64 for p in params)


def test_moe_probe_has_thousands_of_tiny_params():
    workload = bench_host.probe_workload(torch.device("cpu"), seed=0, name="moe-probe")
    params = list(workload.make("fp32").parameters())
    assert workload.name == "moe-probe" and len(params) >= 2000
    assert all(p.numel() <= 2048 for p in params)
    assert sum(p.numel() <= 64 for p in params) >= 2000
    loss = workload.loss(workload.make("fp32"), "fp32", 0)
    assert loss.dim() == 0


def test_arguments():
    args = bench_host.parse_args(["--device", "cpu"])
    assert (args.reps, args.warmup, args.micro_batches, args.model, args.threads, args.clock) \
        == (15, 2, 4, "all", 1, "wall")
    assert bench_host.parse_args(["--device", "cpu", "--quick"]).reps == 3
    with pytest.raises(SystemExit):
        bench_host.parse_args(["--device", "cpu", "--reps", "0"])
    with pytest.raises(SystemExit):  # parsing only: no GPU needed
        bench_host.parse_args(["--device", "cuda", "--clock", "thread"])


# --- the pure helpers, on fixed inputs ------------------------------------------------------

def test_median():
    assert host_report.median([5.0, 1.0, 3.0]) == 3.0
    assert host_report.median([4.0, 1.0, 3.0, 10.0]) == (3.0 + 4.0) / 2
    assert host_report.median([]) is None


def test_ratio_and_per_param():
    assert host_report.ratio(150.0, 120.0) == 1.25
    assert host_report.ratio(1.0, 0.0) is None and host_report.ratio(None, 2.0) is None
    assert host_report.per_param(444.0, 148.0, 148) == 2.0
    assert host_report.per_param(100.0, None, 148) is None


def _raw(name, backward, step, bref, sref, also=None, dtype="fp32"):
    return {"row": name, "dtype": dtype, "backward_ref": bref, "step_ref": sref,
            "step_also_ref": also, "backward_median_us": backward, "step_median_us": step,
            "verified": None, "error": None}


def _fixed_rows():
    return [_raw("native", 1000.0, 400.0, "native", "native"),
            _raw("floor", 1074.0, 999.0, "native", None),
            _raw("native_clip", 1.0, 500.0, None, "native"),
            _raw("wrapper_fp32", 1148.0, 592.0, "native", "native", also="native_clip")]


def test_derive_and_goals_on_fixed_medians():
    n = 148
    derived = {d["row"]: d for d in host_report.derive(_fixed_rows(), n)}
    w = derived["wrapper_fp32"]
    assert w["backward_ratio"] == 1148.0 / 1000.0
    assert w["backward_us_per_param"] == 148.0 / 148
    assert w["step_ratio"] == 592.0 / 400.0 and w["step_us_per_param"] == 192.0 / 148
    assert w["step_also_ratio"] == 592.0 / 500.0
    assert derived["floor"]["step_us"] is None and derived["floor"]["step_ratio"] is None
    assert derived["native_clip"]["backward_us"] is None
    assert derived["native"]["backward_ratio"] == 1.0
    (g,) = host_report.goals(list(derived.values()))
    assert g["row"] == "wrapper_fp32"
    assert g["backward_met"] is True  # 1.148 <= 1.20
    assert g["step_met"] is False  # 1.48 > 1.35
    assert g["backward_added_vs_floor"] == pytest.approx((148.0 / 148) / (74.0 / 148))
    # a floor that adds nothing measurable gives no ratio
    rows = _fixed_rows()
    rows[1]["backward_median_us"] = 990.0
    (g,) = host_report.goals(host_report.derive(rows, n))
    assert g["backward_added_vs_floor"] is None


def test_format_table_on_fixed_medians():
    rows = _fixed_rows()
    rows[3]["verified"] = True
    derived = host_report.derive(rows, 148)
    table = {"model": "probe", "n_params": 148, "numel": 3016, "micro_batches": 4, "reps": 15,
             "warmup": 2, "rows": rows, "derived": derived, "goals": host_report.goals(derived)}
    lines = host_report.format_table(table).splitlines()
    wrapper = next(ln for ln in lines if ln.startswith("wrapper_fp32 "))
    # 1148.0 µs, 1.148 -> "1.15", +1.000 µs/param; 592.0 µs, 1.48, +192/148 = +1.297
    assert wrapper.split() == ["wrapper_fp32", "fp32", "1148.0", "1.15", "+1.000", "592.0",
                               "1.48", "+1.297", "native", "yes"]
    floor = next(ln for ln in lines if ln.startswith("floor "))
    assert floor.split() == ["floor", "fp32", "1074.0", "1.07", "+0.500", "-", "-", "-", "-",
                             "-"]
    # 592 / 500 = 1.184; (592 - 500) / 148 = 0.6216
    assert "wrapper_fp32 step vs native_clip: 1.18x (+0.622 µs/param)" in lines
    assert ("  wrapper_fp32       backward 1.15x met, step 1.48x NOT met; backward adds 2.0x "
            "the floor's µs/param") in lines


def test_critical_path_helpers():
    assert host_report.critical_path(120.0, 80.0) == "host"
    assert host_report.critical_path(80.0, 120.0) == "device"
    assert host_report.critical_path(None, 1.0) is None
    cp = {"status": "measured", "reps": 10, "entries": [
        {"batch": 8, "row": "wrapper_bf16", "phase": "step", "host_us": 900.0,
         "device_us": 2500.0, "critical_path": "device"}]}
    last = host_report.format_critical_path(cp).splitlines()[-1]
    assert last.split() == ["8", "wrapper_bf16", "step", "900.0", "2500.0", "device"]
    assert host_report.format_critical_path({"status": "pending: no GPU"}) \
        == "critical path, GPT-2-124M bf16: pending: no GPU"
