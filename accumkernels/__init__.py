"""accumkernels: fused kernels for exact fp32 gradient accumulation."""

from accumkernels.ops import accumulate_, available_backends

__all__ = ["accumulate_", "available_backends"]
__version__ = "0.1.0"
