// The fused master step's CUDA kernel (master_step_kernel.h) run on the CPU, for tests: the same
// checks, grouping by weight dtype and table building as master_step_cuda(), then each "launch"
// played block by block, thread by thread. The kernel's threads never meet (each writes its own
// elements; the scalars and the table are read-only), so one after another is a valid schedule.
// Built by the host compiler into every build of _C: no GPU, no CUDA runtime.
//
// Also the Python bindings of both: `master_step_cuda_host` always, `master_step_cuda` (the real
// launch, device pointers) only in CUDA builds.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "master_step_kernel.h"

namespace py = pybind11;

namespace accumkernels {
namespace master_step {
namespace {

std::atomic<int> g_sm_count{132};  // H100 SXM; tests vary it to move the grid-stride boundary
std::mutex g_log_mutex;
std::vector<std::string> g_log;  // the last call's launches

template <int kCap>
std::string table_name(const ParamTable<kCap>&) {
  return "param" + std::to_string(kCap);
}
std::string dtype_name(bf16_t) { return "bf16"; }
std::string dtype_name(half_t) { return "fp16"; }

struct HostLauncher {
  std::vector<std::string> log;

  int64_t max_grid() const { return int64_t{g_sm_count.load()} * kBlocksPerSM; }
  template <int kAlgo, class W, class Table>
  void run(const Table& table, const LaunchArgs& args, unsigned grid) {
    log.push_back(dtype_name(W{}) + " " + table_name(table) + " grid=" + std::to_string(grid) +
                  " chunks=" + std::to_string(args.num_chunks) +
                  " tensors=" + std::to_string(table.num_tensors));
    for (unsigned block = 0; block < grid; ++block)
      for (unsigned thread = 0; thread < kThreads; ++thread)
        step_thread<kAlgo, W>(table, args, block, thread, grid);
  }
};

// A list of Python ints (addresses may exceed 2^63).
std::vector<uint64_t> int_list(py::handle seq, const char* name) {
  PyObject* fast = PySequence_Fast(seq.ptr(), "expected a list of ints");
  if (fast == nullptr) throw py::error_already_set();
  const py::object guard = py::reinterpret_steal<py::object>(fast);
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  PyObject** items = PySequence_Fast_ITEMS(fast);
  std::vector<uint64_t> out(static_cast<size_t>(n));
  for (Py_ssize_t i = 0; i < n; ++i) {
    if (!PyLong_Check(items[i]))
      throw py::type_error(std::string(name) + "[" + std::to_string(i) + "] is not an int");
    const unsigned long long v = PyLong_AsUnsignedLongLongMask(items[i]);
    if (PyErr_Occurred()) throw py::error_already_set();
    out[static_cast<size_t>(i)] = v;
  }
  return out;
}

template <class T>
T* as_ptr(uint64_t v) {
  return reinterpret_cast<T*>(static_cast<uintptr_t>(v));
}

// The call from Python: 7 address rows (masters, weights, grads, state0, state1, state2, steps;
// an unused row may be empty), element counts, weight dtype codes, 7 scalars (lr, beta1, beta2,
// weight_decay, eps, momentum, dampening), and the optional scalar tensors' addresses (0: none).
struct PyCall {
  std::vector<MasterStepTensor> tensors;
  MasterStepCall call{};
};

PyCall make_call(int algo, uint32_t flags, py::handle rows, py::handle numels,
                 py::handle weight_dtypes, const std::vector<double>& scalars, uint64_t lr_ptr,
                 uint64_t grad_scale_ptr, uint64_t found_inf_ptr) {
  static const char* kRows[7] = {"masters", "weights", "grads", "state0", "state1", "state2",
                                 "steps"};
  const py::sequence row_seq = py::reinterpret_borrow<py::sequence>(rows);
  if (row_seq.size() != 7) throw std::invalid_argument("master_step: expected 7 address rows");
  const auto num = int_list(numels, "numels");
  const auto dts = int_list(weight_dtypes, "weight_dtypes");
  const size_t n = num.size();
  if (dts.size() != n) throw std::invalid_argument("master_step: one weight dtype per tensor");
  std::vector<std::vector<uint64_t>> r(7);
  for (size_t k = 0; k < 7; ++k) {
    r[k] = int_list(row_seq[k], kRows[k]);
    if (r[k].empty()) r[k].assign(n, 0);
    if (r[k].size() != n)
      throw std::invalid_argument(std::string("master_step: ") + kRows[k] + " has " +
                                  std::to_string(r[k].size()) + " addresses, expected " +
                                  std::to_string(n));
  }
  if (scalars.size() != 7) throw std::invalid_argument("master_step: expected 7 scalars");
  PyCall pc;
  pc.tensors.resize(n);
  for (size_t i = 0; i < n; ++i)
    pc.tensors[i] = {as_ptr<float>(r[0][i]), as_ptr<void>(r[1][i]), as_ptr<float>(r[2][i]),
                     as_ptr<float>(r[3][i]), as_ptr<float>(r[4][i]), as_ptr<float>(r[5][i]),
                     as_ptr<const float>(r[6][i]), static_cast<int64_t>(num[i]),
                     static_cast<int32_t>(dts[i])};
  pc.call = {algo, flags, pc.tensors.data(), n, scalars[0], scalars[1], scalars[2], scalars[3],
             scalars[4], scalars[5], scalars[6], as_ptr<const float>(lr_ptr),
             as_ptr<const float>(grad_scale_ptr), as_ptr<const float>(found_inf_ptr)};
  return pc;
}

}  // namespace
}  // namespace master_step

void master_step_cuda_host(const MasterStepCall& call) {
  master_step::HostLauncher launcher;
  master_step::launch_call(call, launcher);
  const std::lock_guard<std::mutex> lock(master_step::g_log_mutex);
  master_step::g_log.swap(launcher.log);
}

}  // namespace accumkernels

