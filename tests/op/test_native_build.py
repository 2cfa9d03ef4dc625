"""The native extension builds: the CUDA source compiles with nvcc (no GPU needed), and the built
accumkernels._C module reports what it was built with consistently."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc")


def _native_module():
    """accumkernels._C; skip when it was not built, but fail when a built one cannot load."""
    if importlib.util.find_spec("accumkernels._C") is None:
        pytest.skip("accumkernels._C is not built")
    return importlib.import_module("accumkernels._C")


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA kernels cannot be compiled")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_cuda_source_compiles(tmp_path: Path, arch: str) -> None:
    """csrc/accumulate_cuda.cu compiles with nvcc alone (no Python/libtorch headers)."""
    obj = tmp_path / "accumulate_cuda.o"
    flags = ["-std=c++17", "-O3", "-gencode", f"arch=compute_{arch},code=sm_{arch}", "-c"]
    cmd = [NVCC, *flags, "-I", str(CSRC), str(CSRC / "accumulate_cuda.cu"), "-o", str(obj)]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"nvcc failed ({proc.returncode}):\n{proc.stderr}"
    assert obj.is_file() and obj.stat().st_size > 0


# (source, threads per block, blocks per SM the grid launches: csrc's kBlockThreads/kThreads and
# kBlocksPerSM, which __launch_bounds__ names)
KERNELS = [("accumulate_cuda.cu", "accumulate_kernel.h", "kBlockThreads", "kBlocksPerSM"),
           ("master_step_cuda.cu", "master_step_kernel.h", "kThreads", "kBlocksPerSM")]


def _constant(header: str, name: str) -> int:
    import re

    m = re.search(rf"constexpr int {name} = (\d+);", (CSRC / header).read_text())
    assert m, f"{name} not found in {header}"
    return int(m.group(1))


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA kernels cannot be compiled")
@pytest.mark.parametrize("source,header,threads,blocks", KERNELS,
                         ids=[k[0].split("_cuda")[0] for k in KERNELS])
def test_every_kernel_fits_its_grid_without_spills(tmp_path: Path, source, header, threads,
                                                   blocks) -> None:
    """ptxas -v for sm_90, every instantiation: no spill, no stack frame, and registers x threads
    x blocks per SM within the 64K registers of an SM, so the whole persistent grid is resident
    in one wave (the master step at 4 blocks/SM needed 70-71 registers: 3 resident, a quarter of
    the blocks in a second wave)."""
    import re

    per_block = _constant(header, threads)
    per_sm = _constant(header, blocks)
    assert f"__launch_bounds__({threads}, {blocks})" in (CSRC / source).read_text()
    cmd = [NVCC, "-std=c++17", "-O3", "-gencode", "arch=compute_90,code=sm_90", "-c",
           "-Xptxas", "-v", "-I", str(CSRC), str(CSRC / source), "-o", str(tmp_path / "k.o")]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    regs = [int(r) for r in re.findall(r"Used (\d+) registers", proc.stderr)]
    spills = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                        r"loads", proc.stderr)
    assert regs and len(spills) >= len(regs), proc.stderr[-2000:]
    assert all(s == ("0", "0", "0") for s in spills), spills
    assert max(regs) * per_block * per_sm <= 65536, (max(regs), per_block, per_sm)


def test_build_info_is_consistent() -> None:
    """has_cuda() agrees with build_info(), and the dtype codes are the documented ones."""
    C = _native_module()
    info = C.build_info()
    assert {"cuda", "cuda_archs", "cuda_version", "openmp", "simd"} <= info.keys()
    assert C.has_cuda() is info["cuda"]
    assert (C.DTYPE_FLOAT32, C.DTYPE_BFLOAT16, C.DTYPE_FLOAT16) == (0, 1, 2)
    assert isinstance(info["openmp"], bool) and info["simd"]
    if info["cuda"]:
        assert info["cuda_archs"] and info["cuda_version"]
    else:
        assert not info["cuda_archs"] and info["cuda_version"] is None
        with pytest.raises(RuntimeError, match="built without CUDA"):
            C.accumulate_cuda([], [], [], [], 1.0, 0, False, 0, 0, 0)


def test_argument_guards() -> None:
    """Broken argument lists raise ValueError/TypeError before any memory is touched."""
    C = _native_module()
    C.accumulate_cpu([], [], [], [], 1.0, 0, False, 0, 1)  # empty list: no-op
    with pytest.raises(ValueError, match="same length"):
        C.accumulate_cpu([1], [1, 2], [1], [1], 1.0, 0, False, 0, 1)
    with pytest.raises(ValueError, match="dtype code"):
        C.accumulate_cpu([1], [1], [1], [7], 1.0, 0, False, 0, 1)
    with pytest.raises(ValueError, match="null data pointer"):
        C.accumulate_cpu([0], [8], [4], [0], 1.0, 0, False, 0, 1)
    with pytest.raises(TypeError, match=r"src_ptrs\[0\]"):
        C.accumulate_cpu([1], ["x"], [1], [0], 1.0, 0, False, 0, 1)


def test_tensor_reader_is_on() -> None:
    """On Linux with a current torch, the C++ tensor reader (torch's C shim) passes its self-test:
    otherwise every accumulate_ call would take the slower Python path."""
    _native_module()
    from accumkernels.ops.backends import native

    assert native.READER, native.READER_NOTE


def test_tensor_call_guards() -> None:
    """The tensor-taking entry points refuse malformed arguments before touching memory."""
    C = _native_module()
    import torch

    d, s = [torch.zeros(3)], [torch.ones(3)]
    with pytest.raises(ValueError, match="differ in length"):
        C.accumulate_tensors(d, [], 1.0, None, False, None, 0, 1, 1, 0, -1)
    with pytest.raises(ValueError, match="kernel does not match"):
        C.accumulate_tensors(d, s, 1.0, None, False, None, 0, 2, 1, 0, 0)
    assert C.accumulate_tensors(d, [s[0][:2]], 1.0, None, False, None, 0, 1, 1, 0, -1) == (
        "pair", 0, -1)
    assert C.accumulate_tensors(d, [3.0], 1.0, None, False, None, 0, 1, 1, 0, -1)[0] == "slow"
    assert torch.equal(d[0], torch.zeros(3))
    plan = C.Plan.create(d, None, None, False)
    with pytest.raises(ValueError, match="cover every dst"):
        plan.run(None, s + s, 1.0, None, False, None, 0, 1, 1, 0, -1)
    with pytest.raises(ValueError, match="no keys"):
        plan.run(["k"], s, 1.0, None, False, None, 0, 1, 1, 0, -1)
    assert plan.run(None, s, 1.0, None, False, None, 0, 1, 1, 0, -1) is None
    assert torch.equal(d[0], torch.ones(3))


def _sass(args: list[str]) -> list[dict]:
    """benchmarks/sass_check.py's JSON (skips where it cannot compile here)."""
    import json
    import sys

    root = CSRC.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "sass_check.py"), *args,
                           "--json"], capture_output=True, text=True, cwd=root, timeout=600,
                          check=False)
    if proc.returncode == 3:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH: the CUDA kernels cannot be compiled")
