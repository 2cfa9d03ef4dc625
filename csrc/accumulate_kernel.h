// The CUDA kernel's body and its launch marshalling, written once for two compilers:
//  * nvcc (accumulate_cuda.cu): the __global__ kernel calls accumulate_thread() and launches go
//    through CudaLauncher; the device code is what it always was (benchmarks/sass_check.py);
//  * the host compiler (accumulate_cuda_host.cpp): the same functions run on the CPU, block by
//    block and thread by thread, so tests execute this exact code without a GPU.
// Device intrinsics (__ldcs, __stwb, the PTX store, __float_as_uint, bf16/fp16 conversions) sit
// behind the small wrappers below, each with a host definition.
//
// Internal linkage on purpose: the two translation units compile this header with different
// types (CUDA's float4 / the host stand-ins), so their copies must not meet at link time.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "accumulate.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define AK_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define AK_HD inline
#endif

#ifndef ACCUMKERNELS_VEC_STORE
#define ACCUMKERNELS_VEC_STORE 0
#endif
#if ACCUMKERNELS_VEC_STORE != 0 && ACCUMKERNELS_VEC_STORE != 1
#error "ACCUMKERNELS_VEC_STORE must be 0 (__stwb) or 1 (PTX st.global.v4.f32)"
#endif

namespace accumkernels {
namespace {

// 8 warps per block: enough independent 16-byte loads per block, and 4 blocks (1024 threads,
// <= 64 registers each) co-reside on an SM.
constexpr int kBlockThreads = 256;
// Resident blocks per SM for the persistent grid: 1024 threads x 2 vectors x 48 bytes ~ 96 KiB
// of loads in flight per SM, several times what Little's law asks of HBM3 at full speed.
constexpr int kBlocksPerSM = 4;
// Elements per vector: 8 bf16/fp16 = one 16-byte load; 8 fp32 = two float4.
constexpr int kVec = 8;
// Vectors per thread per loop iteration, all loaded before any is stored (more bytes in flight).
constexpr int kUnroll = 2;
// 8192 elements = 2 block iterations: small enough that a GPT-2-sized list gives every block
// ~30 chunks (good balance at the end of the grid), large enough to amortise the per-chunk
// table lookup.
constexpr int64_t kChunkElems = 8192;
// Tensors passed in the kernel-parameter table: 32 B each, 32 KB limit minus the other args.
constexpr int kMaxParamTensors = 1000;

// ---- types and intrinsics: CUDA's under nvcc, host stand-ins otherwise -------------------------

#if defined(__CUDACC__)
using f32x4 = float4;
using u32x4 = uint4;
using bf16_t = __nv_bfloat16;
using half_t = __half;
using bf16x2_t = __nv_bfloat162;
using halfx2_t = __half2;
#else
struct alignas(16) f32x4 {
  float x, y, z, w;
};
struct alignas(16) u32x4 {
  uint32_t x, y, z, w;
};
struct bf16_t {
  uint16_t bits;
};
struct half_t {
  uint16_t bits;
};
struct alignas(4) bf16x2_t {
  bf16_t lo, hi;
};
struct alignas(4) halfx2_t {
  half_t lo, hi;
};

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// IEEE binary16 -> binary32, exact (every half value is a float), NaN payloads kept.
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (man << 13));
  if (man == 0) return bits_to_float(sign);
  uint32_t e = 113;  // subnormal: shift the leading 1 into the implicit bit
  while ((man & 0x400u) == 0) man <<= 1, --e;
  return bits_to_float(sign | (e << 23) | ((man & 0x3ffu) << 13));
}
#endif

// Streaming (read-once) 16-byte load.
AK_HD f32x4 load_stream(const f32x4* p) {
#if defined(__CUDA_ARCH__)
  return __ldcs(p);
#else
  return *p;
#endif
}
AK_HD u32x4 load_stream(const u32x4* p) {
#if defined(__CUDA_ARCH__)
  return __ldcs(p);
#else
  return *p;
#endif
}

