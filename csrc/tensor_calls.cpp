// See tensor_calls.h. Hot loops use the Python C API directly (no pybind11 casters per item).
#include "tensor_calls.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

namespace accumkernels {
namespace {

PyObject* g_increment_version = nullptr;  // torch._C._increment_version
// CPU calls on fewer elements keep the GIL: they end in about the time releasing it costs.
constexpr int64_t kReleaseGilFrom = int64_t{1} << 15;
PyObject* g_str_requires_grad = nullptr;
PyObject* g_str_is_leaf = nullptr;
PyObject* g_str_version = nullptr;
PyObject* g_str_is_inference = nullptr;

py::object failure(const char* code, int64_t i = -1, int64_t j = -1) {
  return py::make_tuple(code, i, j);
}

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

// ---- overlap -----------------------------------------------------------------------------------

bool span_less(const Span& a, const Span& b) {
  return a.begin != b.begin ? a.begin < b.begin : (a.is_dst && !b.is_dst);
}

bool overlaps(uintptr_t a0, uintptr_t a1, uintptr_t b0, uintptr_t b1) { return a0 < b1 && b0 < a1; }

// No dst may overlap another dst, and no src may overlap a dst unless it is exactly that dst's
// memory as float32 (dst[i] += s * dst[i] is elementwise, like torch's a.add_(a)). One sweep in
// address order; the two lists are usually sorted already (then no sort at all).
py::object find_overlap(std::vector<Span>& dst, std::vector<Span>& src, std::vector<Span>& all) {
  for (std::vector<Span>* v : {&dst, &src})
    if (!std::is_sorted(v->begin(), v->end(), span_less)) std::sort(v->begin(), v->end(), span_less);
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

// What torch's in-place ops refuse: writing a tensor that requires grad while grad mode is on
// (torch raises for leaves and views of leaves, and records history otherwise, which this op
// cannot), and writing an inference tensor outside inference mode. Returns nullptr, "grad",
// "inference" or "slow".
const char* refuse_write(PyObject* t, int flags) {
  if (flags & kCheckAutograd) {
    const int rg = attr_true(t, g_str_requires_grad);
    if (rg < 0) return "slow";
    if (rg) return "grad";
  }
  if (flags & kCheckInference) {
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
      const bool inference = r == Py_True;
      Py_DECREF(r);
      return inference ? "inference" : "slow";
    }
    Py_DECREF(v);
  }
  return nullptr;
}

// (code, i) for a refusal of dst (`dst_*`) or found_inf (`found_inf_*`).
py::object refusal(const char* r, const char* name, int64_t i) {
  if (*r == 's') return failure("slow");
  return failure((std::string(name) + (*r == 'g' ? "_grad" : "_inference")).c_str(), i);
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

// ---- scale and found_inf ---------------------------------------------------------------------

// Reads an optional 1-element float32 tensor; returns nullptr (ok, `present` set), `name` (wrong
// dtype/size/device: the Python spec says which) or "slow".
const char* read_scalar(py::handle t, const char* name, const Device& dev, TensorMeta& m,
                        bool& present) {
  present = !t.is_none();
  if (!present) return nullptr;
  if (!read_meta(t.ptr(), m)) return "slow";
  if (m.dtype != kFloat32 || m.numel != 1 || !dev.holds(m) || m.data == 0) return name;
  return nullptr;
}

void run_kernel(const std::vector<TensorPair>& pairs, const CallOptions& o,
                const TensorMeta* scale, const TensorMeta* found_inf) {
  if (o.kernel == kNoKernel || pairs.empty()) return;
  const AccumulateArgs args{pairs.data(),
                            pairs.size(),
                            static_cast<float>(o.scale),
                            scale ? reinterpret_cast<const float*>(scale->data) : nullptr,
                            o.overwrite,
                            found_inf ? reinterpret_cast<float*>(found_inf->data) : nullptr};
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
                  (o.kernel == kCpuKernel && dev.type == torch_device_type_cpu()) ||
                  (o.kernel == kCudaKernel && dev.type == torch_device_type_cuda() &&
                   dev.index == o.device);
  if (!ok) throw std::invalid_argument("accumulate: the kernel does not match the tensors' device");
}

}  // namespace

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
  if (!torch_api_ready() || g_increment_version == nullptr) return failure("slow");
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
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!read_meta(dst[i], d) || !read_meta(src[i], x)) return failure("slow");
    if (d.dtype != kFloat32 || x.dtype < 0 || !same_sizes(d, x) || !dev.holds(d) ||
        !dev.holds(x) || !d.contiguous || !x.contiguous ||
        (d.numel > 0 && (d.data == 0 || x.data == 0)))
      return failure("pair", i);
    if (d.numel == 0) continue;
    const auto idx = static_cast<int32_t>(i);
    pairs.push_back({reinterpret_cast<float*>(d.data), reinterpret_cast<const void*>(x.data),
                     d.numel, x.dtype});
    pair_index.push_back(idx);
    dspans.push_back({d.data, d.end(), idx, true, true});
    sspans.push_back({x.data, x.end(), idx, false, x.dtype == kFloat32});
  }

  TensorMeta scale{}, found{};
  bool has_scale = false, has_found = false;
  if (const char* f = read_scalar(o.scale_tensor, "scale", dev, scale, has_scale))
    return failure(f);
  if (const char* f = read_scalar(o.found_inf, "found_inf", dev, found, has_found))
    return failure(f);

  py::object overlap = find_overlap(dspans, sspans, scratch->all);
  if (!overlap.is_none()) return overlap;
  if (has_found && has_scale && overlaps(found.data, found.end(), scale.data, scale.end()))
    return failure("found_inf_scale");
  for (size_t k = 0; k < pairs.size(); ++k) {
    const TensorPair& p = pairs[k];
    const int32_t i = pair_index[k];
    const uintptr_t d0 = reinterpret_cast<uintptr_t>(p.dst), d1 = d0 + 4 * p.numel;
    const uintptr_t s0 = reinterpret_cast<uintptr_t>(p.src);
    const uintptr_t s1 = s0 + static_cast<uintptr_t>(p.numel * (p.dtype == kFloat32 ? 4 : 2));
    if (has_found && overlaps(found.data, found.end(), d0, d1)) return failure("found_inf_dst", i);
    if (has_found && overlaps(found.data, found.end(), s0, s1)) return failure("found_inf_src", i);
    if (has_scale && overlaps(scale.data, scale.end(), d0, d1)) return failure("scale_dst", i);
  }

  if (o.flags & (kCheckAutograd | kCheckInference)) {
    for (Py_ssize_t i = 0; i < n; ++i)
      if (const char* r = refuse_write(dst[i], o.flags)) return refusal(r, "dst", i);
    if (has_found)
      if (const char* r = refuse_write(o.found_inf.ptr(), o.flags))
        return refusal(r, "found_inf", -1);
  }
  bump_versions(dst.seq());
  if (has_found) bump_versions(py::make_tuple(o.found_inf));
  run_kernel(pairs, o, has_scale ? &scale : nullptr, has_found ? &found : nullptr);
  return py::none();
}

