"""The optimizer wrapper, split into rooms (see optimizer.py for how they fit together)."""

from accumkernels._util import AccumulationWarning
from accumkernels.optim.optimizer import AccumulatingOptimizer

__all__ = ["AccumulatingOptimizer", "AccumulationWarning"]
