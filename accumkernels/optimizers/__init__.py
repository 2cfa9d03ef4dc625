"""Every ``torch.optim`` optimizer as an ``AccumulatingOptimizer`` class a config can name.

``accumkernels.optimizers.AdamW(params, lr=3e-4, weight_decay=0.1, reduction="sum")`` is
``AccumulatingOptimizer(torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1), reduction="sum")``;
likewise ``SGD``, ``Adam``, ``RMSprop``, ... (whatever the installed torch has). In a config::

    optimizer:                              # litgpt, LightningCLI
      class_path: accumkernels.optimizers.AdamW
      init_args: {lr: 3.0e-4, weight_decay: 0.1, max_grad_norm: 1.0}

    optimizer:                              # torchtune
      _component_: accumkernels.optimizers.AdamW
      lr: 2.0e-5

    optimizer:                              # Hydra, instantiate(cfg.optimizer, params=...)
      _target_: accumkernels.optimizers.AdamW
      _partial_: true
      lr: 1.0e-3

``accumkernels.optimizers.torchao`` and ``accumkernels.optimizers.schedulefree`` do the same for
those packages' optimizers (imported on first use; not installed, a lookup is an AttributeError,
:class:`MissingPackageError`, saying what to install); :func:`accumulating` makes the class of any
other optimizer. The defaults (``accumulation_steps=None``, ``reduction="sum"``) fit the loops
of those stacks: they divide the loss by the number of micro-batches themselves and call
``step()`` only at a window's end.
"""

from __future__ import annotations

import torch

from accumkernels.optimizers.factory import (
    COLLISION_PREFIX,
    MissingPackageError,
    accumulating,
    wrapper_options,
)


def _torch_optimizers() -> list[str]:
    names = []
    for name in dir(torch.optim):
        obj = getattr(torch.optim, name)
        if (isinstance(obj, type) and issubclass(obj, torch.optim.Optimizer)
                and obj is not torch.optim.Optimizer and not name.startswith("_")):
            names.append(name)
    return sorted(names)


TORCH_OPTIMIZERS = tuple(_torch_optimizers())
for _name in TORCH_OPTIMIZERS:
    globals()[_name] = accumulating(getattr(torch.optim, _name), module=__name__)
del _name

__all__ = ["COLLISION_PREFIX", "TORCH_OPTIMIZERS", "MissingPackageError", "accumulating",
           "wrapper_options"]
__all__.extend(TORCH_OPTIMIZERS)
