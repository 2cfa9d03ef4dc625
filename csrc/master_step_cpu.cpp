// The fused master step on the CPU: one pass per element over fp32 masters, their bf16/fp16
// weights, the gradients and the optimizer state (AdamW/Adam or SGD).
//
// Per element, when found_inf is absent or zero (otherwise nothing at all is written):
//   1. resync: the master takes the weight where weight != master rounded to the weight dtype
//      (NaN differs): a weight the user wrote is taken in exactly;
//   2. g = grad / grad_scale (fp32 division; stored back into grad with write_grad);
//   3. torch's fused CPU update of an fp32 param, bit for bit (see below);
//   4. weight = master rounded to nearest even (torch's cast).
//
// What torch's fused CPU kernels compute (aten/src/ATen/native/cpu/Fused{Adam,SGD}Kernel.cpp,
// checked against torch 2.13 with ATEN_CPU_CAPABILITY avx512, avx2 and default): fp32
// arithmetic with fp32 constants rounded from doubles; with an FMA build (AVX2/AVX512) the
// multiply-adds below are fused. The kernels are vector code (Vectorized<float>) over each
// thread's chunk, and the chunks start at multiples of 16 elements, so the last n % 8 elements
// of every tensor are the only ones that run torch's scalar loop (on AVX512 the compiler
// vectorises the scalar loop 8 wide, leaving n % 8). That loop, compiled with contraction, pairs
// one multiply-add differently:
//
//   Adam  v = fma(c2*g, g, v*b2)            last n % 8: v = fma(v, b2, (c2*g)*g)
//   SGD   buf = fma(1-d, g, buf*momentum)   last n % 8: buf = fma(buf, momentum, g*(1-d))
//
// Everything else is the same at every position. Without FMA (torch's DEFAULT capability)
// every product is rounded before its addition. `kFlagFma` picks the form (the op layer asks
// torch which capability it runs). The element formulas are spelled out in portable scalar code
// (master_step_cpu.h: adam_elem/sgd_elem, also the vector paths' tails) and in AVX2 and AVX-512
// (master_step_cpu_x86.h), with the same operations in the same order. Which ISA runs is picked
// at run time from what the CPU and the OS report (cpu_simd.h; ACCUMKERNELS_CPU_SIMD caps it);
// no -march flags.
#include <pybind11/pybind11.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "master_step_cpu.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_simd.h"
#if defined(ACCUMKERNELS_X86_SIMD)
#define ACCUMKERNELS_MASTER_X86 1
#include "master_step_cpu_x86.h"
#endif

namespace py = pybind11;

