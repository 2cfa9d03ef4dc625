// The fused master step on the CPU: AVX2 (8 wide) and AVX-512 (16 wide) code of the element
// formulas of master_step_cpu.h, the same operations in the same order. Compiled for those ISAs
// inside these functions only (target attributes); master_step_cpu.cpp picks one at run time.
// Each function sits in its ISA's section (cpu_simd.h). Included by master_step_cpu.cpp only.
#pragma once

#include <immintrin.h>

#include "cpu_simd.h"
#include "master_step_cpu.h"

namespace accumkernels::master_cpu {

template <bool kFma>
AK_AVX2 inline __m256 vmadd(__m256 a, __m256 b, __m256 c) {
  if constexpr (kFma) return _mm256_fmadd_ps(a, b, c);
  return _mm256_add_ps(_mm256_mul_ps(a, b), c);
}

template <int kDType>
AK_AVX2 inline __m256 vwiden(const uint16_t* p) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kDType == kBFloat16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(w), 16));
  return _mm256_cvtph_ps(w);
}

// The master rounded to the weight dtype, as floats (NaN stays NaN).
template <int kDType>
AK_AVX2 inline __m256 vrounded(__m256 m) {
  if constexpr (kDType == kBFloat16) {
    const __m256i u = _mm256_castps_si256(m);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i up = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb));
    const __m256 r = _mm256_castsi256_ps(
        _mm256_and_si256(up, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
    return _mm256_blendv_ps(r, m, _mm256_cmp_ps(m, m, _CMP_UNORD_Q));
  }
  return _mm256_cvtph_ps(_mm256_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <int kDType, bool kFma>
AK_AVX2 inline void vstore_weight(uint16_t* p, __m256 x) {
  __m128i out;
  if constexpr (kDType == kBFloat16) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb)), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i bits = _mm256_blendv_epi8(r, _mm256_set1_epi32(kFma ? 0xffff : 0x7fc0), nan);
    out = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  } else {
    out = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), out);
}

// Steps 1 and 2 on 8 elements.
template <int kDType>
AK_AVX2 inline __m256 vtake_master(const Row& r, int64_t i) {
  const __m256 w = vwiden<kDType>(r.weight + i);
  const __m256 m = _mm256_loadu_ps(r.master + i);
  return _mm256_blendv_ps(m, w, _mm256_cmp_ps(w, vrounded<kDType>(m), _CMP_NEQ_UQ));
}

AK_AVX2 inline __m256 vtake_grad(const Row& r, const Consts& c, int64_t i) {
  __m256 g = _mm256_loadu_ps(r.grad + i);
  if (c.scale) {
    g = _mm256_div_ps(g, _mm256_set1_ps(c.gs));
    if (c.flags & kFlagWriteGrad) _mm256_storeu_ps(r.grad + i, g);
  }
  if (c.flags & kFlagMaximize) g = _mm256_mul_ps(g, _mm256_set1_ps(-1.0f));
  return g;
}

// adam_elem<..., kTail=false> on 8 elements at a time over [begin, end) (a multiple of 8).
template <int kDType, bool kFma>
AK_AVX2 void adam_avx2(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const bool amsgrad = c.flags & kFlagAmsgrad;
  const bool decoupled = c.flags & kFlagAdamW;
  const bool decay = c.wd != 0.0f;
  const __m256 wd = _mm256_set1_ps(c.wd), dec = _mm256_set1_ps(c.decay);
  const __m256 lerp_c = _mm256_set1_ps(c.small_lerp ? c.lerp_w : c.lerp_w1);
  const __m256 b2 = _mm256_set1_ps(c.beta2), c2 = _mm256_set1_ps(c.c2);
  const __m256 bc2 = _mm256_set1_ps(r.bc2_sqrt), eps = _mm256_set1_ps(c.eps);
  const __m256 nss = _mm256_set1_ps(r.neg_step_size);
  for (int64_t i = begin; i < end; i += 8) {
    __m256 p = vtake_master<kDType>(r, i);
    __m256 g = vtake_grad(r, c, i);
    if (decay) {
      if (decoupled)
        p = _mm256_mul_ps(p, dec);
      else
        g = vmadd<kFma>(p, wd, g);
    }
    __m256 m = _mm256_loadu_ps(r.s0 + i);
    m = vmadd<kFma>(lerp_c, _mm256_sub_ps(g, m), c.small_lerp ? m : g);
    const __m256 v =
        vmadd<kFma>(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(_mm256_loadu_ps(r.s1 + i), b2));
    _mm256_storeu_ps(r.s0 + i, m);
    _mm256_storeu_ps(r.s1 + i, v);
    __m256 d = v;
    if (amsgrad) {  // torch's maximum(): a NaN on either side gives all-ones (a NaN)
      const __m256 mx = _mm256_loadu_ps(r.s2 + i);
      d = _mm256_or_ps(_mm256_max_ps(mx, v), _mm256_cmp_ps(mx, v, _CMP_UNORD_Q));
      _mm256_storeu_ps(r.s2 + i, d);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(d), bc2), eps);
    p = _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(nss, m), denom));
    _mm256_storeu_ps(r.master + i, p);
    vstore_weight<kDType, kFma>(r.weight + i, p);
  }
}

