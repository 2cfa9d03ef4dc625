// See torch_api.h. The shim functions are declared here by hand from their documented C
// signatures (torch/csrc/inductor/aoti_torch/c/shim.h): no torch header is included.
#include "torch_api.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "accumulate.h"

#if defined(__unix__) || defined(__APPLE__)
#include <dlfcn.h>
#define ACCUMKERNELS_HAVE_DLOPEN 1
#endif
#if defined(__GLIBC__)
#include <malloc.h>  // malloc_usable_size: bounds the key-set scan to the TensorImpl's block
#endif

namespace accumkernels {
namespace {

using Handle = void*;  // AtenTensorHandle: the address of an at::Tensor (one TensorImpl pointer)
using Err = int32_t;   // AOTITorchError: 0 on success

struct Shim {
  Err (*get_data_ptr)(Handle, void**) = nullptr;
  Err (*get_sizes)(Handle, int64_t**) = nullptr;
  Err (*get_dim)(Handle, int64_t*) = nullptr;
  Err (*get_numel)(Handle, int64_t*) = nullptr;
  Err (*get_dtype)(Handle, int32_t*) = nullptr;
  Err (*get_device_type)(Handle, int32_t*) = nullptr;
  Err (*get_device_index)(Handle, int32_t*) = nullptr;
  Err (*get_layout)(Handle, int32_t*) = nullptr;
  Err (*is_contiguous)(Handle, bool*) = nullptr;
  int32_t dtype_code[3] = {-1, -1, -1};  // torch ScalarType values of float32, bfloat16, float16
  int32_t layout_strided = -1;
  int32_t device_cpu = -1;
  int32_t device_cuda = -1;
  void* requires_grad = nullptr;  // optional exports (see torch_api_enable_writes)
  void* bump_version = nullptr;
};

Shim g_shim;
bool g_ready = false;
PyTypeObject* g_tensor_type = nullptr;     // torch.Tensor
PyTypeObject* g_parameter_type = nullptr;  // torch.nn.Parameter
PyObject* g_cdata = nullptr;               // the `_cdata` getter of torch.Tensor
Py_ssize_t g_impl_offset = 0;              // where the TensorImpl pointer sits (0: use g_cdata)
Py_ssize_t g_keyset_offset = 0;  // where the TensorImpl's DispatchKeySet sits (0: unknown)
uint64_t g_neg_mask = 0;         // its Negative bit

// The write checks' fast paths (torch_api_enable_writes): the exported functions, looked up with
// the shim, and whether each agreed with torch on the samples.
using RequiresGradFn = bool (*)(const void* impl);  // c10::TensorImpl::requires_grad() const
using BumpFn = void (*)(const void* tensor);        // torch::autograd::impl::bump_version(Tensor&)
RequiresGradFn g_requires_grad = nullptr;
BumpFn g_bump = nullptr;
bool g_requires_grad_on = false, g_bump_on = false, g_inference_on = false;
uint64_t g_inference_mask = 0;  // ADInplaceOrView and Autograd: a normal tensor has them

void writes_off() {
  g_requires_grad_on = g_bump_on = g_inference_on = false;
}

// The TensorImpl of an exact torch.Tensor/Parameter `obj`, or nullptr (no Python error left set).
void* tensor_impl(PyObject* obj) {
  if (g_impl_offset > 0) {
    void* impl;
    std::memcpy(&impl, reinterpret_cast<const char*>(obj) + g_impl_offset, sizeof impl);
    return impl;
  }
  PyObject* cdata =
      Py_TYPE(g_cdata)->tp_descr_get(g_cdata, obj, reinterpret_cast<PyObject*>(Py_TYPE(obj)));
  void* impl = cdata != nullptr ? PyLong_AsVoidPtr(cdata) : nullptr;
  Py_XDECREF(cdata);
  if (impl == nullptr) PyErr_Clear();
  return impl;
}

#if defined(ACCUMKERNELS_HAVE_DLOPEN)
template <typename F>
bool load(void* lib, F& fn, const char* name, std::string* why) {
  fn = reinterpret_cast<F>(dlsym(lib, name));
  if (fn == nullptr && why != nullptr) *why = std::string("symbol not found: ") + name;
  return fn != nullptr;
}

bool load_shim(const std::string& library, Shim& s, std::string* why) {
  // RTLD_NOLOAD: only a library `import torch` has loaded already; never load a second copy.
  void* lib = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    if (why != nullptr) *why = "not loaded: " + library;
    return false;
  }
  int32_t (*f32)() = nullptr, (*bf16)() = nullptr, (*f16)() = nullptr, (*strided)() = nullptr;
  int32_t (*cpu)() = nullptr, (*cuda)() = nullptr;
  const bool ok = load(lib, s.get_data_ptr, "aoti_torch_get_data_ptr", why) &&
                  load(lib, s.get_sizes, "aoti_torch_get_sizes", why) &&
                  load(lib, s.get_dim, "aoti_torch_get_dim", why) &&
                  load(lib, s.get_numel, "aoti_torch_get_numel", why) &&
                  load(lib, s.get_dtype, "aoti_torch_get_dtype", why) &&
                  load(lib, s.get_device_type, "aoti_torch_get_device_type", why) &&
                  load(lib, s.get_device_index, "aoti_torch_get_device_index", why) &&
                  load(lib, s.get_layout, "aoti_torch_get_layout", why) &&
                  load(lib, s.is_contiguous, "aoti_torch_is_contiguous", why) &&
                  load(lib, f32, "aoti_torch_dtype_float32", why) &&
                  load(lib, bf16, "aoti_torch_dtype_bfloat16", why) &&
                  load(lib, f16, "aoti_torch_dtype_float16", why) &&
                  load(lib, strided, "aoti_torch_layout_strided", why) &&
                  load(lib, cpu, "aoti_torch_device_type_cpu", why) &&
                  load(lib, cuda, "aoti_torch_device_type_cuda", why);
  // Optional (the write checks' fast paths): missing ones leave those checks to Python.
  s.requires_grad = reinterpret_cast<void*>(dlsym(lib, "_ZNK3c1010TensorImpl13requires_gradEv"));
  s.bump_version =
      reinterpret_cast<void*>(dlsym(lib, "_ZN5torch8autograd4impl12bump_versionERKN2at6TensorE"));
  // The handle stays open on purpose: the functions must outlive this call (and the library is
  // torch's own, loaded for the life of the process anyway).
  if (!ok) return false;
  s.dtype_code[kFloat32] = f32();
  s.dtype_code[kBFloat16] = bf16();
  s.dtype_code[kFloat16] = f16();
  s.layout_strided = strided();
  s.device_cpu = cpu();
  s.device_cuda = cuda();
  return true;
}
#else
bool load_shim(const std::string&, Shim&, std::string* why) {
  if (why != nullptr) *why = "no dlopen on this platform";
  return false;
}
#endif

}  // namespace

