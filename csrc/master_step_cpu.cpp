// The fused master step on the CPU (stub: filled in by the fused-master-step work).
#include <pybind11/pybind11.h>

namespace accumkernels {
void bind_master_step_cpu(pybind11::module_& m) { (void)m; }
}  // namespace accumkernels
