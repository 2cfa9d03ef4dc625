// The fused master step's CUDA kernel: per element of each (fp32 master, bf16/fp16 weight) pair,
//   1. resync: the master takes float(weight) where weight != round(master) (in the weight dtype;
//      NaN differs): the user wrote the weight;
//   2. g = grad / grad_scale (optional; stored back when asked, as torch's fused kernels do);
//   3. the update of the master and its state, bit for bit as torch's own CUDA fused kernel
//      computes it for an fp32 param (torch.optim.Adam/AdamW/SGD(fused=True));
//   4. weight = round_to_nearest_even(master) (torch's weight.copy_(master)).
// With found_inf given and nonzero (NaN included) nothing is written, in every backend. torch's
// fused kernels skip only on exactly 1.0: a GradScaler that sums found_inf over two devices (2.0)
// makes them update with the non-finite gradients; here that step is skipped (the weights stay
// finite), while the steps still drop by found_inf as torch's do. Everything read from device
// memory (found_inf, grad_scale, a tensor lr, each tensor's step): no host synchronisation.
//
// Written once for two compilers, like accumulate_kernel.h (whose host stand-ins of CUDA's
// vector and 16-bit types this file reuses): nvcc compiles it into master_step_cuda.cu, the host
// compiler into master_step_cuda_host.cpp, which plays each launch block by block, thread by
// thread, so that tests run this exact code without a GPU.
//
// ---- The arithmetic ------------------------------------------------------------------------
// torch writes its kernels as plain C++ expressions and nvcc (default --fmad=true) contracts some
// a*b+c into FMAs. Here every operation is an explicit correctly rounded intrinsic (__fadd_rn,
// __fmul_rn, __fdiv_rn, __fsqrt_rn, __fmaf_rn, their double forms, __double2float_rn), chosen to
// reproduce what nvcc 13.0 makes of torch's expressions for sm_90: which products it fuses was
// read from the SASS (FFMA/DFMA vs FMUL/DMUL+FADD) of those expression forms compiled with
// `nvcc -arch=sm_90 -O3` (the notes after each line). On the host the same operations are
// std::fma, +, *, /, std::sqrt in float or double, with no contraction, so the emulation computes
// what the device computes. Notation: RN32/RN64 = round to fp32/fp64, fma64 = fused in double.
//
// SGD (torch's scalars are double; p, g, buf fp32):
//   g = g / scale                  fp32 division (torch divides by double(scale); nvcc emits the
//                                  fp32 division, which is the same value: 53 >= 2*24+2)
//   g = -g                         (maximize; sign flip)
//   g = RN32(fma64(p, wd, g))                                    (wd != 0; DFMA)
//   b = g (first step) or fma64(1 - damp, g, RN64(mom * buf))    (DMUL, then DFMA: nvcc fuses
//                                  the second product of `mom * buf + (1 - damp) * g`)
//   buf = RN32(b); g = nesterov ? RN32(fma64(b, mom, g)) : RN32(b)   (b unrounded)
//   p = RN32(fma64(-lr, g, p))                                   (lr: double, or *lr_ptr)
// Adam/AdamW, torch <= 2.10 (kAdamF64: double scalars, fp32 state):
//   bc1 = RN32(1 - pow64(b1, step)), bc2s = RN32(sqrt64(1 - pow64(b2, step)))
//   ss  = RN32(lr / double(bc1))                                 (double division)
//   g = g / scale; gs = g (the stored grad); g = -g (maximize)
//   Adam:  g = RN32(fma64(p, wd, g));  AdamW: p = RN32(fma64(-RN64(lr * wd), p, p))  (wd != 0)
//   m = RN32(fma64(b1, m, RN64((1 - b1) * g)))                   (the first product fused)
//   v = RN32(fma64(b2, v, RN64(RN64((1 - b2) * g) * g)))
//   u = amsgrad ? (vmax = vmax < v ? v : vmax) : v               (std::max: compare + select)
//   d = RN32(double(sqrt32(u) / bc2s) + eps)
//   p = p - (ss * m) / d                                         (fp32 mul, div, sub)
// Adam/AdamW, torch >= 2.11 (kAdamF32: fp32 opmath, explicit fma in torch's source):
//   lr, b1, b2, wd, eps = RN32(double) (a tensor lr is read as fp32)
//   bc1 = 1 - powf(b1, step), bc2s = sqrt32(1 - powf(b2, step)), ss = lr / bc1
//   Adam:  g = fma32(p, wd, g);        AdamW: p = fma32(-(lr * wd), p, p)             (wd != 0)
//   m = fma32(b1, m, fma32(-b1, g, g)); g2 = g * g; v = fma32(b2, v, fma32(-b2, g2, g2))
//   u as above; d = sqrt32(u) / bc2s + eps; p = p - (ss * m) / d
// pow: on the device the same libdevice pow/powf torch calls (nvcc -ftz=false: __nv_powf is an
// fp32 log2/exp2 polynomial with one rcp.approx, not correctly rounded in general), so the device
// matches torch. On the host pow32 is RN32(double pow), pow64 glibc's pow: a model of a correctly
// rounded power, NOT of nvcc's powf. The host tests therefore prove every operation but pow (their
// model is the correctly rounded power, which the host equals on their betas and steps);
// tests/op/test_master_step_triton.py shows Triton's pow is nvcc's powf op for op, and only a GPU
// compares nvcc's powf with the model (tests/op/test_master_step_gpu.py).
// NaN: the GPU returns the canonical NaN (0x7fffffff) from arithmetic; the host wrappers below
// do the same, so bit patterns agree. Rounding to bf16/fp16 gives 0x7fff for NaN (cvt.rn).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "accumulate_kernel.h"

