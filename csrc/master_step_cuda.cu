// The fused master step's CUDA kernel (stub: filled in by the fused-master-step work).
namespace accumkernels {}
