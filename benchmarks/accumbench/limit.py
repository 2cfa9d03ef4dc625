"""The CPU's limit row: a plain fused C loop with the op's bytes per element, built at run time.

``dst[i] += s * float(src[i])`` over one flat fp32 ``dst`` and one flat ``src`` (bf16, fp16 or
fp32: 2 or 4 bytes read, 4 read and 4 written in ``dst``; with overwrite ``dst[i] = s * src[i]``,
``dst`` not read), split over OpenMP threads (the count torch uses, as the CPU backend does).
It is what a list of tensors costs at best once every per-tensor cost is gone: the kernel
benchmark times it on a buffer of each list's total size, in the same run, and every row
reports its GB/s as a multiple of it (``x limit``).

The loop is compiled with the system C++ compiler (``$CXX``, else ``g++``) as ``-O3 -fopenmp``
for the baseline ISA of the machine's compiler (no ``-march=native``: the limit must not depend
on which vector extensions a build enabled), into a cache folder keyed by the source and the
flags, and loaded with ctypes. Without a compiler :func:`load` raises :class:`NoCompiler`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = r"""
#include <cstdint>
#include <cstring>
#include <omp.h>

static inline float bits_to_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
static inline uint32_t float_to_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// IEEE half -> float without F16C and without branches (bit masks), so that it vectorises.
static inline float half_to_float(uint16_t h) {
    const uint32_t shifted_exp = 0x7c00u << 13;
    const uint32_t o = ((uint32_t)(h & 0x7fffu) << 13) + ((uint32_t)(127 - 15) << 23);
    const uint32_t exp = ((uint32_t)(h & 0x7c00u)) << 13;
    const uint32_t inf_nan = 0u - (uint32_t)(exp == shifted_exp);
    const uint32_t zero_sub = 0u - (uint32_t)(exp == 0u);
    const uint32_t normal = o + (inf_nan & ((uint32_t)(128 - 16) << 23));
    const uint32_t sub = float_to_bits(bits_to_float(o + (1u << 23)) - bits_to_float(113u << 23));
    const uint32_t mag = (sub & zero_sub) | (normal & ~zero_sub);
    return bits_to_float(mag | ((uint32_t)(h & 0x8000u) << 16));
}

// One loop per source type; overwrite (dst = s * src, dst not read) is a loop of its own, so
// that each is a plain vectorised stream.
#define LIMIT_LOOP(NAME, T, LOAD)                                                         \
    void NAME(float* dst, const T* src, int64_t n, float s, int threads, int overwrite) { \
        if (overwrite) {                                                                  \
            _Pragma("omp parallel for simd schedule(static) num_threads(threads)")        \
            for (int64_t i = 0; i < n; ++i) dst[i] = s * LOAD(src[i]);                    \
        } else {                                                                          \
            _Pragma("omp parallel for simd schedule(static) num_threads(threads)")        \
            for (int64_t i = 0; i < n; ++i) dst[i] += s * LOAD(src[i]);                   \
        }                                                                                 \
    }

static inline float load_f32(float x) { return x; }
static inline float load_bf16(uint16_t x) { return bits_to_float((uint32_t)x << 16); }

extern "C" {
LIMIT_LOOP(limit_f32, float, load_f32)
LIMIT_LOOP(limit_bf16, uint16_t, load_bf16)
LIMIT_LOOP(limit_f16, uint16_t, half_to_float)
}
"""
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
SYMBOLS = {torch.float32: "limit_f32", torch.bfloat16: "limit_bf16", torch.float16: "limit_f16"}
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "accumkernels" / "limit"


class NoCompiler(RuntimeError):
    """No C++ compiler to build the limit loop with."""


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def build(cache: Path = CACHE) -> Path:
    """The shared library, compiled once per source, flags and compiler (then reused)."""
    cxx = compiler()
    if cxx is None:
        raise NoCompiler(
            f"the CPU limit row needs a C++ compiler: {os.environ.get('CXX', 'g++')!r} is not "
            "on PATH (install g++, or set CXX to one; --no-limit skips the row)")
    key = hashlib.sha256("\0".join((SOURCE, *FLAGS, cxx)).encode()).hexdigest()[:16]
    lib = cache / key / "limit.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        src, out = Path(tmp) / "limit.cpp", Path(tmp) / "limit.so"
        src.write_text(SOURCE)
        proc = subprocess.run([cxx, *FLAGS, str(src), "-o", str(out)], capture_output=True,
                              text=True, check=False)
        if proc.returncode:
            raise NoCompiler(f"{cxx} failed to build the limit loop:\n{proc.stderr.strip()}")
        os.replace(out, lib)  # atomic: a concurrent run sees the whole file or none
    return lib


class LimitLoop:
    """``loop(dst, src, s)`` on flat contiguous CPU tensors; ``provider(s)`` for the timers."""

    note = "plain fused C loop (OpenMP, -O3, no -march) over one flat buffer of the list's size"

    def __init__(self, threads: int | None = None):
        self.lib = ctypes.CDLL(str(build()))
        self.threads = threads or torch.get_num_threads()
        for name in SYMBOLS.values():
            fn = getattr(self.lib, name)
            fn.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float,
                           ctypes.c_int, ctypes.c_int)
            fn.restype = None

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, s: float,
                 overwrite: bool = False) -> None:
        if dst.dtype != torch.float32 or src.dtype not in SYMBOLS:
            raise TypeError(f"limit loop: fp32 dst and bf16/fp16/fp32 src, got {dst.dtype}, "
                            f"{src.dtype}")
        if not (dst.is_contiguous() and src.is_contiguous()) or dst.numel() != src.numel() \
                or dst.device.type != "cpu" or src.device.type != "cpu":
            raise ValueError("limit loop: two contiguous CPU tensors of the same size")
        getattr(self.lib, SYMBOLS[src.dtype])(dst.data_ptr(), src.data_ptr(), dst.numel(),
                                              float(s), self.threads, int(overwrite))

    def provider(self, s: float, overwrite: bool = False):
        """``fn(dst_list, src_list)`` over one-tensor lists, as the kernel benchmark calls."""
        def fn(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
            for d, g in zip(dst, src, strict=True):
                self(d, g, s, overwrite)
        fn.scale = s
        fn.note = self.note
        return fn


def load(threads: int | None = None) -> LimitLoop:
    return LimitLoop(threads)