// sgd_elem<..., kTail=false> on 8 elements at a time over [begin, end) (a multiple of 8).
template <int kDType, bool kFma>
AK_AVX2 void sgd_avx2(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const bool decay = c.wd != 0.0f;
  const bool momentum = c.flags & kFlagMomentum;
  const bool first = c.flags & kFlagFirstStep;
  const bool nesterov = c.flags & kFlagNesterov;
  const __m256 wd = _mm256_set1_ps(c.wd), mom = _mm256_set1_ps(c.momentum);
  const __m256 damp = _mm256_set1_ps(c.damp), neg_lr = _mm256_set1_ps(c.neg_lr);
  for (int64_t i = begin; i < end; i += 8) {
    __m256 p = vtake_master<kDType>(r, i);
    __m256 g = vtake_grad(r, c, i);
    if (decay) g = vmadd<kFma>(p, wd, g);
    if (momentum) {
      const __m256 b = first ? g
                             : vmadd<kFma>(damp, g, _mm256_mul_ps(_mm256_loadu_ps(r.s0 + i), mom));
      _mm256_storeu_ps(r.s0 + i, b);
      g = nesterov ? vmadd<kFma>(b, mom, g) : b;
    }
    p = vmadd<kFma>(g, neg_lr, p);
    _mm256_storeu_ps(r.master + i, p);
    vstore_weight<kDType, kFma>(r.weight + i, p);
  }
}


template <bool kFma>
AK_AVX512 inline __m512 vmadd16(__m512 a, __m512 b, __m512 c) {
  if constexpr (kFma) return _mm512_fmadd_ps(a, b, c);
  return _mm512_add_ps(_mm512_mul_ps(a, b), c);
}

// The bf16 bits of x rounded to nearest even (NaN: garbage, masked by the callers), in 32 bits.
AK_AVX512 inline __m512i bf16_bits16(__m512i u) {
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb));
}

// Steps 1 and 2 on 16 elements (vtake_master/vtake_grad 16 wide).
template <int kDType>
AK_AVX512 inline __m512 take_master16(const Row& r, int64_t i) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r.weight + i));
  const __m512 m = _mm512_loadu_ps(r.master + i);
  __m512 w;
  __mmask16 differ;
  if constexpr (kDType == kBFloat16) {
    w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512 rounded = _mm512_castsi512_ps(_mm512_and_si512(
        bf16_bits16(_mm512_castps_si512(m)), _mm512_set1_epi32(static_cast<int>(0xffff0000u))));
    differ = _mm512_cmp_ps_mask(w, rounded, _CMP_NEQ_UQ) | _mm512_cmp_ps_mask(m, m, _CMP_UNORD_Q);
  } else {
    w = _mm512_cvtph_ps(h);
    const __m512 rounded =
        _mm512_cvtph_ps(_mm512_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    differ = _mm512_cmp_ps_mask(w, rounded, _CMP_NEQ_UQ);
  }
  return _mm512_mask_blend_ps(differ, m, w);
}

AK_AVX512 inline __m512 take_grad16(const Row& r, const Consts& c, int64_t i) {
  __m512 g = _mm512_loadu_ps(r.grad + i);
  if (c.scale) {
    g = _mm512_div_ps(g, _mm512_set1_ps(c.gs));
    if (c.flags & kFlagWriteGrad) _mm512_storeu_ps(r.grad + i, g);
  }
  if (c.flags & kFlagMaximize) g = _mm512_mul_ps(g, _mm512_set1_ps(-1.0f));
  return g;
}

template <int kDType, bool kFma>
AK_AVX512 inline void store_weight16(uint16_t* p, __m512 x) {
  __m256i out;
  if constexpr (kDType == kBFloat16) {
    __m512i bits = _mm512_srli_epi32(bf16_bits16(_mm512_castps_si512(x)), 16);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q),
                                 _mm512_set1_epi32(kFma ? 0xffff : 0x7fc0));
    out = _mm512_cvtepi32_epi16(bits);
  } else {
    out = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), out);
}