// ---- Plan ------------------------------------------------------------------------------------

py::object Plan::create(py::handle dst_seq, py::handle keys, py::handle owner, bool inference) {
  if (!torch_api_ready() || g_increment_version == nullptr) return failure("slow");
  std::unique_ptr<Plan> plan(new Plan());
  plan->dst_ = copy_list(dst_seq);  // private copies: the caller may change its lists
  plan->keys_ = keys.is_none() ? py::object(py::none()) : py::object(copy_list(keys));
  plan->owner_ = py::reinterpret_borrow<py::object>(owner);
  plan->inference_ = inference;
  const Items dst(plan->dst_);
  const auto n = static_cast<size_t>(dst.size());
  if (!keys.is_none()) {
    const Items k(plan->keys_);
    if (static_cast<size_t>(k.size()) != n)
      throw std::invalid_argument("Plan: keys and dst differ in length");
    for (size_t i = 0; i < n; ++i)
      if (!plan->slot_of_.emplace(k[i], static_cast<int32_t>(i)).second)
        throw std::invalid_argument("Plan: a key appears twice");
  }
  std::vector<Span> spans, no_src, all;
  TensorMeta d{};
  for (size_t i = 0; i < n; ++i) {
    if (!read_meta(dst[i], d)) return failure("slow");
    if (i == 0) plan->device_type_ = d.device_type, plan->device_index_ = d.device_index;
    const Device dev{plan->device_type_, plan->device_index_};
    if (d.dtype != kFloat32 || !d.contiguous || !dev.holds(d) || (d.numel > 0 && d.data == 0))
      return failure("dst", static_cast<int64_t>(i));
    plan->slots_.push_back({d.data, d.numel, plan->sizes_.size(), d.ndim});
    plan->sizes_.insert(plan->sizes_.end(), d.sizes, d.sizes + d.ndim);
    if (d.numel == 0) continue;
    spans.push_back({d.data, d.end(), static_cast<int32_t>(i), true, true});
    plan->lo_ = spans.size() == 1 ? d.data : std::min(plan->lo_, d.data);
    plan->hi_ = std::max(plan->hi_, d.end());
  }
  py::object overlap = find_overlap(spans, no_src, all);
  if (!overlap.is_none()) return overlap;
  plan->stamp_.assign(n, 0);
  plan->pos_.assign(n, -1);
  return py::cast(plan.release(), py::return_value_policy::take_ownership);
}

