// The CPU's SIMD level: CPUID for the instructions, XGETBV for the register state the OS saves
// (see cpu_simd.h). Compiled for baseline x86-64 like the rest of .text.
#include "cpu_simd.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

#if defined(ACCUMKERNELS_X86_SIMD)
#include <cpuid.h>
#endif

namespace accumkernels {
namespace {

#if defined(ACCUMKERNELS_X86_SIMD)
// XCR0: which register states the OS saves on a context switch.
uint64_t xcr0() {
  uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<uint64_t>(edx) << 32) | eax;
}

int detect() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return kSimdGeneric;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28);
  const bool fma = c & (1u << 12), f16c = c & (1u << 29);
  if (!(osxsave && avx && fma && f16c)) return kSimdGeneric;
  const uint64_t xcr = xcr0();
  if ((xcr & 0x6) != 0x6) return kSimdGeneric;  // XMM and YMM state
  if (__get_cpuid_max(0, nullptr) < 7) return kSimdGeneric;
  __cpuid_count(7, 0, a, b, c, d);
  if (!(b & (1u << 5))) return kSimdGeneric;  // AVX2
  const bool f = b & (1u << 16), bw = b & (1u << 30), vl = b & (1u << 31);
  // opmask, the upper halves of ZMM0-15, ZMM16-31
  if (f && bw && vl && (xcr & 0xe0) == 0xe0) return kSimdAvx512;
  return kSimdAvx2;
}
#else
int detect() { return kSimdGeneric; }
#endif

int cap_from_env() {
  const char* force = std::getenv("ACCUMKERNELS_CPU_SIMD");
  if (force == nullptr || *force == '\0') return kSimdAvx512;
  const int level = simd_level_of(force);
  if (level < 0)
    throw std::invalid_argument(std::string("ACCUMKERNELS_CPU_SIMD=") + force +
                                " is not a SIMD level: use generic, avx2 or avx512");
  return level;
}

const int g_detected = detect();
std::atomic<int> g_cap{-1};  // -1: not read from the environment yet

int cap() {
  int c = g_cap.load(std::memory_order_relaxed);
  if (c < 0) {
    int expected = -1;
    const int from_env = cap_from_env();
    g_cap.compare_exchange_strong(expected, from_env, std::memory_order_relaxed);
    c = g_cap.load(std::memory_order_relaxed);
  }
  return c;
}

}  // namespace

int cpu_simd_detected() { return g_detected; }

int cpu_simd_level() { return std::min(g_detected, cap()); }

int cpu_simd_cap() { return cap(); }

int set_cpu_simd_cap(int level) {
  if (level < kSimdGeneric || level > kSimdAvx512)
    throw std::invalid_argument("SIMD level must be 0 (generic), 1 (avx2) or 2 (avx512)");
  const int before = cap();
  g_cap.store(level, std::memory_order_relaxed);
  return before;
}

const char* simd_level_name(int level) {
  switch (level) {
    case kSimdAvx512: return "avx512";
    case kSimdAvx2: return "avx2";
    default: return "generic";
  }
}

int simd_level_of(const std::string& name) {
  for (int level = kSimdGeneric; level <= kSimdAvx512; ++level)
    if (name == simd_level_name(level)) return level;
  return -1;
}

}  // namespace accumkernels