bool torch_api_init(PyObject* tensor_type, PyObject* parameter_type, const std::string& library,
                    std::string* why) {
  g_ready = false;
  if (!PyType_Check(tensor_type) || !PyType_Check(parameter_type)) {
    if (why != nullptr) *why = "expected torch.Tensor and torch.nn.Parameter";
    return false;
  }
  PyObject* cdata = PyObject_GetAttrString(tensor_type, "_cdata");  // the getset descriptor
  if (cdata == nullptr || Py_TYPE(cdata)->tp_descr_get == nullptr) {
    PyErr_Clear();
    Py_XDECREF(cdata);
    if (why != nullptr) *why = "torch.Tensor has no _cdata descriptor";
    return false;
  }
  Shim shim;
  if (!load_shim(library, shim, why)) {
    Py_DECREF(cdata);
    return false;
  }
  Py_XDECREF(g_cdata);
  g_impl_offset = 0;
  Py_XDECREF(reinterpret_cast<PyObject*>(g_tensor_type));
  Py_XDECREF(reinterpret_cast<PyObject*>(g_parameter_type));
  Py_INCREF(tensor_type);
  Py_INCREF(parameter_type);
  g_tensor_type = reinterpret_cast<PyTypeObject*>(tensor_type);
  g_parameter_type = reinterpret_cast<PyTypeObject*>(parameter_type);
  g_cdata = cdata;
  g_shim = shim;
  writes_off();
  g_requires_grad = reinterpret_cast<RequiresGradFn>(shim.requires_grad);
  g_bump = reinterpret_cast<BumpFn>(shim.bump_version);
  g_ready = true;
  return true;
}

void torch_api_disable() {
  g_ready = false;
  writes_off();
}

