// CPU kernel: dst = (overwrite ? 0 : dst) + scale * float32(src), with a fused non-finite check.
//
// Memory bound (10 B/element for bf16/fp16 src, 12 B for fp32), so the goals are: one pass over
// the data, a vector loop per source dtype (AVX2+FMA+F16C picked at run time, with a portable
// loop the compiler vectorises for everything else), and all cores streaming at once by
// splitting the *whole list* into fixed-size chunks, so a list of one huge and many tiny
// tensors still keeps every thread busy.
#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "accumulate.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define ACCUMKERNELS_X86_DISPATCH 1
#include <immintrin.h>
#endif

namespace accumkernels {
namespace {

// 64K elements = 256 KiB of fp32 dst + 128 KiB of bf16 src: large enough that scheduling a
// chunk (one atomic increment) is noise, small enough that a 2-tensor list still splits
// across all cores and the last chunks balance out.
constexpr int64_t kChunkElems = int64_t{1} << 16;
// Calls below kChunkElems * threads * kChunksPerThread use smaller chunks (down to
// kMinChunkElems, a few microseconds of work) so that every thread gets a fair share.
constexpr int64_t kChunksPerThread = 4;
constexpr int64_t kMinChunkElems = 4096;
// Below this many elements in total, run on the calling thread. Measured on the 2-core dev box
// (benchmarks/results/host-overhead-cpu-*.json, "crossover": one call timed serial vs on two
// threads): with fp32 and with bf16 src, two threads lose below 36K elements (by 3-33%) and win
// from 40K on, with or without overwrite (in cache, the time per element barely depends on the
// dtype); the threshold sits between the two. (Adjustable at run time for measuring the
// crossover: set_cpu_parallel_threshold.)
constexpr int64_t kSerialBelow = 38912;
std::atomic<int64_t> g_serial_below{kSerialBelow};

constexpr uint32_t kF32ExpMask = 0x7f800000u;

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}
inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// fp16 -> fp32, exact for normals, subnormals, zeros, inf and NaN (payload kept). Branch-free
// (selects), so the loop below still vectorises.
inline float half_to_float(uint16_t h) {
  constexpr uint32_t kShiftedExp = 0x7c00u << 13;  // fp16 exponent field after the shift
  uint32_t o = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = o & kShiftedExp;
  o += (127u - 15u) << 23;  // re-bias the exponent
  const uint32_t inf_nan = o + ((128u - 16u) << 23);
  // Subnormal: build 2^-14 * (1 + m/1024), then subtract 2^-14 -> exactly m * 2^-24.
  const uint32_t sub = float_bits(bits_float(o + (1u << 23)) - bits_float(113u << 23));
  o = exp == kShiftedExp ? inf_nan : (exp == 0 ? sub : o);
  return bits_float(o | (static_cast<uint32_t>(h & 0x8000u) << 16));
}

inline float bf16_to_float(uint16_t b) { return bits_float(static_cast<uint32_t>(b) << 16); }

inline uint32_t is_nonfinite(float x) { return (float_bits(x) & kF32ExpMask) == kF32ExpMask; }

// A kernel handles one contiguous run of one tensor and returns nonzero if it saw inf/NaN.
using RunFn = uint32_t (*)(float* dst, const void* src, int64_t n, float scale);

template <int kDType>
inline float load_src(const void* src, int64_t i) {
  if constexpr (kDType == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
  if constexpr (kDType == kFloat16) return half_to_float(static_cast<const uint16_t*>(src)[i]);
  return static_cast<const float*>(src)[i];
}

// Portable loop; at -O3 GCC/Clang vectorise it with the baseline ISA (SSE2, NEON, ...).
// kCheck: look for inf/NaN (only when the caller passed found_inf: it costs ALU work per element).
template <int kDType, bool kOverwrite, bool kCheck>
uint32_t run_generic(float* __restrict dst, const void* src, int64_t n, float scale) {
  uint32_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const float x = load_src<kDType>(src, i);
#if defined(__FP_FAST_FMAF)  // hardware FMA in the baseline ISA (e.g. aarch64): one rounding
    const float y = kOverwrite ? scale * x : __builtin_fmaf(scale, x, dst[i]);
#else
    const float y = kOverwrite ? scale * x : dst[i] + scale * x;
#endif
    dst[i] = y;
    if constexpr (kCheck) bad |= is_nonfinite(y);  // a non-finite src, or an overflowed sum
  }
  return bad;
}

#if defined(ACCUMKERNELS_X86_DISPATCH)
// AVX2 + FMA + F16C, compiled for those ISAs only inside this function (the rest of the
// module stays baseline x86-64) and selected at run time with __builtin_cpu_supports.
template <int kDType, bool kOverwrite, bool kCheck>
__attribute__((target("avx2,fma,f16c"))) uint32_t run_avx2(float* __restrict dst,
                                                            const void* src, int64_t n,
                                                            float scale) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  const auto* s32 = static_cast<const float*>(src);
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i exp_mask = _mm256_set1_epi32(static_cast<int>(kF32ExpMask));
  __m256i bad = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256 x0, x1;
    if constexpr (kDType == kBFloat16) {  // bf16 -> fp32 is a 16-bit left shift
      const __m256i w0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s16 + i)));
      const __m256i w1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(s16 + i + 8)));
      x0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      x1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
    } else if constexpr (kDType == kFloat16) {
      x0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s16 + i)));
      x1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(s16 + i + 8)));
    } else {
      x0 = _mm256_loadu_ps(s32 + i);
      x1 = _mm256_loadu_ps(s32 + i + 8);
    }
    __m256 y0, y1;
    if constexpr (kOverwrite) {
      y0 = _mm256_mul_ps(vscale, x0);
      y1 = _mm256_mul_ps(vscale, x1);
    } else {
      y0 = _mm256_fmadd_ps(vscale, x0, _mm256_loadu_ps(dst + i));
      y1 = _mm256_fmadd_ps(vscale, x1, _mm256_loadu_ps(dst + i + 8));
    }
    _mm256_storeu_ps(dst + i, y0);
    _mm256_storeu_ps(dst + i + 8, y1);
    if constexpr (kCheck) {  // on the result: a non-finite src, or an overflowed sum
      const __m256i e0 = _mm256_and_si256(_mm256_castps_si256(y0), exp_mask);
      const __m256i e1 = _mm256_and_si256(_mm256_castps_si256(y1), exp_mask);
      bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpeq_epi32(e0, exp_mask),
                                                  _mm256_cmpeq_epi32(e1, exp_mask)));
    }
  }
  uint32_t bad_tail = 0;
  for (; i < n; ++i) {  // same arithmetic as the vector body: F16C convert, fused multiply-add
    float x;
    if constexpr (kDType == kBFloat16) x = bf16_to_float(s16[i]);
    else if constexpr (kDType == kFloat16) x = _cvtsh_ss(s16[i]);
    else x = s32[i];
    const float y = kOverwrite ? scale * x : __builtin_fmaf(scale, x, dst[i]);
    dst[i] = y;
    if constexpr (kCheck) bad_tail |= is_nonfinite(y);
  }
  return bad_tail | static_cast<uint32_t>(!_mm256_testz_si256(bad, bad));
}
#endif

