// The fused master step on the CPU: the element formulas in portable scalar code, shared by the
// generic path and the vector paths' tails (csrc/master_step_cpu.cpp says what torch computes).
// Included by master_step_cpu.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "accumulate.h"  // dtype codes

// Every product and sum is rounded on its own unless written as an fma: the compiler must not
// fuse a * b + c behind our back (GCC does by default in C++, even through intrinsics).
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace accumkernels::master_cpu {

// Flags of a call (the Python side reads them from _C.MASTER_STEP_CPU_FLAGS).
enum : int {
  kFlagAmsgrad = 1,
  kFlagMaximize = 2,
  kFlagAdamW = 4,
  kFlagWriteGrad = 8,
  kFlagFma = 16,        // torch runs an FMA build (AVX2/AVX512 capability)
  kFlagMomentum = 32,   // SGD with a momentum buffer
  kFlagNesterov = 64,
  kFlagFirstStep = 128, // SGD: the momentum buffer starts as the gradient
};

// One tensor of the list: the master, its weight, its gradient and up to three state arrays
// (Adam: exp_avg, exp_avg_sq, max_exp_avg_sq; SGD: the momentum buffer), with the per-tensor
// Adam constants (they depend on the tensor's step).
struct Row {
  float* master;
  uint16_t* weight;
  float* grad;
  float* s0;
  float* s1;
  float* s2;
  int64_t numel;
  int dtype;
  float step_size;      // float(lr / (1 - beta1^step))
  float neg_step_size;  // float(-(lr / (1 - beta1^step)))
  float bc2_sqrt;       // float(sqrt(1 - beta2^step))
};

// The call's constants, each rounded to fp32 as torch rounds it.
struct Consts {
  int flags;
  bool scale;  // divide the gradient by gs
  float gs;
  float wd;
  // Adam
  float decay;       // AdamW: float(1 - lr * weight_decay)
  bool small_lerp;   // |w| < 0.5: exp_avg + w * (g - exp_avg), else g + (w - 1) * (g - exp_avg)
  float lerp_w;      // float(1 - beta1)
  float lerp_w1;     // float(1 - beta1) - 1
  float beta2;
  float c2;          // float(1 - beta2)
  float eps;
  // SGD
  float momentum;
  float damp;        // float(1 - dampening)
  float lr;
  float neg_lr;
};

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// -- scalar conversions (exactly what F16C and torch's casts do) --------------------------------

inline float bf16_to_float(uint16_t b) { return float_of(static_cast<uint32_t>(b) << 16); }

// float -> bf16 bits, nearest even. torch's cast writes NaN as 0xffff in its AVX2/AVX512
// builds and as 0x7fc0 in the DEFAULT one.
inline uint16_t float_to_bf16(float f, bool fma_build) {
  const uint32_t u = bits_of(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return fma_build ? 0xffffu : 0x7fc0u;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// fp16 bits -> float, exact; a NaN keeps its sign and payload and gets the quiet bit (F16C).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1fu) return float_of(sign | 0x7f800000u | (man << 13) | (man ? 0x400000u : 0u));
  if (exp != 0) return float_of(sign | ((exp + 112u) << 23) | (man << 13));
  // zero or subnormal: man * 2^-24, exact in fp32
  const float mag = static_cast<float>(man) * float_of(0x33800000u);
  return float_of(sign | bits_of(mag));
}

// float -> fp16 bits, nearest even, overflow to inf; NaN: sign, quiet bit and the top payload
// bits (F16C's vcvtps2ph, which torch's cast uses).
inline uint16_t float_to_half(float f) {
  const uint32_t u = bits_of(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7e00u | static_cast<uint16_t>((a >> 13) & 0x3ffu);
  if (a >= 0x477ff000u) return sign | 0x7c00u;  // rounds to >= 65520: inf
  if (a >= 0x38800000u) {                        // normal fp16
    const uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
    return sign | static_cast<uint16_t>((r - (112u << 23)) >> 13);
  }
  // subnormal fp16 (or zero): the value in units of 2^-24, rounded to nearest even by an fp32
  // addition of 0.5 (2^-1 units): exact arithmetic since |f| < 2^-14
  const float units = float_of(a) * float_of(0x4b800000u);  // * 2^24, exact
  const float rounded = (units + float_of(0x4b000000u)) - float_of(0x4b000000u);  // RNE to int
  return sign | static_cast<uint16_t>(rounded);
}

template <int kDType>
inline float widen(uint16_t w) {
  if constexpr (kDType == kBFloat16) return bf16_to_float(w);
  return half_to_float(w);
}

template <int kDType>
inline uint16_t narrow(float f, bool fma_build) {
  if constexpr (kDType == kBFloat16) return float_to_bf16(f, fma_build);
  (void)fma_build;
  return float_to_half(f);
}

// The master rounded to the weight dtype, as a float (NaN stays NaN).
template <int kDType>
inline float rounded(float m) {
  if constexpr (kDType == kBFloat16) {
    const uint32_t u = bits_of(m);
    if ((u & 0x7fffffffu) > 0x7f800000u) return m;
    return float_of((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
  }
  return half_to_float(float_to_half(m));
}

// a * b + c, fused (one rounding) or not (two), as the torch build does.
template <bool kFma>
inline float madd(float a, float b, float c) {
  if constexpr (kFma) return std::fma(a, b, c);
  return a * b + c;
}

// Steps 1 and 2 for element i: the resynced master and the (unscaled) gradient.
template <int kDType>
inline float take_master(const Row& r, int64_t i) {
  const float w = widen<kDType>(r.weight[i]);
  const float m = r.master[i];
  return (w == rounded<kDType>(m)) ? m : w;
}

inline float take_grad(const Row& r, const Consts& c, int64_t i) {
  float g = r.grad[i];
  if (c.scale) {
    g = g / c.gs;
    if (c.flags & kFlagWriteGrad) r.grad[i] = g;
  }
  return g;
}

// One Adam element. kTail: torch's scalar loop (the last n % 8 elements), else its vector code.
template <int kDType, bool kFma, bool kTail>
inline void adam_elem(const Row& r, const Consts& c, int64_t i) {
  float p = take_master<kDType>(r, i);
  float g = take_grad(r, c, i);
  if (c.flags & kFlagMaximize) g = kTail ? -g : g * -1.0f;
  if (c.wd != 0.0f) {
    if (c.flags & kFlagAdamW)
      p = p * c.decay;
    else
      g = madd<kFma>(p, c.wd, g);
  }
  float m = r.s0[i];
  m = c.small_lerp ? madd<kFma>(c.lerp_w, g - m, m) : madd<kFma>(c.lerp_w1, g - m, g);
  const float cg = c.c2 * g;
  const float v = kTail ? madd<kFma>(r.s1[i], c.beta2, cg * g)  // torch's scalar loop
                        : madd<kFma>(cg, g, r.s1[i] * c.beta2);  // its vector code
  r.s0[i] = m;
  r.s1[i] = v;
  float d = v;
  if (c.flags & kFlagAmsgrad) {
    const float mx = r.s2[i];
    if (kTail)
      d = (mx < v) ? v : mx;  // std::max
    else
      d = (std::isnan(mx) || std::isnan(v)) ? float_of(0xffffffffu) : std::max(mx, v);
    r.s2[i] = d;
  }
  const float denom = std::sqrt(d) / r.bc2_sqrt + c.eps;
  p = kTail ? p - (r.step_size * m) / denom : p + (r.neg_step_size * m) / denom;
  r.master[i] = p;
  r.weight[i] = narrow<kDType>(p, kFma);
}

// One SGD element (kTail as above).
template <int kDType, bool kFma, bool kTail>
inline void sgd_elem(const Row& r, const Consts& c, int64_t i) {
  float p = take_master<kDType>(r, i);
  float g = take_grad(r, c, i);
  if (c.flags & kFlagMaximize) g = kTail ? -g : g * -1.0f;
  if (c.wd != 0.0f) g = madd<kFma>(p, c.wd, g);
  if (c.flags & kFlagMomentum) {
    float b;
    if (c.flags & kFlagFirstStep)
      b = g;
    else
      b = kTail ? madd<kFma>(r.s0[i], c.momentum, g * c.damp)
                : madd<kFma>(c.damp, g, r.s0[i] * c.momentum);
    r.s0[i] = b;
    g = (c.flags & kFlagNesterov) ? madd<kFma>(b, c.momentum, g) : b;
  }
  p = kTail ? madd<kFma>(-g, c.lr, p) : madd<kFma>(g, c.neg_lr, p);
  r.master[i] = p;
  r.weight[i] = narrow<kDType>(p, kFma);
}

// Elements [begin, end) of one tensor, portable code.
template <int kDType, bool kFma, bool kAdam>
void run_generic(const Row& r, const Consts& c, int64_t begin, int64_t end) {
  const int64_t body = r.numel - r.numel % 8;
  const int64_t split = std::clamp(body, begin, end);
  for (int64_t i = begin; i < split; ++i) {
    if constexpr (kAdam) adam_elem<kDType, kFma, false>(r, c, i);
    else sgd_elem<kDType, kFma, false>(r, c, i);
  }
  for (int64_t i = split; i < end; ++i) {
    if constexpr (kAdam) adam_elem<kDType, kFma, true>(r, c, i);
    else sgd_elem<kDType, kFma, true>(r, c, i);
  }
}

}  // namespace accumkernels::master_cpu