Py_ssize_t torch_api_find_impl_offset(PyObject* samples) {
  g_impl_offset = 0;
  if (!g_ready) return 0;
  PyObject* fast = PySequence_Fast(samples, "samples must be a sequence");
  if (fast == nullptr) {
    PyErr_Clear();
    return 0;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  std::vector<Py_ssize_t> candidates;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* obj = PySequence_Fast_GET_ITEM(fast, i);
    PyTypeObject* type = Py_TYPE(obj);
    void* want = (type == g_tensor_type || type == g_parameter_type) ? tensor_impl(obj) : nullptr;
    if (want == nullptr) {
      candidates.clear();
      break;
    }
    std::vector<Py_ssize_t> found;
    const auto ptr_size = static_cast<Py_ssize_t>(sizeof(void*));
    for (Py_ssize_t off = sizeof(PyObject); off + ptr_size <= type->tp_basicsize; off += ptr_size) {
      void* p;
      std::memcpy(&p, reinterpret_cast<const char*>(obj) + off, sizeof p);
      const bool seen = i == 0 || std::find(candidates.begin(), candidates.end(), off) !=
                                      candidates.end();
      if (p == want && seen) found.push_back(off);
    }
    candidates.swap(found);
    if (candidates.empty()) break;
  }
  Py_DECREF(fast);
  if (n >= 2 && candidates.size() == 1) g_impl_offset = candidates[0];
  return g_impl_offset;
}
Py_ssize_t torch_api_find_keyset_offset(PyObject* samples, PyObject* raw_keysets,
                                        uint64_t neg_mask) {
  g_keyset_offset = 0;
  g_neg_mask = 0;
#if defined(__GLIBC__)
  if (!g_ready || neg_mask == 0) return 0;
  PyObject* fast = PySequence_Fast(samples, "samples must be a sequence");
  PyObject* keys = fast ? PySequence_Fast(raw_keysets, "raw_keysets must be a sequence") : nullptr;
  if (keys == nullptr) {
    Py_XDECREF(fast);
    PyErr_Clear();
    return 0;
  }
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  std::vector<Py_ssize_t> candidates;
  for (Py_ssize_t i = 0; i < n && (i == 0 || !candidates.empty()); ++i) {
    PyObject* obj = PySequence_Fast_GET_ITEM(fast, i);
    PyTypeObject* type = Py_TYPE(obj);
    void* impl = (type == g_tensor_type || type == g_parameter_type) ? tensor_impl(obj) : nullptr;
    const uint64_t want = i < PySequence_Fast_GET_SIZE(keys)
                              ? PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(keys, i))
                              : 0;
    if (impl == nullptr || PyErr_Occurred()) {
      PyErr_Clear();
      candidates.clear();
      break;
    }
    const size_t size = std::min<size_t>(malloc_usable_size(impl), 4096);
    std::vector<Py_ssize_t> found;
    for (size_t off = sizeof(void*); off + sizeof(uint64_t) <= size; off += sizeof(uint64_t)) {
      uint64_t word;
      std::memcpy(&word, static_cast<const char*>(impl) + off, sizeof word);
      const auto o = static_cast<Py_ssize_t>(off);
      if (word == want &&
          (i == 0 || std::find(candidates.begin(), candidates.end(), o) != candidates.end()))
        found.push_back(o);
    }
    candidates.swap(found);
  }
  Py_DECREF(keys);
  Py_DECREF(fast);
  if (n >= 2 && candidates.size() == 1) {
    g_keyset_offset = candidates[0];
    g_neg_mask = neg_mask;
  }
#else
  (void)samples, (void)raw_keysets, (void)neg_mask;
#endif
  return g_keyset_offset;
}

bool torch_api_ready() { return g_ready; }
int32_t torch_device_type_cpu() { return g_shim.device_cpu; }
int32_t torch_device_type_cuda() { return g_shim.device_cuda; }

bool read_data_ptr(PyObject* obj, uintptr_t& data) {
  if (!g_ready) return false;
  PyTypeObject* type = Py_TYPE(obj);
  if (type != g_tensor_type && type != g_parameter_type) return false;
  void* impl = tensor_impl(obj);
  if (impl == nullptr) return false;
  void* slot = impl;
  void* ptr = nullptr;
  if (g_shim.get_data_ptr(&slot, &ptr) != 0) return false;
  data = reinterpret_cast<uintptr_t>(ptr);
  return true;
}

bool read_meta(PyObject* obj, TensorMeta& m) {
  if (!g_ready) return false;
  PyTypeObject* type = Py_TYPE(obj);
  if (type != g_tensor_type && type != g_parameter_type) return false;
  void* impl = tensor_impl(obj);
  if (impl == nullptr) return false;
  // An at::Tensor is one TensorImpl pointer: a local slot holding `impl` is a valid borrowed
  // AtenTensorHandle for read-only shim calls (none of them copies or releases the tensor).
  void* slot = impl;
  const Handle h = &slot;
  const Shim& s = g_shim;
  int32_t layout = -1, dtype = -1;
  int64_t* sizes = nullptr;
  void* data = nullptr;
  if (s.get_layout(h, &layout) != 0 || layout != s.layout_strided) return false;
  if (s.get_dtype(h, &dtype) != 0 || s.get_dim(h, &m.ndim) != 0 ||
      s.get_sizes(h, &sizes) != 0 || s.get_numel(h, &m.numel) != 0 ||
      s.get_device_type(h, &m.device_type) != 0 || s.get_device_index(h, &m.device_index) != 0 ||
      s.is_contiguous(h, &m.contiguous) != 0 || s.get_data_ptr(h, &data) != 0)
    return false;
  m.sizes = sizes;
  m.data = reinterpret_cast<uintptr_t>(data);
  m.impl = impl;
  m.neg = false;
  if (g_keyset_offset > 0) {
    uint64_t keys;
    std::memcpy(&keys, static_cast<const char*>(impl) + g_keyset_offset, sizeof keys);
    m.neg = (keys & g_neg_mask) != 0;
  }
  m.dtype = dtype == s.dtype_code[kFloat32]    ? kFloat32
            : dtype == s.dtype_code[kBFloat16] ? kBFloat16
            : dtype == s.dtype_code[kFloat16]  ? kFloat16
                                               : -1;
  return true;
}