struct Kernels {
  RunFn run[3][2][2];  // [dtype][overwrite][check]
  const char* name;
};

template <template <int, bool, bool> class Pick, int D>
constexpr std::array<std::array<RunFn, 2>, 2> pick_dtype() {
  return {{{Pick<D, false, false>::fn, Pick<D, false, true>::fn},
           {Pick<D, true, false>::fn, Pick<D, true, true>::fn}}};
}

template <template <int, bool, bool> class Pick>
Kernels make_kernels(const char* name) {
  Kernels k{};
  const std::array<std::array<std::array<RunFn, 2>, 2>, 3> all = {
      pick_dtype<Pick, kFloat32>(), pick_dtype<Pick, kBFloat16>(), pick_dtype<Pick, kFloat16>()};
  for (int d = 0; d < 3; ++d)
    for (int o = 0; o < 2; ++o)
      for (int c = 0; c < 2; ++c) k.run[d][o][c] = all[d][o][c];
  k.name = name;
  return k;
}
template <int D, bool O, bool C>
struct PickGeneric {
  static constexpr RunFn fn = &run_generic<D, O, C>;
};
#if defined(ACCUMKERNELS_X86_DISPATCH)
template <int D, bool O, bool C>
struct PickAvx2 {
  static constexpr RunFn fn = &run_avx2<D, O, C>;
};
#endif

const Kernels& kernels() {
  static const Kernels k = [] {
    // ACCUMKERNELS_CPU_SIMD=generic forces the portable loop (for testing it on AVX2 machines).
    const char* force = std::getenv("ACCUMKERNELS_CPU_SIMD");
    if (force != nullptr && std::strcmp(force, "generic") == 0)
      return make_kernels<PickGeneric>("generic");
#if defined(ACCUMKERNELS_X86_DISPATCH)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
      return make_kernels<PickAvx2>("avx2+fma+f16c");
#endif
    return make_kernels<PickGeneric>("generic");
  }();
  return k;
}

int default_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
#endif
}

