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

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # the package benchmarks/ sits at the repository root
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import accumbench as bench  # noqa: E402
from benchmarks.accumbench import cli, env, limit, overhead, report, results, suites  # noqa: E402

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
    small = bench.make_workload("small")
    assert (small.label, len(small.shapes), small.numel) == ("small-5000x1K", 5000, 5000 * 1024)
    quick_small = bench.make_workload("small", quick=True)
    assert len(quick_small.shapes) >= 1000  # the design contract: many tensors means >= 1000
    moe = bench.make_workload("moe")
    assert (moe.label, len(moe.shapes)) == ("moe-20000x256+4x4M", 20004)
    assert moe.shapes[:20000] == ((256,),) * 20000 and moe.shapes[-1] == (4096, 1024)
    assert moe.numel == 20000 * 256 + 4 * 4096 * 1024
    assert len(bench.make_workload("moe", quick=True).shapes) >= 1000
    with pytest.raises(ValueError, match="unknown workload"):
        bench.make_workload("bert", 1)


def test_llama7b_shapes():
    shapes = bench.llama7b_shapes()
    named = dict(shapes)
    assert len(shapes) == len(named) == 291
    assert sum(math.prod(s) for _, s in shapes) == bench.LLAMA7B_NUMEL == 6_738_415_616
    assert named["model.embed_tokens.weight"] == named["lm_head.weight"] == (32000, 4096)
    assert named["model.layers.0.self_attn.q_proj.weight"] == (4096, 4096)
    assert named["model.layers.31.mlp.gate_proj.weight"] == (11008, 4096)
    assert named["model.layers.31.mlp.down_proj.weight"] == (4096, 11008)
    assert named["model.layers.7.post_attention_layernorm.weight"] == (4096,)
    assert named["model.norm.weight"] == (4096,)


def test_llama_workload_scaling():
    full = bench.make_workload("llama7b")
    assert (full.label, len(full.shapes), full.numel, full.scale) == (
        "llama7b", 291, bench.LLAMA7B_NUMEL, None)
    eight = bench.llama_workload(layers=8)
    assert eight.label == "llama7b-8of32layers" and len(eight.shapes) == 3 + 9 * 8
    assert eight.scale["layers"] == 8 and eight.scale["dim_divisor"] == 1
    assert eight.describe()["scale"]["fraction_of_full"] == pytest.approx(
        eight.numel / bench.LLAMA7B_NUMEL)
    narrow = bench.make_workload("llama", llama_dim_divisor=16)  # the CPU default
    assert narrow.label == "llama7b-dim1of16" and len(narrow.shapes) == 291
    assert narrow.numel == pytest.approx(bench.LLAMA7B_NUMEL / 256, rel=0.01)
    quick = bench.make_workload("llama7b", quick=True)
    assert len(quick.shapes) == 291 and quick.numel < 1_000_000
    with pytest.raises(ValueError):
        bench.llama_workload(layers=0)


def test_llama_layers_that_fit():
    one, full = bench.llama_workload(1).numel, bench.LLAMA7B_NUMEL
    assert bench.llama_layers_that_fit(16 * full, 16) == 32
    assert bench.llama_layers_that_fit(16 * one, 16) == 1
    assert bench.llama_layers_that_fit(0, 16) == 1  # never fewer than one layer
    eight = bench.llama_workload(8).numel
    assert bench.llama_layers_that_fit(16 * eight, 16) == 8
    assert bench.llama_layers_that_fit(16 * eight - 1, 16) == 7


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


def test_add_speedups():
    def row(provider, ms, status="ok"):
        return {"workload": "w", "label": "w", "dtype": "bf16", "provider": provider,
                "status": status, "median_ms": ms}
    rows = [row("loop_literal", 8.0), row("loop_add", 4.0), row("foreach", None, "unsupported"),
            row("native_grad_dtype", 6.0), row("accumkernels:cpu", 1.0)]
    cli.add_speedups(rows)
    ours = rows[-1]
    assert ours["speedup_vs_loop_literal"] == 8.0 and ours["speedup_vs_loop_add"] == 4.0
    assert ours["speedup_vs_native_grad_dtype"] == 6.0 and ours["speedup_vs_foreach"] is None
    assert (ours["best_baseline"], ours["speedup_vs_best_baseline"]) == ("loop_add", 4.0)
    assert rows[0]["speedup_vs_loop_literal"] == 1.0


