"""benchmarks/bench_step.py and accumbench.tally on the CPU: well-formed rows, the byte model
against hand counts, the tally against hand counts (no timing assertions)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_step  # noqa: E402
from benchmarks.accumbench import suites  # noqa: E402
from benchmarks.accumbench.tally import LiveTensorBytes, TrafficTally  # noqa: E402

REPS = 2
ROW_NAMES = ["adamw_fused", "adamw_fused_grad_scale", "read_pass", "adamw_foreach",
             "wrapper_fp32_sum", "wrapper_fp32_clip",
             "wrapper_fp32_mean", "wrapper_fp32_dynamic", "adamw_fused+copy_back",
             "wrapper_bf16_sum", "wrapper_bf16_clip", "wrapper_bf16_mean",
             "wrapper_bf16_dynamic", "wrapper_bf16_sum_separate", "wrapper_bf16_clip_separate",
             "sgd_fused", "sgd_fused+copy_back", "wrapper_bf16_sgd_sum", "wrapper_bf16_sgd_clip",
             "wrapper_bf16_sgd_sum_separate", "wrapper_bf16_sgd_clip_separate"]
SGD_TAIL = ["sgd_fused", "sgd_fused+copy_back", "wrapper_bf16_sgd_sum", "wrapper_bf16_sgd_clip",
            "wrapper_bf16_sgd_sum_separate", "wrapper_bf16_sgd_clip_separate"]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("step") / "step.json"
    rc = bench_step.main(["--quick", "--device", "cpu", "--reps", str(REPS), "--out", str(out)])
    return rc, json.loads(out.read_text())


def test_quick_run_rows_are_well_formed(quick, capsys):
    rc, record = quick
    assert rc == 0
    assert record["benchmark"] == "step"
    assert record["environment"]["torch"] == torch.__version__
    assert "triton" in record["environment"] and "git_commit" in record["environment"]
    cfg = record["config"]
    assert (cfg["workload"], cfg["n_tensors"], cfg["reps"]) == ("gpt2-tiny", 148, REPS)
    assert [r["row"] for r in record["rows"]] == ROW_NAMES
    rows = {r["row"]: r for r in record["rows"]}
    for r in rows.values():
        assert r["status"] == "ok" and r["error"] is None, r
        assert len(r["times_ms"]) == REPS and all(t > 0 for t in r["times_ms"])
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        # every step reached the inner optimizer: warm-up + timed + the tallied one
        steps = 0 if r["kind"] == "read" else cfg["warmup"] + REPS + 1
        assert r["inner_steps"] == steps and r["skipped_steps"] == 0
        assert len(r["other_clock_times_ms"]) == REPS
        fused, fair = rows["adamw_fused"], rows[r["fair_baseline"]]
        assert r["ratio_vs_adamw_fused"] == pytest.approx(r["median_ms"] / fused["median_ms"])
        assert r["ratio_vs_fair"] == pytest.approx(r["median_ms"] / fair["median_ms"])
        assert r["counted"]["bytes"] > 0 and r["counted"]["ops"] >= 1
    assert rows["adamw_fused"]["ratio_vs_adamw_fused"] == 1.0
    assert rows["wrapper_bf16_sum"]["fair_baseline"] == "adamw_fused+copy_back"
    assert rows["wrapper_fp32_sum"]["fair_baseline"] == "adamw_fused"
    assert rows["wrapper_bf16_sum"]["micro_batches"] == 2
    table = bench_step.format_table(record)
    assert all(name in table for name in ROW_NAMES)
    assert "x fused" in table and "counted MB" in table and "x floor" in table


def test_floor_is_measured_in_the_same_run(quick):
    """Each wrapper row's floor: the read pass + its inner step (x 32/28 for the bf16 fused
    master step with AdamW, x 24/20 with SGD), all medians of this run; x floor = median / it."""
    _, record = quick
    rows = {r["row"]: r for r in record["rows"]}
    read = rows["read_pass"]["median_ms"]
    assert read > 0 and rows["read_pass"]["ratio_vs_floor"] == 1.0
    assert rows["read_pass"]["model_bytes"] == 4 * record["config"]["numel"]
    for r in rows.values():
        if r["kind"] != "wrapper":
            assert r["floor_factor"] is None
            continue
        inner = rows[r["inner_baseline"]]["median_ms"]
        factor = 1.0 if r["model_dtype"] == "fp32" else 24 / 20 if "sgd" in r["row"] else 32 / 28
        assert r["floor_factor"] == pytest.approx(factor)
        assert r["floor_ms"] == pytest.approx(read + factor * inner)
        assert r["ratio_vs_floor"] == pytest.approx(r["median_ms"] / r["floor_ms"])
    assert rows["adamw_fused"]["ratio_vs_floor"] == 1.0
    assert rows["adamw_fused+copy_back"]["floor_ms"] is None


def test_read_row_reads_a_window_written_as_the_micro_batches_write_it():
    """The read pass row's buffer is rewritten before every timing: the first micro-batch's
    gradients copied in, the others added (the wrapper's window when its step starts)."""
    shapes = [(3, 4), (5,), (2, 2, 2)]
    init = [torch.zeros(s) for s in shapes]
    row = bench_step.ReadRow(bench_step.RowSpec("read_pass", "read", "fp32"), init, 2)
    rsets = [[torch.randn(s) for s in shapes] for _ in range(2)]
    for rep in (0, 1):
        for v in row.views:
            v.fill_(float("nan"))  # poisoned: prepare must write every element
        row.prepare(rsets, rep)
        for v, a, b in zip(row.views, rsets[0], rsets[1], strict=True):
            assert torch.equal(v, a + b)
        row.step()
    assert row.micro == 2


def test_thread_clock(tmp_path):
    """--clock thread: the thread's CPU time is the figure, the wall clock kept beside it."""
    out = tmp_path / "t.json"
    rc = bench_step.main(["--quick", "--device", "cpu", "--reps", "1", "--variants", "sum",
                          "--no-tally", "--clock", "thread", "--note", "shared box",
                          "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and record["config"]["clock"] == "thread"
    assert record["config"]["note"] == "shared box"
    assert "thread_time" in record["config"]["timer"]
    assert all(len(r["other_clock_times_ms"]) == 1 for r in record["rows"])


def test_inner_rows_count_what_adamw_moves(quick):
    """Counted by TrafficTally: fused AdamW moves 28 B per fp32 element (reads p, grad, m, v;
    writes p, m, v) plus a few bytes per tensor (its step counters)."""
    _, record = quick
    rows = {r["row"]: r for r in record["rows"]}
    numel, n = record["config"]["numel"], record["config"]["n_tensors"]
    fused = rows["adamw_fused"]["counted"]
    assert 16 * numel <= fused["read_bytes"] <= 16 * numel + 32 * n
    assert 12 * numel <= fused["written_bytes"] <= 12 * numel + 32 * n
    assert fused["scalar_reads"] == 0 and fused["syncs"] == 0
    # given a grad_scale (the wrapper's fold), it also writes the divided gradients back
    scaled = rows["adamw_fused_grad_scale"]["counted"]
    assert 16 * numel <= scaled["read_bytes"] <= 16 * numel + 32 * n
    assert 16 * numel <= scaled["written_bytes"] <= 16 * numel + 32 * n
    assert rows["adamw_fused_grad_scale"]["model_bytes"] == 32 * numel
    # the bf16 model's fair baseline adds a copy-back: read 4 B, write 2 B per element
    extra = rows["adamw_fused+copy_back"]["counted_bytes_vs_fair"]
    assert rows["adamw_fused+copy_back"]["counted"]["bytes"] - fused["bytes"] == 6 * numel
    assert extra == 0  # it is its own fair baseline


def test_byte_model_describes_the_current_step(quick):
    """The documented byte model agrees with what one step's ops moved, row by row (when the
    step changes, update bench_step.model_passes)."""
    _, record = quick
    n = record["config"]["n_tensors"]
    for r in record["rows"]:
        if r["row"] == "adamw_foreach":  # the model is AdamW's minimum; foreach moves more
            assert r["counted"]["bytes"] > 2 * r["model_bytes"]
            continue
        unseen = sum(r["model_bytes_by_pass"][k] for k in r["uncounted_passes"])
        # the fused master step's schema declares the gradients mutated (it writes them with
        # write_grad=True); the wrapper passes False, but the tally counts the declared write
        declared = 0
        if "fused_master" in r["model_bytes_by_pass"]:
            declared = 4 * record["config"]["numel"]
        assert abs(r["counted"]["bytes"] + unseen - r["model_bytes"] - declared) \
            <= 64 * n + 4096, r["row"]


def _spec(name: str) -> bench_step.RowSpec:
    return next(s for s in bench_step.row_specs(list(bench_step.VARIANTS)) if s.name == name)


@pytest.mark.parametrize("name,declare_n,expected", [
    # 17 elements; AdamW: 4 fp32 reads + 3 fp32 writes = 28 B each
    ("adamw_fused", False, 17 * 28),
    ("adamw_foreach", False, 17 * 28),
    ("adamw_fused+copy_back", False, 17 * (28 + 4 + 2)),
    # every wrapper row: one read pass of the window for finiteness and the norm (4)
    ("wrapper_fp32_sum", False, 17 * (28 + 4)),
    ("wrapper_fp32_dynamic", False, 17 * (28 + 4)),  # 1/S is fused into accumulation
    ("wrapper_fp32_clip", False, 17 * (28 + 4 + 4)),  # g / grad_scale written back by AdamW
    ("wrapper_fp32_mean", False, 17 * (28 + 4 + 4)),  # 1/N in AdamW's grad_scale: g back
    ("wrapper_fp32_mean", True, 17 * (28 + 4)),  # N declared: 1/N fused into accumulation
    # the fused master step: read window 4 + master 4 + m 4 + v 4 + weight 2, write master 4 +
    # m 4 + v 4 + weight 2 = 32; the window is never written (grad_scale divides in registers)
    ("wrapper_bf16_sum", False, 17 * (32 + 4)),
    ("wrapper_bf16_clip+mean+dynamic", False, 17 * (32 + 4)),
    ("wrapper_bf16_sum", None, 17 * (32 + 4)),  # no separate resync on any device
    # separate passes: resync (exact compare, read master 4 + weight 2 by the native CPU pass),
    # the inner step (g / grad_scale written back with clipping), copy-back 4 + 2
    ("wrapper_bf16_sum_separate", False, 17 * (28 + 4 + 6 + 6)),
    ("wrapper_bf16_clip_separate", False, 17 * (28 + 4 + 4 + 6 + 6)),
    ("wrapper_bf16_sum_separate", None, 17 * (28 + 4 + 30 + 6)),  # torch ops: to 4+2, ne 5,
    # float 6, where 13
    # SGD with momentum: read p, g, buf, write p, buf = 20; fused master: 4+4+4+2 + 4+4+2 = 24
    ("sgd_fused", False, 17 * 20),
    ("sgd_fused+copy_back", False, 17 * (20 + 6)),
    ("wrapper_bf16_sgd_clip", False, 17 * (24 + 4)),
    ("wrapper_bf16_sgd_clip_separate", False, 17 * (20 + 4 + 4 + 6 + 6)),
])
def test_byte_model_matches_a_hand_count(name, declare_n, expected):
    shapes = [(3, 4), (5,)]
    numel = sum(math.prod(s) for s in shapes)
    assert numel == 17
    native_resync = declare_n is not None  # None: the torch-op resync (devices without a pass)
    passes = bench_step.model_passes(_spec(name), numel, 2, bool(declare_n), native_resync)
    assert sum(passes.values()) == expected
    spec = _spec(name)
    if "fused_master" not in passes:
        assert passes["inner"] == 17 * (20 if spec.opt == "sgd" else 28)


def test_tally_counts_ops_by_hand():
    a, b = torch.randn(10), torch.randn(10)
    with TrafficTally() as t:
        a.add_(b)  # read 40 + 40, write 40
    assert (t.read, t.written, t.ops) == (80, 40, 1)
    with TrafficTally() as t:
        c = a * 2  # read 40, write 40 (a fresh output)
        a.copy_(b)  # read 40 (b only), write 40
        torch._foreach_zero_([c])  # write 40
        a.view(2, 5)  # a view: nothing moves
        a.sum().item()  # read 40, write 4; then the host reads 4
    assert (t.read, t.written) == (40 + 40 + 0 + 40 + 4, 40 + 40 + 40 + 4)
    assert (t.ops, t.scalar_reads, t.syncs) == (5, 1, 0)
    assert t.summary()["by_op"]["aten::copy_"] == {"calls": 1, "read_bytes": 40,
                                                   "written_bytes": 40}


def test_tally_fused_adamw_reads_its_grads():
    p = torch.nn.Parameter(torch.randn(100))
    p.grad = torch.randn(100)
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    opt.step()  # state allocated outside the tally
    with TrafficTally() as t:
        opt.step()
    fused = t.summary()["by_op"]["aten::_fused_adamw_"]
    assert fused["read_bytes"] == 4 * 400 + 4  # p, grad, exp_avg, exp_avg_sq, the step
    assert fused["written_bytes"] == 3 * 400  # p, exp_avg, exp_avg_sq


def test_live_tensor_bytes_by_hand():
    before = torch.randn(1000)  # made before the mode: not counted, nor are its views
    with LiveTensorBytes() as live:
        before.view(10, 100).mul_(2)
        a = torch.empty(100)  # 400 B
        a.view(10, 10).add_(1)  # a view and an in-place op: nothing new
        c = a * 2  # 400 B more: the peak, 800
        del c
        d = torch.ones(50)  # 200 B: 600 live
        assert live.current == 600
    assert live.peak == 800 and live.allocations == 3
    del a, d
    assert live.current == 0


def test_suites_dispatch_step(tmp_path):
    out = tmp_path / "s.json"
    rc = suites.main(["step", "--quick", "--reps", "1", "--variants", "sum", "--no-tally",
                      "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0
    assert [r["row"] for r in record["rows"]] == ["adamw_fused", "adamw_fused_grad_scale",
                                                  "read_pass", "adamw_foreach",
                                                  "wrapper_fp32_sum", "adamw_fused+copy_back",
                                                  "wrapper_bf16_sum", "wrapper_bf16_sum_separate",
                                                  *SGD_TAIL]
    assert all(r["counted"] is None and r["inner_steps"] == (r["kind"] != "read") * 2
               for r in record["rows"])
    assert hasattr(suites.load_suite("train"), "main")


@pytest.mark.parametrize("argv,message", [
    (["--variants", "nope"], "unknown variant"),
    (["--micro-batches", "0"], "must be >= 1"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_defaults_depend_on_device():
    cpu = bench_step.parse_args(["--device", "cpu"])
    assert (cpu.workload, cpu.reps, cpu.warmup, cpu.threads) == ("gpt2-24m", 7, 1, 1)
    shapes = [s for _, s in bench_step.WORKLOADS[cpu.workload]()]
    assert len(shapes) == 148 and sum(math.prod(s) for s in shapes) == 24_538_368
    gpu = bench_step.parse_args(["--device", "cuda"])  # parsing only: no GPU needed
    assert (gpu.workload, gpu.reps, gpu.threads) == ("gpt2-124m", 20, 0)


def test_a_failing_row_is_recorded_and_the_others_go_on(monkeypatch):
    monkeypatch.setitem(bench_step.VARIANTS, "bad", {"max_grad_norm": -1.0})
    init = [torch.randn(3, 4), torch.randn(5)]
    rsets = {d: [[torch.randn(t.shape).to(dt) for t in init] for _ in range(2)]
             for d, dt in bench_step.DTYPES.items()}
    bad = bench_step.StepRow(bench_step.RowSpec("bad", "wrapper", "fp32", "bad"), init, 2, False)
    assert bad.error.startswith("ValueError") and "max_grad_norm" in bad.error
    good = bench_step.StepRow(bench_step.RowSpec("adamw_fused", "inner", "fp32"), init, 2, False)
    broken = bench_step.StepRow(_spec("wrapper_fp32_sum"), init, 2, False)

    def boom() -> None:
        raise RuntimeError("step failed")

    broken.step = boom
    bench_step.time_rows([bad, good, broken], rsets, 1, 2, torch.device("cpu"))
    assert len(good.times) == 2 and bad.times == [] and broken.times == []
    assert broken.error == "RuntimeError: step failed"
    args = bench_step.parse_args(["--device", "cpu", "--quick"])
    records = [bench_step.row_record(r, 17, args, 3, None) for r in (bad, good, broken)]
    assert [r["status"] for r in records] == ["error", "ok", "error"]
    assert records[1]["inner_steps"] == 3 and records[1]["median_ms"] > 0
    # a row whose inner optimizer took fewer steps than it was given is not ok
    assert bench_step.row_record(good, 17, args, 4, None)["status"] == "MISMATCH"
    for r in (bad, good, broken):
        r.close()


def test_step_phases(tmp_path):
    """benchmarks/step_phases.py: every phase of a wrapper step timed, the phases inside the
    window and the window inside the step (CPU time of the same thread: sums cannot exceed)."""
    from benchmarks import step_phases

    out = tmp_path / "phases.json"
    rc = step_phases.main(["--workload", "gpt2-tiny", "--reps", "2", "--rows",
                           "adamw_fused,wrapper_fp32_clip,wrapper_bf16_sum", "--out", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and record["clock"] == "thread"
    med = record["median_ms"]
    assert set(med) == {"adamw_fused", "wrapper_fp32_clip", "wrapper_bf16_sum"}
    assert set(med["adamw_fused"]) == {"step"}  # no wrapper: nothing but the step
    for name in ("wrapper_fp32_clip", "wrapper_bf16_sum"):
        for sample in range(2):
            s = {k: v[sample] for k, v in record["samples_ms"][name].items()}
            assert s["inner"] <= s["apply"] <= s["window"] <= s["step"]
            parts = s["take_in"] + s["gather"] + s["decide"] + s["apply"] + s["finish"]
            assert parts <= s["window"] * 1.001 + 1e-3
