"""The fused master step's Triton kernel under the interpreter (CPU tensors; tests/conftest.py
sets TRITON_INTERPRET=1 before Triton is imported on CPU-only hosts), against the exact model of
test_master_step_cuda_host.py, bit for bit.

What the interpreter computes exactly: fp32/fp64 +, -, *, div_rn, sqrt_rn (numpy's IEEE ops), tl.fma
(Triton's native fma_fp32/fma_fp64), the int bit tricks of the bf16/fp16 conversions. Its gaps,
which only a GPU closes (tests/op/test_master_step_gpu.py): it cannot call libdevice, so pow is
the kernel's interpreter path (float64 squaring for an integer step, rounded; equal to the
correctly rounded model on these tests' betas and steps): the interpreter tests prove everything
but pow, and test_fp32_pow_is_nvccs_powf proves the compiled pow is nvcc's powf, op for op
(whether nvcc's powf is correctly rounded for a beta and step only a GPU shows); Triton 3.6 and
3.8's interpreter rounds tl.fma twice, so the tests install an exact one there
(``exact_interpreter_fma``); NaN payloads follow numpy, not the
GPU's canonical NaN, so NaNs are compared as "NaN here too". The last test compiles the kernel
ahead of time for sm_90 and reads its PTX: IEEE divisions and square roots, explicit fma, no
approximations, 16-byte accesses.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import HAS_CUDA
from test_master_step_cuda_host import (Guards, fma32, fma64, make_case, options, snapshot,
                                       step_spec)

mst = pytest.importorskip("accumkernels.ops.backends.master_step_triton")
if mst.triton is None:
    pytest.skip("triton is not installed", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
interpreter_only = pytest.mark.skipif(HAS_CUDA,
                                      reason="the interpreter runs only on CPU-only hosts")
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")


def _interpreter_fma_is_exact() -> bool:
    """Triton >= 3.9's interpreter computes tl.fma with one rounding (its native fma_fp32/64);
    3.6 and 3.8 compute numpy's a*b+c, rounded twice."""
    from triton.runtime import interpreter

    return hasattr(getattr(interpreter, "_interpreter", None), "fma_fp32")


@pytest.fixture(autouse=True, scope="module")
def exact_interpreter_fma():
    """Where the interpreter rounds tl.fma twice (Triton 3.6/3.8) these tests give it a correctly
    rounded fma (the model's fma32/fma64), what the compiled kernel's fma.rn.f32/f64 computes
    (the AOT PTX test shows those instructions, every version): the interpreter tests then prove
    the kernel's arithmetic under every Triton, not the interpreter's emulation of fma.
    Before this, 3.6/3.8 failed 14 tests here by 1-5 elements (m and p one ulp off)."""
    if _interpreter_fma_is_exact():
        yield
        return
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        a, b, c = np.broadcast_arrays(x.data, y.data, z.data)
        exact = fma64 if c.dtype == np.float64 else fma32
        return interpreter.TensorHandle(np.asarray(exact(a, b, c), c.dtype).reshape(c.shape),
                                        z.dtype.scalar)

    patch = pytest.MonkeyPatch()
    patch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)
    yield
    patch.undo()


