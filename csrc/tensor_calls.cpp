// See tensor_calls.h: the shared pieces (call_detail.h) and the public call. Hot loops use the
// Python C API directly (no pybind11 casters per item).
#include "tensor_calls.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "call_detail.h"

namespace accumkernels {
namespace {

PyObject* g_increment_version = nullptr;  // torch._C._increment_version
// CPU calls on fewer elements keep the GIL: they end in about the time releasing it costs.
constexpr int64_t kReleaseGilFrom = int64_t{1} << 15;
PyObject* g_str_requires_grad = nullptr;
PyObject* g_str_is_leaf = nullptr;
PyObject* g_str_version = nullptr;
PyObject* g_str_is_inference = nullptr;

}  // namespace

namespace detail {

py::object failure(const char* code, int64_t i, int64_t j) {
  return py::make_tuple(code, i, j);
}

// ---- overlap -----------------------------------------------------------------------------------

namespace {
// A function object (not a function pointer), so that the sort inlines it.
struct SpanLess {
  bool operator()(const Span& a, const Span& b) const {
    return a.begin != b.begin ? a.begin < b.begin : (a.is_dst && !b.is_dst);
  }
};
constexpr SpanLess span_less{};

}  // namespace

// No dst may overlap another dst, and no src may overlap a dst unless it is exactly that dst's
// memory as float32 (dst[i] += s * dst[i] is elementwise, like torch's a.add_(a)). One sweep in
// address order; the two lists are usually sorted already (then no sort at all).
py::object find_overlap(std::vector<Span>& dst, std::vector<Span>& src, std::vector<Span>& all) {
  for (std::vector<Span>* v : {&dst, &src}) {
    if (std::is_sorted(v->begin(), v->end(), span_less)) continue;
    // Descending (tensors allocated in the reverse of list order, as backward makes grads):
    // one reversal. Ties cannot matter: within one list every span has the same kind.
    if (std::is_sorted(v->rbegin(), v->rend(), span_less)) std::reverse(v->begin(), v->end());
    else std::sort(v->begin(), v->end(), span_less);
  }
  all.resize(dst.size() + src.size());
  std::merge(dst.begin(), dst.end(), src.begin(), src.end(), all.begin(), span_less);
  const Span none{0, 0, -1, true, false};
  const Span* last_dst = &none;  // the dst seen so far that ends last
  const Span* last_src = &none;
  for (const Span& s : all) {
    if (s.is_dst) {
      if (last_dst->end > s.begin)
        return failure("dst_alias", std::min(last_dst->index, s.index),
                       std::max(last_dst->index, s.index));
      // A src starting before this dst cannot be its identical twin (those sort after it).
      if (last_src->end > s.begin) return failure("src_overlap", last_src->index, s.index);
      if (s.end > last_dst->end) last_dst = &s;
    } else {
      if (last_dst->end > s.begin) {
        // If another dst overlapped s as well, it would overlap last_dst: reported above.
        const bool twin = last_dst->index == s.index && last_dst->begin == s.begin &&
                          last_dst->end == s.end && s.f32;
        if (!twin) return failure("src_overlap", s.index, last_dst->index);
      }
      if (s.end > last_src->end) last_src = &s;
    }
  }
  return py::none();
}

// ---- checks in Python attributes (only what the flags ask for) ----------------------------------

namespace {
// Whether the attribute `name` of `t` is True; -1 on error (cleared).
int attr_true(PyObject* t, PyObject* name) {
  PyObject* v = PyObject_GetAttr(t, name);
  if (v == nullptr) {
    PyErr_Clear();
    return -1;
  }
  const int r = v == Py_True;
  Py_DECREF(v);
  return r;
}

}  // namespace

// What torch's in-place ops refuse: writing a tensor that requires grad while grad mode is on
// (torch raises for leaves and views of leaves, and records history otherwise, which this op
// cannot), and writing an inference tensor outside inference mode. Returns nullptr, "grad",
// "inference" or "slow".
const char* refuse_write(PyObject* t, int flags, const void* impl) {
  if (impl == nullptr && (flags & (kCheckAutograd | kCheckInference))) impl = tensor_impl_of(t);
  if (flags & kCheckAutograd) {
    int rg = impl_requires_grad(impl);  // -1: ask Python
    if (rg < 0) rg = attr_true(t, g_str_requires_grad);
    if (rg < 0) return "slow";
    if (rg) return "grad";
  }
  if (flags & kCheckInference) {
    const int inference = impl_is_inference(impl);
    if (inference == 1) return "inference";
    if (inference == 0) return nullptr;
    // `_version` raises for inference tensors (they have no counter), and costs half of
    // is_inference(); confirm on the rare failure.
    PyObject* v = PyObject_GetAttr(t, g_str_version);
    if (v == nullptr) {
      PyErr_Clear();
      PyObject* r = PyObject_CallMethodNoArgs(t, g_str_is_inference);
      if (r == nullptr) {
        PyErr_Clear();
        return "slow";
      }
      const bool inference_now = r == Py_True;
      Py_DECREF(r);
      return inference_now ? "inference" : "slow";
    }
    Py_DECREF(v);
  }
  return nullptr;
}

// (code, i) for a refusal of dst (`dst_*`), found_inf or norm_sq; an empty `name`: `r` is the
// full code already (refuse_outputs).
py::object refusal(const char* r, const char* name, int64_t i) {
  if (*r == 's') return failure("slow");
  if (*name == 0) return failure(r, i);
  return failure((std::string(name) + (*r == 'g' ? "_grad" : "_inference")).c_str(), i);
}

const char* refuse_outputs(const CallOptions& o, const CallScalars& s) {
  static const char* const codes[2][2] = {{"found_inf_grad", "found_inf_inference"},
                                          {"norm_sq_grad", "norm_sq_inference"}};
  const py::handle outs[2] = {s.has_found ? o.found_inf : py::handle(),
                              s.has_norm ? o.norm_sq : py::handle()};
  for (int k = 0; k < 2; ++k) {
    if (!outs[k]) continue;
    const char* r = refuse_write(outs[k].ptr(), o.flags);
    if (r != nullptr) return *r == 's' ? "slow" : codes[k][*r == 'g' ? 0 : 1];
  }
  return nullptr;
}

void bump_outputs(const CallOptions& o, const CallScalars& s) {
  if (s.has_found && s.has_norm) bump_versions(py::make_tuple(o.found_inf, o.norm_sq));
  else if (s.has_found) bump_versions(py::make_tuple(o.found_inf));
  else if (s.has_norm) bump_versions(py::make_tuple(o.norm_sq));
}

const char* norm_scalar_overlap(const CallScalars& s) {
  if (!s.has_norm) return nullptr;
  const uintptr_t n0 = s.norm.data, n1 = s.norm.end();
  if (s.has_found && overlaps(n0, n1, s.found.data, s.found.end())) return "norm_sq_found_inf";
  if (s.has_scale && overlaps(n0, n1, s.scale.data, s.scale.end())) return "norm_sq_scale";
  return nullptr;
}

py::list copy_list(py::handle seq) {
  PyObject* list = PySequence_List(seq.ptr());
  if (list == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::list>(list);
}

void bump_versions(py::handle tensors) {
  PyObject* r = PyObject_CallOneArg(g_increment_version, tensors.ptr());
  if (r == nullptr) throw py::error_already_set();
  Py_DECREF(r);
}

void bump_items(const Items& items) {
  if (!fast_bump_ready()) {
    bump_versions(items.seq());
    return;
  }
  const Py_ssize_t n = items.size();
  for (Py_ssize_t i = 0; i < n; ++i) {
    void* impl = tensor_impl_of(items[i]);
    if (impl == nullptr) {  // (read before: cannot happen) torch's own path, for the rest too
      py::list rest;
      for (Py_ssize_t j = i; j < n; ++j) rest.append(py::handle(items[j]));
      bump_versions(rest);
      return;
    }
    impl_bump_version(impl);
  }
}

// ---- scale and found_inf ---------------------------------------------------------------------

namespace {
// One optional 1-element float32 tensor: nullptr (ok, `present` set), `name` or "slow".
const char* read_scalar(py::handle t, const char* name, const Device& dev, TensorMeta& m,
                        bool& present) {
  present = !t.is_none();
  if (!present) return nullptr;
  if (!read_meta(t.ptr(), m)) return "slow";
  if (m.dtype != kFloat32 || m.numel != 1 || !dev.holds(m) || m.data == 0 || m.neg) return name;
  return nullptr;
}
}  // namespace

const char* read_scalars(const CallOptions& o, const Device& dev, int64_t norm_len,
                         CallScalars& s) {
  if (const char* f = read_scalar(o.scale_tensor, "scale", dev, s.scale, s.has_scale)) return f;
  if (const char* f = read_scalar(o.found_inf, "found_inf", dev, s.found, s.has_found)) return f;
  s.has_norm = wants_norm(o);
  if (!s.has_norm) return nullptr;
  TensorMeta& m = s.norm;
  if (!read_meta(o.norm_sq.ptr(), m)) return "slow";
  if (m.dtype != kFloat32 || m.ndim != 1 || m.numel != norm_len || !m.contiguous ||
      !dev.holds(m) || m.neg || (m.numel > 0 && m.data == 0))
    return "norm_sq";
  return nullptr;
}

void run_kernel(const std::vector<TensorPair>& pairs, const CallOptions& o, const CallScalars& s) {
  if (o.kernel == kNoKernel || pairs.empty()) return;
  const TensorMeta* scale = s.scale_or_null();
  const TensorMeta* found_inf = s.found_or_null();
  const TensorMeta* norm = s.norm_or_null();
  const AccumulateArgs args{pairs.data(),
                            pairs.size(),
                            static_cast<float>(o.scale),
                            scale ? reinterpret_cast<const float*>(scale->data) : nullptr,
                            o.overwrite,
                            found_inf ? reinterpret_cast<float*>(found_inf->data) : nullptr,
                            norm ? reinterpret_cast<float*>(norm->data) : nullptr};
  if (o.kernel == kCudaHostKernel) {
    py::gil_scoped_release no_gil;
    accumulate_cuda_host(args);
    return;
  }
  if (o.kernel == kCpuKernel) {
    int64_t total = 0;
    for (const TensorPair& p : pairs) total += p.numel;
    if (total < kReleaseGilFrom) {  // done before another thread could get the GIL
      accumulate_cpu(args, o.num_threads);
      return;
    }
    py::gil_scoped_release no_gil;
    accumulate_cpu(args, o.num_threads);
    return;
  }
#if defined(ACCUMKERNELS_WITH_CUDA)
  py::gil_scoped_release no_gil;
  accumulate_cuda(args, reinterpret_cast<void*>(static_cast<uintptr_t>(o.stream)), o.device);
#else
  throw std::runtime_error("accumkernels._C was built without CUDA");
#endif
}

void check_kernel_device(const CallOptions& o, const Device& dev) {
  const bool ok = o.kernel == kNoKernel ||
                  ((o.kernel == kCpuKernel || o.kernel == kCudaHostKernel) &&
                   dev.type == torch_device_type_cpu()) ||
                  (o.kernel == kCudaKernel && dev.type == torch_device_type_cuda() &&
                   dev.index == o.device);
  if (!ok) throw std::invalid_argument("accumulate: the kernel does not match the tensors' device");
}

bool reader_ready() { return torch_api_ready() && g_increment_version != nullptr; }

}  // namespace detail

using namespace detail;

void set_increment_version(py::handle fn) {
  Py_XDECREF(g_increment_version);
  Py_INCREF(fn.ptr());
  g_increment_version = fn.ptr();
  if (g_str_requires_grad == nullptr) {
    g_str_requires_grad = PyUnicode_InternFromString("requires_grad");
    g_str_is_leaf = PyUnicode_InternFromString("is_leaf");
    g_str_version = PyUnicode_InternFromString("_version");
    g_str_is_inference = PyUnicode_InternFromString("is_inference");
  }
}

py::object accumulate_tensors(py::handle dst_seq, py::handle src_seq, const CallOptions& o) {
  if (!reader_ready()) return failure("slow");
  const Items dst(dst_seq), src(src_seq);
  const Py_ssize_t n = dst.size();
  if (src.size() != n) throw std::invalid_argument("accumulate: dst and src differ in length");
  if (n == 0) return py::none();
  TensorMeta d{}, x{};
  if (!read_meta(dst[0], d)) return failure("slow");
  const Device dev{d.device_type, d.device_index};
  check_kernel_device(o, dev);

  ScratchLease scratch;
  std::vector<TensorPair>& pairs = scratch->pairs;
  std::vector<int32_t>& pair_index = scratch->index;  // list index of each pair (non-empty)
  std::vector<Span>& dspans = scratch->dst;
  std::vector<Span>& sspans = scratch->src;
  const bool norm = wants_norm(o);
  const bool refusals = (o.flags & (kCheckAutograd | kCheckInference)) != 0;
  Py_ssize_t refused = -1;  // the first dst torch would not write (reported after the rest)
  const char* refused_why = nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!read_meta(dst[i], d) || !read_meta(src[i], x)) return failure("slow");
    if (d.dtype != kFloat32 || x.dtype < 0 || !same_sizes(d, x) || !dev.holds(d) ||
        !dev.holds(x) || !d.contiguous || !x.contiguous || d.neg || x.neg ||
        (d.numel > 0 && (d.data == 0 || x.data == 0)))
      return failure("pair", i);
    if (refusals && refused < 0) {
      refused_why = refuse_write(dst[i], o.flags, d.impl);
      if (refused_why != nullptr) refused = i;
    }
    const auto idx = static_cast<int32_t>(i);
    if (d.numel == 0) {
      if (norm) {  // its norm slot is written (0): the kernel sees the empty pair
        pairs.push_back({nullptr, nullptr, 0, x.dtype, idx});
        pair_index.push_back(idx);
      }
      continue;
    }
    pairs.push_back({reinterpret_cast<float*>(d.data), reinterpret_cast<const void*>(x.data),
                     d.numel, x.dtype, idx});
    pair_index.push_back(idx);
    dspans.push_back({d.data, d.end(), idx, true, true});
    sspans.push_back({x.data, x.end(), idx, false, x.dtype == kFloat32});
  }

