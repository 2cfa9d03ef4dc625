"""The suite files (one tagged row per run), the summary that ends ``make bench``, the CPU peak
memory of a fresh process, and the wrapper table (no timing assertions)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import bench_wrapper  # noqa: E402
from benchmarks.accumbench import peakmem, results, suites, summary  # noqa: E402

RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"


def _record(commit="a" * 40, date="2026-01-02T03:04:05+00:00", slug="cpu-x"):
    return {"benchmark": "step", "date": date, "rows": [],
            "environment": {"device_slug": slug, "device_name": "X", "git_commit": commit,
                            "git_dirty": False, "torch": "2.13.0"}}


def test_tagged_rows_append_and_read_back(tmp_path):
    path = tmp_path / "step.jsonl"
    results.append_row(path, results.tagged_row("step", _record(), "loaded box"))
    results.append_row(path, results.tagged_row("step", _record("b" * 40, slug="cpu-y")))
    results.append_row(path, results.tagged_row("step", _record("c" * 40), source="imported"))
    rows = results.load_rows(path)
    assert len(path.read_text().splitlines()) == 3  # one line per row
    assert rows[0]["tags"] == {"device": "cpu-x", "device_name": "X", "commit": "a" * 40,
                               "dirty": False, "torch": "2.13.0",
                               "date": "2026-01-02T03:04:05+00:00", "note": "loaded box",
                               "source": "measured"}
    assert rows[0]["record"] == _record() and rows[0]["suite"] == "step"
    assert results.latest(rows)["tags"]["commit"] == "c" * 40
    assert results.latest(rows, "cpu-y")["tags"]["commit"] == "b" * 40
    assert results.latest(rows, "cpu-x", measured_only=True)["tags"]["commit"] == "a" * 40
    assert results.latest(rows, "cpu-z") is None
    assert results.load_rows(tmp_path / "absent.jsonl") == []


def test_where_a_run_goes(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCUMBENCH_RESULTS_DIR", str(tmp_path))
    p = argparse.ArgumentParser()
    results.add_arguments(p, "step")
    p.add_argument("--quick", action="store_true")
    target = results.results_target
    assert target("step", p.parse_args([])) == tmp_path / "step.jsonl"
    assert target("step", p.parse_args(["--quick"])) is None  # a smoke test is not a result
    assert target("step", p.parse_args(["--quick", "--results", "r.jsonl"])) == Path("r.jsonl")
    assert target("step", p.parse_args(["--no-results"])) is None
    args = p.parse_args(["--note", "n"])
    args.out = tmp_path / "o.json"
    assert results.save("step", _record(), args) == tmp_path / "step.jsonl"
    assert json.loads(args.out.read_text()) == _record()
    (row,) = results.load_rows(tmp_path / "step.jsonl")
    assert row["tags"]["note"] == "n"
    with pytest.raises(ValueError, match="unknown suite"):
        results.suite_path("nope")


def test_import_keeps_the_records_date_and_commit(tmp_path):
    rec = tmp_path / "old-step-v3.json"
    rec.write_text(json.dumps(_record("d" * 40, "2025-11-27T12:00:00+00:00")))
    out = tmp_path / "step.jsonl"
    assert results.main(["import", "step", str(rec), "--note", "quiet box", "--results",
                         str(out)]) == 0
    (row,) = results.load_rows(out)
    assert row["tags"]["commit"] == "d" * 40 and row["tags"]["date"].startswith("2025-11-27")
    assert row["tags"]["source"] == "imported from old-step-v3.json"
    assert row["tags"]["note"] == "quiet box"


def test_committed_results_are_suite_files_of_tagged_rows():
    """benchmarks/results/ holds the suite files, the plot drawn from kernels.jsonl and the
    README: no dated one-run files."""
    names = sorted(p.name for p in RESULTS_DIR.iterdir())
    suite_files = [n for n in names if n.endswith(".jsonl")]
    assert set(names) - set(suite_files) <= {"README.md", "kernels.png"}
    assert {f"{s}.jsonl" for s in ("kernels", "step", "host", "train", "wrapper")} <= set(
        suite_files)
    for name in suite_files:
        rows = results.load_rows(RESULTS_DIR / name)
        assert rows, name
        for row in rows:
            assert row["suite"] == name[:-len(".jsonl")]
            assert set(results.TAG_KEYS) <= set(row["tags"]), name
            assert row["tags"]["date"] and row["tags"]["torch"], name


# --- the summary ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_suites(tmp_path_factory):
    """Every suite of make bench in a tiny configuration, each appending to its suite file in
    one folder; then the summary of that folder."""
    folder = tmp_path_factory.mktemp("suites")
    runs = {
        "kernels": ["--quick", "--device", "cpu", "--threads", "1", "--workloads", "gpt2,small",
                    "--dtypes", "bf16,fp32", "--providers", "loop_add,foreach,accumkernels:cpu",
                    "--no-overhead", "--no-plot"],
        "step": ["step", "--quick", "--device", "cpu", "--reps", "1", "--warmup", "0",
                 "--variants", "sum", "--no-tally"],
        "host": ["host", "--quick", "--device", "cpu", "--model", "probe", "--reps", "1",
                 "--warmup", "0"],
        "train": ["train", "--quick", "--device", "cpu", "--steps", "1", "--warmup", "0",
                  "--rows", "native_bf16,main_grad_fp32,accumkernels"],
        "wrapper": ["wrapper", "--quick", "--device", "cpu"],
    }
    printed = {}
    for suite, argv in runs.items():
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = suites.main([*argv, "--note", "tiny", "--results", str(folder / f"{suite}.jsonl")])
        assert rc == 0, (suite, buf.getvalue()[-2000:])
        printed[suite] = buf.getvalue()
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert suites.main(["summary", "--device", "cpu", "--results-dir", str(folder)]) == 0
    return folder, printed, buf.getvalue()


SUMMARY_LINES = {
    "kernels": ("kernels: on the gpt2-tiny list (148 tensors) accumkernels:cpu runs",
                "the best naive loop", "the same-run limit with bf16 gradients"),
    "kernels-others": ("kernels, the other lists (bf16", "small-1000x65"),
    "step": ("step: the wrapper's step is", "its floor for a bf16 model", "for an fp32 one"),
    "host": ("host (probe, 148 tiny tensors", "backward", "native"),
    "memory-train": ("memory (train, gpt2", "the wrapper peaks at", "B/param",
                     "native bf16 accumulation at"),
    "precision": ("precision: the accumulated gradients against the float64 sum",
                  "native bf16"),
    "share": ("accumulation's share of a micro-batch (train): the wrapper",),
    "memory-wrapper": ("memory (wrapper table", "B/param at peak over native bf16"),
}


def test_summary_prints_each_of_its_lines(tiny_suites):
    _, printed, text = tiny_suites
    lines = text.splitlines()
    assert lines[0].startswith("summary (") and "commit" in lines[0] and "tiny" in lines[0]
    for key, parts in SUMMARY_LINES.items():
        hits = [ln for ln in lines if ln.strip().startswith(parts[0])]
        assert len(hits) == 1, (key, text)
        assert all(p in hits[0] for p in parts), (key, hits[0])
    # each suite ends its own output with its own lines of the summary
    assert SUMMARY_LINES["kernels"][0] in printed["kernels"]
    assert SUMMARY_LINES["step"][0] in printed["step"]
    assert SUMMARY_LINES["precision"][0] in printed["train"]
    assert SUMMARY_LINES["memory-wrapper"][0] in printed["wrapper"]


def test_every_suite_file_got_one_tagged_row(tiny_suites):
    folder, _, _ = tiny_suites
    for suite in ("kernels", "step", "host", "train", "wrapper"):
        (row,) = results.load_rows(folder / f"{suite}.jsonl")
        tags = row["tags"]
        assert row["suite"] == suite and tags["note"] == "tiny" and tags["source"] == "measured"
        assert tags["torch"] == torch.__version__ and tags["device"].startswith("cpu-")
        assert tags["date"] and "commit" in tags and "dirty" in tags
        env = row["record"].get("environment") or row["record"]
        assert tags["commit"] == env["git_commit"]


def test_summary_says_what_is_missing(tmp_path):
    record = json.loads(json.dumps(_record()))
    text = summary.format_summary({}, {}, {})
    assert text == "summary: no results"
    rows = [{"row": "wrapper_bf16_sum", "kind": "wrapper", "status": "ok", "ratio_vs_floor": 1.1},
            {"row": "wrapper_fp32_sum", "kind": "wrapper", "status": "ok", "ratio_vs_floor": 1.2}]
    record.update(rows=rows, config={"workload": "w", "reps": 3, "clock": "wall"})
    text = summary.format_summary({"step": record}, missing={"kernels": "no row for cpu-x"})
    assert "kernels: no row for cpu-x" in text
    assert "1.10x its floor for a bf16 model and 1.20x for an fp32 one" in text
    assert suites.main(["summary", "--device", "cpu", "--results-dir", str(tmp_path)]) == 1


# --- peak memory on the CPU -------------------------------------------------------------------

_TRANSIENT = """
import torch
from benchmarks.accumbench import peakmem
m = peakmem.mark()
t = torch.ones(25_000_000)  # 100 MB, written
del t
grew, method = peakmem.growth(m)
print(grew, "fresh process" in method)
"""


def test_peak_rss_growth_sees_a_transient_tensor():
    """Measured as the tables measure it: in a fresh process with the child's malloc settings
    (a long-lived test process may serve the tensor from memory it freed earlier)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _TRANSIENT], capture_output=True, text=True,
                          timeout=300, check=False, cwd=REPO_ROOT,
                          env=os.environ | peakmem.CHILD_ENV | {"PYTHONPATH": str(REPO_ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    grew, fresh = done.stdout.split()[-2:]
    assert int(grew) >= 90e6 and fresh == "True"


def test_wrapper_table_has_a_peak_column(tmp_path, capsys):
    out, suite_file = tmp_path / "w.json", tmp_path / "wrapper.jsonl"
    assert bench_wrapper.main(["--quick", "--device", "cpu", "--out", str(out), "--results",
                               str(suite_file)]) == 0
    record = json.loads(out.read_text())
    rows = {r["provider"]: r for r in record["rows"]}
    assert list(rows) == list(bench_wrapper.PROVIDERS)
    assert all(r["peak_bytes_above_model"] > 0 for r in rows.values())  # never nan
    assert rows["native_bf16"]["extra_bytes_per_param_vs_native"] == 0
    assert all(len(r["times_ms"]) == record["config"]["windows"] for r in rows.values())
    assert "fresh process" in record["config"]["peak_method"]
    text = capsys.readouterr().out
    assert "nan" not in text and "peak MB" in text
    assert len(results.load_rows(suite_file)) == 1
