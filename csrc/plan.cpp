// Plan (tensor_calls.h): a fixed dst list checked once; each launch reads only the src side.
#include <algorithm>
#include <memory>
#include <stdexcept>

#include "call_detail.h"
#include "tensor_calls.h"

namespace accumkernels {

using namespace detail;

// ---- Plan ------------------------------------------------------------------------------------

py::object Plan::create(py::handle dst_seq, py::handle keys, py::handle owner, bool inference,
                        py::handle norm_slots, int64_t norm_len) {
  if (!reader_ready()) return failure("slow");
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
  plan->set_norm_slots(norm_slots, norm_len, n);
  py::object failed = plan->capture(false);
  if (!failed.is_none()) return failed;
  plan->stamp_.assign(n, 0);
  plan->pos_.assign(n, -1);
  return py::cast(plan.release(), py::return_value_policy::take_ownership);
}

// norm_sq's size and each dst's element of it (the memory guard: every slot inside norm_sq; the
// Python layer also refuses two dst sharing a slot).
void Plan::set_norm_slots(py::handle slots, int64_t norm_len, size_t n) {
  if (slots.is_none()) {
    norm_len_ = static_cast<int64_t>(n);
    norm_slot_.resize(n);
    for (size_t i = 0; i < n; ++i) norm_slot_[i] = static_cast<int32_t>(i);
  } else {
    const Items s(slots);
    if (static_cast<size_t>(s.size()) != n)
      throw std::invalid_argument("Plan: norm_slots and dst differ in length");
    norm_len_ = norm_len;
    for (Py_ssize_t i = 0; i < s.size(); ++i) {
      const long long v = PyLong_AsLongLong(s[i]);
      if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
      if (v < 0 || v >= norm_len) throw std::invalid_argument("Plan: a norm slot is out of range");
      norm_slot_.push_back(static_cast<int32_t>(v));
    }
  }
  if (norm_len_ > kMaxNormSlots) throw std::invalid_argument("Plan: too many norm slots");
}

// Reads every dst and checks the dst rules; fills slots_, sizes_, lo_, hi_ (and the device, at
// creation). `again`: the dst moved since they were captured; failures then are ("plan_stale",
// i, why) with why 0 (no longer inside the owner's memory), 1 (no longer a usable dst) or 2
// (overlapping another dst), and the plan launches nothing until a later refresh succeeds.
py::object Plan::capture(bool again) {
  const Items dst(dst_);
  const auto n = static_cast<size_t>(dst.size());
  auto fail = [&](const char* code, size_t i, int64_t why) {
    if (again) slots_.clear();  // never launch on a half-refreshed table
    return again ? failure("plan_stale", static_cast<int64_t>(i), why)
                 : failure(code, static_cast<int64_t>(i));
  };
  TensorMeta d{}, own{};
  if (!owner_.is_none()) {
    if (!read_meta(owner_.ptr(), own) || (again && own.data == 0)) return fail("slow", 0, 0);
    owner_data_ = own.data;
  }
  std::vector<Span> spans, no_src, all;
  slots_.clear();
  sizes_.clear();
  lo_ = hi_ = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!read_meta(dst[static_cast<Py_ssize_t>(i)], d)) return fail("slow", i, 1);
    if (i == 0 && !again) device_type_ = d.device_type, device_index_ = d.device_index;
    const Device dev{device_type_, device_index_};
    if (d.dtype != kFloat32 || !d.contiguous || !dev.holds(d) || d.neg ||
        (d.numel > 0 && d.data == 0))
      return fail("dst", i, 1);
    if (again && !owner_.is_none() && d.numel > 0 && (d.data < own.data || d.end() > own.end()))
      return fail("dst", i, 0);
    slots_.push_back({d.data, d.numel, sizes_.size(), d.ndim});
    sizes_.insert(sizes_.end(), d.sizes, d.sizes + d.ndim);
    if (d.numel == 0) continue;
    spans.push_back({d.data, d.end(), static_cast<int32_t>(i), true, true});
    lo_ = spans.size() == 1 ? d.data : std::min(lo_, d.data);
    hi_ = std::max(hi_, d.end());
  }
  py::object overlap = find_overlap(spans, no_src, all);
  if (!overlap.is_none()) {
    if (!again) return overlap;
    return fail("dst_alias", py::cast<size_t>(py::tuple(overlap)[1]), 2);
  }
  return py::none();
}