  CallScalars sc;
  if (const char* f = read_scalars(o, dev, n, sc)) return failure(f);

  py::object overlap = find_overlap(dspans, sspans, scratch->all);
  if (!overlap.is_none()) return overlap;
  if (sc.has_found && sc.has_scale &&
      overlaps(sc.found.data, sc.found.end(), sc.scale.data, sc.scale.end()))
    return failure("found_inf_scale");
  if (const char* f = norm_scalar_overlap(sc)) return failure(f);
  for (size_t k = 0; k < pairs.size(); ++k) {
    const TensorPair& p = pairs[k];
    const int32_t i = pair_index[k];
    if (p.numel == 0) continue;
    const uintptr_t d0 = reinterpret_cast<uintptr_t>(p.dst), d1 = d0 + 4 * p.numel;
    const uintptr_t s0 = reinterpret_cast<uintptr_t>(p.src);
    const uintptr_t s1 = s0 + static_cast<uintptr_t>(p.numel * (p.dtype == kFloat32 ? 4 : 2));
    if (sc.has_found) {
      if (overlaps(sc.found.data, sc.found.end(), d0, d1)) return failure("found_inf_dst", i);
      if (overlaps(sc.found.data, sc.found.end(), s0, s1)) return failure("found_inf_src", i);
    }
    if (sc.has_scale && overlaps(sc.scale.data, sc.scale.end(), d0, d1))
      return failure("scale_dst", i);
    if (sc.has_norm) {
      if (overlaps(sc.norm.data, sc.norm.end(), d0, d1)) return failure("norm_sq_dst", i);
      if (overlaps(sc.norm.data, sc.norm.end(), s0, s1)) return failure("norm_sq_src", i);
    }
  }

  if (refusals) {
    if (refused >= 0) return refusal(refused_why, "dst", refused);
    if (const char* f = refuse_outputs(o, sc)) return refusal(f, "", -1);
  }
  bump_items(dst);
  bump_outputs(o, sc);
  run_kernel(pairs, o, sc);
  return py::none();
}

}  // namespace accumkernels
