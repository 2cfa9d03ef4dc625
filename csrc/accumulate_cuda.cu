// CUDA kernel: dst = (overwrite ? 0 : dst) + scale * float32(src) over a whole list of tensors
// in ONE launch, with a fused non-finite check.
//
// Design (apex's multi_tensor_apply, improved):
//  * every tensor is cut into kChunkElems-element chunks; a table holds, per tensor, its
//    pointers, numel, dtype and the index of its first chunk (a prefix sum);
//  * the table is a __grid_constant__ kernel parameter (up to kMaxParamTensors tensors: CUDA
//    12.1+ allows 32764 bytes of parameters on Volta+, and a parameter keeps the launch CUDA-
//    graph capturable); longer lists put it in stream-ordered device memory instead;
//  * a persistent grid (SMs x kBlocksPerSM blocks) strides over chunks, each chunk finding its
//    tensor by binary search over the prefix sums, so any list is one launch;
//  * the dtype branch is uniform per chunk; aligned chunks use 16-byte loads/stores
//    (8 bf16/fp16 -> 2 x float4), unaligned tensors and tails a scalar loop.
//
// Compile-time switch ACCUMKERNELS_VEC_STORE picks the 16-byte store of the vector path (set by
// CMake's ACCUMKERNELS_CUDA_STORE, so a GPU session can build and time both):
//   0 (default) __stwb: PTX st.global.wb.v4.f32, which nvcc 13.0 compiles to
//     STG.E.128.STRONG.SM for sm_80 and sm_90 (a strong store at SM scope; cuobjdump -sass);
//   1 inline PTX st.global.v4.f32: a weak store, plain STG.E.128, same register count.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "accumulate.h"

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

struct TensorEntry {  // 32 bytes
  float* dst;
  const void* src;
  int64_t numel;
  int32_t chunk_begin;  // index of this tensor's first chunk in the launch
  int32_t dtype;
};

template <int kCap>
struct ParamTable {
  int32_t num_tensors;
  TensorEntry t[kCap];
};
static_assert(sizeof(ParamTable<kMaxParamTensors>) + 64 <= 32764, "kernel parameters too big");

struct DeviceTable {  // same interface, entries in device memory
  int32_t num_tensors;
  const TensorEntry* t;
};

struct LaunchArgs {
  int64_t num_chunks;
  float scale;             // used when scale_ptr is null
  const float* scale_ptr;  // device address or null
  float* found_inf;        // device address or null
};

__device__ __forceinline__ bool nonfinite(float x) {
  return (__float_as_uint(x) & 0x7f800000u) == 0x7f800000u;
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// Load 8 source elements (16-byte aligned) as fp32. src is read once: streaming load.
__device__ __forceinline__ void load8(const float* p, float (&x)[kVec]) {
  const float4 a = __ldcs(reinterpret_cast<const float4*>(p));
  const float4 b = __ldcs(reinterpret_cast<const float4*>(p) + 1);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ void load8(const __nv_bfloat16* p, float (&x)[kVec]) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __bfloat1622float2(h[k]);
    x[2 * k] = f.x, x[2 * k + 1] = f.y;
  }
}
__device__ __forceinline__ void load8(const __half* p, float (&x)[kVec]) {
  const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(p));
  const auto* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const float2 f = __half22float2(h[k]);
    x[2 * k] = f.x, x[2 * k + 1] = f.y;
  }
}

