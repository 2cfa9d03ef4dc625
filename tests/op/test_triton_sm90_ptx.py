"""The Triton backend's kernels compiled ahead of time for sm_90 (Triton's own compiler, no GPU,
the launch options the backend passes): what the PTX says about memory access width and about
the fused multiply-add the CUDA kernel's fmaf pins down. Skips where this Triton cannot compile
without a GPU."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

tb = pytest.importorskip("accumkernels.ops.backends.triton")
if tb.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]  # the repository

AOT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from accumkernels.ops.backends import triton as tb

def ptx(fn, sig, const):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig
             if a.endswith(("_base", "_ptr"))}
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    kernel = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tb.NUM_WARPS, "enable_fp_fusion": tb.FP_FUSION})
    return kernel.asm["ptx"]

out = {}
for w in ("bf16", "fp16"):
    out["resync_" + w] = ptx(
        tb._resync_kernel, {"table_ptr": "*i64", "n_tensors": "i32", "m_base": "*fp32",
                            "w_base": "*" + w},
        {"SEARCH_STEPS": 8, "BF16": w == "bf16", "BLOCK": 1024})
for mode in ("add", "overwrite"):
    out["accumulate_" + mode] = ptx(
        tb._accumulate_kernel, {"table_ptr": "*i64", "n_tensors": "i32", "dst_base": "*fp32",
                                "src_base": "*bf16", "scale_ptr": "*fp32", "scale": "fp32",
                                "found_inf_ptr": "*fp32"},
        {"SCALE_FROM_PTR": False, "OVERWRITE": mode == "overwrite", "CHECK_FINITE": True,
         "SEARCH_STEPS": 8, "SRC_VEC": tb.HALF_SRC_VEC, "BLOCK": tb.BLOCK, "TAIL": tb.TAIL})
print(json.dumps(out))
"""

OPS = re.compile(r"\b((?:ld|st)\.global\.[\w.]+|fma\.rn\.f32|mul\.rn\.f32|add\.rn\.f32)\b")


@pytest.fixture(scope="module")
def ptx() -> dict[str, Counter]:
    """Each kernel's PTX instruction counts (one compile for the module)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600, check=False)
    if proc.returncode != 0 and "GPUTarget" in proc.stderr and "ImportError" in proc.stderr:
        pytest.skip(f"no ahead-of-time compile here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return {k: Counter(OPS.findall(v)) for k, v in json.loads(proc.stdout).items()}


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["bf16", "fp16"])
def test_resync_full_blocks_use_16_byte_loads(ptx, weights):
    """resync_masters_' aligned full blocks load masters and weights 16 bytes at a time: per
    thread 8 elements (1024 / 128 threads) = two 16-byte master loads and one 16-byte weight load;
    the masked tail path keeps its 4- and 2-byte loads."""
    ops = ptx["resync_" + weights]
    assert ops["ld.global.v4.b32"] >= 3, ops
    assert not any(op.startswith("st.global.v") for op in ops), ops  # stores: only where changed


@pytest.mark.slow
def test_accumulate_fma_is_explicit(ptx):
    """With contraction off (Triton 3.10's default, and what the backend passes), the add path
    still fuses dst + src * scale into one fma.rn.f32, as the CUDA kernel's fmaf; the overwrite
    path multiplies only."""
    add, overwrite = ptx["accumulate_add"], ptx["accumulate_overwrite"]
    assert add["fma.rn.f32"] > 0 and add["mul.rn.f32"] == 0, add
    assert overwrite["fma.rn.f32"] == 0 and overwrite["mul.rn.f32"] > 0, overwrite
    for ops in (add, overwrite):
        assert ops["ld.global.v4.b32"] > 0 and ops["st.global.v4.b32"] > 0, ops
