// CPU kernel: dst = (overwrite ? 0 : dst) + scale * float32(src), with a fused non-finite check.
//
// Memory bound (10 B/element for bf16/fp16 src, 12 B for fp32), so the goals are: one pass over
// the data, a vector loop per source dtype (AVX2+FMA+F16C picked at run time, with a portable
// loop the compiler vectorises for everything else), and all cores streaming at once by
// splitting the *whole list* into fixed-size chunks, so a list of one huge and many tiny
// tensors still keeps every thread busy.
#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "accumulate.h"
#include "cpu_simd.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(ACCUMKERNELS_X86_SIMD)
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

// A kernel handles one contiguous run of one tensor and returns nonzero if it saw inf/NaN; with
// kNorm it also stores the run's sum of squares of the written values in *sq.
using RunFn = uint32_t (*)(float* dst, const void* src, int64_t n, float scale, float* sq);

template <int kDType>
inline float load_src(const void* src, int64_t i) {
  if constexpr (kDType == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(src)[i]);
  if constexpr (kDType == kFloat16) return half_to_float(static_cast<const uint16_t*>(src)[i]);
  return static_cast<const float*>(src)[i];
}

template <int kDType, bool kOverwrite>
inline float generic_step(float* __restrict dst, const void* src, int64_t i, float scale) {
  const float x = load_src<kDType>(src, i);
#if defined(__FP_FAST_FMAF)  // hardware FMA in the baseline ISA (e.g. aarch64): one rounding
  const float y = kOverwrite ? scale * x : __builtin_fmaf(scale, x, dst[i]);
#else
  const float y = kOverwrite ? scale * x : dst[i] + scale * x;
#endif
  dst[i] = y;
  return y;
}

// Portable loop; at -O3 GCC/Clang vectorise it with the baseline ISA (SSE2, NEON, ...).
// kCheck: look for inf/NaN (only when the caller passed found_inf: it costs ALU work per element).
// kNorm: sum the squares in kLanes independent partial sums (vectorisable, and each adds only
// n / kLanes terms).
template <int kDType, bool kOverwrite, bool kCheck, bool kNorm>
uint32_t run_generic(float* __restrict dst, const void* src, int64_t n, float scale, float* sq) {
  uint32_t bad = 0;
  if constexpr (!kNorm) {
    (void)sq;
    for (int64_t i = 0; i < n; ++i) {
      const float y = generic_step<kDType, kOverwrite>(dst, src, i, scale);
      if constexpr (kCheck) bad |= is_nonfinite(y);  // a non-finite src, or an overflowed sum
    }
  } else {
    constexpr int kLanes = 8;
    float lane[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      for (int k = 0; k < kLanes; ++k) {
        const float y = generic_step<kDType, kOverwrite>(dst, src, i + k, scale);
        if constexpr (kCheck) bad |= is_nonfinite(y);
        lane[k] += y * y;
      }
    }
    for (int k = 0; i < n; ++i, ++k) {
      const float y = generic_step<kDType, kOverwrite>(dst, src, i, scale);
      if constexpr (kCheck) bad |= is_nonfinite(y);
      lane[k] += y * y;
    }
    *sq = ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
  }
  return bad;
}

