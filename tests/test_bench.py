"""The benchmark layer: its pure helpers, its correctness check, and a --quick CLI run."""

from __future__ import annotations

import datetime
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accumkernels import bench
from accumkernels.bench import cli

REPO_ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
ODD_SHAPES = ((0,), (1,), (3,), (4097,), (65538,), (33, 7))


def test_gpt2_124m_shapes():
    shapes = dict(bench.gpt2_124m_shapes())
    assert len(shapes) == 148  # names are unique
    # wte + wpe + 12 x (12 E^2 + 13 E) + ln_f, E = 768: 38,597,376 + 786,432 + 85,054,464 + 1,536
    assert sum(math.prod(s) for s in shapes.values()) == 124_439_808
    assert shapes["wte.weight"] == (50257, 768)
    assert shapes["wpe.weight"] == (1024, 768)
    assert shapes["h.0.attn.c_attn.weight"] == (768, 2304)
    assert shapes["h.11.mlp.c_proj.weight"] == (3072, 768)
    assert shapes["ln_f.bias"] == (768,)


@pytest.mark.parametrize("n_layer,n_embd", [(1, 8), (3, 16)])
def test_gpt2_shapes_follow_config(n_layer, n_embd):
    shapes = bench.gpt2_shapes(vocab_size=100, n_embd=n_embd, n_positions=32, n_layer=n_layer)
    e = n_embd
    assert len(shapes) == 2 + 12 * n_layer + 2
    assert sum(math.prod(s) for _, s in shapes) == (
        100 * e + 32 * e + n_layer * (12 * e * e + 13 * e) + 2 * e)


def test_make_workload():
    full = bench.make_workload("gpt2", 1 << 20)
    assert (full.label, len(full.shapes), full.numel) == ("gpt2-124m", 148, 124_439_808)
    tiny = bench.make_workload("gpt2", 1 << 20, quick=True)
    assert len(tiny.shapes) == 148 and tiny.numel < 1_000_000
    flat = bench.make_workload("flat", 256 << 20)
    assert (flat.label, flat.shapes, flat.numel) == ("flat-256M", ((256 << 20,),), 256 << 20)
    with pytest.raises(ValueError, match="unknown workload"):
        bench.make_workload("llama", 1)


@pytest.mark.parametrize("dtype,overwrite,expected", [
    (torch.bfloat16, False, 10), (torch.float16, False, 10), (torch.float32, False, 12),
    (torch.bfloat16, True, 6), (torch.float16, True, 6), (torch.float32, True, 8),
])
def test_bytes_per_element(dtype, overwrite, expected):
    assert bench.bytes_per_element(dtype, overwrite) == expected


def test_parse_and_format_count():
    assert bench.parse_count("256M") == 268_435_456
    assert bench.parse_count("16m") == 16 << 20
    assert bench.parse_count("4K") == 4096
    assert bench.parse_count("65539") == 65539
    with pytest.raises(ValueError):
        bench.parse_count("1.5M")
    assert bench.format_count(256 << 20) == "256M"
    assert bench.format_count(1 << 30) == "1G"
    assert bench.format_count(65539) == "65539"


def test_quantiles():
    assert bench.quantiles([5.0, 1.0, 3.0, 2.0, 4.0]) == pytest.approx([3.0, 1.8, 4.2])
    assert bench.quantiles([7.0]) == [7.0, 7.0, 7.0]


def test_select_providers():
    names = ["loop_literal", "loop_add", "foreach", "accumkernels:cpu", "accumkernels:torch"]
    assert bench.select_providers(names, []) == names
    assert bench.select_providers(names, ["accumkernels"]) == names[3:]
    assert bench.select_providers(names, ["loop_*", "accumkernels:cpu"]) == names[:2] + names[3:4]
    assert bench.select_providers(names, ["accumkernels:cuda"]) == []


def test_num_buffer_sets():
    assert bench.num_buffer_sets(1, CPU) == 16
    assert bench.num_buffer_sets(1, CPU, max_sets=2) == 2
    assert bench.num_buffer_sets(1 << 30, CPU) == 2


def test_providers_skip_triton_on_cpu():
    names = list(bench.make_providers(CPU))
    assert names[:3] == ["loop_literal", "loop_add", "foreach"]
    assert "accumkernels:triton" not in names
    assert all(n.startswith("accumkernels:") for n in names[3:])


@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_provider_passes_check(dtype, overwrite):
    dst = bench.random_tensors(ODD_SHAPES, torch.float32, CPU)
    src = bench.random_tensors(ODD_SHAPES, bench.DTYPES[dtype], CPU)
    idx = bench.sample_indices(ODD_SHAPES, CPU)
    for name, fn in bench.make_providers(CPU, overwrite=overwrite).items():
        ok, rel = bench.check_provider(fn, dst, src, idx, bench.SCALE, overwrite)
        assert ok, f"{name}: max rel err {rel}"
        assert rel <= bench.REL_TOL


