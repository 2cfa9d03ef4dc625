// Master-weight re-sync on the CPU (issue 20): one pass over each (fp32 master, bf16/fp16
// weight) pair that takes the weight into the master wherever the weight differs from the
// master rounded to the weight's dtype (the weight was changed outside the optimizer). It reads
// 4 + 2 bytes per element, allocates nothing and writes only the elements that differ. It runs
// on every pair at every step: nothing cached about the weights (a fingerprint, a version
// counter) may stand in for it, since .data, numpy and storage writes bypass all of them.
//
// "Differs" is torch's `weight != master.to(weight.dtype)`: compared as floats (+0 == -0), a
// NaN on either side differs. Rounding is round-to-nearest-even, as torch's casts.

#include <cstdint>
#include <cstring>

#include "accumulate.h"
#include "cpu_simd.h"

#if defined(ACCUMKERNELS_X86_SIMD)
#define ACCUMKERNELS_RESYNC_X86 1
#include <immintrin.h>
#endif

namespace accumkernels {
namespace {

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// The master rounded to bf16 (nearest even), as a float; a NaN stays a NaN.
inline float round_bf16(float m) {
  const uint32_t u = bits_of(m);
  if ((u & 0x7fffffffu) > 0x7f800000u) return m;
  return float_of((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

inline float widen(uint16_t w, int dtype) {
  if (dtype == kBFloat16) return float_of(static_cast<uint32_t>(w) << 16);
#if defined(__FLT16_MAX__)
  _Float16 h;
  std::memcpy(&h, &w, sizeof(h));
  return static_cast<float>(h);
#else
  return 0.0f;  // unreachable: resync_masters_cpu refuses fp16 on such builds first
#endif
}

inline float round_to(float m, int dtype) {
  if (dtype == kBFloat16) return round_bf16(m);
#if defined(__FLT16_MAX__)
  return static_cast<float>(static_cast<_Float16>(m));
#else
  return m;
#endif
}

// Scalar elements [from, n); returns how many were taken from the weight.
int64_t resync_scalar(float* master, const uint16_t* weight, int64_t from, int64_t n, int dtype) {
  int64_t taken = 0;
  for (int64_t i = from; i < n; ++i) {
    const float w = widen(weight[i], dtype);
    if (!(w == round_to(master[i], dtype))) {
      master[i] = w;
      ++taken;
    }
  }
  return taken;
}

#if defined(ACCUMKERNELS_RESYNC_X86)
template <int kDType>
AK_AVX2 int64_t resync_avx2(float* master, const uint16_t* weight, int64_t n) {
  const __m256i lsb_one = _mm256_set1_epi32(1);
  const __m256i half_ulp = _mm256_set1_epi32(0x7fff);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  int64_t taken = 0;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 m = _mm256_loadu_ps(master + i);
    const __m128i w16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(weight + i));
    __m256 w, r;
    if constexpr (kDType == kBFloat16) {
      w = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w16), 16));
      const __m256i u = _mm256_castps_si256(m);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), lsb_one);
      const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(half_ulp, lsb));
      const __m256 nan = _mm256_cmp_ps(m, m, _CMP_UNORD_Q);
      r = _mm256_blendv_ps(_mm256_castsi256_ps(_mm256_and_si256(up, high)), m, nan);
    } else {
      w = _mm256_cvtph_ps(w16);
      r = _mm256_cvtph_ps(_mm256_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    const __m256 differ = _mm256_cmp_ps(w, r, _CMP_NEQ_UQ);
    const int mask = _mm256_movemask_ps(differ);
    if (mask != 0) {  // rare: the weight was changed outside the optimizer
      _mm256_storeu_ps(master + i, _mm256_blendv_ps(m, w, differ));
      taken += __builtin_popcount(static_cast<unsigned>(mask));
    }
  }
  // The tail (< 8 elements) with the same instructions (F16C for fp16: no _Float16 needed).
  for (; i < n; ++i) {
    float w, r;
    if constexpr (kDType == kBFloat16) {
      w = float_of(static_cast<uint32_t>(weight[i]) << 16);
      r = round_bf16(master[i]);
    } else {
      w = _cvtsh_ss(weight[i]);
      r = _cvtsh_ss(_cvtss_sh(master[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    if (!(w == r)) {
      master[i] = w;
      ++taken;
    }
  }
  return taken;
}

bool vector_path() { return cpu_simd_level() >= kSimdAvx2; }
#endif

// -- copy-back ---------------------------------------------------------------------------------
// The copy-back writes weight = master rounded to the weight's dtype, torch's cast bit for bit
// (reads 4, writes 2 bytes per element). It records nothing about what it wrote: the user may
// write the weights through .data, numpy or the storage, which no cached picture sees, so the
// next step compares every (master, weight) pair exactly (resync_masters_cpu).

inline uint16_t to_bits_bf16(float m) {  // torch's float -> bfloat16: nearest even, NaN 0x7fc0
  const uint32_t u = bits_of(m);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

inline uint16_t to_bits(float m, int dtype) {
  if (dtype == kBFloat16) return to_bits_bf16(m);
#if defined(__FLT16_MAX__)
  const _Float16 h = static_cast<_Float16>(m);
  uint16_t out;
  std::memcpy(&out, &h, sizeof(out));
  return out;
#else
  return 0;  // unreachable: copy_back_cpu refuses fp16 on such builds first
#endif
}

#if defined(ACCUMKERNELS_RESYNC_X86)
// torch's float -> bfloat16 on 8 lanes (nearest even; NaN -> 0x7fc0), the 16 bits in each lane.
AK_AVX2 inline __m256i round_bf16_bits8(__m256i u) {
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
  const __m256i nan = _mm256_cmpgt_epi32(
      _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)), _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), nan);
}

// weight = master rounded (16 elements a step).
template <int kDType>
AK_AVX2 void copy_back_avx2(const float* m, uint16_t* w, int64_t n16) {
  int64_t i = 0;
  for (; i + 16 <= n16; i += 16) {
    __m128i lo, hi;
    if constexpr (kDType == kBFloat16) {
      const auto* mi = reinterpret_cast<const __m256i*>(m + i);
      const __m256i r0 = round_bf16_bits8(_mm256_loadu_si256(mi));
      const __m256i r1 = round_bf16_bits8(_mm256_loadu_si256(mi + 1));
      // packus interleaves 128-bit halves: [r0 lo, r1 lo, r0 hi, r1 hi] -> reorder the quads
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xD8);
      lo = _mm256_castsi256_si128(packed);
      hi = _mm256_extracti128_si256(packed, 1);
    } else {
      const int mode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
      lo = _mm256_cvtps_ph(_mm256_loadu_ps(m + i), mode);
      hi = _mm256_cvtps_ph(_mm256_loadu_ps(m + i + 8), mode);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + i), lo);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(w + i + 8), hi);
  }
  for (; i < n16; ++i) {  // the tail (< 16 elements); F16C for fp16: no _Float16 needed
    if constexpr (kDType == kBFloat16)
      w[i] = to_bits_bf16(m[i]);
    else
      w[i] = _cvtss_sh(m[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
}
#endif

}  // namespace

bool copy_back_cpu(const float* master, uint16_t* weight, int64_t n, int dtype) {
#if defined(ACCUMKERNELS_RESYNC_X86)
  if (vector_path()) {
    if (dtype == kBFloat16)
      copy_back_avx2<kBFloat16>(master, weight, n);
    else
      copy_back_avx2<kFloat16>(master, weight, n);
    return true;
  }
#endif
#if !defined(__FLT16_MAX__)
  if (dtype == kFloat16) return false;
#endif
  for (int64_t i = 0; i < n; ++i) weight[i] = to_bits(master[i], dtype);
  return true;
}

int64_t resync_masters_cpu(float* master, const uint16_t* weight, int64_t n, int dtype) {
#if defined(ACCUMKERNELS_RESYNC_X86)
  if (vector_path()) {
    return dtype == kBFloat16 ? resync_avx2<kBFloat16>(master, weight, n)
                              : resync_avx2<kFloat16>(master, weight, n);
  }
#endif
#if !defined(__FLT16_MAX__)
  if (dtype == kFloat16) return -1;  // no fp16 rounding on this build: the caller falls back
#endif
  return resync_scalar(master, weight, 0, n, dtype);
}

}  // namespace accumkernels
