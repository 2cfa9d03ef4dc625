// Pieces shared by the public call (tensor_calls.cpp) and Plan (plan.cpp): failure codes,
// list access, reusable buffers, the overlap sweep, the autograd refusals, the launch.
#pragma once

#include <Python.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "tensor_calls.h"

namespace accumkernels {
namespace detail {

// (code, i, j): a broken rule, for the Python layer to name (see tensor_calls.h).
py::object failure(const char* code, int64_t i = -1, int64_t j = -1);

struct Device {
  int32_t type, index;
  bool holds(const TensorMeta& m) const { return m.device_type == type && m.device_index == index; }
};

// A list as a borrowed item array (lists and tuples are used in place, others copied once).
class Items {
 public:
  explicit Items(py::handle seq) {
    PyObject* fast = PySequence_Fast(seq.ptr(), "expected a list or tuple of tensors");
    if (fast == nullptr) throw py::error_already_set();
    guard_ = py::reinterpret_steal<py::object>(fast);
    size_ = PySequence_Fast_GET_SIZE(fast);
    items_ = PySequence_Fast_ITEMS(fast);
  }
  Py_ssize_t size() const { return size_; }
  PyObject* operator[](Py_ssize_t i) const { return items_[i]; }
  py::handle seq() const { return guard_; }

 private:
  py::object guard_;
  Py_ssize_t size_ = 0;
  PyObject** items_ = nullptr;
};

// ---- per-call buffers ------------------------------------------------------------------------

struct Span {
  uintptr_t begin, end;
  int32_t index;
  bool is_dst;
  bool f32;  // src only: float32, so an identical dst span is the elementwise in-place case
};

// Vectors reused from call to call (a call on a short list must not pay for allocations).
struct Scratch {
  std::vector<TensorPair> pairs;
  std::vector<int32_t> index;
  std::vector<Span> dst, src, all;
  std::vector<int32_t> order;
  std::vector<TensorMeta> metas;
  bool busy = false;
};

// The thread's Scratch, or a fresh one if a call re-enters (Python code run by a decref).
class ScratchLease {
 public:
  ScratchLease() {
    thread_local Scratch shared;
    if (!shared.busy) {
      s_ = &shared;
    } else {
      own_ = std::make_unique<Scratch>();
      s_ = own_.get();
    }
    s_->busy = true;
    for (auto* v : {&s_->dst, &s_->src, &s_->all}) v->clear();
    s_->pairs.clear();
    s_->index.clear();
    s_->order.clear();
    s_->metas.clear();
  }
  ~ScratchLease() { s_->busy = false; }
  ScratchLease(const ScratchLease&) = delete;
  ScratchLease& operator=(const ScratchLease&) = delete;
  Scratch* operator->() const { return s_; }

 private:
  Scratch* s_ = nullptr;
  std::unique_ptr<Scratch> own_;
};


inline bool overlaps(uintptr_t a0, uintptr_t a1, uintptr_t b0, uintptr_t b1) {
  return a0 < b1 && b0 < a1;
}

// No dst may overlap another dst, and no src a dst unless it is exactly that dst's memory as
// float32; None or the failure. Sorts `dst` and `src`; `all` is scratch space.
py::object find_overlap(std::vector<Span>& dst, std::vector<Span>& src, std::vector<Span>& all);

// What torch's in-place ops refuse (by `flags`): nullptr, "grad", "inference" or "slow".
// `impl`: t's TensorImpl when the caller has it (else found here).
const char* refuse_write(PyObject* t, int flags, const void* impl = nullptr);
// The failure for a refusal of dst (`name` "dst") or found_inf; `name` "": `r` is the code.
py::object refusal(const char* r, const char* name, int64_t i);

py::list copy_list(py::handle seq);  // a new list (the caller may change its own)
void bump_versions(py::handle tensors);  // torch._C._increment_version(tensors)
// The same for the tensors of `items` (a Python sequence's item array), one by one through the
// reader's bump when it is on (no Python call), else through bump_versions(seq).
void bump_items(const Items& items);

// A call's optional scale and found_inf tensors (1-element float32 on the call's device), and its
// optional norm_sq (a contiguous float32 vector on that device).
struct CallScalars {
  TensorMeta scale{}, found{}, norm{};
  bool has_scale = false, has_found = false, has_norm = false;
  const TensorMeta* scale_or_null() const { return has_scale ? &scale : nullptr; }
  const TensorMeta* found_or_null() const { return has_found ? &found : nullptr; }
  const TensorMeta* norm_or_null() const { return has_norm ? &norm : nullptr; }
};
// Reads o.scale_tensor, o.found_inf and o.norm_sq (`norm_len` elements): nullptr (ok),
// "scale"/"found_inf"/"norm_sq" (wrong dtype, size, device ...: the Python spec says which) or
// "slow".
const char* read_scalars(const CallOptions& o, const Device& dev, int64_t norm_len,
                         CallScalars& s);
inline bool wants_norm(const CallOptions& o) { return o.norm_sq && !o.norm_sq.is_none(); }
void check_kernel_device(const CallOptions& o, const Device& dev);
// found_inf and norm_sq: what torch would refuse to write (a full failure code, or "slow"), the
// version bumps, and norm_sq overlapping found_inf or scale (a failure code).
const char* refuse_outputs(const CallOptions& o, const CallScalars& s);
void bump_outputs(const CallOptions& o, const CallScalars& s);
const char* norm_scalar_overlap(const CallScalars& s);
void run_kernel(const std::vector<TensorPair>& pairs, const CallOptions& o, const CallScalars& s);
bool reader_ready();  // the tensor reader is on and set_increment_version was called

}  // namespace detail
}  // namespace accumkernels
