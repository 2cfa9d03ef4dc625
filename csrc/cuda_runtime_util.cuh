// What the CUDA launch files (accumulate_cuda.cu, master_step_cuda.cu) share: error checks, the
// current-device guard, the SM count, whether a stream is being captured, and the stream-ordered
// copy of a launch table too long for a kernel parameter. Included by .cu files only.
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

inline bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();  // e.g. the legacy stream during a global capture: play safe
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// `launch_with(device_entries)` with the n entries copied to device memory allocated, filled and
// freed in stream order (the host buffer is staged by cudaMemcpyAsync before it returns, so
// `entries` may die afterwards). `what` names the table in errors.
template <class Entry, class F>
void with_table_copy(cudaStream_t stream, const Entry* entries, size_t n, F launch_with,
                     const std::string& what) {
  const size_t bytes = n * sizeof(Entry);
  void* mem = nullptr;
  check(cudaMallocAsync(&mem, bytes, stream), ("cudaMallocAsync(" + what + ")").c_str());
  cudaError_t err = cudaMemcpyAsync(mem, entries, bytes, cudaMemcpyHostToDevice, stream);
  if (err == cudaSuccess) {
    try {
      launch_with(static_cast<const Entry*>(mem));
    } catch (...) {
      cudaFreeAsync(mem, stream);
      throw;
    }
  }
  const cudaError_t free_err = cudaFreeAsync(mem, stream);
  check(err, ("cudaMemcpyAsync(" + what + ")").c_str());
  check(free_err, ("cudaFreeAsync(" + what + ")").c_str());
}

}  // namespace cuda_util
}  // namespace accumkernels