// Load 8 dst elements (16-byte aligned); plain loads: dst is written right back.
__device__ __forceinline__ void load8_dst(const float* p, float (&x)[kVec]) {
  const float4 a = reinterpret_cast<const float4*>(p)[0];
  const float4 b = reinterpret_cast<const float4*>(p)[1];
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

// Store 4 floats at p (16-byte aligned). A plain `*reinterpret_cast<float4*>(p) = v` is split
// into 4 scalar stores by nvcc here, so the vector path names its store explicitly (see the
// ACCUMKERNELS_VEC_STORE note at the top).
__device__ __forceinline__ void store4(float* p, float a, float b, float c, float d) {
#if ACCUMKERNELS_VEC_STORE == 1
  asm volatile("st.global.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(p), "f"(a), "f"(b), "f"(c),
               "f"(d)
               : "memory");
#else
  __stwb(reinterpret_cast<float4*>(p), make_float4(a, b, c, d));
#endif
}

// One chunk (len <= kChunkElems elements) by the whole block; returns this thread's bad flag.
template <typename T, bool kOverwrite>
__device__ __forceinline__ bool accumulate_chunk(float* __restrict__ dst,
                                                 const T* __restrict__ src, int len,
                                                 float scale) {
  bool bad = false;
  int scalar_from = 0;
  if (((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15) == 0) {
    const int nvec = len / kVec;
    for (int v0 = threadIdx.x; v0 < nvec; v0 += kBlockThreads * kUnroll) {
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
            bad |= nonfinite(x[u][k]);
            d[u][k] = kOverwrite ? scale * x[u][k] : fmaf(scale, x[u][k], d[u][k]);
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
  for (int i = scalar_from + threadIdx.x; i < len; i += kBlockThreads) {
    const float x = to_float(src[i]);
    bad |= nonfinite(x);
    dst[i] = kOverwrite ? scale * x : fmaf(scale, x, dst[i]);
  }
  return bad;
}

template <class Table, bool kOverwrite>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSM)
    accumulate_kernel(const __grid_constant__ Table table, const LaunchArgs args) {
  const float scale = args.scale_ptr != nullptr ? *args.scale_ptr : args.scale;
  bool bad = false;
  for (int64_t c = blockIdx.x; c < args.num_chunks; c += gridDim.x) {
    // Last tensor whose first chunk is <= c (uniform across the block: broadcast reads).
    int lo = 0, hi = table.num_tensors - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (table.t[mid].chunk_begin <= c) lo = mid;
      else hi = mid - 1;
    }
    const TensorEntry& e = table.t[lo];
    const int64_t start = (c - e.chunk_begin) * kChunkElems;  // 64-bit: tensors may be > 2^31
    const int len = static_cast<int>(min(kChunkElems, e.numel - start));
    float* dst = e.dst + start;
    if (e.dtype == kBFloat16)
      bad |= accumulate_chunk<__nv_bfloat16, kOverwrite>(
          dst, static_cast<const __nv_bfloat16*>(e.src) + start, len, scale);
    else if (e.dtype == kFloat16)
      bad |= accumulate_chunk<__half, kOverwrite>(dst, static_cast<const __half*>(e.src) + start,
                                                  len, scale);
    else
      bad |= accumulate_chunk<float, kOverwrite>(dst, static_cast<const float*>(e.src) + start,
                                                 len, scale);
  }
  // found_inf is uniform, so every thread of the block reaches the barrier or none does.
  if (args.found_inf != nullptr && __syncthreads_or(bad) && threadIdx.x == 0)
    *args.found_inf = 1.0f;
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("accumkernels CUDA: ") + what + " failed: " +
                             cudaGetErrorString(err));
}

// Sets `device` current for the scope and restores the caller's device afterwards; a negative
// `device` means "the current one" and is replaced by it.
class DeviceGuard {
 public:
  explicit DeviceGuard(int& device) {
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (device < 0) device = prev_;
    if (prev_ != device) check(cudaSetDevice(device), "cudaSetDevice");
    else prev_ = -1;
  }
  ~DeviceGuard() {
    if (prev_ >= 0) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

int sm_count(int device) {  // cached: cudaDeviceGetAttribute is cheap, but not free
  constexpr int kCached = 64;
  static std::atomic<int> cache[kCached] = {};
  if (device >= 0 && device < kCached && cache[device].load(std::memory_order_relaxed) > 0)
    return cache[device].load(std::memory_order_relaxed);
  int n = 0;
  check(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device),
        "cudaDeviceGetAttribute(MultiProcessorCount)");
  if (device >= 0 && device < kCached) cache[device].store(n, std::memory_order_relaxed);
  return n;
}

template <class Table>
void launch(const Table& table, const LaunchArgs& args, bool overwrite, cudaStream_t stream,
            int device) {
  const int64_t grid = std::min<int64_t>(args.num_chunks, int64_t{sm_count(device)} * kBlocksPerSM);
  if (overwrite)
    accumulate_kernel<Table, true><<<static_cast<unsigned>(grid), kBlockThreads, 0, stream>>>(table, args);
  else
    accumulate_kernel<Table, false><<<static_cast<unsigned>(grid), kBlockThreads, 0, stream>>>(table, args);
  check(cudaGetLastError(), "accumulate kernel launch");
}

// Fills chunk_begin for entries [0, n) and returns the number of chunks.
int64_t assign_chunks(TensorEntry* e, size_t n) {
  int64_t chunks = 0;
  for (size_t i = 0; i < n; ++i) {
    if (chunks > INT32_MAX) throw std::invalid_argument("accumulate_cuda: too many chunks");
    e[i].chunk_begin = static_cast<int32_t>(chunks);
    chunks += (e[i].numel + kChunkElems - 1) / kChunkElems;
  }
  return chunks;
}

// Table as a kernel parameter, sized to the list so short lists copy few parameter bytes.
template <int kCap>
void launch_param(TensorEntry* e, size_t n, LaunchArgs args, bool overwrite, cudaStream_t stream,
                  int device) {
  ParamTable<kCap> table;  // only the first n entries are read by the kernel
  table.num_tensors = static_cast<int32_t>(n);
  args.num_chunks = assign_chunks(e, n);
  std::copy(e, e + n, table.t);
  launch(table, args, overwrite, stream, device);
}

void launch_param_any(TensorEntry* e, size_t n, const LaunchArgs& args, bool overwrite,
                      cudaStream_t stream, int device) {
  if (n <= 64) launch_param<64>(e, n, args, overwrite, stream, device);
  else if (n <= 256) launch_param<256>(e, n, args, overwrite, stream, device);
  else launch_param<kMaxParamTensors>(e, n, args, overwrite, stream, device);
}

bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. legacy stream during a global capture: play safe
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

std::string version_text(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Loads one kernel instantiation (cudaFuncGetAttributes forces the lazy module load).
template <class Table, bool kOverwrite>
cudaError_t load_kernel() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, accumulate_kernel<Table, kOverwrite>);
}

}  // namespace