AK_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
#endif
}

AK_HD int64_t min64(int64_t a, int64_t b) {
#if defined(__CUDA_ARCH__)
  return min(a, b);
#else
  return std::min(a, b);
#endif
}

#if defined(__CUDACC__)  // CUDA's conversions are __host__ __device__
AK_HD float to_float(bf16_t x) { return __bfloat162float(x); }
AK_HD float to_float(half_t x) { return __half2float(x); }
AK_HD void widen2(const bf16x2_t& h, float& a, float& b) {
  const float2 f = __bfloat1622float2(h);
  a = f.x, b = f.y;
}
AK_HD void widen2(const halfx2_t& h, float& a, float& b) {
  const float2 f = __half22float2(h);
  a = f.x, b = f.y;
}
#else
inline float to_float(bf16_t x) { return bits_to_float(static_cast<uint32_t>(x.bits) << 16); }
inline float to_float(half_t x) { return half_bits_to_float(x.bits); }
inline void widen2(const bf16x2_t& h, float& a, float& b) {
  a = to_float(h.lo), b = to_float(h.hi);
}
inline void widen2(const halfx2_t& h, float& a, float& b) {
  a = to_float(h.lo), b = to_float(h.hi);
}
#endif
AK_HD float to_float(float x) { return x; }

// Store 4 floats at p (16-byte aligned). A plain `*reinterpret_cast<float4*>(p) = v` is split
// into 4 scalar stores by nvcc here, so the vector path names its store explicitly (see the
// ACCUMKERNELS_VEC_STORE note in accumulate_cuda.cu).
AK_HD void store4(float* p, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && ACCUMKERNELS_VEC_STORE == 1
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
#elif defined(__CUDA_ARCH__)
  __stwb(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
#else
  p[0] = a, p[1] = b, p[2] = c, p[3] = d;
#endif
}

// ---- the launch's data -------------------------------------------------------------------------

struct TensorEntry {  // 32 bytes
  float* dst;
  const void* src;
  int64_t numel;
  int32_t chunk_begin;  // index of this tensor's first chunk in the launch
  int32_t dtype;        // the dtype code; with norm_sq, | norm_slot << kDTypeBits
};

constexpr int kDTypeBits = 2;
constexpr int32_t kDTypeMask = (1 << kDTypeBits) - 1;
static_assert(kMaxNormSlots <= (INT32_MAX >> kDTypeBits) + 1, "norm slots do not fit the table");

template <int kCap>
struct ParamTable {
  int32_t num_tensors;
  TensorEntry t[kCap];
};
static_assert(sizeof(ParamTable<kMaxParamTensors>) + 64 <= 32764, "kernel parameters too big");

struct LaunchArgs {
  int64_t num_chunks;
  float scale;             // used when scale_ptr is null
  const float* scale_ptr;  // device address or null
  float* found_inf;        // device address or null
  float* norm_sq;          // device address or null (the kNorm kernels only)
  bool zero_norm;          // kNorm only: this launch (one block) zeroes the table's norm slots
};

// ---- per-thread work ---------------------------------------------------------------------------

AK_HD bool nonfinite(float x) { return (float_bits(x) & 0x7f800000u) == 0x7f800000u; }

// Load 8 source elements (16-byte aligned) as fp32. src is read once: streaming load.
AK_HD void load8(const float* p, float (&x)[kVec]) {
  const f32x4 a = load_stream(reinterpret_cast<const f32x4*>(p));
  const f32x4 b = load_stream(reinterpret_cast<const f32x4*>(p) + 1);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
AK_HD void load8(const bf16_t* p, float (&x)[kVec]) {
  const u32x4 raw = load_stream(reinterpret_cast<const u32x4*>(p));
  const auto* h = reinterpret_cast<const bf16x2_t*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) widen2(h[k], x[2 * k], x[2 * k + 1]);
}
AK_HD void load8(const half_t* p, float (&x)[kVec]) {
  const u32x4 raw = load_stream(reinterpret_cast<const u32x4*>(p));
  const auto* h = reinterpret_cast<const halfx2_t*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) widen2(h[k], x[2 * k], x[2 * k + 1]);
}