bool Plan::src_fits(const TensorMeta& m, const Slot& s) const {
  if (m.dtype < 0 || !m.contiguous || m.device_type != device_type_ ||
      m.device_index != device_index_ || m.ndim != s.ndim || (m.numel > 0 && m.data == 0))
    return false;
  return std::equal(m.sizes, m.sizes + m.ndim, sizes_.begin() + static_cast<ptrdiff_t>(s.sizes_at));
}

py::object Plan::check_overlaps(const std::vector<int32_t>& order,
                                const std::vector<TensorMeta>& src, const TensorMeta* scale,
                                const TensorMeta* found_inf) const {
  // Only tensors inside [lo_, hi_) can touch a dst: check those against this launch's dst.
  for (size_t k = 0; k < src.size(); ++k) {
    const TensorMeta& x = src[k];
    if (x.numel == 0 || !overlaps(x.data, x.end(), lo_, hi_)) continue;
    for (size_t j = 0; j < order.size(); ++j) {
      const Slot& s = slots_[static_cast<size_t>(order[j])];
      if (s.numel == 0 || !overlaps(x.data, x.end(), s.data, s.data + 4 * s.numel)) continue;
      const bool twin = j == k && x.data == s.data && x.dtype == kFloat32;  // same numel: checked
      if (!twin) return failure("src_overlap", static_cast<int64_t>(k), static_cast<int64_t>(j));
    }
  }
  for (const TensorMeta* t : {found_inf, scale}) {
    if (t == nullptr || !overlaps(t->data, t->end(), lo_, hi_)) continue;
    for (size_t j = 0; j < order.size(); ++j) {
      const Slot& s = slots_[static_cast<size_t>(order[j])];
      if (s.numel > 0 && overlaps(t->data, t->end(), s.data, s.data + 4 * s.numel))
        return failure(t == found_inf ? "found_inf_dst" : "scale_dst", static_cast<int64_t>(j));
    }
  }
  if (found_inf != nullptr) {
    if (scale != nullptr && overlaps(found_inf->data, found_inf->end(), scale->data, scale->end()))
      return failure("found_inf_scale");
    for (size_t k = 0; k < src.size(); ++k)
      if (src[k].numel > 0 &&
          overlaps(found_inf->data, found_inf->end(), src[k].data, src[k].end()))
        return failure("found_inf_src", static_cast<int64_t>(k));
  }
  return py::none();
}

