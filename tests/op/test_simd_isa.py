"""Every SIMD path of the CPU kernels stays within its instruction set, whatever CPU runs the tests.

A green run on an AVX-512 machine proves nothing about the AVX2 path it never takes: AVX2 code
compiled with AVX-512 allowed runs there and dies with SIGILL on a CPU without it (AMD Zen 2/3,
most Intel desktop parts). So the built module is checked three ways:

- its disassembly, function by function (tests/op/_isa_check.py): the AVX2 and generic paths use
  no instruction or register above their level, and the AVX-512 path exists;
- on an emulated CPU without AVX-512 (`qemu-x86_64 -cpu Haswell`, `make test` installs
  qemu-user): the AVX2 path runs for real and writes the same bits as on this machine;
- here, at every level this CPU supports: the levels agree where the arithmetic is the same.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import _isa_check
import pytest
import torch

import accumkernels
from accumkernels import master_adam_step_, master_sgd_step_
from accumkernels.ops.backends import native
from accumkernels.ops.master_passes import copy_back_, resync_masters_

ROOT = Path(__file__).resolve().parents[2]
X86 = platform.machine() in ("x86_64", "AMD64")

pytestmark = [
    pytest.mark.skipif(native._C is None, reason="accumkernels._C is not built"),
    pytest.mark.skipif(not X86, reason="the SIMD paths are x86-64's"),
]

# The entry points each vector path must have (a path that vanished would pass the rest; the
# 8- and 16-wide loops inside them are inlined).
AVX2_ENTRIES = ("run_avx2<", "resync_avx2<", "copy_back_avx2<")
AVX512_ENTRIES = ("run_avx512<",)


def module_path() -> str:
    return os.environ.get("ACCUMKERNELS_ISA_CHECK_MODULE") or native._C.__file__


def test_no_path_uses_instructions_above_its_level():
    """Disassembled by function: AVX2 functions carry no EVEX encoding, ZMM, XMM/YMM16-31 or
    opmask register; every other function but the AVX-512 ones is baseline x86-64 (no VEX, no
    YMM, nothing above SSE2). ACCUMKERNELS_ISA_CHECK_MODULE checks another build (e.g. an older
    commit's)."""
    report = _isa_check.check(module_path())
    shown = [f"{lv} path {name[:120]}: {text} <- {why}"
             for lv, name, text, why in report.violations[:20]]
    assert not report.violations, \
        f"{len(report.violations)} instructions above their path's level:\n" + "\n".join(shown)
    avx2, avx512 = report.functions_of("avx2"), report.functions_of("avx512")
    for entry in AVX2_ENTRIES:
        assert any(entry in f for f in avx2), f"no AVX2 function {entry}...> in the module"
    for entry in AVX512_ENTRIES:
        assert any(entry in f for f in avx512), f"no AVX-512 function {entry}...> in the module"
    assert any(report.uses[f].get("ymm") for f in avx2), "the AVX2 path uses no YMM register"
    assert any(report.uses[f].get("zmm") for f in avx512), "the AVX-512 path uses no ZMM"


CHECKED_SOURCE = r"""
#include <immintrin.h>
extern "C" __attribute__((target("%(target)s"))) void %(name)s(float* p, unsigned n) {
  for (unsigned i = 0; i < n; ++i) p[i] = (float)(i * 3u) + p[i];
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++ to build the probe")
@pytest.mark.parametrize("name, target, flagged", [
    ("widen_avx2", "avx512f,avx512vl,avx2,fma,f16c", True),   # the 7e1f664 bug
    ("widen_avx2", "avx2,fma,f16c", False),
    ("widen_generic", "avx2", True),
    ("widen_generic", "sse2", False),
    ("widen_avx512", "avx512f,avx512vl", False),
])
def test_the_check_sees_a_path_compiled_above_its_level(tmp_path, name, target, flagged):
    """The check itself can fail: a probe module whose function is compiled for a wider ISA than
    its name says (an unsigned-to-float loop, which AVX-512 turns into vcvtusi2ss) is flagged."""
    src = tmp_path / "probe.cpp"
    src.write_text(CHECKED_SOURCE % {"name": name, "target": target})
    so = tmp_path / "probe.so"
    subprocess.run(["g++", "-O3", "-shared", "-fPIC", str(src), "-o", str(so)], check=True)
    report = _isa_check.check(str(so))
    assert name in report.functions
    assert bool([v for v in report.violations if v[1] == name]) == flagged, report.violations


def _cpuinfo_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo")
    line = next(ln for ln in text.splitlines() if ln.startswith("flags"))
    return set(line.split(":", 1)[1].split())


def test_the_level_is_what_the_cpu_and_the_os_report():
    """CPUID and XGETBV agree with the kernel's view (/proc/cpuinfo lists a feature only when the
    OS enabled its register state); the running level is the detected one unless capped."""
    flags = _cpuinfo_flags()
    want = ("avx512" if {"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"} <= flags
            else "avx2" if {"avx2", "fma", "f16c"} <= flags else "generic")
    info = native._C.cpu_simd()
    assert info["detected"] == want
    assert accumkernels.build_info()["simd_detected"] == want
    before = native._C.set_cpu_simd_cap("avx512")
    try:
        assert native._C.cpu_simd()["level"] == want  # a cap above the CPU runs the CPU's level
        native._C.set_cpu_simd_cap("generic")
        assert native._C.cpu_simd()["level"] == "generic"
        assert accumkernels.build_info()["simd"] == "generic"
    finally:
        native._C.set_cpu_simd_cap(before)
    with pytest.raises(ValueError, match="use generic, avx2 or avx512"):
        native._C.set_cpu_simd_cap("avx3")


def test_an_unknown_level_in_the_environment_is_refused():
    """ACCUMKERNELS_CPU_SIMD=avx3 (a typo) is an error naming the levels (at the import, whose
    probe call is the first kernel call), not a silent run of another path."""
    code = ("import torch, accumkernels\n"
            "accumkernels.accumulate_([torch.zeros(8)], [torch.ones(8)], backend='cpu')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=False, env=os.environ | {"ACCUMKERNELS_CPU_SIMD": "avx3",
                                                         "PYTHONPATH": str(ROOT)})
    assert done.returncode != 0
    assert ("ValueError: ACCUMKERNELS_CPU_SIMD=avx3 is not a SIMD level: use generic, avx2 or "
            "avx512") in done.stderr, done.stderr


# -- the same bits at every level ------------------------------------------------------------------

SIZES = [1, 7, 8, 15, 16, 17, 31, 33, 100, 4097]


def make_inputs(seed: int) -> dict:
    """Fresh random inputs for every kernel: the op (mixed dtypes, a non-finite element), the
    master step (bf16 and fp16 weights, some written by the user), re-sync and copy-back."""
    g = torch.Generator().manual_seed(seed)
    low = (torch.bfloat16, torch.float16)
    srcs = [(torch.randn(n, generator=g) * 3).to((torch.float32, *low)[i % 3])
            for i, n in enumerate(SIZES)]
    srcs[4][3] = float("inf")
    masters = [torch.randn(n, generator=g) for n in SIZES]
    weights = [m.to(low[i % 2]) for i, m in enumerate(masters)]
    # fp16 subnormals, in the vector body and in the scalar tail of every tensor: their
    # conversion is where the 7e1f664 AVX2 path used an AVX-512 instruction (vcvtusi2ss)
    tiny = torch.tensor([3e-6, -6e-8, 1e-5, 2e-7])
    for i, w in enumerate(weights):
        hit = torch.rand(w.numel(), generator=g) < 0.2
        w[hit] = torch.randn(int(hit.sum()), generator=g).to(w.dtype)
        w[-min(4, w.numel()):] = tiny[:min(4, w.numel())].to(w.dtype)
        if w.numel() > 8:
            w[:4] = tiny.to(w.dtype)
            masters[i][:2] = w[:2].float()  # some masters equal to their (subnormal) weight
    for src in srcs:
        if src.dtype == torch.float16:
            src[-min(4, src.numel()):] = tiny[:min(4, src.numel())].to(src.dtype)
    return {"dst": [torch.randn(n, generator=g) for n in SIZES], "src": srcs,
            "masters": masters, "weights": weights,
            "grads": [torch.randn(n, generator=g) * 0.1 for n in SIZES],
            "exp_avgs": [torch.randn(n, generator=g) * 0.1 for n in SIZES],
            "exp_avg_sqs": [torch.rand(n, generator=g) * 0.1 for n in SIZES],
            "bufs": [torch.randn(n, generator=g) for n in SIZES]}


def run_kernels(x: dict) -> dict:
    """Every CPU kernel on copies of `x`, at the level in use; what each wrote."""
    out = {}
    for overwrite, scale in ((False, 0.37), (True, 0.37), (False, 1.0)):
        dst = [t.clone() for t in x["dst"]]
        found, norm = torch.zeros(1), torch.zeros(len(SIZES))
        accumkernels.accumulate_(dst, x["src"], scale, overwrite=overwrite, found_inf=found,
                                 norm_sq=norm, backend="cpu")
        out[f"acc-{overwrite}-{scale}"] = dst + [found, norm]
    m, w = [t.clone() for t in x["masters"]], [t.clone() for t in x["weights"]]
    ea, es = [t.clone() for t in x["exp_avgs"]], [t.clone() for t in x["exp_avg_sqs"]]
    steps = [torch.tensor(3.0) for _ in SIZES]
    master_adam_step_(m, w, [t.clone() for t in x["grads"]], ea, es, None, steps, lr=1e-2,
                      beta1=0.9, beta2=0.999, weight_decay=0.01, eps=1e-8, amsgrad=False,
                      adamw=True, backend="cpu")
    out["adam"] = m + w + ea + es
    m, w = [t.clone() for t in x["masters"]], [t.clone() for t in x["weights"]]
    bufs = [t.clone() for t in x["bufs"]]
    master_sgd_step_(m, w, [t.clone() for t in x["grads"]], bufs, lr=0.1, momentum=0.9,
                     dampening=0.0, nesterov=True, weight_decay=0.01, maximize=False,
                     is_first_step=False, backend="cpu")
    out["sgd"] = m + w + bufs
    m, w = [t.clone() for t in x["masters"]], [t.clone() for t in x["weights"]]
    resync_masters_(m, w)
    out["resync"] = m
    copy_back_(m, w)
    out["copy_back"] = w
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def assert_same_bits(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for name, tensors in want.items():
        for i, (a, b) in enumerate(zip(got[name], tensors, strict=True)):
            assert torch.equal(bits(a), bits(b)), f"{where}: {name}[{i}] differs"


def at_level(level: str, fn, *args):
    before = native._C.set_cpu_simd_cap(level)
    try:
        assert native._C.cpu_simd()["level"] == level
        return fn(*args)
    finally:
        native._C.set_cpu_simd_cap(before)


def levels_here() -> list[str]:
    top = _isa_check.LEVELS.index(native._C.cpu_simd()["detected"])
    return list(_isa_check.LEVELS[:top + 1])


def test_every_level_here_writes_the_same_bits():
    """The master step, re-sync and copy-back are torch's arithmetic at every level: the same
    bits. The op's AVX2 loop fuses the multiply-add where the portable one rounds twice, so
    between generic and the vector levels only its exact cases agree bit for bit (overwrite, a
    scale of 1) and the others within one rounding; AVX2 and AVX-512 run the same op loop."""
    x = make_inputs(int(torch.randint(0, 2**31, ())))
    runs = {level: at_level(level, run_kernels, x) for level in levels_here()}
    if len(runs) < 2:
        pytest.skip(f"this CPU runs one SIMD level only ({list(runs)})")
    vector = [lv for lv in runs if lv != "generic"]
    for level in vector[1:]:
        assert_same_bits(runs[level], runs[vector[0]], f"{level} vs {vector[0]}")
    for level in vector:
        got, want = dict(runs[level]), dict(runs["generic"])
        for key in [k for k in want if k.startswith("acc-")]:
            a, b = got.pop(key), want.pop(key)
            # norm_sq: other partial sums (8 lanes, 16 lanes), each within a few roundings
            torch.testing.assert_close(a[-1], b[-1], rtol=1e-5, atol=0)
            assert torch.equal(a[-2], b[-2]), f"{key}: found_inf"
            if key == "acc-False-0.37":  # one rounding (fused) or two, against float64
                for u, v, d, src in zip(a[:-2], b[:-2], x["dst"], x["src"]):
                    product = torch.tensor(0.37).double() * src.double()  # the fp32 scale
                    ref = d.double() + product
                    bound = 2.0 ** -24 * (ref.abs() + product.abs()) * (1 + 2 ** -20)
                    for y in (u, v):
                        finite = ref.isfinite()
                        assert torch.equal(y[~finite].double(), ref[~finite])
                        assert ((y.double() - ref)[finite].abs() <= bound[finite]).all()
            else:
                assert_same_bits({key: a[:-2]}, {key: b[:-2]}, f"{level} vs generic")
        assert_same_bits(got, want, f"{level} vs generic")


# -- the AVX2 path on a CPU without AVX-512, emulated ----------------------------------------------

QEMU = shutil.which("qemu-x86_64")
EMULATED = r"""
import sys, torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import test_simd_isa as t
from accumkernels.ops.backends import native
x = torch.load(sys.argv[3])
torch.save({"info": native._C.cpu_simd(), "out": t.run_kernels(x)}, sys.argv[4])
print("ran", native._C.cpu_simd()["level"])
"""


def test_the_avx2_path_runs_on_a_cpu_without_avx512(tmp_path):
    """Under `qemu-x86_64 -cpu Haswell` (AVX2, FMA, F16C; no AVX-512) the kernels detect AVX2,
    run every kernel without an illegal instruction, and write the bits the AVX2 level writes
    here. (make test installs qemu-user; CI fails rather than skip without it.)"""
    if QEMU is None:
        if os.environ.get("CI"):
            pytest.fail("qemu-x86_64 is not installed (make test installs qemu-user)")
        pytest.skip("qemu-x86_64 not installed (apt-get install qemu-user, or make test)")
    x = make_inputs(int(torch.randint(0, 2**31, ())))
    torch.save(x, tmp_path / "in.pt")
    here = Path(__file__).resolve().parent
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    env.pop("ACCUMKERNELS_CPU_SIMD", None)
    done = subprocess.run([QEMU, "-cpu", "Haswell", sys.executable, "-c", EMULATED, str(here),
                           str(here.parent), str(tmp_path / "in.pt"), str(tmp_path / "out.pt")],
                          capture_output=True, text=True, timeout=600, check=False, env=env)
    err = "\n".join(ln for ln in done.stderr.splitlines()
                    if not re.match(r"qemu-x86_64: warning: TCG doesn't support", ln))
    assert done.returncode == 0, f"exit {done.returncode} under -cpu Haswell:\n{err[-3000:]}"
    got = torch.load(tmp_path / "out.pt")
    assert got["info"]["detected"] == "avx2" and got["info"]["level"] == "avx2", got["info"]
    assert_same_bits(got["out"], at_level("avx2", run_kernels, x), "emulated Haswell vs here")