def _wrong_scale(dst, src):
    bench.loop_add(dst, src, 2 * bench.SCALE)


def _skips_last_tensor(dst, src):
    bench.loop_add(dst[:-1], src[:-1], bench.SCALE)


def _leaves_one_element(dst, src):  # an interior element never written (still poisoned)
    bench.loop_add(dst, src, bench.SCALE, overwrite=True)
    dst[4].view(-1)[1000] = float("nan")  # caught by the sample or the NaN scan


def _reads_dst(dst, src):  # accumulates where it should overwrite
    bench.loop_add(dst, src, bench.SCALE, overwrite=False)


@pytest.mark.parametrize("fn,overwrite", [
    (_wrong_scale, False), (_skips_last_tensor, False), (_leaves_one_element, True),
    (_reads_dst, True),
])
def test_check_catches_wrong_results(fn, overwrite):
    dst = bench.random_tensors(ODD_SHAPES, torch.float32, CPU)
    src = bench.random_tensors(ODD_SHAPES, torch.bfloat16, CPU)
    ok, _ = bench.check_provider(fn, dst, src, bench.sample_indices(ODD_SHAPES, CPU),
                                 bench.SCALE, overwrite)
    assert not ok


def test_slugify_and_out_path():
    assert cli.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert cli.slugify("Intel(R) Xeon(R) CPU @ 2.20GHz") == "intel-xeon-cpu-2-20ghz"
    assert cli.device_slug(CPU).startswith("cpu-")
    path = cli.default_out_path("cpu-x", datetime.date(2026, 1, 2), overwrite=True, quick=True)
    assert path.name == "cpu-x-2026-01-02-overwrite-quick.json"
    assert path.parent.parts[-2:] == ("benchmarks", "results")


def test_json_safe():
    assert cli._json_safe({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"}) == {
        "a": [1.0, None], "b": None, "c": "x"}


METADATA = ("schema_version", "date", "argv", "device", "device_name", "device_slug", "gpu_name",
            "cpu_name", "torch", "triton", "cuda", "python", "git_commit", "git_dirty",
            "available_backends", "config", "providers", "copy", "rows")


def _check_rows(record: dict, workloads, dtypes, providers) -> None:
    got = [(r["workload"], r["dtype"], r["provider"]) for r in record["rows"]]
    assert sorted(got) == sorted((w, d, p) for w in workloads for d in dtypes for p in providers)
    for r in record["rows"]:
        if r["provider"] == "foreach" and r["status"] == "unsupported":
            continue  # torch may refuse mixed dtypes: recorded, not converted
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["frac_copy"] > 0
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        bpe = bench.bytes_per_element(bench.DTYPES[r["dtype"]], r["overwrite"])
        assert r["bytes"] == bpe * r["numel"]


def test_cli_quick(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-m", "accumkernels.bench", "--quick", "--device", "cpu", "--out",
         str(out)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert set(METADATA) <= set(record)
    assert record["device"] == "cpu" and record["gpu_name"] is None
    assert record["torch"] == torch.__version__
    assert record["copy"]["gbps"] > 0
    providers = list(bench.make_providers(CPU))
    assert list(record["providers"]) == providers
    _check_rows(record, ["gpt2", "flat"], ["bf16", "fp32"], providers)
    literal = [r for r in record["rows"] if r["provider"] == "loop_literal"]
    assert all(r["speedup_vs_loop_literal"] == pytest.approx(1.0) for r in literal)
    assert "vs literal" in proc.stdout
    assert all(p in proc.stdout for p in providers)
    assert "[1/" in proc.stderr  # progress goes to stderr


def test_cli_overwrite_fp16_filtered(tmp_path, capsys):
    out = tmp_path / "y.json"
    argv = ["--quick", "--device", "cpu", "--overwrite", "--workloads", "flat", "--dtypes",
            "fp16", "--providers", "loop_add,accumkernels", "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["argv"] == argv and record["config"]["overwrite"] is True
    providers = ["loop_add"] + [p for p in bench.make_providers(CPU) if p.startswith("accum")]
    _check_rows(record, ["flat"], ["fp16"], providers)
    assert "overwrite" in capsys.readouterr().out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--dtypes", "int8", "--device", "cpu"])
    assert "unknown dtype" in capsys.readouterr().err
    assert cli.main(["--quick", "--device", "cpu", "--providers", "nothing"]) == 2
