"""What the kernels compile to, without a GPU: registers, spills and global loads/stores in SASS.

    python -m benchmarks.sass_check                # both kernels, sm_90, a table
    python -m benchmarks.sass_check --triton --json
    python -m benchmarks.sass_check --cuda --arch 80
    python -m benchmarks.sass_check --triton --block 8192 --warps 8 --half-vec 4   # a tuning variant

--cuda compiles csrc/accumulate_cuda.cu with nvcc once per vector store (ACCUMKERNELS_VEC_STORE=0
__stwb, 1 PTX st.global.v4.f32); --triton compiles accumkernels' Triton kernel ahead of time for
the arch (bf16/fp16/fp32 sources x add/overwrite, found_inf on, 16-byte-aligned pointers) with
Triton's own compiler. Both read the SASS with cuobjdump (from PATH, else the one Triton ships).
Exit status 3 when a requested compile cannot run here (no nvcc, or this Triton cannot compile
without a GPU); run with TRITON_INTERPRET unset.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPS = re.compile(r"\b((?:LDG|STG|LDL|STL|LDS|STS)\.[A-Z0-9.]+|(?:LDL|STL))\b")


class CannotCompile(Exception):
    """The tool chain needed for a section is missing here."""


def cuobjdump() -> str:
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        raise CannotCompile("no cuobjdump on PATH and no Triton to borrow it from") from None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not bundled.is_file():
        raise CannotCompile("no cuobjdump")
    return str(bundled)


def inspect(binary: Path) -> list[dict]:
    """Per kernel function in ``binary`` (cubin or object): registers, stack/local bytes and
    counts of global/local/shared memory instructions."""
    tool = cuobjdump()
    res = subprocess.run([tool, "-res-usage", str(binary)], capture_output=True, text=True,
                         check=True).stdout
    sass = subprocess.run([tool, "-sass", str(binary)], capture_output=True, text=True,
                          check=True).stdout
    usage = {m.group(1): m.group(2) for m in
             re.finditer(r"Function (\S+):\s*\n\s*(REG:.*)", res)}
    out = []
    for name, body in re.findall(r"Function : (\S+)\n(.*?)(?=\n\s*Function : |\Z)", sass, re.DOTALL):
        fields = dict(re.findall(r"(\w+(?:\[\d+\])?):(\d+)", usage.get(name, "")))
        out.append({"function": name, "registers": int(fields.get("REG", -1)),
                    "spill_bytes": int(fields.get("STACK", 0)) + int(fields.get("LOCAL", 0)),
                    "ops": dict(sorted(collections.Counter(OPS.findall(body)).items()))})
    return out


def cuda_variants(arch: str) -> list[dict]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CannotCompile("nvcc not on PATH")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for store, macro in (("stwb", 0), ("ptx", 1)):
            obj = Path(tmp) / f"accumulate_cuda_{store}.o"
            cmd = [nvcc, "-std=c++17", "-O3", f"-DACCUMKERNELS_VEC_STORE={macro}", "-gencode",
                   f"arch=compute_{arch},code=sm_{arch}", "-c", "-I", str(ROOT / "csrc"),
                   str(ROOT / "csrc" / "accumulate_cuda.cu"), "-o", str(obj)]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            for k in inspect(obj):
                rows.append({"kernel": "cuda", "variant": f"store={store}", **k})
    return rows


def triton_variants(arch: str, block: int | None, warps: int | None, tail: int | None,
                    half_vec: int | None) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise CannotCompile("TRITON_INTERPRET=1 is set")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from accumkernels.ops.backends import triton as tb
    except ImportError as exc:
        raise CannotCompile(f"cannot import Triton's compiler: {exc}") from None
    block = block or tb.BLOCK
    warps = warps or tb.NUM_WARPS
    tail = min(tail or tb.TAIL, block)
    half_vec = half_vec or tb.HALF_SRC_VEC
    fn = tb._accumulate_kernel
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for src in ("bf16", "fp16", "fp32"):
            for overwrite in (False, True):
                signature = {"table_ptr": "*i64", "n_tensors": "i32", "dst_base": "*fp32",
                             "src_base": f"*{src}", "scale_ptr": "*fp32", "scale": "fp32",
                             "found_inf_ptr": "*fp32"}
                constants = {"SCALE_FROM_PTR": False, "OVERWRITE": overwrite,
                             "CHECK_FINITE": True, "SEARCH_STEPS": 8,
                             "SRC_VEC": 4 if src == "fp32" else half_vec, "BLOCK": block, "TAIL": tail}
                signature.update(dict.fromkeys(constants, "constexpr"))
                aligned = [["tt.divisibility", 16]]
                attrs = {(fn.arg_names.index(a),): aligned for a in
                         ("table_ptr", "dst_base", "src_base", "scale_ptr", "found_inf_ptr")}
                try:
                    kernel = triton.compile(ASTSource(fn, signature, constants, attrs),
                                            target=GPUTarget("cuda", int(arch), 32),
                                            options={"num_warps": warps,
                                                     "enable_fp_fusion": tb.FP_FUSION})
                except Exception as exc:  # reported as "cannot compile here"
                    raise CannotCompile(f"triton.compile failed: {type(exc).__name__}: "
                                        f"{str(exc)[:300]}") from exc
                cubin = Path(tmp) / f"{src}_{overwrite}.cubin"
                cubin.write_bytes(kernel.asm["cubin"])
                for k in inspect(cubin):
                    rows.append({"kernel": "triton", "variant": f"{src} "
                                 + ("overwrite" if overwrite else "add")
                                 + f" block={block} warps={warps} tail={tail}"
                                 + (f" half_vec={half_vec}" if src != "fp32" else ""), **k})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cuda", action="store_true", help="only the CUDA kernel")
    p.add_argument("--triton", action="store_true", help="only the Triton kernel")
    p.add_argument("--arch", default="90", help="SM architecture number (default 90)")
    p.add_argument("--block", type=int, help="Triton BLOCK (default: the backend's)")
    p.add_argument("--warps", type=int, help="Triton num_warps (default: the backend's)")
    p.add_argument("--tail", type=int, help="Triton TAIL (default: the backend's)")
    p.add_argument("--half-vec", type=int, choices=(4, 8),
                   help="Triton HALF_SRC_VEC (default: the backend's)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    both = not (args.cuda or args.triton)
    rows = []
    try:
        if both or args.cuda:
            rows += cuda_variants(args.arch)
        if both or args.triton:
            rows += triton_variants(args.arch, args.block, args.warps, args.tail, args.half_vec)
    except CannotCompile as exc:
        print(f"sass_check: {exc}", file=sys.stderr)
        return 3
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for r in rows:
        ops = " ".join(f"{k}x{v}" for k, v in r["ops"].items())
        print(f"{r['kernel']:6} {r['variant']:52} regs {r['registers']:3} spill "
              f"{r['spill_bytes']:3}  {r['function'][:40]:40}  {ops}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
