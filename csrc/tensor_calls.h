// accumulate_ on Python tensor lists, in one C++ call: read every tensor (torch_api.h), check the
// op's rules, bump the version counters of what is written, run the kernel.
//
// This is the fast path of accumkernels/ops/accumulate.py. A failed check returns (code, i, j) and writes
// nothing; the Python layer turns the code into the error message (its readable spec,
// accumkernels/ops/validate.py, checks the same rules and names them). Code "slow" means
// some object could not be read here (not a plain tensor, the reader is off): the Python path
// then handles the whole call.
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "accumulate.h"
#include "torch_api.h"

namespace accumkernels {

namespace py = pybind11;

enum CallFlags : int {
  kCheckAutograd = 1,   // grad mode is on: a leaf that requires grad may not be written
  kCheckInference = 2,  // outside inference mode: an inference tensor may not be written
};

// kCudaHostKernel: the CUDA kernel emulated on the CPU (tests only, see accumulate.h).
enum KernelKind : int { kNoKernel = 0, kCpuKernel = 1, kCudaKernel = 2, kCudaHostKernel = 3 };

struct CallOptions {
  double scale = 1.0;
  py::handle scale_tensor;  // None or a 1-element float32 tensor read by the kernel
  bool overwrite = false;
  py::handle found_inf;     // None or a 1-element float32 tensor the kernel may set to 1
  int flags = 0;
  int kernel = kNoKernel;   // kNoKernel: validate and bump versions only (other backends)
  int num_threads = 0;      // CPU kernel
  uint64_t stream = 0;      // CUDA kernel: cudaStream_t
  int device = -1;          // CUDA kernel: device index
  py::handle norm_sq;       // null/None, or a float32 vector with one slot per dst (see Plan)
};

// Must be called once (from Python, at import) with torch._C._increment_version.
void set_increment_version(py::handle fn);

// The public call: dst[i] += scale * src[i] for two equally long sequences of tensors.
// Returns None on success, else (code, i, j).
py::object accumulate_tensors(py::handle dst, py::handle src, const CallOptions& opt);

// A fixed dst list, read and checked once (dtype, contiguity, device, no overlap); each launch
// reads only the src side. `keys` (e.g. the params owning each dst) let a launch name a subset
// of the dst, in any order; `owner`, if given, is a tensor whose version counter every dst
// shares (a flat buffer the dst are views of): a launch then bumps it once instead of each dst.
// Each launch first checks that the dst memory has not moved (the owner's address, else each
// launched dst's); if it has (share_memory_, a storage resized or swapped), the plan reads
// every dst again and launches on the new addresses, or refuses ("plan_stale", i, why).
// A launch's norm_sq (optional) has `norm_len` elements; dst i's squared norm goes to element
// norm_slots[i] (default: norm_len = the number of dst, slot i), only for the dst it writes.
class Plan {
 public:
  // Returns a Plan, or (code, i, j) if the dst list breaks a rule (codes as above).
  static py::object create(py::handle dst, py::handle keys, py::handle owner, bool inference,
                           py::handle norm_slots, int64_t norm_len);

  // src[k] goes to the dst of keys[k] (keys None: to dst[k], and src covers every dst).
  py::object run(py::handle keys, py::handle src, const CallOptions& opt);
  size_t size() const { return slots_.size(); }

 private:
  struct Slot {
    uintptr_t data;
    int64_t numel;
    size_t sizes_at;  // offset of this dst's sizes in sizes_
    int64_t ndim;
  };
  Plan() = default;
  py::object capture(bool again);
  void set_norm_slots(py::handle slots, int64_t norm_len, size_t n);
  py::object run_once(py::handle keys, py::handle src, const CallOptions& opt, bool& moved);
  bool src_fits(const TensorMeta& m, const Slot& s) const;
  py::object check_overlaps(const std::vector<int32_t>& order, const std::vector<TensorMeta>& src,
                            const TensorMeta* scale, const TensorMeta* found_inf,
                            const TensorMeta* norm) const;

  py::list dst_;      // holds the dst tensors alive
  py::object keys_;   // a list, or None
  py::object owner_;  // a tensor, or None
  std::vector<Slot> slots_;
  std::vector<int64_t> sizes_;
  std::unordered_map<PyObject*, int32_t> slot_of_;
  std::vector<uint32_t> stamp_;  // launch number that last used each slot (duplicate check)
  std::vector<int32_t> pos_;     // ... and at which position of that launch
  std::vector<int32_t> norm_slot_;  // norm_sq element of each dst
  int64_t norm_len_ = 0;            // elements a launch's norm_sq must have
  uint32_t launch_ = 0;
  uintptr_t lo_ = 0, hi_ = 0;  // every dst lies in [lo_, hi_)
  uintptr_t owner_data_ = 0;   // the owner's address when the dst were read
  int32_t device_type_ = -1, device_index_ = -1;
  bool inference_ = false;
};

}  // namespace accumkernels