namespace accumkernels {
namespace ms = master_step;

void bind_master_step_cuda(pybind11::module_& m) {
  namespace akn = accumkernels;
  m.attr("MASTER_STEP_SGD") = static_cast<int>(akn::kStepSgd);
  m.attr("MASTER_STEP_ADAM_F64") = static_cast<int>(akn::kStepAdamF64);
  m.attr("MASTER_STEP_ADAM_F32") = static_cast<int>(akn::kStepAdamF32);
  py::dict flags;
  flags["amsgrad"] = static_cast<int>(akn::kStepAmsgrad);
  flags["maximize"] = static_cast<int>(akn::kStepMaximize);
  flags["adamw"] = static_cast<int>(akn::kStepAdamW);
  flags["nesterov"] = static_cast<int>(akn::kStepNesterov);
  flags["first_step"] = static_cast<int>(akn::kStepFirst);
  flags["momentum"] = static_cast<int>(akn::kStepMomentum);
  flags["write_grad"] = static_cast<int>(akn::kStepWriteGrad);
  m.attr("MASTER_STEP_FLAGS") = flags;

  m.def(
      "master_step_cuda_host",
      [](int algo, uint32_t flags, py::handle rows, py::handle numels, py::handle weight_dtypes,
         const std::vector<double>& scalars, uint64_t lr_ptr, uint64_t grad_scale_ptr,
         uint64_t found_inf_ptr) {
        const ms::PyCall pc = ms::make_call(algo, flags, rows, numels, weight_dtypes, scalars,
                                            lr_ptr, grad_scale_ptr, found_inf_ptr);
        py::gil_scoped_release no_gil;
        accumkernels::master_step_cuda_host(pc.call);
      },
      py::arg("algo"), py::arg("flags"), py::arg("rows"), py::arg("numels"),
      py::arg("weight_dtypes"), py::arg("scalars"), py::arg("lr_ptr"), py::arg("grad_scale_ptr"),
      py::arg("found_inf_ptr"),
      "The fused master step's CUDA kernel played on the CPU (host addresses): rows = 7 address "
      "lists (masters, weights, grads, state0, state1, state2, steps; unused ones empty), "
      "scalars = (lr, beta1, beta2, weight_decay, eps, momentum, dampening).");
  m.def("master_step_cuda_host_configure",
        [](int sm_count, bool /*capturing*/) {
          if (sm_count < 1) throw std::invalid_argument("sm_count must be >= 1");
          ms::g_sm_count.store(sm_count);
        },
        py::arg("sm_count"), py::arg("capturing"),
        "The emulated device of master_step_cuda_host: SM count and whether its stream counts as "
        "captured (no launch depends on it).");
  m.def("master_step_cuda_host_launches",
        [] {
          const std::lock_guard<std::mutex> lock(ms::g_log_mutex);
          return ms::g_log;
        },
        "master_step_cuda_host's last call's launches: weight dtype, table kind, grid, chunks, "
        "tensors.");
#if defined(ACCUMKERNELS_WITH_CUDA)
  m.def(
      "master_step_cuda",
      [](int algo, uint32_t flags, py::handle rows, py::handle numels, py::handle weight_dtypes,
         const std::vector<double>& scalars, uint64_t lr_ptr, uint64_t grad_scale_ptr,
         uint64_t found_inf_ptr, uint64_t stream, int device) {
        const ms::PyCall pc = ms::make_call(algo, flags, rows, numels, weight_dtypes, scalars,
                                            lr_ptr, grad_scale_ptr, found_inf_ptr);
        py::gil_scoped_release no_gil;
        accumkernels::master_step_cuda(pc.call,
                                       reinterpret_cast<void*>(static_cast<uintptr_t>(stream)),
                                       device);
      },
      py::arg("algo"), py::arg("flags"), py::arg("rows"), py::arg("numels"),
      py::arg("weight_dtypes"), py::arg("scalars"), py::arg("lr_ptr"), py::arg("grad_scale_ptr"),
      py::arg("found_inf_ptr"), py::arg("stream"), py::arg("device"),
      "master_step_cuda_host on device memory: one launch per weight dtype on `stream` of "
      "`device`.");
  m.def(
      "master_step_cuda_load",
      [](int device) {
        py::gil_scoped_release no_gil;
        return accumkernels::master_step_cuda_load(device);
      },
      py::arg("device"),
      "Load every master step kernel on `device` (none is then first loaded inside a CUDA-graph "
      "capture): '' when done, else why not.");
#endif
}
}  // namespace accumkernels