def same(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Elementwise: identical bits, or both NaN for fp32 (the interpreter keeps numpy's NaN
    payloads). Weight bits compare exactly: the kernel writes 0x7fff for NaN itself."""
    if got.dtype == np.uint16:
        return got == want
    g32, w32 = got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32)
    return (g32 == w32) | (np.isnan(got) & np.isnan(np.asarray(want, np.float32)))


def run_triton(algo: str, case: dict, o: dict) -> None:
    L = case["lists"]
    common = dict(grad_scale=None if o["grad_scale"] is None else torch.tensor([o["grad_scale"]]),
                  found_inf=o.get("found_inf_tensor"), write_grad=o["write_grad"])
    lr = torch.tensor(o["lr"]) if o.get("tensor_lr") else o["lr"]
    if algo == "sgd":
        mst.sgd(L["p"], L["w"], L["g"], L["s0"] or None, lr=lr, momentum=o["momentum"],
                dampening=o["dampening"], weight_decay=o["weight_decay"], nesterov=o["nesterov"],
                maximize=o["maximize"], is_first_step=o["is_first_step"], **common)
    else:
        mst.adam(L["p"], L["w"], L["g"], L["s0"], L["s1"], L["s2"] if o["amsgrad"] else None,
                 L["step"], lr=lr, beta1=o["beta1"], beta2=o["beta2"],
                 weight_decay=o["weight_decay"], eps=o["eps"], amsgrad=o["amsgrad"],
                 maximize=o["maximize"], adamw=o["adamw"],
                 arithmetic="fp32" if algo == "adam_f32" else "fp64", **common)


def check(algo: str, case: dict, o: dict) -> None:
    before = snapshot(case)
    run_triton(algo, case, o)
    after = snapshot(case)
    case["guards"].check()
    for i, (t0, t1) in enumerate(zip(before, after)):
        want = step_spec(algo, t0, o)
        for k in ("p", "w", "g", "s0", "s1", "s2"):
            if t0[k] is None or want[k] is None:
                continue
            ok = same(t1[k], want[k])
            bad = np.flatnonzero(~ok)
            assert bad.size == 0, f"tensor {i} {k}: {bad.size} elements differ, first {bad[0]}"


# sizes: a full aligned block (1024), blocks and a tail, short tensors; odd-indexed tensors are
# one element off alignment (the masked path throughout)
SIZES = [1, 3, 1024, 2048 + 5, 6, 1031]
CASES = [  # (algo, adamw, amsgrad, maximize, weight_decay, eps)
    ("adam_f32", True, False, False, 0.01, 1e-8), ("adam_f32", False, True, True, 0.1, 1e-3),
    ("adam_f64", True, True, False, 0.0, 1e-8), ("adam_f64", False, False, True, 0.01, 3e-4),
]


@interpreter_only
@pytest.mark.parametrize("algo,adamw,amsgrad,maximize,wd,eps", CASES,
                         ids=[f"{c[0]}-{'adamw' if c[1] else 'adam'}{'-ams' if c[2] else ''}"
                              f"{'-max' if c[3] else ''}-wd{c[4]}" for c in CASES])
def test_adam_matches_model(algo, adamw, amsgrad, maximize, wd, eps):
    """Adam/AdamW in both of torch's forms, bf16 and fp16 weights (a launch each), written
    weights at every vector position and in tails, aligned and misaligned tensors."""
    case = make_case(SIZES, [torch.bfloat16, torch.float16], algo, amsgrad=amsgrad, misalign=1)
    check(algo, case, options(adamw=adamw, amsgrad=amsgrad, maximize=maximize, weight_decay=wd,
                              eps=eps, lr=3e-3, beta1=0.85, beta2=0.995))


SGD_CASES = [(0.0, 0.0, False, False, True, 0.01), (0.9, 0.1, False, False, False, 0.01),
             (0.9, 0.0, True, True, True, 0.0)]


@interpreter_only
@pytest.mark.parametrize("mom,damp,nesterov,first,maximize,wd", SGD_CASES)
def test_sgd_matches_model(mom, damp, nesterov, first, maximize, wd):
    case = make_case(SIZES, [torch.float16, torch.bfloat16], "sgd", momentum=mom != 0,
                     misalign=1)
    check("sgd", case, options(momentum=mom, dampening=damp, nesterov=nesterov,
                               is_first_step=first, maximize=maximize, weight_decay=wd, lr=0.05))


@interpreter_only
@pytest.mark.parametrize("algo", ["adam_f32", "adam_f64", "sgd"])
@pytest.mark.parametrize("write_grad", [True, False], ids=["write_grad", "keep_grad"])
def test_grad_scale_tensor_lr_and_nonfinite(algo, write_grad):
    """grad_scale (stored back only with write_grad), a tensor lr, NaN/inf gradients, a NaN
    weight and a NaN maximum."""
    case = make_case([8, 1024 + 13], [torch.bfloat16, torch.float16], algo, amsgrad=True,
                     nonfinite=True)
    check(algo, case, options(amsgrad=algo != "sgd", grad_scale=512.0, write_grad=write_grad,
                              tensor_lr=True, weight_decay=0.01))


@interpreter_only
def test_many_tensors_one_launch_per_dtype():
    """300 small tensors of both dtypes (the binary search over 150 each) and empty ones."""
    sizes = [random.randint(0, 9) for _ in range(300)]
    case = make_case(sizes, [torch.bfloat16, torch.float16], "adam_f32")
    check("adam_f32", case, options(weight_decay=0.01))


@interpreter_only
@pytest.mark.parametrize("flag", [1.0, 2.0])
@pytest.mark.parametrize("algo", ["adam_f64", "sgd"])
def test_found_inf_writes_nothing(algo, flag):
    """found_inf 1.0 or 2.0 (GradScaler's sum over two devices; torch's fused kernels skip only
    on 1.0): nothing written. 0.0: the step runs."""
    case = make_case([5, 1030], [torch.bfloat16], algo, amsgrad=True)
    before = snapshot(case)
    run_triton(algo, case, options(amsgrad=algo != "sgd", grad_scale=2.0,
                                   found_inf_tensor=torch.tensor([flag])))
    for t0, t1 in zip(before, snapshot(case)):
        for k in ("p", "w", "g", "s0", "s1", "s2"):
            if t0[k] is not None:
                assert t0[k].tobytes() == t1[k].tobytes(), k
    check(algo, case, options(amsgrad=algo != "sgd", grad_scale=2.0,
                              found_inf_tensor=torch.tensor([0.0])))


def test_compile_options_link_a_toolkit_libdevice_or_refuse(monkeypatch, tmp_path):
    """Adam's launches: no reflect-ftz and the toolkit libdevice (ACCUMKERNELS_LIBDEVICE first);
    none found: Triton >= 3.9's own, else the fp32 form is refused (the fp64 form and SGD run)."""
    fake = tmp_path / "libdevice.10.bc"
    fake.write_bytes(b"bc")
    try:
        mst.libdevice_path.cache_clear()
        monkeypatch.setenv("ACCUMKERNELS_LIBDEVICE", str(fake))
        assert mst.compile_options(mst.ADAM_F32) == {
            "enable_fp_fusion": False, "enable_reflect_ftz": False,
            "extern_libs": (("libdevice", str(fake)),)}
        assert mst.compile_options(mst.SGD) == {"enable_fp_fusion": False}
        mst.libdevice_path.cache_clear()
        monkeypatch.setenv("ACCUMKERNELS_LIBDEVICE", str(tmp_path / "missing.bc"))
        with pytest.raises(RuntimeError, match="is not a file"):
            mst.compile_options(mst.ADAM_F32)
        mst.libdevice_path.cache_clear()
        monkeypatch.delenv("ACCUMKERNELS_LIBDEVICE")
        monkeypatch.setattr(mst, "_toolkit_libdevices", lambda: [])
        monkeypatch.setattr(mst, "_own_libdevice_is_nvccs", lambda: False)
        with pytest.raises(RuntimeError, match="powf is not nvcc's"):
            mst.compile_options(mst.ADAM_F32)
        assert mst.compile_options(mst.ADAM_F64) == {"enable_fp_fusion": False,
                                                     "enable_reflect_ftz": False}
        monkeypatch.setattr(mst, "_own_libdevice_is_nvccs", lambda: True)
        assert "extern_libs" not in mst.compile_options(mst.ADAM_F32)
    finally:
        mst.libdevice_path.cache_clear()


def test_launch_option_disables_contraction():
    """The installed Triton has the enable_fp_fusion launch option the backend passes."""
    from triton.backends.nvidia.compiler import CUDAOptions

    assert "enable_fp_fusion" in CUDAOptions.__dataclass_fields__


AOT = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from accumkernels.ops.backends import master_step_triton as mst
from accumkernels.ops.backends.master_step_triton_kernels import master_step_kernel
from accumkernels.ops.backends.master_step_triton_kernels import pow_probe_kernel

def compile(fn, sig, const, algo):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in sig
             if a.endswith(("_base", "_ptr"))}
    sig = {**sig, **dict.fromkeys(const, "constexpr")}
    k = triton.compile(ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": mst.NUM_WARPS, **mst.compile_options(algo)})
    return k.asm["ptx"]

fn, out = master_step_kernel, {"libdevice": mst.libdevice_path()}
for algo in (0, 1, 2):
    sig = {"table_ptr": "*i64", "n_tensors": "i32", "m_base": "*fp32", "w_base": "*i16",
           "g_base": "*fp32", "s0_base": "*fp32", "s1_base": "*fp32", "s2_base": "*fp32",
           "step_base": "*fp32", "lr_ptr": "*fp32", "scale_ptr": "*fp32", "found_inf_ptr": "*fp32"}
    const = dict(ALGO=algo, BF16=True, HAS_SCALE=True, STORE_GRAD=True, LR_FROM_PTR=False,
                 HAS_FOUND_INF=True, MAXIMIZE=True, ADAMW=algo == 2, AMSGRAD=algo != 0,
                 MOMENTUM=algo == 0, FIRST=False, NESTEROV=algo == 0, LIBDEVICE=True,
                 SEARCH_STEPS=8, BLOCK=mst.BLOCK)
    out[algo] = compile(fn, sig, const, algo)
for dt, algo in (("fp32", 2), ("fp64", 1)):
    out["pow_" + dt] = compile(pow_probe_kernel, {"b_ptr": "*" + dt, "s_ptr": "*" + dt,
                                            "o_ptr": "*" + dt}, {}, algo)
print(json.dumps(out))
"""

NVCC_POW = """
extern "C" __global__ void pow32(const float* b, const float* s, float* o) { *o = powf(*b, *s); }
"""
FP_OP = re.compile(r"^\s+((?:add|sub|mul|fma|div|sqrt|rcp|ex2|lg2|cvt)\.[\w.]*f(?:32|64)[\w.]*)"
                   r"\s+[^;]*?((?:, 0[fd][0-9A-F]+)*);", re.M)


def fp_ops(ptx: str) -> Counter:
    """The floating-point operations of a PTX listing with their immediates, ``.rn`` and sub/add
    folded: Triton marks every add/mul ``.rn`` (contraction off), nvcc leaves them plain (ptxas
    may contract those; the SASS check below shows it contracts none in powf); LLVM folds
    ``add(x, neg(y))`` into ``sub``."""
    return Counter((op.replace(".rn.", ".").replace("sub.", "add."), imm)
                   for op, imm in FP_OP.findall(ptx))


def aot_ptx() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", AOT], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


@pytest.mark.slow
def test_ptx_of_an_ahead_of_time_sm90_compile():
    """Compiled for sm_90 without a GPU (Triton's own compiler, interpreter off, the backend's
    compile_options): every fp division and square root is IEEE (div.rn/sqrt.rn), products and
    sums are .rn (never contracted), the FMAs are the explicit ones, the aligned path uses 16-byte
    accesses, and no flush-to-zero or approximate instruction is left but the rcp.approx.ftz
    inside libdevice's pow, which nvcc's own powf/pow contain too (next test)."""
    ptx = aot_ptx()
    for algo in ("0", "1", "2"):
        text = ptx[algo]
        assert not any(op in text for op in ("div.full", "div.approx", "sqrt.approx",
                                             "ex2.approx", "lg2.approx")), algo
        assert set(re.findall(r"\b[\w.]*\.ftz[\w.]*", text)) <= {"rcp.approx.ftz.f32",
                                                                 "rcp.approx.ftz.f64"}, algo
        assert "ld.global.v4.b32" in text and "st.global.v4.b32" in text, algo
        assert "ld.global.v2.b32" in text, algo  # 4 bf16 weights = 8 bytes
    assert "fma.rn.f32" in ptx["2"] and "fma.rn.f64" not in ptx["2"]  # torch >= 2.11 form
    assert "fma.rn.f64" in ptx["1"] and "fma.rn.f32" not in ptx["1"]  # torch <= 2.10 form
    assert "fma.rn.f64" in ptx["0"]  # SGD
    assert "__internal_accurate_pow" in ptx["1"]  # libdevice pow(double, double)
    assert "rcp.approx" not in ptx["0"]  # SGD calls no libdevice function


@pytest.mark.slow
def test_fp32_pow_is_nvccs_powf(tmp_path):
    """The fp32 pow the kernel links is nvcc's powf (torch's fused Adam and the CUDA kernel,
    nvcc -O3 -arch=sm_90, -ftz=false): the same floating-point operations with the same
    constants (Triton's PTX against nvcc's), and ptxas contracts none of nvcc's plain add/mul
    (its SASS has as many FFMA as the PTX has fma.rn). Proves it for the Triton and toolkit
    installed here (Triton 3.6, 3.8, 3.9 and nvcc 13.0 when this was written); Triton 3.6/3.8's
    default (its own libdevice, reflect-ftz on) fails it: ex2.approx.ftz."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed")
    ptx = aot_ptx()
    assert "ex2" not in ptx["pow_fp32"] and ".ftz" not in ptx["pow_fp32"].replace(
        "rcp.approx.ftz.f32", "")
    src = tmp_path / "pow.cu"
    src.write_text(NVCC_POW)
    subprocess.run([nvcc, "-arch=sm_90", "-O3", "-ptx", str(src), "-o", str(tmp_path / "p.ptx")],
                   check=True, timeout=300)
    want = (tmp_path / "p.ptx").read_text()
    assert fp_ops(ptx["pow_fp32"]) == fp_ops(want)
    cuobjdump = Path(mst.triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    if cuobjdump.exists():
        subprocess.run([nvcc, "-arch=sm_90", "-O3", "-cubin", str(src), "-o",
                        str(tmp_path / "p.cubin")], check=True, timeout=300)
        sass = subprocess.run([str(cuobjdump), "-sass", str(tmp_path / "p.cubin")],
                              capture_output=True, text=True, check=True).stdout
        assert len(re.findall(r"\bFFMA\b", sass)) == want.count("fma.rn.f32")
