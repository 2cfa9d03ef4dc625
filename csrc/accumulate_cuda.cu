// CUDA kernel: dst = (overwrite ? 0 : dst) + scale * float32(src) over a whole list of tensors
// in ONE launch, with a fused non-finite check and, optionally, each dst's squared L2 norm.
//
// Design (apex's multi_tensor_apply, improved):
//  * every tensor is cut into kChunkElems-element chunks; a table holds, per tensor, its
//    pointers, numel, dtype and the index of its first chunk (a prefix sum);
//  * the table is a __grid_constant__ kernel parameter (up to kMaxParamTensors tensors: CUDA
//    12.1+ allows 32764 bytes of parameters on Volta+, and a parameter keeps the launch CUDA-
//    graph capturable); longer lists launch once per such table (no host-to-device table copy,
//    which from pageable memory may stall the host);
//  * a persistent grid (SMs x kBlocksPerSM blocks) strides over chunks, each chunk finding its
//    tensor by binary search over the prefix sums, so any table is one launch;
//  * the dtype branch is uniform per chunk; aligned chunks use 16-byte loads/stores
//    (8 bf16/fp16 -> 2 x float4), unaligned tensors and tails a scalar loop;
//  * norm_sq (the kNorm instantiations, so calls without it run the unchanged kernel): a first
//    one-block launch of the same kernel zeroes the launch's slots, then each thread sums the
//    squares it writes in a chunk, a warp shuffle tree adds the warp's sums and lane 0
//    atomicAdds them to the tensor's slot (8 atomics per 8192-element chunk). No allocation and
//    no host sync, so it captures in CUDA graphs like the rest; the order of the atomic adds
//    varies from run to run (the result may differ in the last bits, within the bound).
//
// Compile-time switch ACCUMKERNELS_VEC_STORE picks the 16-byte store of the vector path (set by
// CMake's ACCUMKERNELS_CUDA_STORE, so a GPU session can build and time both):
//   0 (default) __stwb: PTX st.global.wb.v4.f32, which nvcc 13.0 compiles to
//     STG.E.128.STRONG.SM for sm_80 and sm_90 (a strong store at SM scope; cuobjdump -sass);
//   1 inline PTX st.global.v4.f32: a weak store, plain STG.E.128, same register count.
//
// The kernel's body and the launch marshalling live in accumulate_kernel.h, shared with the host
// build (accumulate_cuda_host.cpp), which runs the same code on the CPU for the tests. This file
// holds what only a GPU can do: the __global__ entry with its barrier, and the CUDA runtime calls.
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "accumulate.h"
#include "accumulate_kernel.h"
#include "cuda_runtime_util.cuh"

namespace accumkernels {
namespace {

template <class Table, bool kOverwrite, bool kNorm>
__global__ void __launch_bounds__(kBlockThreads, kBlocksPerSM)
    accumulate_kernel(const __grid_constant__ Table table, const LaunchArgs args) {
  const bool bad =
      kernel_thread<Table, kOverwrite, kNorm>(table, args, blockIdx.x, threadIdx.x, gridDim.x);
  // found_inf is uniform, so every thread of the block reaches the barrier or none does.
  if (args.found_inf != nullptr) after_barrier(args, __syncthreads_or(bad), threadIdx.x);
}

using cuda_util::check;
using cuda_util::DeviceGuard;
using cuda_util::sm_count;

// launch_entries' Launcher (accumulate_kernel.h): real launches on `stream` of `device`.
struct CudaLauncher {
  cudaStream_t stream;
  int device;

  int64_t max_grid() const { return int64_t{sm_count(device)} * kBlocksPerSM; }
  template <class Table, bool kOverwrite, bool kNorm>
  void run(const Table& table, const LaunchArgs& args, unsigned grid) {
    accumulate_kernel<Table, kOverwrite, kNorm><<<grid, kBlockThreads, 0, stream>>>(table, args);
    check(cudaGetLastError(), "accumulate kernel launch");
  }
};

std::string version_text(int v) {  // 13000 -> "13.0"
  return std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10);
}

// Loads one kernel instantiation (cudaFuncGetAttributes forces the lazy module load).
template <class Table, bool kOverwrite, bool kNorm>
cudaError_t load_kernel() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, accumulate_kernel<Table, kOverwrite, kNorm>);
}

// Every instantiation for one table type: add/overwrite, without and with norm_sq.
template <class Table>
cudaError_t load_table_kernels() {
  const cudaError_t loads[] = {load_kernel<Table, false, false>(),
                               load_kernel<Table, true, false>(),
                               load_kernel<Table, false, true>(),
                               load_kernel<Table, true, true>()};
  for (const cudaError_t e : loads)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
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
    const cudaError_t loads[] = {load_table_kernels<ParamTable<64>>(),
                                 load_table_kernels<ParamTable<256>>(),
                                 load_table_kernels<ParamTable<kMaxParamTensors>>()};
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
  std::vector<TensorEntry> entries = make_entries(a);
  if (entries.empty()) return;
  DeviceGuard guard(device);
  CudaLauncher launcher{static_cast<cudaStream_t>(stream_handle), device};
  launch_entries(entries, a, launcher);
}

}  // namespace accumkernels