// Load 8 dst elements (16-byte aligned); plain loads: dst is written right back.
AK_HD void load8_dst(const float* p, float (&x)[kVec]) {
  const f32x4 a = reinterpret_cast<const f32x4*>(p)[0];
  const f32x4 b = reinterpret_cast<const f32x4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// One chunk (len <= kChunkElems elements) by the whole block, as thread `thread` of it; returns
// this thread's bad flag. kNorm: adds the squares of the values it writes to `sq`.
template <typename T, bool kOverwrite, bool kNorm>
AK_HD bool accumulate_chunk(float* __restrict__ dst, const T* __restrict__ src, int len,
                            float scale, unsigned thread, float& sq) {
  int scalar_from = 0;  // (declared first: keeps the SASS of the pre-host-build kernel)
  bool bad = false;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int nvec = len / kVec;
    for (int v0 = thread; v0 < nvec; v0 += kBlockThreads * kUnroll) {
      float x[kUnroll][kVec];
      float d[kUnroll][kVec];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * kBlockThreads;
        if (v < nvec) {
          load8(src + v * kVec, x[u]);
          if (!kOverwrite) load8_dst(dst + v * kVec, d[u]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int v = v0 + u * kBlockThreads;
        if (v < nvec) {
#pragma unroll
          for (int k = 0; k < kVec; ++k) {
            d[u][k] = kOverwrite ? scale * x[u][k] : fmaf(scale, x[u][k], d[u][k]);
            bad |= nonfinite(d[u][k]);  // a non-finite src, or an overflowed sum
            if (kNorm) sq = fmaf(d[u][k], d[u][k], sq);
          }
          float* out = dst + v * kVec;
          store4(out, d[u][0], d[u][1], d[u][2], d[u][3]);
          store4(out + 4, d[u][4], d[u][5], d[u][6], d[u][7]);
        }
      }
    }
    scalar_from = nvec * kVec;
  }
  // Unaligned tensors (e.g. views at odd offsets) and the < kVec tail of aligned ones.
#pragma unroll 4
  for (int i = scalar_from + thread; i < len; i += kBlockThreads) {
    const float x = to_float(src[i]);
    const float y = kOverwrite ? scale * x : fmaf(scale, x, dst[i]);
    dst[i] = y;
    bad |= nonfinite(y);
    if (kNorm) sq = fmaf(y, y, sq);
  }
  return bad;
}

// Adds a thread's partial sum of squares to *slot: on the GPU a shuffle tree over the warp, then
// one atomicAdd by its lane 0 (all 32 lanes call it: the caller's control flow is block-uniform);
// on the host, where threads run one after another, a plain add.
AK_HD void add_norm(float* slot, float sq, unsigned thread) {
#if defined(__CUDA_ARCH__)
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) sq += __shfl_xor_sync(0xffffffffu, sq, offset);
  if ((thread & 31u) == 0) atomicAdd(slot, sq);
#else
  (void)thread;
  *slot += sq;
#endif
}