bool Plan::src_fits(const TensorMeta& m, const Slot& s) const {
  if (m.dtype < 0 || !m.contiguous || m.neg || m.device_type != device_type_ ||
      m.device_index != device_index_ || m.ndim != s.ndim || (m.numel > 0 && m.data == 0))
    return false;
  return std::equal(m.sizes, m.sizes + m.ndim, sizes_.begin() + static_cast<ptrdiff_t>(s.sizes_at));
}

py::object Plan::check_overlaps(const std::vector<int32_t>& order,
                                const std::vector<TensorMeta>& src, const TensorMeta* scale,
                                const TensorMeta* found_inf, const TensorMeta* norm) const {
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
  for (const TensorMeta* t : {found_inf, scale, norm}) {
    if (t == nullptr || !overlaps(t->data, t->end(), lo_, hi_)) continue;
    for (size_t j = 0; j < order.size(); ++j) {
      const Slot& s = slots_[static_cast<size_t>(order[j])];
      if (s.numel > 0 && overlaps(t->data, t->end(), s.data, s.data + 4 * s.numel))
        return failure(t == found_inf ? "found_inf_dst" : t == norm ? "norm_sq_dst" : "scale_dst",
                       static_cast<int64_t>(j));
    }
  }
  if (norm != nullptr)
    for (size_t k = 0; k < src.size(); ++k)
      if (src[k].numel > 0 && overlaps(norm->data, norm->end(), src[k].data, src[k].end()))
        return failure("norm_sq_src", static_cast<int64_t>(k));
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
  if (slots_.empty() && PyList_GET_SIZE(dst_.ptr()) > 0) {  // a refresh failed: try again
    py::object failed = capture(true);
    if (!failed.is_none()) return failed;
  }
  bool moved = false;
  py::object result = run_once(keys, src_seq, o, moved);
  if (!moved) return result;
  // A dst's memory moved since the plan read it (share_memory_, a storage resized or swapped):
  // read every dst again, then launch on the new addresses, or refuse with nothing written.
  py::object failed = capture(true);
  if (!failed.is_none()) return failed;
  result = run_once(keys, src_seq, o, moved);
  return moved ? failure("plan_stale", 0, 1) : result;
}

py::object Plan::run_once(py::handle keys, py::handle src_seq, const CallOptions& o, bool& moved) {
  moved = false;
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
  // Writes go to the addresses read when the plan was built: only if the memory is still there.
  // With an owner (every dst a view of it, sharing its storage), one look at the owner's address
  // covers them all; without one, each launched dst is looked at below (one shim call each).
  const bool owned = !owner_.is_none();
  uintptr_t now = 0;
  if (owned) {
    if (!read_data_ptr(owner_.ptr(), now)) return failure("slow");
    if (now != owner_data_) {
      moved = true;
      return py::none();
    }
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
  const bool norm = wants_norm(o);
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
    if (!owned) {
      if (!read_data_ptr(PyList_GET_ITEM(dst_.ptr(), s), now)) return failure("slow");
      if (now != slot.data) {
        moved = true;
        return py::none();
      }
    }
    if (!src_fits(x, slot)) return failure("pair", static_cast<int64_t>(k));
    if (slot.numel > 0)
      pairs.push_back({reinterpret_cast<float*>(slot.data), reinterpret_cast<const void*>(x.data),
                       slot.numel, x.dtype, norm_slot_[su]});
    else if (norm)  // its norm slot is written (0): the kernel sees the empty pair
      pairs.push_back({nullptr, nullptr, 0, x.dtype, norm_slot_[su]});
  }
  CallScalars sc;
  if (const char* f = read_scalars(o, dev, norm_len_, sc)) return failure(f);
  if (const char* f = norm_scalar_overlap(sc)) return failure(f);
  py::object overlap = check_overlaps(order, metas, sc.scale_or_null(), sc.found_or_null(),
                                      sc.norm_or_null());
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
  if (const char* f = refuse_outputs(o, sc)) return refusal(f, "", -1);
  if (!owner_.is_none()) {
    bump_versions(py::make_tuple(owner_));
  } else {
    py::tuple written(n);
    for (size_t k = 0; k < n; ++k) {
      PyObject* t = PyList_GET_ITEM(dst_.ptr(), order[k]);
      Py_INCREF(t);
      PyTuple_SET_ITEM(written.ptr(), static_cast<Py_ssize_t>(k), t);
    }
    bump_items(Items(written));
  }
  bump_outputs(o, sc);
  run_kernel(pairs, o, sc);
  return py::none();
}

}  // namespace accumkernels