namespace accumkernels {
namespace {

using namespace master_cpu;

using RunFn = void (*)(const Row&, const Consts&, int64_t, int64_t);

template <int kDType, bool kFma, bool kAdam>
RunFn pick_one() {
#if defined(ACCUMKERNELS_MASTER_X86)
  const int level = cpu_simd_level();
  if (level == kSimdAvx512) return &run_avx512<kDType, kFma, kAdam>;
  if (level == kSimdAvx2) return &run_avx2<kDType, kFma, kAdam>;
#endif
  return &run_generic<kDType, kFma, kAdam>;
}

template <bool kAdam>
RunFn pick(int dtype, bool fma) {
  if (dtype == kBFloat16)
    return fma ? pick_one<kBFloat16, true, kAdam>() : pick_one<kBFloat16, false, kAdam>();
  return fma ? pick_one<kFloat16, true, kAdam>() : pick_one<kFloat16, false, kAdam>();
}

// 64K elements (about 2 MB of traffic for Adam): a multiple of 8, so that a tensor's tail lies
// in its last chunk and every other chunk is whole vectors.
constexpr int64_t kChunk = int64_t{1} << 16;
// Below this many elements in a call, one thread: waking the team costs more than it saves.
constexpr int64_t kSerialBelow = int64_t{1} << 15;

struct Chunk {
  uint32_t row;
  int64_t begin;
};

template <bool kAdam>
void run_rows(const std::vector<Row>& rows, const Consts& c, int num_threads) {
  RunFn fn[2][2];  // [dtype is fp16][fma]
  for (int h = 0; h < 2; ++h)
    for (int f = 0; f < 2; ++f) fn[h][f] = pick<kAdam>(h ? kFloat16 : kBFloat16, f != 0);
  const int fma = (c.flags & kFlagFma) ? 1 : 0;
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (size_t k = 0; k < rows.size(); ++k) {
    total += rows[k].numel;
    for (int64_t s = 0; s < rows[k].numel; s += kChunk)
      chunks.push_back({static_cast<uint32_t>(k), s});
  }
  auto run_chunk = [&](int64_t j) {
    const Row& r = rows[chunks[static_cast<size_t>(j)].row];
    const int64_t b = chunks[static_cast<size_t>(j)].begin;
    fn[r.dtype == kFloat16 ? 1 : 0][fma](r, c, b, std::min(r.numel, b + kChunk));
  };
  const int64_t n = static_cast<int64_t>(chunks.size());
#if defined(_OPENMP)
  if (num_threads > 1 && total >= kSerialBelow && n > 1) {
    const int team = static_cast<int>(std::min<int64_t>(num_threads, n));
#pragma omp parallel for num_threads(team) schedule(static)
    for (int64_t j = 0; j < n; ++j) run_chunk(j);
    return;
  }
#else
  (void)num_threads;
  (void)total;
#endif
  for (int64_t j = 0; j < n; ++j) run_chunk(j);
}

// -- Python side ---------------------------------------------------------------------------------

// A list of Python ints (addresses or counts) without pybind11's per-item caster cost.
std::vector<uint64_t> ints(py::handle seq, const char* name) {
  PyObject* fast = PySequence_Fast(seq.ptr(), "expected a list of ints");
  if (fast == nullptr) throw py::error_already_set();
  py::object guard = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_Check(items[i]))
      throw py::type_error(std::string(name) + "[" + std::to_string(i) + "] is not an int");
    const unsigned long long v = PyLong_AsUnsignedLongLongMask(items[i]);
    if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) throw py::error_already_set();
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

// Pointer list k of a call: 0 masters, 1 weights, 2 grads, 3-5 state, 6 steps (Adam).
constexpr int kLists = 7;
constexpr size_t kElemBytes[kLists] = {4, 2, 4, 4, 4, 4, 4};

// A call's arguments, checked (the memory guards) before anything is written.
struct Call {
  std::vector<Row> rows;                   // the non-empty tensors
  std::vector<std::vector<uint64_t>> ptr;  // [list][tensor]; empty: list absent
  std::vector<uint64_t> numel;
};

// `need[k]`: list k (3..6) must hold one pointer per tensor.
Call make_call(const char* op, py::handle ptr_lists, py::handle numels_in, py::handle dtypes_in,
               py::handle steps_in, const bool need[kLists]) {
  Call call;
  call.numel = ints(numels_in, "numels");
  const auto dtypes = ints(dtypes_in, "dtypes");
  const size_t n = call.numel.size();
  for (py::handle l : py::reinterpret_borrow<py::sequence>(ptr_lists))
    call.ptr.push_back(ints(l, "pointers"));
  call.ptr.push_back(steps_in.is_none() ? std::vector<uint64_t>{} : ints(steps_in, "steps"));
  if (call.ptr.size() != kLists || dtypes.size() != n)
    throw std::invalid_argument(std::string(op) +
                                ": expected 6 pointer lists and one dtype per tensor");
  for (int k = 0; k < kLists; ++k) {
    const bool required = k < 3 || need[k];
    const size_t len = call.ptr[k].size();
    if (required ? len != n : len != 0 && len != n)
      throw std::invalid_argument(std::string(op) + ": pointer list " + std::to_string(k) +
                                  " has the wrong length");
  }
  auto at = [&](int k, size_t i) { return call.ptr[k].empty() ? uint64_t{0} : call.ptr[k][i]; };
  for (size_t i = 0; i < n; ++i) {
    if (need[6] && at(6, i) == 0) throw std::invalid_argument(std::string(op) + ": null step");
    const int64_t numel = static_cast<int64_t>(call.numel[i]);
    if (numel < 0) throw std::invalid_argument(std::string(op) + ": negative numel");
    if (numel == 0) continue;
    const int dtype = static_cast<int>(dtypes[i]);
    if (dtype != kBFloat16 && dtype != kFloat16)
      throw std::invalid_argument(std::string(op) + ": weights must be bf16 or fp16");
    for (int k = 0; k < 6; ++k)
      if ((k < 3 || need[k]) && at(k, i) == 0)
        throw std::invalid_argument(std::string(op) + ": null data pointer");
    call.rows.push_back({reinterpret_cast<float*>(at(0, i)),
                         reinterpret_cast<uint16_t*>(at(1, i)),
                         reinterpret_cast<float*>(at(2, i)), reinterpret_cast<float*>(at(3, i)),
                         reinterpret_cast<float*>(at(4, i)), reinterpret_cast<float*>(at(5, i)),
                         numel, dtype, 0.0f, 0.0f, 1.0f});
  }
  return call;
}

// Two arrays of the call that share memory, as (list, index, list, index), or None. Each element
// is read and written once by one thread: arrays must not overlap.
py::object find_overlap(const Call& call) {
  struct Span {
    uint64_t begin, end;
    int list;
    size_t index;
  };
  std::vector<Span> spans;
  for (int k = 0; k < kLists; ++k)
    for (size_t i = 0; i < call.ptr[k].size(); ++i) {
      const uint64_t count = k == 6 ? 1 : call.numel[i];
      if (count != 0 && call.ptr[k][i] != 0)
        spans.push_back({call.ptr[k][i], call.ptr[k][i] + count * kElemBytes[k], k, i});
    }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return a.begin < b.begin; });
  uint64_t reach = 0;
  size_t widest = 0;  // the span reaching furthest so far
  for (size_t s = 0; s < spans.size(); ++s) {
    if (s > 0 && spans[s].begin < reach)
      return py::make_tuple(spans[widest].list, spans[widest].index, spans[s].list, spans[s].index);
    if (spans[s].end > reach) {
      reach = spans[s].end;
      widest = s;
    }
  }
  return py::none();
}

