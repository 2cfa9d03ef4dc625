// Reading torch tensors from C++ without linking libtorch.
//
// A tensor's metadata (address, sizes, dtype, device, contiguity) is read through torch's stable
// C shim (the AOTInductor ABI, `aoti_torch_*`), looked up at run time in the libtorch that
// `import torch` has already loaded; the TensorImpl comes from the tensor's `_cdata`. Reading the
// same facts through torch's Python attributes costs several times more (each attribute is a
// ~25-40 ns binding call), and that per-tensor cost is what decides whether a validated
// 300-tensor call beats torch._foreach_add_.
//
// Nothing here is required: when a symbol is missing, or the Python side's self-test (see
// accumkernels/ops/backends/native.py) finds the shim disagreeing with torch's own attributes, the
// reader stays off and callers take the portable Python path.
#pragma once

#include <Python.h>

#include <cstdint>
#include <string>

namespace accumkernels {

struct TensorMeta {
  uintptr_t data;        // address of the first element (0 for an empty tensor without storage)
  const int64_t* sizes;  // `ndim` sizes, owned by the tensor: valid while it lives unchanged
  int64_t ndim;
  int64_t numel;
  int32_t dtype;         // DType code (kFloat32, kBFloat16, kFloat16), or -1 for other dtypes
  int32_t device_type;   // c10::DeviceType value (compare with torch_device_type_cpu(), ...)
  int32_t device_index;
  bool contiguous;
  bool neg;              // the neg bit is set (e.g. x.conj().imag): memory holds -value
  void* impl;            // its TensorImpl (valid while the tensor lives)

  int64_t elem_size() const { return dtype == 0 ? 4 : 2; }  // for the three supported dtypes
  uintptr_t end() const { return data + static_cast<uintptr_t>(numel * elem_size()); }
};

// Looks the shim up in `library` (a path to libtorch_cpu, already loaded) and remembers the
// exact tensor types whose `_cdata` may be read. Returns false (with a reason) if unusable.
bool torch_api_init(PyObject* tensor_type, PyObject* parameter_type, const std::string& library,
                    std::string* why);
void torch_api_disable();

// The TensorImpl pointer normally comes from the `_cdata` getter (a ~40-100 ns Python call).
// Torch keeps that pointer inside the tensor object at a fixed offset (THPVariable's `cdata`);
// this finds the offset by matching `_cdata` on every tensor in `samples` and, if exactly one
// offset matches them all, reads the pointer there from then on (a load instead of a call).
// Returns the offset used (0: none found, the getter stays in use).
Py_ssize_t torch_api_find_impl_offset(PyObject* samples);

// The neg bit lives in the TensorImpl's DispatchKeySet, which the C shim does not expose. This
// finds where the key set sits in the TensorImpl: the one offset holding, in every sample,
// that sample's key set (`raw_keysets`: torch._C._dispatch_keys(t).raw_repr() per sample), and
// from then on read_meta reports `neg` as (key set & neg_mask) != 0. Returns the offset (0:
// not found; then the reader must stay off, it cannot see the neg bit). Linux/glibc only: the
// scan is bounded by the TensorImpl's allocation (malloc_usable_size).
Py_ssize_t torch_api_find_keyset_offset(PyObject* samples, PyObject* raw_keysets,
                                        uint64_t neg_mask);
bool torch_api_ready();
int32_t torch_device_type_cpu();
int32_t torch_device_type_cuda();

// Fills `m` for an exact torch.Tensor or nn.Parameter (subclasses may override what a tensor
// reports, so they are not read here). Returns false for anything else and on any shim error
// (sparse, mkldnn, nested tensors ...): the caller then takes the Python path, which names the
// problem. Never leaves a Python error set.
bool read_meta(PyObject* obj, TensorMeta& m);

// Only the data address of an exact torch.Tensor/Parameter (one shim call): what a LaunchPlan
// compares with the address it captured, at every launch. False when it cannot be read.
bool read_data_ptr(PyObject* obj, uintptr_t& data);

// ---- the write checks without Python attributes (optional) ----------------------------------
//
// torch's in-place rules ask two facts of a tensor, `requires_grad` and `is_inference()`, and an
// in-place op bumps its version counter. Through Python each is an attribute call (~30-60 ns);
// these read them from the TensorImpl directly: requires_grad and the version bump through the
// functions libtorch exports for them (c10::TensorImpl::requires_grad,
// torch::autograd::impl::bump_version), inference-ness from the key set (no ADInplaceOrView
// and no Autograd key: torch's own definition) read where the neg bit is. Each is switched on
// by torch_api_enable_writes only after it agreed with torch on samples; until then (or when a
// symbol is missing) the answers are -1 / false and callers ask Python.
int impl_requires_grad(const void* impl);  // 1, 0, or -1 (unknown)
int impl_is_inference(const void* impl);   // 1, 0, or -1 (unknown)
bool impl_bump_version(void* impl);        // false: not on (nothing done)
bool fast_bump_ready();
// The TensorImpl of an exact torch.Tensor/Parameter, or nullptr.
void* tensor_impl_of(PyObject* obj);
// `samples`: tensors; `inference`, `requires_grad`: what torch says of each (lists of bools);
// `inference_mask`: the key-set bits a normal tensor has and an inference tensor lacks. Returns
// which parts were switched on ("requires_grad", "inference", "bump", comma-separated).
std::string torch_api_enable_writes(PyObject* samples, PyObject* inference,
                                    PyObject* requires_grad, uint64_t inference_mask);

// What a list of `lists_plain` holds (see list_meta.cpp).
enum ListKind : long { kListFp32 = 0, kListLow = 1, kListStep = 2 };

// Whether every entry of `lists` (a list of lists of tensors, lists[0] the masters) is a plain
// tensor of its list's kind (`kinds`): the bulk test of the fused master step's arguments.
// False when anything is not (or cannot be read): the caller then applies its own rules.
bool lists_plain(PyObject* lists, PyObject* kinds);

// The metadata of the tensors of `tensors` (a list) as one record (list_meta.cpp): of the first
// `full` the address, numel, sizes, dtype, device, contiguity and neg bit; of the rest the
// address only. Empty when the reader is off or when an entry cannot be read, or one of the
// first `full` is not contiguous (strides are not recorded) or has over kSnapshotDims dims:
// then nothing can be compared and the caller checks in Python.
constexpr int64_t kSnapshotDims = 8;
std::string metas_snapshot(PyObject* tensors, Py_ssize_t full);
// Whether `tensors` reads now exactly as `snapshot` recorded them (false for an empty one).
bool metas_same(PyObject* tensors, const std::string& snapshot);

// Whether two tensors have the same sizes.
inline bool same_sizes(const TensorMeta& a, const TensorMeta& b) {
  if (a.ndim != b.ndim) return false;
  for (int64_t k = 0; k < a.ndim; ++k)
    if (a.sizes[k] != b.sizes[k]) return false;
  return true;
}

}  // namespace accumkernels