// Thread `thread` of block `block` (of `grid`) up to the block-wide barrier: every chunk of
// the grid-stride loop; returns the thread's bad flag (the kernel ORs it over the block).
// kNorm: each thread sums the squares it writes in a chunk, and after the chunk (a block-uniform
// point) its warp adds them to the tensor's slot. (Carrying the sum over a block's consecutive
// chunks of one tensor saves atomics but cost a table-in-device-memory kernel a 24-byte spill.)
template <class Table, bool kOverwrite, bool kNorm>
AK_HD bool accumulate_thread(const Table& table, const LaunchArgs& args, unsigned block,
                             unsigned thread, unsigned grid) {
  const float scale = args.scale_ptr != nullptr ? *args.scale_ptr : args.scale;
  bool bad = false;
  for (int64_t c = block; c < args.num_chunks; c += grid) {
    // Last tensor whose first chunk is <= c (uniform across the block: broadcast reads).
    int lo = 0, hi = table.num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table.t[mid].chunk_begin <= c) lo = mid;
      else hi = mid - 1;
    }
    const TensorEntry& e = table.t[lo];
    float sq = 0.0f;
    const int32_t dtype = kNorm ? (e.dtype & kDTypeMask) : e.dtype;
    const int64_t start = (c - e.chunk_begin) * kChunkElems;  // 64-bit: tensors may be > 2^31
    const int len = static_cast<int>(min64(kChunkElems, e.numel - start));
    float* dst = e.dst + start;
    if (dtype == kBFloat16)
      bad |= accumulate_chunk<bf16_t, kOverwrite, kNorm>(
          dst, static_cast<const bf16_t*>(e.src) + start, len, scale, thread, sq);
    else if (dtype == kFloat16)
      bad |= accumulate_chunk<half_t, kOverwrite, kNorm>(
          dst, static_cast<const half_t*>(e.src) + start, len, scale, thread, sq);
    else
      bad |= accumulate_chunk<float, kOverwrite, kNorm>(
          dst, static_cast<const float*>(e.src) + start, len, scale, thread, sq);
    if (kNorm) add_norm(args.norm_sq + (e.dtype >> kDTypeBits), sq, thread);
  }
  return bad;
}

// The zero_norm launch (one block, before the accumulating one): every slot of the table to 0,
// empty tensors' included.
template <class Table>
AK_HD void zero_norm_slots(const Table& table, const LaunchArgs& args, unsigned thread) {
  for (int i = static_cast<int>(thread); i < table.num_tensors; i += kBlockThreads)
    args.norm_sq[table.t[i].dtype >> kDTypeBits] = 0.0f;
}

// The kernel's body up to the barrier, for both kinds of launch.
template <class Table, bool kOverwrite, bool kNorm>
AK_HD bool kernel_thread(const Table& table, const LaunchArgs& args, unsigned block,
                         unsigned thread, unsigned grid) {
  if (kNorm && args.zero_norm) {
    zero_norm_slots(table, args, thread);
    return false;
  }
  return accumulate_thread<Table, kOverwrite, kNorm>(table, args, block, thread, grid);
}

// After the barrier: `block_bad` is the OR of the block's flags (only called with found_inf).
AK_HD void after_barrier(const LaunchArgs& args, bool block_bad, unsigned thread) {
  if (block_bad && thread == 0) *args.found_inf = 1.0f;
}

// ---- launch marshalling (host side of both builds) ---------------------------------------------
//
// A Launcher provides: int64_t max_grid();
// template <class Table, bool kOverwrite, bool kNorm>
//   void run(const Table&, const LaunchArgs&, unsigned grid);

template <class Table, bool kNorm, class Launcher>
void launch_kind(const Table& table, const LaunchArgs& args, bool overwrite, Launcher& launcher) {
  if (kNorm) {  // the slots are added to by many blocks: zero them first, in stream order
    LaunchArgs zero = args;
    zero.zero_norm = true;
    zero.found_inf = nullptr;
    launcher.template run<Table, false, kNorm>(table, zero, 1);
  }
  if (args.num_chunks == 0) return;  // only empty tensors (kNorm): nothing else to do
  const auto grid = static_cast<unsigned>(std::min<int64_t>(args.num_chunks, launcher.max_grid()));
  if (overwrite) launcher.template run<Table, true, kNorm>(table, args, grid);
  else launcher.template run<Table, false, kNorm>(table, args, grid);
}

template <class Table, class Launcher>
void launch(const Table& table, const LaunchArgs& args, bool overwrite, Launcher& launcher) {
  if (args.norm_sq != nullptr) launch_kind<Table, true>(table, args, overwrite, launcher);
  else launch_kind<Table, false>(table, args, overwrite, launcher);
}