py::object Plan::run(py::handle keys, py::handle src_seq, const CallOptions& o) {
  if (!torch_api_ready()) return failure("slow");
  const Items src(src_seq);
  const auto n = static_cast<size_t>(src.size());
  const Device dev{device_type_, device_index_};
  if (n == 0) return py::none();
  check_kernel_device(o, dev);
  const bool identity = keys.is_none();
  if (identity && n != slots_.size())
    throw std::invalid_argument("Plan.run: without keys, src must cover every dst");
  std::unique_ptr<Items> key_items;
  if (!identity) {
    if (keys_.is_none()) throw std::invalid_argument("Plan.run: this plan has no keys");
    key_items = std::make_unique<Items>(keys);
    if (static_cast<size_t>(key_items->size()) != n)
      throw std::invalid_argument("Plan.run: keys and src differ in length");
  }
  if (++launch_ == 0) {  // the stamp counter wrapped: forget every stamp
    std::fill(stamp_.begin(), stamp_.end(), 0);
    launch_ = 1;
  }
  const Items own_keys(keys_.is_none() ? py::handle(dst_) : py::handle(keys_));  // fast match
  ScratchLease scratch;
  std::vector<int32_t>& order = scratch->order;
  std::vector<TensorMeta>& metas = scratch->metas;
  std::vector<TensorPair>& pairs = scratch->pairs;
  order.resize(n);
  metas.resize(n);
  for (size_t k = 0; k < n; ++k) {
    int32_t s = static_cast<int32_t>(k);
    if (!identity) {
      PyObject* key = (*key_items)[static_cast<Py_ssize_t>(k)];
      if (k >= slots_.size() || key != own_keys[static_cast<Py_ssize_t>(k)]) {
        const auto it = slot_of_.find(key);
        if (it == slot_of_.end()) return failure("not_member", static_cast<int64_t>(k));
        s = it->second;
      }
    }
    const auto su = static_cast<size_t>(s);
    if (stamp_[su] == launch_) return failure("dst_alias", pos_[su], static_cast<int64_t>(k));
    stamp_[su] = launch_;
    pos_[su] = static_cast<int32_t>(k);
    order[k] = s;
    TensorMeta& x = metas[k];
    if (!read_meta(src[static_cast<Py_ssize_t>(k)], x)) return failure("slow");
    const Slot& slot = slots_[su];
    if (!src_fits(x, slot)) return failure("pair", static_cast<int64_t>(k));
    if (slot.numel > 0)
      pairs.push_back({reinterpret_cast<float*>(slot.data), reinterpret_cast<const void*>(x.data),
                       slot.numel, x.dtype});
  }
  TensorMeta scale{}, found{};
  bool has_scale = false, has_found = false;
  if (const char* f = read_scalar(o.scale_tensor, "scale", dev, scale, has_scale))
    return failure(f);
  if (const char* f = read_scalar(o.found_inf, "found_inf", dev, found, has_found))
    return failure(f);
  py::object overlap = check_overlaps(order, metas, has_scale ? &scale : nullptr,
                                      has_found ? &found : nullptr);
  if (!overlap.is_none()) return overlap;

  // Inference-ness never changes (checked at creation); with an owner, the dst are its views
  // and require grad exactly when it does, so one look covers them all.
  if ((o.flags & kCheckInference) && inference_) return failure("dst_inference", 0);
  if (o.flags & kCheckAutograd) {
    if (!owner_.is_none()) {
      if (const char* r = refuse_write(owner_.ptr(), kCheckAutograd)) return refusal(r, "dst", 0);
    } else {
      for (size_t k = 0; k < n; ++k)
        if (const char* r = refuse_write(PyList_GET_ITEM(dst_.ptr(), order[k]), kCheckAutograd))
          return refusal(r, "dst", static_cast<int64_t>(k));
    }
  }
  if (has_found)
    if (const char* r = refuse_write(o.found_inf.ptr(), o.flags))
      return refusal(r, "found_inf", -1);
  if (!owner_.is_none()) {
    bump_versions(py::make_tuple(owner_));
  } else {
    py::tuple written(n);
    for (size_t k = 0; k < n; ++k) {
      PyObject* t = PyList_GET_ITEM(dst_.ptr(), order[k]);
      Py_INCREF(t);
      PyTuple_SET_ITEM(written.ptr(), static_cast<Py_ssize_t>(k), t);
    }
    bump_versions(written);
  }
  if (has_found) bump_versions(py::make_tuple(o.found_inf));
  run_kernel(pairs, o, has_scale ? &scale : nullptr, has_found ? &found : nullptr);
  return py::none();
}

}  // namespace accumkernels
