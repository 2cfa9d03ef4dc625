// accumkernels native kernels: dst[i] = (overwrite ? 0 : dst[i]) + scale * float32(src[i]),
// optionally with the squared L2 norm of each written dst (norm_sq).
//
// Plain C++ interface (no Python, no libtorch): raw pointers, sizes and dtype codes, so that
// accumulate_cuda.cu compiles with nvcc alone and bindings.cpp is the only pybind11 user.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace accumkernels {

// Source dtype codes; the values are part of the Python interface (_C.DTYPE_*).
enum DType : int32_t {
  kFloat32 = 0,
  kBFloat16 = 1,
  kFloat16 = 2,
};

// One (dst, src) pair: dst is a contiguous float32 array, src a contiguous array of `dtype`,
// both `numel` elements long. `norm_slot`: where its squared norm goes (read only with norm_sq).
struct TensorPair {
  float* dst;
  const void* src;
  int64_t numel;
  int32_t dtype;
  int32_t norm_slot;
};

// norm_slot must lie in [0, kMaxNormSlots) (the CUDA table packs it next to the dtype code).
constexpr int32_t kMaxNormSlots = int32_t{1} << 29;

// Arguments shared by both backends.
struct AccumulateArgs {
  const TensorPair* tensors;  // `num_tensors` pairs; pairs with numel == 0 are skipped
  size_t num_tensors;
  float scale;                // used when scale_ptr is null
  const float* scale_ptr;     // optional: scale read from here (host for CPU, device for CUDA)
  bool overwrite;             // true: dst = scale * src, dst is never read
  float* found_inf;           // optional: set to 1.0f if any written dst element is inf/NaN
  // Optional: norm_sq[p.norm_slot] = sum over p's elements of dst^2, the values just written
  // (fp32 squares, fp32 sums; overwritten, not added to; inf/NaN when a written value is, or
  // when the sum overflows). With it, pairs with numel == 0 are not skipped: their slot gets 0.
  // Each fp32 partial sum adds a bounded number of terms (CPU: <= 4096 per SIMD lane of a chunk,
  // then chunk partials in order; CUDA: 32 per thread, a warp tree, then one atomicAdd per warp
  // and chunk), so the relative error stays far below the worst case n * 2^-24.
  float* norm_sq = nullptr;
};

// CPU: parallel over fixed-size chunks of the whole list with `num_threads` threads
// (<= 0: the OpenMP default). Blocking; safe to call without the GIL.
void accumulate_cpu(const AccumulateArgs& args, int num_threads);

// Elements per call below which accumulate_cpu runs on the calling thread (waking a thread team
// costs more than it saves there). The setter returns the previous value; benchmarks use it to
// measure the crossover.
int64_t cpu_parallel_threshold();
int64_t set_cpu_parallel_threshold(int64_t elements);

// Which SIMD path the CPU kernel picked at run time, e.g. "avx2+fma+f16c" or "generic".
std::string cpu_simd_name();
// fp32 masters <- bf16/fp16 weights where the weight != the rounded master; returns how many
// elements were taken (-1: fp16 unsupported on this build). Host memory, contiguous.
int64_t resync_masters_cpu(float* master, const uint16_t* weight, int64_t n, int dtype);
// weight = master rounded to dtype (bf16/fp16, torch's cast bit for bit). false: fp16
// unsupported on this build (nothing written).
bool copy_back_cpu(const float* master, uint16_t* weight, int64_t n, int dtype);
bool cpu_has_openmp();

// CUDA: one launch for the whole list on `stream` (a cudaStream_t) of `device` (< 0: the
// current device); pointers in `args` are device addresses. Throws std::runtime_error on a
// CUDA error. Only defined when the module was built with CUDA (ACCUMKERNELS_WITH_CUDA).
void accumulate_cuda(const AccumulateArgs& args, void* stream, int device);
std::string cuda_runtime_version();  // CUDART_VERSION the kernels were compiled against
std::string cuda_vec_store();  // the vector path's store: "stwb" or "ptx" (ACCUMKERNELS_VEC_STORE)
// Whether the kernels can run on `device`: checks the driver against the runtime they were built
// with (static cudart: CUDA 13 needs driver R580+) and the device, then (with load_kernels)
// loads every kernel instantiation, so that none is first loaded inside a CUDA-graph capture.
// "" when usable, else why not. Never throws.
std::string cuda_prepare(int device, bool load_kernels);

// For tests, in every build: the CUDA kernel's code and launch marshalling run on the CPU
// (accumulate_cuda_host.cpp); pointers in `args` are host addresses. The emulated device has
// `sm_count` SMs; `capturing` says whether its stream counts as captured, which no launch depends
// on (long lists launch as parameter-table groups either way; the tests check both).
void accumulate_cuda_host(const AccumulateArgs& args);
void cuda_host_configure(int sm_count, bool capturing);
// The last call's launches, one line each: table kind, grid, chunks, tensors.
std::vector<std::string> cuda_host_launches();

}  // namespace accumkernels