// adam_avx2 16 wide over [begin, end) (a multiple of 16).
template <int kDType, bool kFma>
AK_AVX512 void adam_avx512(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const bool amsgrad = c.flags & kFlagAmsgrad;
  const bool decoupled = c.flags & kFlagAdamW;
  const bool decay = c.wd != 0.0f;
  const __m512 wd = _mm512_set1_ps(c.wd), dec = _mm512_set1_ps(c.decay);
  const __m512 lerp_c = _mm512_set1_ps(c.small_lerp ? c.lerp_w : c.lerp_w1);
  const __m512 b2 = _mm512_set1_ps(c.beta2), c2 = _mm512_set1_ps(c.c2);
  const __m512 bc2 = _mm512_set1_ps(r.bc2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 nss = _mm512_set1_ps(r.neg_step_size);
  for (int64_t i = begin; i < end; i += 16) {
    __m512 p = take_master16<kDType>(r, i);
    __m512 g = take_grad16(r, c, i);
    if (decay) {
      if (decoupled)
        p = _mm512_mul_ps(p, dec);
      else
        g = vmadd16<kFma>(p, wd, g);
    }
    __m512 m = _mm512_loadu_ps(r.s0 + i);
    m = vmadd16<kFma>(lerp_c, _mm512_sub_ps(g, m), c.small_lerp ? m : g);
    const __m512 v =
        vmadd16<kFma>(_mm512_mul_ps(c2, g), g, _mm512_mul_ps(_mm512_loadu_ps(r.s1 + i), b2));
    _mm512_storeu_ps(r.s0 + i, m);
    _mm512_storeu_ps(r.s1 + i, v);
    __m512 d = v;
    if (amsgrad) {  // torch's maximum(): a NaN on either side gives all-ones (a NaN)
      const __m512 mx = _mm512_loadu_ps(r.s2 + i);
      d = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mx, v, _CMP_UNORD_Q), _mm512_max_ps(mx, v),
                               _mm512_castsi512_ps(_mm512_set1_epi32(-1)));
      _mm512_storeu_ps(r.s2 + i, d);
    }
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(d), bc2), eps);
    p = _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(nss, m), denom));
    _mm512_storeu_ps(r.master + i, p);
    store_weight16<kDType, kFma>(r.weight + i, p);
  }
}

// sgd_avx2 16 wide over [begin, end) (a multiple of 16).
template <int kDType, bool kFma>
AK_AVX512 void sgd_avx512(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const bool decay = c.wd != 0.0f;
  const bool momentum = c.flags & kFlagMomentum;
  const bool first = c.flags & kFlagFirstStep;
  const bool nesterov = c.flags & kFlagNesterov;
  const __m512 wd = _mm512_set1_ps(c.wd), mom = _mm512_set1_ps(c.momentum);
  const __m512 damp = _mm512_set1_ps(c.damp), neg_lr = _mm512_set1_ps(c.neg_lr);
  for (int64_t i = begin; i < end; i += 16) {
    __m512 p = take_master16<kDType>(r, i);
    __m512 g = take_grad16(r, c, i);
    if (decay) g = vmadd16<kFma>(p, wd, g);
    if (momentum) {
      const __m512 b = first ? g : vmadd16<kFma>(damp, g,
                                                 _mm512_mul_ps(_mm512_loadu_ps(r.s0 + i), mom));
      _mm512_storeu_ps(r.s0 + i, b);
      g = nesterov ? vmadd16<kFma>(b, mom, g) : b;
    }
    p = vmadd16<kFma>(g, neg_lr, p);
    _mm512_storeu_ps(r.master + i, p);
    store_weight16<kDType, kFma>(r.weight + i, p);
  }
}

// The tail of one tensor, [split, end): adam_elem/sgd_elem's scalar form, compiled (inlined)
// under the caller's ISA.
template <int kDType, bool kFma, bool kAdam>
inline void run_tail(const Row& r, const Consts& c, int64_t split, int64_t end) {
  for (int64_t i = split; i < end; ++i) {
    if constexpr (kAdam) adam_elem<kDType, kFma, true>(r, c, i);
    else sgd_elem<kDType, kFma, true>(r, c, i);
  }
}

// Elements [begin, end) of one tensor (begin a multiple of 16) on AVX2: 8 wide up to the tail,
// then the tail's scalar form. Everything it runs is compiled for AVX2/FMA/F16C only.
template <int kDType, bool kFma, bool kAdam>
AK_AVX2 void run_avx2(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const int64_t split = std::clamp(r.numel - r.numel % 8, begin, end);
  if constexpr (kAdam) adam_avx2<kDType, kFma>(r, c, begin, split);
  else sgd_avx2<kDType, kFma>(r, c, begin, split);
  run_tail<kDType, kFma, kAdam>(r, c, split, end);
}

// The same on AVX-512: 16 wide, then one 8-wide block if one is left, then the tail.
template <int kDType, bool kFma, bool kAdam>
AK_AVX512 void run_avx512(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const int64_t split = std::clamp(r.numel - r.numel % 8, begin, end);
  const int64_t wide_end = begin + (split - begin) / 16 * 16;
  if constexpr (kAdam) {
    adam_avx512<kDType, kFma>(r, c, begin, wide_end);
    adam_avx2<kDType, kFma>(r, c, wide_end, split);
  } else {
    sgd_avx512<kDType, kFma>(r, c, begin, wide_end);
    sgd_avx2<kDType, kFma>(r, c, wide_end, split);
  }
  run_tail<kDType, kFma, kAdam>(r, c, split, end);
}

}  // namespace accumkernels::master_cpu