def test_num_buffer_sets():
    assert bench.num_buffer_sets(1, CPU) == 16
    assert bench.num_buffer_sets(1, CPU, max_sets=2) == 2
    assert bench.num_buffer_sets(1 << 30, CPU) == 2


def test_providers_skip_triton_on_cpu():
    names = list(bench.make_providers(CPU))
    assert names[:4] == ["loop_literal", "loop_add", "foreach", "native_grad_dtype"]
    assert "accumkernels:triton" not in names
    assert all(n.startswith("accumkernels:") for n in names[4:])
    assert set(bench.BASELINES) == set(names[:4]) == set(bench.BASELINE_CODE)


needs_grad_dtype = pytest.mark.skipif(not bench.NativeGradDtype.supported(),
                                      reason="this torch has no Tensor.grad_dtype")


@needs_grad_dtype
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_native_grad_dtype_accumulates_in_place(dtype):
    """AccumulateGrad adds the upcast gradient into the fp32 .grad we bound: dst, in place."""
    dst = bench.random_tensors(ODD_SHAPES, torch.float32, CPU)
    src = bench.random_tensors(ODD_SHAPES, bench.DTYPES[dtype], CPU)
    before = [d.clone() for d in dst]
    ptrs = [d.data_ptr() for d in dst]
    native = bench.NativeGradDtype()
    assert bench.provider_scale(native) == 1.0 and "scale 1" in native.note
    native(dst, src)
    native(dst, src)  # bound params are reused: still the same dst
    assert [d.data_ptr() for d in dst] == ptrs
    for d, b, g in zip(dst, before, src):  # two fp32 roundings of b + g + g
        b, g = b.double(), g.double()
        assert ((d.double() - (b + 2 * g)).abs() <= 2**-23 * (b.abs() + 2 * g.abs())).all()
    params = native._params(dst, src)
    assert all(p.grad is d and p.dtype == g.dtype for p, d, g in zip(params, dst, src))


@needs_grad_dtype
def test_native_grad_dtype_overwrite_zeroes_first():
    dst = [torch.full((5,), float("nan"))]
    src = [torch.ones(5, dtype=torch.bfloat16)]
    bench.NativeGradDtype(overwrite=True)(dst, src)
    assert torch.equal(dst[0], torch.ones(5))


