// The fused master step's CUDA kernel run on the host, and the CUDA launch's binding (stub).
#include <pybind11/pybind11.h>

namespace accumkernels {
void bind_master_step_cuda(pybind11::module_& m) { (void)m; }
}  // namespace accumkernels
