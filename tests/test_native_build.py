"""The native extension builds: the CUDA source compiles with nvcc (no GPU needed), and the built
accumkernels._C module reports what it was built with consistently."""

from __future__ import annotations

import importlib
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"
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
    from accumkernels.backends import native

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
