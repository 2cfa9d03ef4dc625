"""accumkernels: fused kernels for exact fp32 gradient accumulation."""

from accumkernels.buffer import MasterGradBuffer
from accumkernels.checks import check_model, validate_batch_sizes
from accumkernels.ops import accumulate_, available_backends
from accumkernels.optim import AccumulatingOptimizer

__all__ = [
    "AccumulatingOptimizer",
    "MasterGradBuffer",
    "accumulate_",
    "available_backends",
    "check_model",
    "validate_batch_sizes",
]
__version__ = "0.1.0"
