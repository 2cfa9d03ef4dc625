// What the CUDA launch files (accumulate_cuda.cu, master_step_cuda.cu) share: error checks, the
// current-device guard and the SM count. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstddef>
#include <stdexcept>
#include <string>

namespace accumkernels {
namespace cuda_util {

inline void check(cudaError_t err, const char* what) {
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

inline int sm_count(int device) {  // cached: cudaDeviceGetAttribute is cheap, but not free
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

}  // namespace cuda_util
}  // namespace accumkernels
