"""Lightning Fabric: the recipe, and ``setup`` where Fabric builds DDP.

The recipe: wrap the optimizer before ``fabric.setup_optimizers`` (or ``fabric.setup``)::

    optimizer = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4))
    # or by name: accumkernels.optimizers.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)

with the defaults ``accumulation_steps=None`` (a Fabric loop calls ``optimizer.step()`` only at a
window's end: every ``step()`` ends the window, the short last one included) and
``reduction="sum"`` (the loop divides the loss by the number of micro-batches). Everything else
in the loop stays: ``fabric.no_backward_sync(model, enabled=...)`` around the accumulating
backwards, ``fabric.clip_gradients(model, optimizer, max_norm=...)`` before the step (it clips
``p.grad``, the fp32 window), ``fabric.save``/``fabric.load`` with the optimizer in the state.

Under ``strategy="ddp"`` the ``DistributedDataParallel`` module Fabric builds must reduce the
fp32 window through ``accumkernels.ddp_comm_hook``, which Fabric does not register. One line does
both (instead of ``fabric.setup(model, optimizer)``)::

    from accumkernels.integrations.fabric import setup
    model, optimizer = setup(fabric, model, optimizer)

A checkpoint taken in the middle of a window under DDP holds rank 0's window only (``fabric.save``
writes rank 0's state): loading it on another rank is refused; save at a window's end.
"""

from __future__ import annotations

import torch

from accumkernels import integrations as common
from accumkernels._engines import foreign_engine_error

__all__ = ["setup"]

_FOREIGN_STRATEGIES = {"DeepSpeedStrategy": "DeepSpeed", "FSDPStrategy": "FSDP"}


def setup(fabric, module: torch.nn.Module, optimizer: torch.optim.Optimizer, **options):
    """``fabric.setup(module, optimizer)`` with the optimizer in an ``AccumulatingOptimizer``
    (``accumulation_steps=None``, ``**options`` passed through; one already wrapped, e.g. a
    by-name class, is kept as it is, and refused with options: they would not reach it) and
    ``accumkernels.ddp_comm_hook`` registered on the ``DistributedDataParallel`` module Fabric
    builds. Returns ``(module, optimizer)``.

    Everything that can be refused without building anything (the options' names and values,
    the strategy, the optimizer) is refused before Fabric moves or casts the module."""
    options = common.check_options(options)  # Fabric divides nothing: the loop does
    for cls in type(fabric.strategy).__mro__:
        if cls.__name__ in _FOREIGN_STRATEGIES:
            raise foreign_engine_error(
                f"the Fabric strategy is {_FOREIGN_STRATEGIES[cls.__name__]} "
                f"({type(fabric.strategy).__name__})")
    common.check_wrappable(optimizer, options, model=module)
    module = fabric.setup_module(module)
    # Fabric keeps the module it built (DDP under strategy="ddp") as the forward module
    ddp = common.find_ddp(getattr(module, "_forward_module", None))
    if ddp is not None:
        common.check_ddp_hook(ddp)  # a foreign hook is refused before anything is wrapped
    wrapped = common.wrap_optimizer(optimizer, options, model=getattr(module, "module", None))
    if ddp is not None:
        common.register_ddp_hook(ddp)
    return module, fabric.setup_optimizers(wrapped)