#if defined(ACCUMKERNELS_X86_DISPATCH)
// AVX2 + FMA + F16C, compiled for those ISAs only inside this function (the rest of the
// module stays baseline x86-64) and selected at run time (cpu_simd.h). The AVX-512 level runs it
// too: the loop is bound by memory, not by the vector width.
template <int kDType, bool kOverwrite, bool kCheck, bool kNorm>
AK_AVX2 uint32_t run_avx2(float* __restrict dst, const void* src, int64_t n, float scale,
                          float* sq) {
  const auto* s16 = static_cast<const uint16_t*>(src);
  const auto* s32 = static_cast<const float*>(src);
  const __m256 vscale = _mm256_set1_ps(scale);
  const __m256i exp_mask = _mm256_set1_epi32(static_cast<int>(kF32ExpMask));
  __m256i bad = _mm256_setzero_si256();
  __m256 sq0 = _mm256_setzero_ps(), sq1 = _mm256_setzero_ps();  // kNorm: 16 partial sums
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
    if constexpr (kNorm) {
      sq0 = _mm256_fmadd_ps(y0, y0, sq0);
      sq1 = _mm256_fmadd_ps(y1, y1, sq1);
    }
    if constexpr (kCheck) {  // on the result: a non-finite src, or an overflowed sum
      const __m256i e0 = _mm256_and_si256(_mm256_castps_si256(y0), exp_mask);
      const __m256i e1 = _mm256_and_si256(_mm256_castps_si256(y1), exp_mask);
      bad = _mm256_or_si256(bad, _mm256_or_si256(_mm256_cmpeq_epi32(e0, exp_mask),
                                                  _mm256_cmpeq_epi32(e1, exp_mask)));
    }
  }
  uint32_t bad_tail = 0;
  float sq_tail = 0.0f;
  for (; i < n; ++i) {  // same arithmetic as the vector body: F16C convert, fused multiply-add
    float x;
    if constexpr (kDType == kBFloat16) x = bf16_to_float(s16[i]);
    else if constexpr (kDType == kFloat16) x = _cvtsh_ss(s16[i]);
    else x = s32[i];
    const float y = kOverwrite ? scale * x : __builtin_fmaf(scale, x, dst[i]);
    dst[i] = y;
    if constexpr (kCheck) bad_tail |= is_nonfinite(y);
    if constexpr (kNorm) sq_tail = __builtin_fmaf(y, y, sq_tail);
  }
  if constexpr (kNorm) {  // a tree over the 16 lanes, then the tail
    const __m256 s8 = _mm256_add_ps(sq0, sq1);
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    *sq = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2))) + sq_tail;
  } else {
    (void)sq;
  }
  return bad_tail | static_cast<uint32_t>(!_mm256_testz_si256(bad, bad));
}
#endif

struct Kernels {
  RunFn run[3][2][2][2];  // [dtype][overwrite][check][norm]
  const char* name;
};

template <template <int, bool, bool, bool> class Pick, int D>
void fill_dtype(Kernels& k) {
  k.run[D][0][0][0] = Pick<D, false, false, false>::fn;
  k.run[D][0][0][1] = Pick<D, false, false, true>::fn;
  k.run[D][0][1][0] = Pick<D, false, true, false>::fn;
  k.run[D][0][1][1] = Pick<D, false, true, true>::fn;
  k.run[D][1][0][0] = Pick<D, true, false, false>::fn;
  k.run[D][1][0][1] = Pick<D, true, false, true>::fn;
  k.run[D][1][1][0] = Pick<D, true, true, false>::fn;
  k.run[D][1][1][1] = Pick<D, true, true, true>::fn;
}

template <template <int, bool, bool, bool> class Pick>
Kernels make_kernels(const char* name) {
  Kernels k{};
  fill_dtype<Pick, kFloat32>(k);
  fill_dtype<Pick, kBFloat16>(k);
  fill_dtype<Pick, kFloat16>(k);
  k.name = name;
  return k;
}
template <int D, bool O, bool C, bool N>
struct PickGeneric {
  static constexpr RunFn fn = &run_generic<D, O, C, N>;
};
#if defined(ACCUMKERNELS_X86_DISPATCH)
template <int D, bool O, bool C, bool N>
struct PickAvx2 {
  static constexpr RunFn fn = &run_avx2<D, O, C, N>;
};
#endif

