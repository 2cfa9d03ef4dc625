// CUDA launches of the fused master step (the kernel's body: master_step_kernel.h).
//
// One launch per weight dtype (bf16, fp16) for the whole list, apex-style multi-tensor: every
// tensor is cut into kChunk-element chunks, a table holds each tensor's pointers, numel and first
// chunk, and a persistent grid (SMs x kBlocksPerSM blocks) strides over the chunks, each finding
// its tensor by binary search. The table is a __grid_constant__ kernel parameter up to
// kMaxParamEntries tensors (CUDA-graph capturable); longer lists launch once per such table, so no
// call copies a table from host memory. found_inf, grad_scale, a tensor lr and every tensor's step
// are read by the kernel: no host synchronisation.
#include <cuda_runtime.h>

#include <atomic>
#include <string>
#include <vector>

#include "cuda_runtime_util.cuh"
#include "master_step_kernel.h"

namespace accumkernels {
namespace master_step {
namespace {

template <int kAlgo, class W, class Table>
__global__ void __launch_bounds__(kThreads, kBlocksPerSM)
    master_step_kernel(const __grid_constant__ Table table, const LaunchArgs args) {
  step_thread<kAlgo, W>(table, args, blockIdx.x, threadIdx.x, gridDim.x);
}

using cuda_util::check;
using cuda_util::DeviceGuard;
using cuda_util::sm_count;

struct CudaLauncher {
  cudaStream_t stream;
  int device;

  int64_t max_grid() const { return int64_t{sm_count(device)} * kBlocksPerSM; }
  template <int kAlgo, class W, class Table>
  void run(const Table& table, const LaunchArgs& args, unsigned grid) {
    master_step_kernel<kAlgo, W, Table><<<grid, kThreads, 0, stream>>>(table, args);
    check(cudaGetLastError(), "master step kernel launch");
  }
};

template <int kAlgo, class W>
cudaError_t load_algo() {  // cudaFuncGetAttributes forces the lazy module load
  cudaFuncAttributes attr{};
  const cudaError_t loads[] = {
      cudaFuncGetAttributes(&attr, master_step_kernel<kAlgo, W, ParamTable<64>>),
      cudaFuncGetAttributes(&attr, master_step_kernel<kAlgo, W, ParamTable<kMaxParamEntries>>)};
  for (const cudaError_t e : loads)
    if (e != cudaSuccess) return e;
  return cudaSuccess;
}

}  // namespace
}  // namespace master_step

std::string master_step_cuda_load(int device) {
  try {
    cuda_util::DeviceGuard guard(device);
    using master_step::load_algo;
    const cudaError_t loads[] = {
        load_algo<kStepSgd, bf16_t>(), load_algo<kStepAdamF64, bf16_t>(),
        load_algo<kStepAdamF32, bf16_t>(), load_algo<kStepSgd, half_t>(),
        load_algo<kStepAdamF64, half_t>(), load_algo<kStepAdamF32, half_t>()};
    for (const cudaError_t e : loads) {
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        return std::string("loading the master step kernels failed: ") + cudaGetErrorString(e);
      }
    }
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

void master_step_cuda(const MasterStepCall& call, void* stream, int device) {
  cuda_util::DeviceGuard guard(device);
  master_step::CudaLauncher launcher{static_cast<cudaStream_t>(stream), device};
  master_step::launch_call(call, launcher);
}

}  // namespace accumkernels
