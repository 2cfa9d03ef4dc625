"""accumkernels: fused kernels for exact fp32 gradient accumulation."""

from accumkernels import _torch_private

_torch_private.check_core()  # a torch without what the ops' registration needs: named here

from accumkernels.batch_size import MicroBatchSearch, find_micro_batch_size
from accumkernels.buffer import MasterGradBuffer
from accumkernels.checks import check_model, validate_batch_sizes
from accumkernels._version import __version__ as __version__
from accumkernels.info import build_info
from accumkernels.ops.master_step import master_adam_step_, master_sgd_step_
from accumkernels.ops.accumulate import accumulate_, available_backends
from accumkernels.optim import AccumulatingOptimizer
from accumkernels.optim.sync.ddp_hook import ddp_comm_hook
from accumkernels.optimizers import accumulating
from accumkernels.wgrad import fuse_wgrad_accumulation

__all__ = [
    "AccumulatingOptimizer",
    "MasterGradBuffer",
    "MicroBatchSearch",
    "accumulate_",
    "accumulating",
    "available_backends",
    "build_info",
    "check_model",
    "ddp_comm_hook",
    "find_micro_batch_size",
    "fuse_wgrad_accumulation",
    "master_adam_step_",
    "master_sgd_step_",
    "validate_batch_sizes",
]