struct Chunk {
  uint32_t tensor;  // index into the argument list
  int64_t start;    // first element of this chunk within the tensor
};

}  // namespace

std::string cpu_simd_name() { return kernels().name; }

int64_t cpu_parallel_threshold() { return g_serial_below.load(std::memory_order_relaxed); }

int64_t set_cpu_parallel_threshold(int64_t elements) {
  if (elements < 0) throw std::invalid_argument("cpu parallel threshold must be >= 0");
  return g_serial_below.exchange(elements, std::memory_order_relaxed);
}

bool cpu_has_openmp() {
#if defined(_OPENMP)
  return true;
#else
  return false;
#endif
}

void accumulate_cpu(const AccumulateArgs& args, int num_threads) {
  const TensorPair* t = args.tensors;
  int64_t total = 0;
  for (size_t i = 0; i < args.num_tensors; ++i) {  // the memory guards, before writing
    if (t[i].numel < 0) throw std::invalid_argument("accumulate_cpu: negative numel");
    if (t[i].numel == 0) continue;
    if (t[i].dtype < kFloat32 || t[i].dtype > kFloat16)
      throw std::invalid_argument("accumulate_cpu: unknown src dtype code");
    if (t[i].dst == nullptr || t[i].src == nullptr)
      throw std::invalid_argument("accumulate_cpu: null data pointer");
    total += t[i].numel;
  }
  if (total == 0) return;
  if (args.num_tensors > UINT32_MAX) throw std::invalid_argument("accumulate_cpu: too many tensors");

  const Kernels& k = kernels();
  const float scale = args.scale_ptr ? *args.scale_ptr : args.scale;
  const int ow = args.overwrite ? 1 : 0;
  const int check = args.found_inf != nullptr ? 1 : 0;
  if (num_threads <= 0) num_threads = default_threads();

  uint32_t bad = 0;
  if (total < g_serial_below.load(std::memory_order_relaxed) || num_threads <= 1) {
    for (size_t i = 0; i < args.num_tensors; ++i)
      if (t[i].numel > 0)
        bad |= k.run[t[i].dtype][ow][check](t[i].dst, t[i].src, t[i].numel, scale);
  } else {
    // Chunks of at most kChunkElems, and small enough that each thread gets about
    // kChunksPerThread of them: a call just above the threshold still splits evenly.
    const int64_t even = (total + int64_t{num_threads} * kChunksPerThread - 1) /
                         (int64_t{num_threads} * kChunksPerThread);
    const int64_t chunk = std::clamp((even + 63) / 64 * 64, kMinChunkElems, kChunkElems);
    std::vector<Chunk> chunks;
    chunks.reserve(static_cast<size_t>(total / chunk + args.num_tensors));
    for (size_t i = 0; i < args.num_tensors; ++i)
      for (int64_t s = 0; s < t[i].numel; s += chunk)
        chunks.push_back({static_cast<uint32_t>(i), s});
    num_threads =
        static_cast<int>(std::min<size_t>(static_cast<size_t>(num_threads), chunks.size()));
    auto run_chunk = [&](size_t c) -> uint32_t {
      const TensorPair& p = t[chunks[c].tensor];
      const int64_t start = chunks[c].start;
      const int64_t len = std::min(chunk, p.numel - start);
      const size_t elem = p.dtype == kFloat32 ? 4 : 2;
      const void* src = static_cast<const char*>(p.src) + static_cast<size_t>(start) * elem;
      return k.run[p.dtype][ow][check](p.dst + start, src, len, scale);
    };
    const int64_t n = static_cast<int64_t>(chunks.size());
#if defined(_OPENMP)
    // Static schedule: each thread streams one contiguous run of the list, which the hardware
    // prefetchers like; chunks are equal-sized except per-tensor tails, so balance is good.
#pragma omp parallel for num_threads(num_threads) schedule(static) reduction(| : bad)
    for (int64_t c = 0; c < n; ++c) bad |= run_chunk(static_cast<size_t>(c));
#else
    std::atomic<int64_t> next{0};
    std::atomic<uint32_t> shared_bad{0};
    auto worker = [&] {
      uint32_t b = 0;
      for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < n;)
        b |= run_chunk(static_cast<size_t>(c));
      shared_bad.fetch_or(b, std::memory_order_relaxed);
    };
    std::vector<std::thread> pool;
    for (int i = 1; i < num_threads; ++i) pool.emplace_back(worker);
    worker();
    for (auto& th : pool) th.join();
    bad = shared_bad.load();
#endif
  }
  if (bad && args.found_inf) *args.found_inf = 1.0f;
}

}  // namespace accumkernels