#if !defined(__CUDACC__)
#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif
#endif

namespace accumkernels {

// ---- the call (plain C++: the bindings build it, both builds launch it) ----------------------

// Which update: SGD, or Adam/AdamW in the arithmetic of torch's CUDA kernel up to 2.10 (double
// scalars) or from 2.11 (fp32 with explicit fma). The values are part of the Python interface.
enum MasterStepAlgo : int32_t { kStepSgd = 0, kStepAdamF64 = 1, kStepAdamF32 = 2 };

enum MasterStepFlag : uint32_t {
  kStepAmsgrad = 1,
  kStepMaximize = 2,
  kStepAdamW = 4,     // decoupled weight decay
  kStepNesterov = 8,
  kStepFirst = 16,    // SGD's first step: the momentum buffer takes the gradient
  kStepMomentum = 32, // SGD with a momentum buffer
  kStepWriteGrad = 64 // with grad_scale: store the unscaled gradient
};

// One parameter. state0/1/2: exp_avg, exp_avg_sq, max_exp_avg_sq (Adam) or the momentum buffer
// (SGD, state0); unused ones may be null. step: the (already incremented) fp32 step (Adam).
struct MasterStepTensor {
  float* master;
  void* weight;  // bf16 or fp16 (weight_dtype: kBFloat16 / kFloat16)
  float* grad;
  float* state0;
  float* state1;
  float* state2;
  const float* step;
  int64_t numel;
  int32_t weight_dtype;
};

struct MasterStepCall {
  int32_t algo;
  uint32_t flags;
  const MasterStepTensor* tensors;
  size_t num_tensors;
  double lr, beta1, beta2, weight_decay, eps, momentum, dampening;
  const float* lr_ptr;      // optional tensor lr (device memory; host memory for the emulation)
  const float* grad_scale;  // optional
  const float* found_inf;   // optional: nonzero -> nothing is written
};

// One launch per weight dtype on `stream` of `device` (< 0: current). CUDA builds only.
void master_step_cuda(const MasterStepCall& call, void* stream, int device);
// Loads every instantiation of the kernel on `device` (so that none is first loaded inside a
// CUDA-graph capture): "" when done, else why not. CUDA builds only; never throws.
std::string master_step_cuda_load(int device);

namespace master_step {
namespace {

constexpr int kThreads = 256;
constexpr int kLanes = 4;              // elements per thread per iteration: float4 state accesses
constexpr int64_t kChunk = 8192;       // elements per chunk (a block's unit of work)
constexpr int kBlocksPerSM = 3;  // all resident: __launch_bounds__ allows 80 registers, no spills
constexpr int kMaxParamEntries = 400;  // 72-byte entries in the 32 KB kernel-parameter space

// ---- exactly rounded operations, one definition per compiler --------------------------------

#if defined(__CUDA_ARCH__)
__device__ __forceinline__ float add32(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub32(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul32(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float div32(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqrt32(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float fma32(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ float pow32(float a, float b) { return powf(a, b); }
__device__ __forceinline__ double add64(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub64(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul64(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double div64(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqrt64(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ double fma64(double a, double b, double c) { return __fma_rn(a, b, c); }
__device__ __forceinline__ double pow64(double a, double b) { return pow(a, b); }
__device__ __forceinline__ float to32(double a) { return __double2float_rn(a); }
__device__ __forceinline__ float neg32(float a) {  // a sign flip, as torch's `-grad` compiles
  return __uint_as_float(__float_as_uint(a) ^ 0x80000000u);
}
#else
// The GPU's arithmetic returns the canonical NaN; x86 propagates an operand's payload.
inline float canon(float x) {
  if (x == x) return x;
  const uint32_t u = 0x7fffffffu;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline double canon(double x) {
  if (x == x) return x;
  const uint64_t u = 0x7fffffffffffffffull;
  std::memcpy(&x, &u, sizeof x);
  return x;
}
inline float add32(float a, float b) { return canon(a + b); }
inline float sub32(float a, float b) { return canon(a - b); }
inline float mul32(float a, float b) { return canon(a * b); }
inline float div32(float a, float b) { return canon(a / b); }
inline float sqrt32(float a) { return canon(std::sqrt(a)); }
inline float fma32(float a, float b, float c) { return canon(std::fma(a, b, c)); }
inline float pow32(float a, float b) {
  return canon(static_cast<float>(std::pow(static_cast<double>(a), static_cast<double>(b))));
}
inline double add64(double a, double b) { return canon(a + b); }
inline double sub64(double a, double b) { return canon(a - b); }
inline double mul64(double a, double b) { return canon(a * b); }
inline double div64(double a, double b) { return canon(a / b); }
inline double sqrt64(double a) { return canon(std::sqrt(a)); }
inline double fma64(double a, double b, double c) { return canon(std::fma(a, b, c)); }
inline double pow64(double a, double b) { return canon(std::pow(a, b)); }
inline float to32(double a) { return static_cast<float>(a); }  // payload kept, as cvt does
inline float neg32(float a) {
  uint32_t u;
  std::memcpy(&u, &a, sizeof u);
  u ^= 0x80000000u;
  std::memcpy(&a, &u, sizeof a);
  return a;
}
#endif

// fp32 -> bf16/fp16 bits, round to nearest even, NaN -> 0x7fff (what cvt.rn does on sm_80+, and
// so torch's c10 conversion on those GPUs).
#if defined(__CUDACC__)
AK_HD uint16_t round_bits(float x, bf16_t) { return __bfloat16_as_ushort(__float2bfloat16_rn(x)); }
AK_HD uint16_t round_bits(float x, half_t) { return __half_as_ushort(__float2half_rn(x)); }
AK_HD float widen_bits(uint16_t h, bf16_t) { return __bfloat162float(__ushort_as_bfloat16(h)); }
AK_HD float widen_bits(uint16_t h, half_t) { return __half2float(__ushort_as_half(h)); }
#else
inline uint16_t round_bits(float x, bf16_t) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
inline uint16_t round_bits(float x, half_t) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return 0x7fff;
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  uint32_t mant, shift;
  if (a >= 0x38800000u) {  // normal half: keep 10 of 23 fraction bits, rebias the exponent
    mant = a - 0x38000000u;
    shift = 13;
  } else {  // subnormal half (or zero): value / 2^-24 with the implicit bit made explicit
    const uint32_t e = a >> 23;
    if (e < 102) return static_cast<uint16_t>(sign);  // below 2^-25: rounds to zero
    mant = (a & 0x7fffffu) | 0x800000u;
    shift = 126 - e;  // 14..24
  }
  const uint32_t keep = mant >> shift;
  const uint32_t rest = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  const uint32_t up = rest > half || (rest == half && (keep & 1u));
  return static_cast<uint16_t>(sign | (keep + up));  // a carry moves into the exponent: right
}
inline float widen_bits(uint16_t h, bf16_t) { return to_float(bf16_t{h}); }
inline float widen_bits(uint16_t h, half_t) { return to_float(half_t{h}); }
#endif

// ---- the launch's data -------------------------------------------------------------------------

struct Entry {  // 72 bytes
  float* master;
  uint16_t* weight;
  float* grad;
  float* s0;
  float* s1;
  float* s2;
  const float* step;
  int64_t numel;
  int32_t chunk_begin;
  int32_t pad;
};

template <int kCap>
struct ParamTable {
  int32_t num_tensors;
  Entry t[kCap];
};
static_assert(sizeof(ParamTable<kMaxParamEntries>) + 160 <= 32764, "kernel parameters too big");

struct LaunchArgs {
  int64_t num_chunks;
  uint32_t flags;
  double lr, beta1, beta2, weight_decay, eps, momentum, dampening;
  const float* lr_ptr;
  const float* grad_scale;
  const float* found_inf;
};

// Per-tensor constants of the update (Adam: from the tensor's step).
struct Scalars {
  float scale;  // grad scale (has_scale)
  bool has_scale;
  // kAdamF32 / the fp32 parts of kAdamF64
  float lr32, b1_32, b2_32, wd32, eps32, bc1, bc2s, ss;
  // kAdamF64 / SGD
  double lr64, wd64;
};

// ---- one element ----------------------------------------------------------------------------

// State of one element in registers; the update functions change it in place.
struct Lane {
  float p, g, s0, s1, s2;  // master, gradient, state
  float gs;                // the gradient to store (after the unscale)
};

template <int kAlgo>
AK_HD void update(Lane& x, const Scalars& c, const LaunchArgs& a) {
  const uint32_t f = a.flags;
  float g = x.g;
  if (c.has_scale) g = div32(g, c.scale);
  x.gs = g;
  if (f & kStepMaximize) g = neg32(g);
  if (kAlgo == kStepSgd) {
    if (c.wd64 != 0.0) g = to32(fma64(x.p, c.wd64, g));
    if (f & kStepMomentum) {
      const double b = (f & kStepFirst) ? static_cast<double>(g)
                                          : fma64(sub64(1.0, a.dampening), g,
                                                  mul64(a.momentum, x.s0));
      x.s0 = to32(b);
      g = (f & kStepNesterov) ? to32(fma64(b, a.momentum, g)) : to32(b);
    }
    x.p = to32(fma64(-c.lr64, g, x.p));
  } else if (kAlgo == kStepAdamF64) {
    if (c.wd64 != 0.0) {
      if (f & kStepAdamW) x.p = to32(fma64(-mul64(c.lr64, c.wd64), x.p, x.p));
      else g = to32(fma64(x.p, c.wd64, g));
    }
    x.s0 = to32(fma64(a.beta1, x.s0, mul64(sub64(1.0, a.beta1), g)));
    x.s1 = to32(fma64(a.beta2, x.s1, mul64(mul64(sub64(1.0, a.beta2), g), g)));
    float u = x.s1;
    if (f & kStepAmsgrad) u = x.s2 = x.s2 < x.s1 ? x.s1 : x.s2;
    const float d = to32(add64(div32(sqrt32(u), c.bc2s), a.eps));
    x.p = sub32(x.p, div32(mul32(c.ss, x.s0), d));
  } else {  // kStepAdamF32
    if (c.wd32 != 0.0f) {
      if (f & kStepAdamW) x.p = fma32(-mul32(c.lr32, c.wd32), x.p, x.p);
      else g = fma32(x.p, c.wd32, g);
    }
    x.s0 = fma32(c.b1_32, x.s0, fma32(-c.b1_32, g, g));
    const float g2 = mul32(g, g);
    x.s1 = fma32(c.b2_32, x.s1, fma32(-c.b2_32, g2, g2));
    float u = x.s1;
    if (f & kStepAmsgrad) u = x.s2 = x.s2 < x.s1 ? x.s1 : x.s2;
    const float d = add32(div32(sqrt32(u), c.bc2s), c.eps32);
    x.p = sub32(x.p, div32(mul32(c.ss, x.s0), d));
  }
}

// Resync, update, and the weight to write (its bits), for one element.
template <int kAlgo, class W>
AK_HD uint16_t step_element(Lane& x, uint16_t w_bits, const Scalars& c, const LaunchArgs& a) {
  const float w = widen_bits(w_bits, W{});
  if (w != widen_bits(round_bits(x.p, W{}), W{})) x.p = w;  // NaN != NaN: taken too
  update<kAlgo>(x, c, a);
  return round_bits(x.p, W{});
}

template <int kAlgo>
AK_HD Scalars tensor_scalars(const LaunchArgs& a, const Entry& e) {
  Scalars c{};
  c.has_scale = a.grad_scale != nullptr;
  c.scale = c.has_scale ? *a.grad_scale : 1.0f;
  c.lr64 = a.lr_ptr != nullptr ? static_cast<double>(*a.lr_ptr) : a.lr;
  c.wd64 = a.weight_decay;
  if (kAlgo == kStepAdamF64) {
    const double s = static_cast<double>(*e.step);
    c.bc1 = to32(sub64(1.0, pow64(a.beta1, s)));
    c.bc2s = to32(sqrt64(sub64(1.0, pow64(a.beta2, s))));
    c.ss = to32(div64(c.lr64, static_cast<double>(c.bc1)));
  } else if (kAlgo == kStepAdamF32) {
    c.lr32 = a.lr_ptr != nullptr ? *a.lr_ptr : to32(a.lr);
    c.b1_32 = to32(a.beta1);
    c.b2_32 = to32(a.beta2);
    c.wd32 = to32(a.weight_decay);
    c.eps32 = to32(a.eps);
    const float s = *e.step;
    c.bc1 = sub32(1.0f, pow32(c.b1_32, s));
    c.bc2s = sqrt32(sub32(1.0f, pow32(c.b2_32, s)));
    c.ss = div32(c.lr32, c.bc1);
  }
  return c;
}

// ---- memory access ---------------------------------------------------------------------------

AK_HD void load4(const float* p, float (&v)[kLanes]) {
  const f32x4 q = *reinterpret_cast<const f32x4*>(p);
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
AK_HD void store4(float* p, const float (&v)[kLanes]) {
  f32x4 q;
  q.x = v[0], q.y = v[1], q.z = v[2], q.w = v[3];
  *reinterpret_cast<f32x4*>(p) = q;
}
AK_HD void load4(const uint16_t* p, uint16_t (&v)[kLanes]) {  // 8-byte aligned
  uint64_t q = *reinterpret_cast<const uint64_t*>(p);
  for (int k = 0; k < kLanes; ++k) v[k] = static_cast<uint16_t>(q >> (16 * k));
}
AK_HD void store4(uint16_t* p, const uint16_t (&v)[kLanes]) {
  uint64_t q = 0;
  for (int k = 0; k < kLanes; ++k) q |= static_cast<uint64_t>(v[k]) << (16 * k);
  *reinterpret_cast<uint64_t*>(p) = q;
}

// One chunk [start, start + len) of tensor e by the whole block, as thread `thread` of it.
template <int kAlgo, class W>
AK_HD void step_chunk(const Entry& e, int64_t start, int len, const Scalars& c,
                      const LaunchArgs& a, unsigned thread) {
  const uint32_t f = a.flags;
  const bool adam = kAlgo != kStepSgd;
  const bool s1 = adam;
  const bool s0 = adam || (f & kStepMomentum);
  const bool s2 = adam && (f & kStepAmsgrad);
  const bool store_grad = c.has_scale && (f & kStepWriteGrad);
  float* master = e.master + start;
  uint16_t* weight = e.weight + start;
  float* grad = e.grad + start;
  float* st0 = s0 ? e.s0 + start : nullptr;
  float* st1 = s1 ? e.s1 + start : nullptr;
  float* st2 = s2 ? e.s2 + start : nullptr;
  uintptr_t wide = reinterpret_cast<uintptr_t>(master) | reinterpret_cast<uintptr_t>(grad);
  if (s0) wide |= reinterpret_cast<uintptr_t>(st0);
  if (s1) wide |= reinterpret_cast<uintptr_t>(st1);
  if (s2) wide |= reinterpret_cast<uintptr_t>(st2);
  int scalar_from = 0;
  if ((wide & 15) == 0 && (reinterpret_cast<uintptr_t>(weight) & 7) == 0) {
    const int nvec = len / kLanes;
    for (int v = static_cast<int>(thread); v < nvec; v += kThreads) {
      const int i = v * kLanes;
      float p[kLanes], g[kLanes], a0[kLanes], a1[kLanes], a2[kLanes];
      uint16_t w[kLanes];
      load4(master + i, p);
      load4(grad + i, g);
      load4(weight + i, w);
      if (s0) load4(st0 + i, a0);
      if (s1) load4(st1 + i, a1);
      if (s2) load4(st2 + i, a2);
      for (int k = 0; k < kLanes; ++k) {
        Lane x{p[k], g[k], s0 ? a0[k] : 0.0f, s1 ? a1[k] : 0.0f, s2 ? a2[k] : 0.0f, 0.0f};
        w[k] = step_element<kAlgo, W>(x, w[k], c, a);
        p[k] = x.p, g[k] = x.gs, a0[k] = x.s0, a1[k] = x.s1, a2[k] = x.s2;
      }
      store4(master + i, p);
      store4(weight + i, w);
      if (store_grad) store4(grad + i, g);
      if (s0) store4(st0 + i, a0);
      if (s1) store4(st1 + i, a1);
      if (s2) store4(st2 + i, a2);
    }
    scalar_from = nvec * kLanes;
  }
  // Unaligned tensors and the < kLanes tail of aligned ones.
  for (int i = scalar_from + static_cast<int>(thread); i < len; i += kThreads) {
    Lane x{master[i], grad[i], s0 ? st0[i] : 0.0f, s1 ? st1[i] : 0.0f, s2 ? st2[i] : 0.0f, 0.0f};
    weight[i] = step_element<kAlgo, W>(x, weight[i], c, a);
    master[i] = x.p;
    if (store_grad) grad[i] = x.gs;
    if (s0) st0[i] = x.s0;
    if (s1) st1[i] = x.s1;
    if (s2) st2[i] = x.s2;
  }
}

// Thread `thread` of block `block` (of `grid`): every chunk of the grid-stride loop.
template <int kAlgo, class W, class Table>
AK_HD void step_thread(const Table& table, const LaunchArgs& a, unsigned block, unsigned thread,
                       unsigned grid) {
  if (a.found_inf != nullptr && *a.found_inf != 0.0f) return;  // uniform: the whole grid leaves
  for (int64_t c = block; c < a.num_chunks; c += grid) {
    int lo = 0, hi = table.num_tensors - 1;  // last tensor whose first chunk is <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table.t[mid].chunk_begin <= c) lo = mid;
      else hi = mid - 1;
    }
    const Entry& e = table.t[lo];
    const int64_t start = (c - e.chunk_begin) * kChunk;
    const int len = static_cast<int>(e.numel - start < kChunk ? e.numel - start : kChunk);
    step_chunk<kAlgo, W>(e, start, len, tensor_scalars<kAlgo>(a, e), a, thread);
  }
}

// ---- launch marshalling (host side of both builds) ---------------------------------------------
//
// A Launcher provides: int64_t max_grid();
// template <int kAlgo, class W, class Table> void run(const Table&, const LaunchArgs&, unsigned);

inline int64_t assign_chunks(Entry* e, size_t n) {
  int64_t chunks = 0;
  for (size_t i = 0; i < n; ++i) {
    if (chunks > INT32_MAX) throw std::invalid_argument("master_step_cuda: too many chunks");
    e[i].chunk_begin = static_cast<int32_t>(chunks);
    chunks += (e[i].numel + kChunk - 1) / kChunk;
  }
  return chunks;
}

template <class W, class Table, class Launcher>
void launch_table(int32_t algo, const Table& table, const LaunchArgs& a, Launcher& launcher) {
  if (a.num_chunks == 0) return;
  const auto grid = static_cast<unsigned>(a.num_chunks < launcher.max_grid() ? a.num_chunks
                                                                            : launcher.max_grid());
  if (algo == kStepSgd) launcher.template run<kStepSgd, W>(table, a, grid);
  else if (algo == kStepAdamF64) launcher.template run<kStepAdamF64, W>(table, a, grid);
  else launcher.template run<kStepAdamF32, W>(table, a, grid);
}

template <int kCap, class W, class Launcher>
void launch_param(int32_t algo, Entry* e, size_t n, LaunchArgs a, Launcher& launcher) {
  ParamTable<kCap> table;  // only the first n entries are read
  table.num_tensors = static_cast<int32_t>(n);
  a.num_chunks = assign_chunks(e, n);
  std::copy(e, e + n, table.t);
  launch_table<W>(algo, table, a, launcher);
}

template <class W, class Launcher>
void launch_param_any(int32_t algo, Entry* e, size_t n, const LaunchArgs& a, Launcher& launcher) {
  if (n <= 64) launch_param<64, W>(algo, e, n, a, launcher);
  else launch_param<kMaxParamEntries, W>(algo, e, n, a, launcher);
}

// One weight dtype's entries: parameter tables of up to kMaxParamEntries each, one launch per
// table. Always, not only while a stream is captured: a table in device memory would need a
// host-to-device copy per call, which from pageable memory may stall the host until the stream
// drains, and a pinned staging buffer would have to outlive the launch. The launches are
// stream-ordered and each tensor's update is independent, so groups give the same result.
template <class W, class Launcher>
void launch_group(int32_t algo, std::vector<Entry>& entries, const LaunchArgs& a,
                  Launcher& launcher) {
  const size_t n = entries.size();
  for (size_t i = 0; i < n; i += kMaxParamEntries)
    launch_param_any<W>(algo, entries.data() + i, std::min<size_t>(kMaxParamEntries, n - i), a,
                        launcher);
}

// The call's checks (memory safety: what the kernel dereferences) and its launches, one per
// weight dtype.
template <class Launcher>
void launch_call(const MasterStepCall& call, Launcher& launcher) {
  if (call.algo < kStepSgd || call.algo > kStepAdamF32)
    throw std::invalid_argument("master_step_cuda: unknown algorithm");
  const bool adam = call.algo != kStepSgd;
  const bool s0 = adam || (call.flags & kStepMomentum);
  const bool s2 = adam && (call.flags & kStepAmsgrad);
  std::vector<Entry> bf16, fp16;
  for (size_t i = 0; i < call.num_tensors; ++i) {
    const MasterStepTensor& t = call.tensors[i];
    if (t.numel < 0) throw std::invalid_argument("master_step_cuda: negative numel");
    if (t.numel == 0) continue;
    if (t.master == nullptr || t.weight == nullptr || t.grad == nullptr ||
        (s0 && t.state0 == nullptr) || (adam && t.state1 == nullptr) ||
        (s2 && t.state2 == nullptr) || (adam && t.step == nullptr))
      throw std::invalid_argument("master_step_cuda: null data pointer");
    const Entry e{t.master, static_cast<uint16_t*>(t.weight), t.grad, t.state0, t.state1,
                  t.state2, t.step, t.numel, 0, 0};
    if (t.weight_dtype == kBFloat16) bf16.push_back(e);
    else if (t.weight_dtype == kFloat16) fp16.push_back(e);
    else throw std::invalid_argument("master_step_cuda: weights must be bf16 or fp16");
  }
  const LaunchArgs a{0, call.flags, call.lr, call.beta1, call.beta2, call.weight_decay, call.eps,
                     call.momentum, call.dampening, call.lr_ptr, call.grad_scale, call.found_inf};
  launch_group<bf16_t>(call.algo, bf16, a, launcher);
  launch_group<half_t>(call.algo, fp16, a, launcher);
}

}  // namespace
}  // namespace master_step
}  // namespace accumkernels