// The table of the level in use (cpu_simd_level: read at every call, tests switch it).
const Kernels& kernels() {
  static const Kernels generic = make_kernels<PickGeneric>("generic");
#if defined(ACCUMKERNELS_X86_DISPATCH)
  static const Kernels avx2 = make_kernels<PickAvx2>("avx2+fma+f16c");
  if (cpu_simd_level() >= kSimdAvx2) return avx2;
#endif
  return generic;
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

namespace {

const void* src_at(const TensorPair& p, int64_t start) {
  const size_t elem = p.dtype == kFloat32 ? 4 : 2;
  return static_cast<const char*>(p.src) + static_cast<size_t>(start) * elem;
}

// The whole list on the calling thread. With norm_sq, each tensor in pieces of at most
// kChunkElems elements whose partial sums are added in order (every partial sum stays short).
uint32_t run_serial(const AccumulateArgs& args, const Kernels& k, float scale, int ow, int check) {
  uint32_t bad = 0;
  for (size_t i = 0; i < args.num_tensors; ++i) {
    const TensorPair& p = args.tensors[i];
    if (args.norm_sq == nullptr) {
      if (p.numel > 0) bad |= k.run[p.dtype][ow][check][0](p.dst, p.src, p.numel, scale, nullptr);
      continue;
    }
    float sum = 0.0f;
    for (int64_t s = 0; s < p.numel; s += kChunkElems) {
      float part = 0.0f;
      bad |= k.run[p.dtype][ow][check][1](p.dst + s, src_at(p, s),
                                          std::min(kChunkElems, p.numel - s), scale, &part);
      sum += part;
    }
    args.norm_sq[p.norm_slot] = sum;
  }
  return bad;
}

// The chunk table of a call and each thread's share of it, kept from call to call (per calling
// thread: calls may come from several Python threads at once without the GIL), so that a call
// allocates nothing once the tables have grown to its list.
struct ChunkTable {
  std::vector<Chunk> chunks;
  std::vector<size_t> bounds;  // thread t runs chunks [bounds[t], bounds[t + 1])
  std::vector<float> part;     // norm_sq: each chunk's partial sum
};

ChunkTable& chunk_table() {
  thread_local ChunkTable table;
  return table;
}

// The list cut into chunks of at most `chunk` elements, in list order, and split into
// `num_threads` contiguous runs of about equal elements (not equal chunk counts: a list of
// many tiny tensors and a few large ones would leave one thread most of the bytes). A run ends
// where a chunk's midpoint passes the thread's even share, so shares differ by at most one
// chunk's elements.
void build_chunks(const AccumulateArgs& args, int64_t chunk, int64_t total, int num_threads,
                  ChunkTable& table) {
  const TensorPair* t = args.tensors;
  std::vector<Chunk>& chunks = table.chunks;
  std::vector<size_t>& bounds = table.bounds;
  chunks.clear();
  bounds.assign(static_cast<size_t>(num_threads) + 1, 0);
  int next = 1;  // the next thread whose run has not started yet
  int64_t done = 0;
  for (size_t i = 0; i < args.num_tensors; ++i)
    for (int64_t s = 0; s < t[i].numel; s += chunk) {
      const int64_t len = std::min(chunk, t[i].numel - s);
      while (next < num_threads && done + len / 2 >= total / num_threads * next +
                                                       total % num_threads * next / num_threads)
        bounds[static_cast<size_t>(next++)] = chunks.size();
      chunks.push_back({static_cast<uint32_t>(i), s});
      done += len;
    }
  for (; next <= num_threads; ++next) bounds[static_cast<size_t>(next)] = chunks.size();
}

// The list cut into chunks over `num_threads` threads, each streaming its contiguous run of the
// table (which the hardware prefetchers like); with norm_sq, each chunk's partial sum is kept
// and the partials of each tensor are added in chunk order afterwards.
uint32_t run_parallel(const AccumulateArgs& args, const Kernels& k, float scale, int ow,
                      int check, int num_threads, int64_t total) {
  const TensorPair* t = args.tensors;
  // Chunks of at most kChunkElems, and small enough that each thread gets about
  // kChunksPerThread of them: a call just above the threshold still splits evenly.
  const int64_t even = (total + int64_t{num_threads} * kChunksPerThread - 1) /
                       (int64_t{num_threads} * kChunksPerThread);
  const int64_t chunk = std::clamp((even + 63) / 64 * 64, kMinChunkElems, kChunkElems);
  num_threads = static_cast<int>(std::min<int64_t>(num_threads, (total + chunk - 1) / chunk));
  ChunkTable& table = chunk_table();
  build_chunks(args, chunk, total, num_threads, table);
  const std::vector<Chunk>& chunks = table.chunks;
  const std::vector<size_t>& bounds = table.bounds;
  const int norm = args.norm_sq != nullptr ? 1 : 0;
  if (norm && table.part.size() < chunks.size()) table.part.resize(chunks.size());
  float* part = table.part.data();
  auto run_chunk = [&](size_t c) -> uint32_t {
    const TensorPair& p = t[chunks[c].tensor];
    const int64_t start = chunks[c].start;
    return k.run[p.dtype][ow][check][norm](p.dst + start, src_at(p, start),
                                           std::min(chunk, p.numel - start), scale,
                                           norm ? &part[c] : nullptr);
  };
  // Run r of the table (empty runs do nothing).
  auto run_share = [&](int r) -> uint32_t {
    uint32_t b = 0;
    for (size_t c = bounds[static_cast<size_t>(r)]; c < bounds[static_cast<size_t>(r) + 1]; ++c)
      b |= run_chunk(c);
    return b;
  };
  uint32_t bad = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(num_threads) reduction(| : bad)
  {
    // The runtime may give fewer threads than asked for: then each takes several runs.
    const int team = omp_get_num_threads();
    for (int r = omp_get_thread_num(); r < num_threads; r += team) bad |= run_share(r);
  }
#else
  std::atomic<int> next{0};
  std::atomic<uint32_t> shared_bad{0};
  auto worker = [&] {
    uint32_t b = 0;
    for (int r; (r = next.fetch_add(1, std::memory_order_relaxed)) < num_threads;)
      b |= run_share(r);
    shared_bad.fetch_or(b, std::memory_order_relaxed);
  };
  std::vector<std::thread> pool;
  for (int i = 1; i < num_threads; ++i) pool.emplace_back(worker);
  worker();
  for (auto& th : pool) th.join();
  bad = shared_bad.load();
#endif
  if (norm) {  // chunks are in tensor order; an empty tensor has none and gets 0
    size_t c = 0;
    for (size_t i = 0; i < args.num_tensors; ++i) {
      float sum = 0.0f;
      for (; c < chunks.size() && chunks[c].tensor == i; ++c) sum += part[c];
      args.norm_sq[t[i].norm_slot] = sum;
    }
  }
  return bad;
}

}  // namespace

void accumulate_cpu(const AccumulateArgs& args, int num_threads) {
  const TensorPair* t = args.tensors;
  int64_t total = 0;
  for (size_t i = 0; i < args.num_tensors; ++i) {  // the memory guards, before writing
    if (t[i].numel < 0) throw std::invalid_argument("accumulate_cpu: negative numel");
    if (args.norm_sq != nullptr && (t[i].norm_slot < 0 || t[i].norm_slot >= kMaxNormSlots))
      throw std::invalid_argument("accumulate_cpu: norm slot out of range");
    if (t[i].numel == 0) continue;
    if (t[i].dtype < kFloat32 || t[i].dtype > kFloat16)
      throw std::invalid_argument("accumulate_cpu: unknown src dtype code");
    if (t[i].dst == nullptr || t[i].src == nullptr)
      throw std::invalid_argument("accumulate_cpu: null data pointer");
    total += t[i].numel;
  }
  if (total == 0 && args.norm_sq == nullptr) return;
  if (args.num_tensors > UINT32_MAX) throw std::invalid_argument("accumulate_cpu: too many tensors");

  const Kernels& k = kernels();
  const float scale = args.scale_ptr ? *args.scale_ptr : args.scale;
  const int ow = args.overwrite ? 1 : 0;
  const int check = args.found_inf != nullptr ? 1 : 0;
  if (num_threads <= 0) num_threads = default_threads();

  const uint32_t bad =
      total < g_serial_below.load(std::memory_order_relaxed) || num_threads <= 1
          ? run_serial(args, k, scale, ow, check)
          : run_parallel(args, k, scale, ow, check, num_threads, total);
  if (bad && args.found_inf) *args.found_inf = 1.0f;
}

}  // namespace accumkernels
