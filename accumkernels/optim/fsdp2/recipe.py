"""Which params are FSDP2's (DTensors), the supported recipe, and the refusal of stray DTensors.

Kept apart from accumkernels.optim.fsdp2.layout so the flat layout can refuse DTensor params (tensor
parallel) without importing the FSDP2 room.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

RECIPE = ("fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
          "reduce_dtype=torch.float32)) on an fp32 model, and AccumulatingOptimizer(optimizer, "
          "model=<the fully_shard root>)")

# Tensor parallelism (DTensor params from parallelize_module) without fully_shard: refused, by name
TP_RECIPE = (
    "FSDP2 + TP (torchtitan's recipe): parallelize_module(model, tp_mesh, plan) first, then "
    "fully_shard(..., mesh=dp_mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
    "reduce_dtype=torch.float32)) on the blocks and the root of the fp32 model (dp_mesh and "
    "tp_mesh from one init_device_mesh(..., mesh_dim_names=('dp', 'tp'))), and "
    "AccumulatingOptimizer(optimizer, model=<the fully_shard root>)")
TENSOR_PARALLEL = (
    "AccumulatingOptimizer: {what}. Tensor parallelism without FSDP2 (parallelize_module alone, "
    "or under DistributedDataParallel) is not supported: the fp32 window of DTensor params "
    "follows FSDP2's gradient path. Supported: " + TP_RECIPE + "; FSDP2 alone: " + "{recipe}")


def tensor_parallel_error(what: str) -> ValueError:
    return ValueError(TENSOR_PARALLEL.format(what=what, recipe=RECIPE))


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
            raise tensor_parallel_error(
                f"param {i} is a DTensor (FSDP2 or tensor parallelism); the layout of DTensor "
                "params is picked from the inner optimizer's params")