@pytest.mark.parametrize("overwrite", [False, True], ids=["accumulate", "overwrite"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_every_provider_passes_check(dtype, overwrite):
    dst = bench.random_tensors(ODD_SHAPES, torch.float32, CPU)
    src = bench.random_tensors(ODD_SHAPES, bench.DTYPES[dtype], CPU)
    idx = bench.sample_indices(ODD_SHAPES, CPU)
    for name, fn in bench.make_providers(CPU, overwrite=overwrite).items():
        if name == "native_grad_dtype" and not bench.NativeGradDtype.supported():
            continue
        ok, rel = bench.check_provider(fn, dst, src, idx, bench.provider_scale(fn), overwrite)
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
    assert env.slugify("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert env.slugify("Intel(R) Xeon(R) CPU @ 2.20GHz") == "intel-xeon-cpu-2-20ghz"
    assert env.device_slug(CPU).startswith("cpu-")
    path = env.default_out_path("cpu-x", datetime.date(2026, 1, 2), overwrite=True, quick=True)
    assert path.name == "cpu-x-2026-01-02-overwrite-quick.json"
    assert path.parent.parts[-2:] == ("benchmarks", "results")


def test_dirty_ignores_the_suite_files(tmp_path):
    """A suite file that took a row from the previous suite of make bench leaves the tree clean."""
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "step.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "x")
    root = tmp_path.resolve()
    with (tmp_path / "benchmarks" / "results" / "step.jsonl").open("a") as f:
        f.write("{}\n")
    commit, dirty = env.git_info(root)
    assert len(commit) == 40 and dirty is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert env.git_info(root)[1] is True


def test_json_safe():
    assert report.json_safe({"a": [1.0, float("nan")], "b": float("inf"), "c": "x"}) == {
        "a": [1.0, None], "b": None, "c": "x"}


def test_overhead_breaks_down_the_cpu_call():
    providers = bench.make_providers(CPU)
    row = overhead.measure_overhead("accumkernels:cpu", providers["accumkernels:cpu"], CPU,
                                    n_tensors=300, numel=16)
    assert row["status"] == "ok", row
    assert (row["n_tensors"], row["numel_per_tensor"], row["dtype"]) == (300, 16, "bf16")
    assert row["host_us"] > 0 and row["wall_us"] > 0 and row["device_us"] is None
    assert set(row["stages_us"]) == {"accumulate_", "custom_op", "backend", "binding"}
    for key in ("validation_us", "dispatch_us", "marshal_us", "binding_us", "python_us"):
        assert row[key] is not None
    assert row["python_us"] == pytest.approx(row["stages_us"]["accumulate_"]
                                             - row["stages_us"]["binding"])
    loop = overhead.measure_overhead("loop_add", providers["loop_add"], CPU, n_tensors=300,
                                     numel=16)
    assert loop["status"] == "ok" and loop["stages_us"] is None and loop["host_us"] > 0


def test_overhead_records_errors():
    def broken(dst, src):
        raise RuntimeError("no")
    row = overhead.measure_overhead("x", broken, CPU, n_tensors=3, numel=4)
    assert row["status"] == "error" and "no" in row["error"]


def _plot_record(rows, device="cpu"):
    return {"rows": rows, "copy": {"numel": 1 << 20, "gbps": 20.0}, "device_name": "test",
            "device": device, "torch": torch.__version__, "config": {"overwrite": False}}


def _plot_rows():
    rows = [{"workload": "flat", "label": f"flat-{n}", "numel": n, "gbps": g, "dtype": d,
             "provider": p}
            for n, g in ((1 << 20, 5.0), (16 << 20, 8.0)) for d in ("bf16", "fp32")
            for p in ("loop_add", "accumkernels:cpu", "limit")]
    rows += [{"workload": w, "label": w, "numel": 7, "gbps": g, "dtype": d, "provider": p}
             for w in ("gpt2", "small") for d in ("bf16", "fp32")
             for p, g in (("loop_add", 1.0), ("accumkernels:cpu", 3.0), ("limit", 4.0))]
    return rows


def test_write_plot(tmp_path):
    pytest.importorskip("matplotlib")
    path, msg = report.write_plot(_plot_record(_plot_rows()), tmp_path / "p.png")
    assert path == tmp_path / "p.png" and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in msg
    limits = report._limits(_plot_record(_plot_rows()))  # the limit rows of the same run
    assert limits[("gpt2", "bf16")] == 4.0 and limits[(f"flat-{1 << 20}", "fp32")] == 5.0
    gpu = report._limits(_plot_record([r for r in _plot_rows() if r["provider"] != "limit"],
                                      device="cuda:0"))
    assert set(gpu.values()) == {20.0}  # on a GPU: the copy_ of the run
    assert report._limits(_plot_record([r for r in _plot_rows() if r["provider"] != "limit"])
                          ) == {}  # a CPU record without limit rows: no line


def test_plot_is_drawn_from_the_suite_file(tmp_path):
    """The plot of a run is the latest row of the kernels suite file (of the device asked)."""
    pytest.importorskip("matplotlib")
    suite_file = tmp_path / "kernels.jsonl"
    for device, gbps in (("cpu-a", 1.0), ("cpu-b", 2.0)):
        record = {**_plot_record(_plot_rows()), "device_slug": device, "date": "2026-01-02",
                  "git_commit": "c" * 40}
        results.append_row(suite_file, results.tagged_row("kernels", record, "note"))
    assert len(results.load_rows(suite_file)) == 2
    path, msg = report.plot_from_suite(suite_file, tmp_path / "k.png", device="cpu-a")
    assert path == tmp_path / "k.png" and path.stat().st_size > 0, msg
    path, msg = report.plot_from_suite(suite_file, tmp_path / "none.png", device="cpu-z")
    assert path is None and "no row" in msg and not (tmp_path / "none.png").exists()
    assert suites.main(["plot", "--results", str(suite_file), "--out",
                        str(tmp_path / "again.png")]) == 0
    assert (tmp_path / "again.png").stat().st_size > 0


def test_write_plot_skips_cleanly(tmp_path, monkeypatch):
    path, msg = report.write_plot(_plot_record([]), tmp_path / "p.png")
    assert path is None and "no rows" in msg
    rows = [{"workload": "flat", "label": "flat-1", "numel": 1, "gbps": 1.0, "dtype": "bf16",
             "provider": "x"}]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    path, msg = report.write_plot(_plot_record(rows), tmp_path / "p.png")
    assert path is None and "matplotlib is not installed" in msg
    assert not (tmp_path / "p.png").exists()


# --- the limit row ---------------------------------------------------------------------------

needs_cxx = pytest.mark.skipif(limit.compiler() is None, reason="no C++ compiler")


@needs_cxx
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("s", [bench.SCALE, 0.3])
def test_limit_loop_computes_dst_plus_s_src(dtype, s):
    """The C loop's dst is torch's fp32 ``dst + s * src`` exactly (no FMA: -O3 without -march)."""
    loop = limit.load(threads=2)
    for n in (0, 1, 7, 4099, 1 << 17):
        dst = torch.randn(n)
        src = torch.randn(n).to(bench.DTYPES[dtype])
        expected = dst + s * src.float()
        loop(dst, src, s)
        assert torch.equal(dst, expected), (dtype, n)
        dst.fill_(float("nan"))  # overwrite must not read dst
        loop(dst, src, s, overwrite=True)
        assert torch.equal(dst, s * src.float()), (dtype, n)
    fn = loop.provider(s)
    dst, src = [torch.randn(33)], [torch.randn(33).to(bench.DTYPES[dtype])]
    expected = dst[0] + s * src[0].float()
    fn(dst, src)
    assert torch.equal(dst[0], expected) and fn.scale == s


@needs_cxx
def test_limit_loop_converts_every_kind_of_half():
    bits = [0, 1, 0x3FF, 0x400, 0x3C00, 0x7BFF, 0x7C00, 0xFC00, 0x7E00, 0x8001, 0x83FF, 0xC000]
    src = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.float16)
    dst = torch.zeros(len(bits))
    limit.load()(dst, src, 1.0)
    assert torch.equal(dst.isnan(), src.float().isnan())
    ok = ~dst.isnan()
    assert torch.equal(dst[ok], src.float()[ok])


@needs_cxx
def test_limit_loop_refuses_what_it_cannot_do():
    loop = limit.load()
    with pytest.raises(TypeError):
        loop(torch.zeros(4, dtype=torch.float64), torch.zeros(4), 1.0)
    with pytest.raises(ValueError):
        loop(torch.zeros(4), torch.zeros(5), 1.0)
    with pytest.raises(ValueError):
        loop(torch.zeros(8)[::2], torch.zeros(4), 1.0)


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    with pytest.raises(limit.NoCompiler, match="needs a C\\+\\+ compiler"):
        limit.build(tmp_path / "cache")
    assert cli.main(["--quick", "--device", "cpu", "--workloads", "flat", "--no-overhead",
                     "--no-plot", "--no-results"]) == 2
    assert "needs a C++ compiler" in capsys.readouterr().err
    assert cli.main(["--quick", "--device", "cpu", "--workloads", "flat", "--dtypes", "bf16",
                     "--providers", "loop_add", "--no-limit", "--no-overhead", "--no-plot",
                     "--no-results"]) == 0


def test_add_limits():
    def row(label, dtype, provider, gbps, status="ok"):
        return {"label": label, "dtype": dtype, "provider": provider, "gbps": gbps,
                "status": status}
    rows = [row("gpt2", "bf16", "limit", 10.0), row("gpt2", "bf16", "loop_add", 2.0),
            row("gpt2", "bf16", "accumkernels:cpu", 9.0), row("gpt2", "fp32", "limit", None,
                                                              "error"),
            row("gpt2", "fp32", "loop_add", 3.0)]
    cli.add_limits(rows, copy_gbps=50.0, device=CPU)
    assert [r["x_limit"] for r in rows] == [1.0, 0.2, 0.9, None, None]
    assert rows[1]["limit_gbps"] == 10.0
    cli.add_limits(rows, copy_gbps=50.0, device=torch.device("cuda"))  # GPU: the copy_
    assert rows[2]["x_limit"] == pytest.approx(9.0 / 50.0)


METADATA = ("benchmark", "schema_version", "date", "argv", "device", "device_name", "device_slug",
            "gpu_name", "cpu_name", "torch", "triton", "cuda", "python", "git_commit", "git_dirty",
            "available_backends", "config", "providers", "copy", "rows", "overhead", "plot")
MAY_REFUSE = ("foreach", "native_grad_dtype")  # torch may refuse: recorded, not converted


def _check_rows(record: dict, workloads, dtypes, providers, flat_sizes=1) -> None:
    got = [(r["workload"], r["dtype"], r["provider"]) for r in record["rows"]]
    assert sorted(got) == sorted((w, d, p) for w in workloads for d in dtypes for p in providers
                                 for _ in range(flat_sizes if w == "flat" else 1))
    for r in record["rows"]:
        if r["provider"] in MAY_REFUSE and r["status"] == "unsupported":
            continue
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["frac_copy"] > 0
        assert r["p20_ms"] <= r["median_ms"] <= r["p80_ms"]
        bpe = bench.bytes_per_element(bench.DTYPES[r["dtype"]], r["overwrite"])
        assert r["bytes"] == bpe * r["numel"]
        assert r["scale"] == (1.0 if r["provider"] == "native_grad_dtype" else bench.SCALE)
        for b in bench.BASELINES:
            assert f"speedup_vs_{b}" in r
        assert "x_limit" in r and "limit_gbps" in r


def test_cli_quick(tmp_path):
    out, suite_file = tmp_path / "x.json", tmp_path / "kernels.jsonl"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.accumbench", "--quick", "--device", "cpu", "--threads",
         "1", "--note", "a test", "--out", str(out), "--results", str(suite_file)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr
    record = json.loads(out.read_text())
    assert set(METADATA) <= set(record)
    assert record["torch_threads"] == record["config"]["threads"] == 1
    assert record["schema_version"] == 3 and record["benchmark"] == "kernels"
    assert record["device"] == "cpu" and record["gpu_name"] is None
    assert record["torch"] == torch.__version__
    assert record["copy"]["gbps"] > 0
    providers = list(bench.make_providers(CPU))
    assert list(record["providers"]) == providers
    sizes = record["config"]["flat_sizes"]
    assert len(sizes) >= 2  # a size sweep, even when quick
    _check_rows(record, ["gpt2", "llama7b", "small", "moe", "flat"], ["bf16", "fp16", "fp32"],
                [*providers, "limit"], flat_sizes=len(sizes))
    labels = {w["label"]: w for w in record["config"]["workloads"]}
    assert labels["llama7b-dim1of128"]["n_tensors"] == 291
    assert labels["llama7b-dim1of128"]["scale"]["dim_divisor"] == 128
    literal = [r for r in record["rows"] if r["provider"] == "loop_literal"]
    assert all(r["speedup_vs_loop_literal"] == pytest.approx(1.0) for r in literal)
    # the limit row: one per list and dtype, the list's total size, the same threads
    for r in (r for r in record["rows"] if r["provider"] == "limit"):
        assert r["kind"] == "limit" and r["threads"] == 1 and r["x_limit"] == pytest.approx(1.0)
        same = [x for x in record["rows"] if (x["label"], x["dtype"]) == (r["label"], r["dtype"])]
        assert all(x["numel"] == r["numel"] and x["limit_gbps"] == r["gbps"] for x in same)
        assert r["n_tensors"] == same[-1]["n_tensors"]
    assert all(r["x_limit"] == pytest.approx(r["gbps"] / r["limit_gbps"])
               for r in record["rows"])
    header = next(line for line in proc.stdout.splitlines() if line.startswith("workload"))
    assert header.split()[5:8] == ["GB/s", "x", "limit"]  # "x limit" beside GB/s
    assert "vs literal" in proc.stdout and "vs native" in proc.stdout
    assert all(p in proc.stdout for p in providers)
    assert "[1/" in proc.stderr  # progress goes to stderr
    over = record["overhead"]
    assert over["config"]["n_tensors"] == 300
    assert [r["provider"] for r in over["rows"]] == providers
    assert all(r["host_us"] > 0 for r in over["rows"] if r["status"] == "ok")
    assert "host overhead per call: 300 tensors" in proc.stdout
    assert "summary (" in proc.stdout and "kernels: on the gpt2-tiny list" in proc.stdout
    # one tagged row in the suite file: the record as written to --out
    (row,) = results.load_rows(suite_file)
    assert row["suite"] == "kernels" and row["record"]["rows"] == record["rows"]
    tags = row["tags"]
    assert set(results.TAG_KEYS) <= set(tags)
    assert (tags["device"], tags["torch"], tags["note"], tags["source"]) == (
        record["device_slug"], torch.__version__, "a test", "measured")
    assert tags["commit"] == record["git_commit"] and tags["date"] == record["date"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert record["plot"] is None and "plot skipped" in proc.stderr
    else:  # drawn from the suite file, beside it
        assert record["plot"] == "kernels.png" and (tmp_path / "kernels.png").stat().st_size > 0


def test_cli_overwrite_fp16_filtered(tmp_path, capsys):
    out = tmp_path / "y.json"
    argv = ["--quick", "--device", "cpu", "--overwrite", "--workloads", "flat", "--dtypes",
            "fp16", "--flat-numel", "1K,4097", "--providers", "loop_add,accumkernels",
            "--no-overhead", "--no-plot", "--out", str(out)]
    assert cli.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["argv"] == argv and record["config"]["overwrite"] is True
    assert record["config"]["flat_sizes"] == [1024, 4097]
    assert record["config"]["copy_numel"] == 4097
    assert record["overhead"] is None and record["plot"] is None
    assert not out.with_suffix(".png").exists()
    providers = ["loop_add"] + [p for p in bench.make_providers(CPU) if p.startswith("accum")]
    rows = record["rows"]
    assert sorted({r["label"] for r in rows}) == ["flat-1K", "flat-4097"]
    assert len(rows) == 2 * (len(providers) + 1)  # and the limit row of each size
    assert all(r["status"] == "ok" and r["bytes"] == 6 * r["numel"] for r in rows)
    assert [r["x_limit"] for r in rows if r["provider"] == "limit"] == [1.0, 1.0]
    assert "overwrite" in capsys.readouterr().out


def test_cli_rejects_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--dtypes", "int8", "--device", "cpu"])
    assert "unknown dtype" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--flat-numel", "1.5M", "--device", "cpu"])
    assert "not an element count" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--llama-layers", "33", "--device", "cpu"])
    assert "1..32" in capsys.readouterr().err
    assert cli.main(["--quick", "--device", "cpu", "--providers", "nothing"]) == 2