// Fills chunk_begin for entries [0, n) and returns the number of chunks.
inline int64_t assign_chunks(TensorEntry* e, size_t n) {
  int64_t chunks = 0;
  for (size_t i = 0; i < n; ++i) {
    if (chunks > INT32_MAX) throw std::invalid_argument("accumulate_cuda: too many chunks");
    e[i].chunk_begin = static_cast<int32_t>(chunks);
    chunks += (e[i].numel + kChunkElems - 1) / kChunkElems;
  }
  return chunks;
}

// Table as a kernel parameter, sized to the list so short lists copy few parameter bytes.
template <int kCap, class Launcher>
void launch_param(TensorEntry* e, size_t n, LaunchArgs args, bool overwrite, Launcher& launcher) {
  ParamTable<kCap> table;  // only the first n entries are read by the kernel
  table.num_tensors = static_cast<int32_t>(n);
  args.num_chunks = assign_chunks(e, n);
  std::copy(e, e + n, table.t);
  launch(table, args, overwrite, launcher);
}

template <class Launcher>
void launch_param_any(TensorEntry* e, size_t n, const LaunchArgs& args, bool overwrite,
                      Launcher& launcher) {
  if (n <= 64) launch_param<64>(e, n, args, overwrite, launcher);
  else if (n <= 256) launch_param<256>(e, n, args, overwrite, launcher);
  else launch_param<kMaxParamTensors>(e, n, args, overwrite, launcher);
}

// The call's non-empty pairs as table entries, after the kernel's own guards. With norm_sq the
// empty pairs stay too (zero chunks: the chunk search never lands on them; the zero_norm launch
// zeroes their slots), and each entry carries its norm slot above the dtype code.
inline std::vector<TensorEntry> make_entries(const AccumulateArgs& a) {
  std::vector<TensorEntry> entries;
  entries.reserve(a.num_tensors);
  const bool norm = a.norm_sq != nullptr;
  for (size_t i = 0; i < a.num_tensors; ++i) {
    const TensorPair& p = a.tensors[i];
    if (p.numel < 0) throw std::invalid_argument("accumulate_cuda: negative numel");
    if (norm && (p.norm_slot < 0 || p.norm_slot >= kMaxNormSlots))
      throw std::invalid_argument("accumulate_cuda: norm slot out of range");
    const int32_t packed = norm ? (p.norm_slot << kDTypeBits) : 0;
    if (p.numel == 0) {
      if (norm) entries.push_back({nullptr, nullptr, 0, 0, packed});
      continue;
    }
    if (p.dtype < kFloat32 || p.dtype > kFloat16)
      throw std::invalid_argument("accumulate_cuda: unknown src dtype code");
    if (p.dst == nullptr || p.src == nullptr)
      throw std::invalid_argument("accumulate_cuda: null data pointer");
    entries.push_back({p.dst, p.src, p.numel, 0, p.dtype | packed});
  }
  return entries;
}

// One call: parameter tables of up to kMaxParamTensors entries, one launch (two with norm_sq)
// per table. Longer lists go as several tables, captured or not: a table in device memory would
// need a host-to-device copy per call, which from pageable memory may stall the host until the
// stream drains. The launches are stream-ordered, each pair is independent and each norm slot
// belongs to one entry, so the groups give the same result as one launch.
template <class Launcher>
void launch_entries(std::vector<TensorEntry>& entries, const AccumulateArgs& a,
                    Launcher& launcher) {
  const LaunchArgs args{0, a.scale, a.scale_ptr, a.found_inf, a.norm_sq, false};
  const size_t n = entries.size();
  for (size_t i = 0; i < n; i += kMaxParamTensors)
    launch_param_any(entries.data() + i, std::min<size_t>(kMaxParamTensors, n - i), args,
                     a.overwrite, launcher);
}

}  // namespace
}  // namespace accumkernels
