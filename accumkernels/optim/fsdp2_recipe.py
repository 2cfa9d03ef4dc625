"""Which params are FSDP2's (DTensors), the supported recipe, and the refusal of stray DTensors.

Kept apart from accumkernels.optim.fsdp2 so the flat layout can refuse DTensor params (tensor
parallel) without importing the FSDP2 room.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

RECIPE = ("fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
          "reduce_dtype=torch.float32)) on an fp32 model, and AccumulatingOptimizer(optimizer, "
          "model=<the fully_shard root>)")


def dtensor_type():
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_sharded(optimizer: object) -> bool:
    """Whether ``optimizer`` holds a DTensor param (the wrapper then takes FSDP2's layout)."""
    dtensor = dtensor_type()
    groups = getattr(optimizer, "param_groups", None)
    if dtensor is None or not isinstance(groups, list):
        return False
    return any(isinstance(p, dtensor) for g in groups if isinstance(g, dict)
               for p in g.get("params", ()))


def refuse_sharded(params: list[torch.Tensor]) -> None:
    """DTensor params outside the FSDP2 layout (e.g. tensor parallel): say so before any state.

    FSDP1 and DeepSpeed params are refused by accumkernels._engines."""
    dtensor = dtensor_type()
    for i, p in enumerate(params):
        if dtensor is not None and isinstance(p, dtensor):
            raise ValueError(
                f"AccumulatingOptimizer: param {i} is a DTensor; FSDP2 params are handled by "
                f"AccumulatingOptimizer(optimizer, model=...) itself: {RECIPE}")