float read_flag(uint64_t ptr) { return ptr != 0 ? *reinterpret_cast<const float*>(ptr) : 0.0f; }

void fill_scale(Consts& c, uint64_t grad_scale_ptr) {
  c.scale = grad_scale_ptr != 0;
  c.gs = c.scale ? *reinterpret_cast<const float*>(grad_scale_ptr) : 1.0f;
}

// torch's _fused_adam on a checked call: steps += 1 (every step, the empty tensors' too); the
// update unless found_inf is set (any nonzero value, NaN included, skips it); steps -= found_inf.
void adam_run(Call& call, double lr, double beta1, double beta2, double weight_decay, double eps,
              int flags, uint64_t grad_scale_ptr, uint64_t found_inf_ptr, int num_threads) {
  auto step_at = [&](size_t i) { return reinterpret_cast<float*>(call.ptr[6][i]); };
  const float found = read_flag(found_inf_ptr);
  for (size_t i = 0; i < call.ptr[6].size(); ++i) *step_at(i) = *step_at(i) + 1.0f;
  if (found == 0.0f) {
    Consts c{};
    c.flags = flags;
    fill_scale(c, grad_scale_ptr);
    c.wd = static_cast<float>(weight_decay);
    c.decay = static_cast<float>(1.0 - lr * weight_decay);
    c.lerp_w = static_cast<float>(1.0 - beta1);
    c.small_lerp = std::fabs(c.lerp_w) < 0.5f;
    c.lerp_w1 = c.lerp_w - 1.0f;
    c.beta2 = static_cast<float>(beta2);
    c.c2 = static_cast<float>(1.0 - beta2);
    c.eps = static_cast<float>(eps);
    size_t k = 0;
    for (size_t i = 0; i < call.numel.size(); ++i) {
      if (call.numel[i] == 0) continue;
      const double step = *step_at(i);  // torch: double step = state_step.item<float>()
      const double step_size = lr / (1.0 - std::pow(beta1, step));
      Row& r = call.rows[k++];
      r.step_size = static_cast<float>(step_size);
      r.neg_step_size = static_cast<float>(-step_size);
      r.bc2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, step)));
    }
    run_rows<true>(call.rows, c, num_threads);
  }
  if (found_inf_ptr != 0)
    for (size_t i = 0; i < call.ptr[6].size(); ++i) *step_at(i) = *step_at(i) - found;
}