def test_vector_store_switch_compiles_to_what_the_source_says() -> None:
    """ACCUMKERNELS_VEC_STORE=1 (PTX st.global.v4.f32) gives plain 128-bit stores; the default
    (__stwb) gives 128-bit stores too; both keep 16-byte loads and spill nothing."""
    rows = _sass(["--cuda", "--arch", "90"])
    by_store: dict[str, list[dict]] = {}
    for r in rows:
        by_store.setdefault(r["variant"], []).append(r)
    assert set(by_store) == {"store=stwb", "store=ptx"}
    for variant, kernels in by_store.items():
        assert len(kernels) == 12, variant  # 3 parameter tables x add/overwrite x norm_sq or not
        for k in kernels:
            wide = {op: n for op, n in k["ops"].items() if op.startswith("STG.E.128")}
            assert wide, f"{variant}: no 128-bit store in {k['ops']}"
            assert any(op.startswith("LDG.E") and op.endswith(".128") for op in k["ops"])
            assert k["spill_bytes"] == 0 and 0 < k["registers"] <= 64, k
            if variant == "store=ptx":
                assert set(wide) == {"STG.E.128"}, f"ptx store is not plain: {wide}"


def test_cmake_rejects_archs_this_nvcc_cannot_build(tmp_path: Path) -> None:
    """ACCUMKERNELS_CUDA_ARCHS=70 with nvcc 13 (which starts at sm_75) stops at configure with
    a message naming the arch and the ones nvcc supports (not nvcc's own cryptic failure)."""
    cmake = shutil.which("cmake")
    if NVCC is None or cmake is None:
        pytest.skip("needs nvcc and cmake")
    listed = subprocess.run([NVCC, "--list-gpu-arch"], capture_output=True, text=True,
                            check=False).stdout
    if "compute_70" in listed:
        pytest.skip("this nvcc still builds sm_70")
    import sys

    import pybind11

    cmd = [cmake, "-S", str(CSRC.parent), "-B", str(tmp_path), "-DACCUMKERNELS_CUDA=ON",
           "-DACCUMKERNELS_CUDA_ARCHS=70;90", f"-DCMAKE_CUDA_COMPILER={NVCC}",
           f"-DPython_EXECUTABLE={sys.executable}", f"-Dpybind11_DIR={pybind11.get_cmake_dir()}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode != 0
    assert "sm_70 is not supported by" in proc.stderr and "--list-gpu-arch" in proc.stderr


def test_cuda_prepare_answers_without_raising() -> None:
    """The driver/device probe returns '' where the kernels can run, else a reason."""
    C = _native_module()
    import torch

    if not C.has_cuda():
        assert C.cuda_prepare(0) == "accumkernels._C was built without CUDA"
        return
    if torch.cuda.is_available():
        assert C.cuda_prepare(torch.cuda.current_device()) == ""
        assert C.cuda_prepare(torch.cuda.current_device(), False) == ""
        assert "no CUDA device" in C.cuda_prepare(torch.cuda.device_count())
    else:
        assert C.cuda_prepare(0)


def test_unusable_cuda_kernels_fall_back_with_one_warning(monkeypatch) -> None:
    """A driver too old for the extension's static CUDA runtime: `auto` skips the cuda backend
    (one warning per device, however often backends are resolved), an explicit backend='cuda'
    is refused with the reason."""
    _native_module()
    import warnings

    import torch

    from accumkernels.ops import backends
    from accumkernels.ops.backends import native

    if not native._C.has_cuda():
        pytest.skip("built without CUDA")
    why = "the CUDA driver supports CUDA 12.4, older than the CUDA 13.0 runtime"
    calls = []
    monkeypatch.setattr(native._C, "cuda_prepare", lambda i, load: calls.append(i) or why)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(native, "_CUDA_PROBLEMS", {})
    monkeypatch.setattr(backends, "_RESOLVED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    device = torch.device("cuda", 0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert backends.resolve("auto", device) in ("triton", "torch")
        assert "cuda" not in backends.available_backends(device)
        with pytest.raises(ValueError, match="older than the CUDA 13.0 runtime"):
            backends.resolve("cuda", device)
    mine = [w for w in seen if "cannot run on cuda:0" in str(w.message)]
    assert len(mine) == 1 and issubclass(mine[0].category, RuntimeWarning)
    assert calls == [0]