// ---- the write checks without Python attributes -------------------------------------------

void* tensor_impl_of(PyObject* obj) {
  if (!g_ready) return nullptr;
  PyTypeObject* type = Py_TYPE(obj);
  if (type != g_tensor_type && type != g_parameter_type) return nullptr;
  return tensor_impl(obj);
}

int impl_requires_grad(const void* impl) {
  if (!g_requires_grad_on || impl == nullptr) return -1;
  return g_requires_grad(impl) ? 1 : 0;
}

int impl_is_inference(const void* impl) {
  if (!g_inference_on || g_keyset_offset <= 0 || impl == nullptr) return -1;
  uint64_t keys;
  std::memcpy(&keys, static_cast<const char*>(impl) + g_keyset_offset, sizeof keys);
  return (keys & g_inference_mask) == 0 ? 1 : 0;
}

bool fast_bump_ready() { return g_bump_on; }

bool impl_bump_version(void* impl) {
  if (!g_bump_on || impl == nullptr) return false;
  void* slot = impl;  // an at::Tensor is one TensorImpl pointer (borrowed: no refcount change)
  g_bump(&slot);
  return true;
}

namespace {
// `obj._version` as a number, or -1 (error cleared).
long long version_of(PyObject* obj) {
  PyObject* v = PyObject_GetAttrString(obj, "_version");
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const long long r = PyLong_AsLongLong(v);
  Py_DECREF(v);
  if (r == -1 && PyErr_Occurred()) PyErr_Clear();
  return r;
}

// Whether `list[i]` is True; -1 if it is not a bool.
int bool_at(PyObject* list, Py_ssize_t i) {
  if (!PyList_Check(list) || i >= PyList_GET_SIZE(list)) return -1;
  PyObject* v = PyList_GET_ITEM(list, i);
  return v == Py_True ? 1 : v == Py_False ? 0 : -1;
}
}  // namespace

std::string torch_api_enable_writes(PyObject* samples, PyObject* inference,
                                    PyObject* requires_grad, uint64_t inference_mask) {
  g_requires_grad_on = g_bump_on = g_inference_on = false;
  if (!g_ready || !PyList_Check(samples) || PyList_GET_SIZE(samples) < 2) return {};
  const Py_ssize_t n = PyList_GET_SIZE(samples);
  bool rg_ok = g_requires_grad != nullptr, inf_ok = g_keyset_offset > 0 && inference_mask != 0;
  bool bump_ok = false, saw_inference = false, saw_normal = false, saw_rg = false;
  g_inference_mask = inference_mask;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = PyList_GET_ITEM(samples, i);
    void* impl = tensor_impl_of(t);
    const int want_inf = bool_at(inference, i), want_rg = bool_at(requires_grad, i);
    if (impl == nullptr || want_inf < 0 || want_rg < 0) return {};
    if (rg_ok) rg_ok = g_requires_grad(impl) == (want_rg == 1);
    if (inf_ok) {
      g_inference_on = true;  // (asked once here, confirmed only if every sample agrees)
      inf_ok = impl_is_inference(impl) == want_inf;
      g_inference_on = false;
    }
    saw_inference |= want_inf == 1;
    saw_normal |= want_inf == 0;
    saw_rg |= want_rg == 1;
    if (g_bump != nullptr && !bump_ok && want_inf == 0 && want_rg == 0) {
      const long long before = version_of(t);
      void* slot = impl;
      g_bump(&slot);  // a sample: bumping its counter is harmless
      bump_ok = before >= 0 && version_of(t) == before + 1;
      if (!bump_ok) return {};  // bumped something else than torch's counter: nothing is used
    }
  }
  g_requires_grad_on = rg_ok && saw_rg;
  g_inference_on = inf_ok && saw_inference && saw_normal;
  g_bump_on = bump_ok;
  std::string on;
  for (auto [flag, name] : {std::pair<bool, const char*>{g_requires_grad_on, "requires_grad"},
                            {g_inference_on, "inference"}, {g_bump_on, "bump"}})
    if (flag) on += (on.empty() ? "" : ",") + std::string(name);
  return on;
}

}  // namespace accumkernels