std::string cuda_runtime_version() { return version_text(CUDART_VERSION); }

std::string cuda_vec_store() { return ACCUMKERNELS_VEC_STORE == 1 ? "ptx" : "stwb"; }

std::string cuda_prepare(int device, bool load_kernels) {
  int driver = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0) {
    (void)cudaGetLastError();
    return "no CUDA driver found";
  }
  // Minor-version compatibility: a CUDA 13.x runtime runs on any 13.x driver (R580+), not on 12.x.
  if (driver / 1000 < CUDART_VERSION / 1000)
    return "the CUDA driver supports CUDA " + version_text(driver) + ", older than the CUDA " +
           version_text(CUDART_VERSION) + " runtime the extension was built with (CUDA " +
           std::to_string(CUDART_VERSION / 1000) + " needs driver R" +
           (CUDART_VERSION / 1000 >= 13 ? "580" : "525") + " or newer)";
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(err);
  }
  if (device < 0 || device >= count)
    return "no CUDA device " + std::to_string(device) + " (" + std::to_string(count) + " visible)";
  if (!load_kernels) return "";
  try {
    DeviceGuard guard(device);
    // Every instantiation, so that no kernel is first loaded inside a CUDA-graph capture.
    const cudaError_t loads[] = {
        load_kernel<ParamTable<64>, false>(),  load_kernel<ParamTable<64>, true>(),
        load_kernel<ParamTable<256>, false>(), load_kernel<ParamTable<256>, true>(),
        load_kernel<ParamTable<kMaxParamTensors>, false>(),
        load_kernel<ParamTable<kMaxParamTensors>, true>(),
        load_kernel<DeviceTable, false>(),     load_kernel<DeviceTable, true>()};
    for (const cudaError_t e : loads) {
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string("loading the accumulate kernels failed: ") + cudaGetErrorString(e);
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void accumulate_cuda(const AccumulateArgs& a, void* stream_handle, int device) {
  std::vector<TensorEntry> entries;
  entries.reserve(a.num_tensors);
  for (size_t i = 0; i < a.num_tensors; ++i) {
    const TensorPair& p = a.tensors[i];
    if (p.numel < 0) throw std::invalid_argument("accumulate_cuda: negative numel");
    if (p.numel == 0) continue;
    if (p.dtype < kFloat32 || p.dtype > kFloat16)
      throw std::invalid_argument("accumulate_cuda: unknown src dtype code");
    if (p.dst == nullptr || p.src == nullptr)
      throw std::invalid_argument("accumulate_cuda: null data pointer");
    entries.push_back({p.dst, p.src, p.numel, 0, p.dtype});
  }
  if (entries.empty()) return;

  DeviceGuard guard(device);
  const auto stream = static_cast<cudaStream_t>(stream_handle);
  const LaunchArgs args{0, a.scale, a.scale_ptr, a.found_inf};
  const size_t n = entries.size();
  if (n <= static_cast<size_t>(kMaxParamTensors)) {
    launch_param_any(entries.data(), n, args, a.overwrite, stream, device);
    return;
  }
  if (stream_is_capturing(stream)) {
    // A memcpy from pageable host memory cannot be captured (the graph would re-read freed
    // host memory on replay): launch per group of kMaxParamTensors instead.
    for (size_t i = 0; i < n; i += kMaxParamTensors)
      launch_param_any(entries.data() + i, std::min<size_t>(kMaxParamTensors, n - i), args,
                       a.overwrite, stream, device);
    return;
  }
  // Long list: table in device memory, allocated, filled and freed in stream order (the host
  // buffer is staged by cudaMemcpyAsync before it returns, so `entries` may die afterwards).
  LaunchArgs dargs = args;
  dargs.num_chunks = assign_chunks(entries.data(), n);
  const size_t bytes = n * sizeof(TensorEntry);
  void* table_mem = nullptr;
  check(cudaMallocAsync(&table_mem, bytes, stream), "cudaMallocAsync(tensor table)");
  cudaError_t err = cudaMemcpyAsync(table_mem, entries.data(), bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    const DeviceTable table{static_cast<int32_t>(n), static_cast<const TensorEntry*>(table_mem)};
    try {
      launch(table, dargs, a.overwrite, stream, device);
    } catch (...) {
      cudaFreeAsync(table_mem, stream);
      throw;
    }
  }
  const cudaError_t free_err = cudaFreeAsync(table_mem, stream);
  check(err, "cudaMemcpyAsync(tensor table)");
  check(free_err, "cudaFreeAsync(tensor table)");
}

}  // namespace accumkernels