void sgd_run(Call& call, double lr, double momentum, double dampening, double weight_decay,
             int flags, uint64_t grad_scale_ptr, uint64_t found_inf_ptr, int num_threads) {
  if (read_flag(found_inf_ptr) != 0.0f) return;
  Consts c{};
  c.flags = flags;
  fill_scale(c, grad_scale_ptr);
  c.wd = static_cast<float>(weight_decay);
  c.momentum = static_cast<float>(momentum);
  c.damp = static_cast<float>(1.0 - dampening);
  c.lr = static_cast<float>(lr);
  c.neg_lr = static_cast<float>(-lr);
  run_rows<false>(call.rows, c, num_threads);
}

}  // namespace

void bind_master_step_cpu(pybind11::module_& m) {
  py::dict flags;
  flags["amsgrad"] = static_cast<int>(kFlagAmsgrad);
  flags["maximize"] = static_cast<int>(kFlagMaximize);
  flags["adamw"] = static_cast<int>(kFlagAdamW);
  flags["write_grad"] = static_cast<int>(kFlagWriteGrad);
  flags["fma"] = static_cast<int>(kFlagFma);
  flags["momentum"] = static_cast<int>(kFlagMomentum);
  flags["nesterov"] = static_cast<int>(kFlagNesterov);
  flags["first_step"] = static_cast<int>(kFlagFirstStep);
  m.attr("MASTER_STEP_CPU_FLAGS") = flags;

  m.def(
      "master_adam_step_cpu",
      [](py::handle ptrs, py::handle steps, py::handle numels, py::handle dtypes, double lr,
         double beta1, double beta2, double weight_decay, double eps, int flags,
         uint64_t grad_scale_ptr, uint64_t found_inf_ptr, int num_threads) -> py::object {
        const bool need[kLists] = {true, true, true, true, true, (flags & kFlagAmsgrad) != 0,
                                   true};
        Call call = make_call("master_adam_step_cpu", ptrs, numels, dtypes, steps, need);
        py::object overlap = find_overlap(call);
        if (!overlap.is_none()) return overlap;
        {
          py::gil_scoped_release no_gil;
          adam_run(call, lr, beta1, beta2, weight_decay, eps, flags, grad_scale_ptr,
                   found_inf_ptr, num_threads);
        }
        return py::none();
      },
      py::arg("ptrs"), py::arg("steps"), py::arg("numels"), py::arg("dtypes"), py::arg("lr"),
      py::arg("beta1"), py::arg("beta2"), py::arg("weight_decay"), py::arg("eps"),
      py::arg("flags"), py::arg("grad_scale_ptr"), py::arg("found_inf_ptr"),
      py::arg("num_threads"),
      "Fused master Adam/AdamW step on host memory, steps included (+1, then -found_inf). "
      "ptrs: 6 lists of addresses (masters, weights, grads, exp_avgs, exp_avg_sqs, "
      "max_exp_avg_sqs or []); steps: fp32 step addresses; dtypes: weight dtype codes; flags: "
      "MASTER_STEP_CPU_FLAGS; grad_scale_ptr/found_inf_ptr: fp32 addresses or 0. Returns None, "
      "or (list, i, list, j) for two arrays that share memory (then nothing was written; list 6: "
      "steps).");

  m.def(
      "master_sgd_step_cpu",
      [](py::handle ptrs, py::handle numels, py::handle dtypes, double lr, double momentum,
         double dampening, double weight_decay, int flags, uint64_t grad_scale_ptr,
         uint64_t found_inf_ptr, int num_threads) -> py::object {
        const bool need[kLists] = {true, true, true, (flags & kFlagMomentum) != 0, false, false,
                                   false};
        Call call = make_call("master_sgd_step_cpu", ptrs, numels, dtypes, py::none(), need);
        py::object overlap = find_overlap(call);
        if (!overlap.is_none()) return overlap;
        {
          py::gil_scoped_release no_gil;
          sgd_run(call, lr, momentum, dampening, weight_decay, flags, grad_scale_ptr,
                  found_inf_ptr, num_threads);
        }
        return py::none();
      },
      py::arg("ptrs"), py::arg("numels"), py::arg("dtypes"), py::arg("lr"), py::arg("momentum"),
      py::arg("dampening"), py::arg("weight_decay"), py::arg("flags"),
      py::arg("grad_scale_ptr"), py::arg("found_inf_ptr"), py::arg("num_threads"),
      "Fused master SGD step on host memory. ptrs: 6 lists of addresses (masters, weights, "
      "grads, momentum buffers or [], [], []); the rest and the result as master_adam_step_cpu.");
}

}  // namespace accumkernels
