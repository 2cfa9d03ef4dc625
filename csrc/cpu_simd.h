// Which SIMD path the CPU kernels run, for the three of them (the accumulate op, the fused master
// step, the master re-sync and copy-back), decided in one place.
//
// Levels: 0 = generic (baseline x86-64, or any other CPU), 1 = AVX2 + FMA + F16C, 2 = AVX-512
// (F, BW, VL). The level this machine runs is read from the CPU (CPUID) and the OS (XGETBV: the
// OS saves the YMM state, and for AVX-512 the opmask and ZMM state too), never from compile flags.
// ACCUMKERNELS_CPU_SIMD=generic|avx2|avx512 caps it (a level above the machine's runs the
// machine's); tests switch it at run time with set_cpu_simd_cap.
//
// Each path's functions are compiled for their own ISA only (AK_AVX2 / AK_AVX512: a target
// attribute on that function alone; an AVX2 function never carries the AVX-512 one) and are named
// for it (a `_avx2` / `_avx512` suffix), so that tests/op/test_simd_isa.py can disassemble the
// built module by function and check, on any machine, that no path uses an instruction above its
// level: every other function of the module is baseline x86-64.
#pragma once

#include <string>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ACCUMKERNELS_X86_SIMD 1
#define AK_AVX2 __attribute__((target("avx2,fma,f16c")))
#define AK_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))
#endif

namespace accumkernels {

constexpr int kSimdGeneric = 0;
constexpr int kSimdAvx2 = 1;
constexpr int kSimdAvx512 = 2;

// The widest level this CPU and OS support.
int cpu_simd_detected();
// The level the kernels run: min(detected, cap). Cheap (one relaxed atomic load).
int cpu_simd_level();
// Sets the cap (0..2; ACCUMKERNELS_CPU_SIMD's value at first use otherwise) and returns the
// previous one. std::invalid_argument for a level outside 0..2.
int set_cpu_simd_cap(int level);
int cpu_simd_cap();
// "generic", "avx2", "avx512"; the level of a name (-1 if unknown).
const char* simd_level_name(int level);
int simd_level_of(const std::string& name);

}  // namespace accumkernels
