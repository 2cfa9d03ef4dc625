"""The op layer: the fused accumulate op and the fused master step, their checks and backends.

Usable on its own (nothing here imports the wrapper). ``accumulate.py`` is ``accumulate_`` and
``available_backends``; ``plan.py`` a prepared call of it; ``validate.py`` and ``layouts.py`` the
checks both ops share; ``master_step*.py`` the fused AdamW/Adam/SGD step of fp32 masters and
their low-precision weights; ``master_passes.py`` the re-sync and copy-back passes;
``backends/`` the kernels (C++/CUDA through ``_C``, Triton, the torch reference).
"""

from accumkernels.ops.accumulate import accumulate_, available_backends

__all__ = ["accumulate_", "available_backends"]
