"""Smoke tests of benchmarks/bench_train.py on a tiny CPU model (no timing assertions)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_train  # noqa: E402

FP32_ROWS = ("main_grad_fp32", "accumkernels")
# Bytes per param alive together at a step, counted by hand: bf16 weights 2; bf16 rows: bf16
# .grad 2 + AdamW's bf16 exp_avg and exp_avg_sq 4; fp32 rows: fp32 masters 4 + fp32 window
# (main_grad) 4 + AdamW's fp32 state 8.
PERSISTENT_BYTES_PER_PARAM = {"large_batch": 8, "native_bf16": 8, "main_grad_fp32": 18,
                              "accumkernels": 18}


def _run(tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "train.json"
    rc = bench_train.main(["--quick", "--device", "cpu", "--out", str(out), *extra])
    return rc, json.loads(out.read_text())


def test_quick_gpt2_table(tmp_path, capsys):
    rc, record = _run(tmp_path)
    rows = {r["row"]: r for r in record["rows"]}
    assert list(rows) == bench_train.available_rows()
    for name in ("large_batch", "native_bf16", *FP32_ROWS):
        r = rows[name]
        assert r["status"] == "ok", r
        assert r["time_s"] > 0 and r["samples_per_s"] > 0 and r["ms_per_microbatch"] > 0
        # CPU: peak live tensor bytes; at the second window's step the model copy, its
        # gradients (or the fp32 window and masters) and AdamW's state are all alive
        assert r["peak_mem_bytes"] >= PERSISTENT_BYTES_PER_PARAM[name] * record["config"]["params"]
        assert set(r["reference_by_param"]) == set(record["config"]["verified_params"])
    if "accumkernels+fused_wgrad" not in rows:  # concurrent work: a failure there is its own
        assert rc == 0
    assert rows["large_batch"]["accumulation_steps"] == 1
    assert "accum_share" not in rows["large_batch"]  # nothing accumulated
    for n in ("native_bf16", *FP32_ROWS):  # measured interleaved: a share >= 0 or a verdict
        r = rows[n]
        assert r["accum_verdict"] in ("measured", "below noise", "below reference")
        assert r["accum_share"] is None or r["accum_share"] > 0
        assert len(r["microbatch_ms"]) == 4 * record["config"]["steps"]
    assert len(record["reference"]["microbatch_ms"]) == 4 * record["config"]["steps"]
    assert rows["native_bf16"]["micro_batch_size"] * 4 == record["config"]["batch_size"]
    # the gradients the fp32 rows accumulate are the ones the hooks saw: fp32-exact sums
    for name in FP32_ROWS:
        assert set(rows[name]["reference_by_param"].values()) == {"hooks"}
        assert rows[name]["rel_err"] <= 1e-6, rows[name]
        assert rows[name]["rel_err_hooks"] == rows[name]["rel_err"]
        assert rows[name]["rel_err_recomputed"] is None
    # bf16 accumulation of 4 micro-batches rounds: visibly worse than the fp32 rows
    assert rows["native_bf16"]["rel_err"] > 1e-4
    assert rows["large_batch"]["reference_by_param"] == dict.fromkeys(
        record["config"]["verified_params"], "recomputed")
    assert record["reference"]["ms_per_microbatch"] > 0
    assert record["environment"]["torch"] == torch.__version__
    assert record["config"]["peak_mem_method"].startswith("peak live tensor bytes")
    out = capsys.readouterr().out
    assert "samples/s" in out and "accum share" in out and "err hooks" in out
    assert "peak MB" in out and "live tensor bytes" in out and "B/param" in out
    assert "summary (" in out and "precision:" in out and "memory (train" in out


def test_quick_llama_fused_rows(tmp_path):
    """A Llama (nn.Linear everywhere): the model fuse_wgrad_accumulation can actually patch."""
    rows = "accumkernels,accumkernels+fused_wgrad"
    _, record = _run(tmp_path, "--model", "llama", "--rows", rows)
    got = {r["row"]: r for r in record["rows"]}
    assert got["accumkernels"]["status"] == "ok"
    assert got["accumkernels"]["rel_err"] <= 1e-6
    fused = got.get("accumkernels+fused_wgrad")
    if fused is not None and fused["status"] == "ok":
        assert fused["fused_layers"] > 0
        refs = fused["reference_by_param"]
        # nn.Linear weights are fused (no gradient for hooks to see), the norms are not
        assert refs["model.layers.0.self_attn.q_proj.weight"] == "recomputed"
        assert refs["model.norm.weight"] == "hooks"
        assert fused["rel_err_hooks"] <= 1e-6
        assert fused["rel_err_recomputed"] < 1e-2  # the reference's bf16 rounding, no more
    elif fused is not None:
        assert fused["error"]  # concurrent work: recorded, not asserted here
    else:
        assert not hasattr(bench_train.accumkernels, "fuse_wgrad_accumulation")


@pytest.mark.parametrize("argv,message", [
    (["--batch-size", "6", "--accumulation-steps", "4"], "multiple"),
    (["--rows", "nope"], "unknown row"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_train.parse_args(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err


def test_defaults_depend_on_device():
    cpu = bench_train.parse_args(["--device", "cpu"])
    assert (cpu.n_layer, cpu.n_embd, cpu.seq) == (2, 64, 32)
    big = bench_train.parse_args(["--device", "cuda"])  # parsing only: no GPU needed
    assert (big.n_layer, big.n_embd, big.n_head, big.seq, big.vocab) == (12, 768, 12, 1024, 50257)
    assert big.batch_size % big.accumulation_steps == 0


# --- the accumulation share: a difference of medians against its noise bound ----------------

def test_accumulation_share_measured_when_above_noise():
    ref = [10.0, 10.1, 9.9, 10.0, 10.2, 9.8, 10.0, 10.1]
    row = [12.0, 12.1, 11.9, 12.0, 12.2, 11.8, 12.0, 12.1]
    got = bench_train.accumulation_share(row, ref)
    assert got["accum_verdict"] == "measured"
    assert got["accum_ms"] == pytest.approx(2.0)
    assert got["accum_share"] == pytest.approx(2.0 / 12.0)
    assert 0 < got["noise_ms"] < 0.5 and got["noise_share"] == pytest.approx(got["noise_ms"] / 12)


@pytest.mark.parametrize("seed", range(20))
def test_accumulation_share_is_never_negative(seed):
    """Under load (spikes of several x on either side, as a shared 2-core box gives) the share is
    a non-negative number or None with a verdict, never a negative figure like the -149 % the
    sequential measurement printed."""
    gen = torch.Generator().manual_seed(seed)
    noise = lambda n: (torch.rand(n, generator=gen) * 4).tolist()
    spikes = lambda xs: [x * (1 + 5 * (i % 3 == 0)) for i, x in enumerate(xs)]
    ref = spikes([10 + e for e in noise(12)])
    row = [10 + e for e in noise(12)]
    got = bench_train.accumulation_share(row, ref)
    assert got["accum_share"] is None or got["accum_share"] > 0
    if got["accum_share"] is None:
        assert got["accum_verdict"] in ("below noise", "below reference")
    else:
        assert got["accum_ms"] > got["noise_ms"]


def test_accumulation_share_below_noise_within_the_bound():
    ref = [10.0, 11.0, 9.0, 10.5, 9.5, 10.0]
    row = [10.2, 11.1, 9.1, 10.6, 9.4, 10.3]  # 0.1 ms apart, spread of 1 ms
    got = bench_train.accumulation_share(row, ref)
    assert got["accum_verdict"] == "below noise" and got["accum_share"] is None
    assert abs(got["accum_ms"]) <= got["noise_ms"]
    assert bench_train._share_cell({**got}) == "below noise"


def test_accumulation_share_faster_than_the_reference():
    """Fused weight gradients can make a row's micro-batch cheaper than the plain backward: no
    negative share, the verdict says so."""
    ref = [12.0, 12.1, 11.9, 12.0]
    row = [10.0, 10.1, 9.9, 10.0]
    got = bench_train.accumulation_share(row, ref)
    assert got["accum_verdict"] == "below reference" and got["accum_share"] is None
    assert bench_train._share_cell(got) == "< reference"


def test_accumulation_share_needs_two_samples():
    got = bench_train.accumulation_share([12.0], [10.0])
    assert got["noise_ms"] == float("inf") and got["accum_verdict"] == "below noise"


def test_median_se():
    assert bench_train.median_se([1.0]) == float("inf")
    assert bench_train.median_se([3.0] * 9) == 0.0
    xs = [float(i) for i in range(1, 10)]  # IQR 4
    assert bench_train.median_se(xs) == pytest.approx(1.2533 * 4 / 1.349 / 3)


def test_rows_and_reference_are_interleaved(monkeypatch):
    """Each repetition runs one window of the reference and of every row, starting one later."""
    order = []
    monkeypatch.setattr(bench_train.Entry, "run_window",
                        lambda self, window, device, keep: order.append((self.row, keep)))
    base = bench_train.make_model("gpt2", 1, 16, 2, 32, 8)
    data = [torch.randint(32, (4, 8)) for _ in range(3)]
    ref, entries = bench_train.time_interleaved(["native_bf16", "accumkernels"], base, data, 4,
                                                1, torch.device("cpu"))
    assert [r for r, _ in order] == [None, "native_bf16", "accumkernels",
                                     "native_bf16", "accumkernels", None,
                                     "accumkernels", None, "native_bf16"]
    assert [k for _, k in order] == [False] * 3 + [True] * 6
    assert ref.row is None and [e.row for e in entries] == ["native_bf16", "accumkernels"]
