"""Engines that own the gradient path are refused before the wrapper touches anything.

DeepSpeed steps its optimizer inside ``engine.backward``/``engine.step`` and ZeRO rewrites
``param_groups`` (stage 3 replaces each param's storage by a shard); FSDP1
(``FullyShardedDataParallel``) reduce-scatters and accumulates into ``FlatParameter`` shards,
which pass the wrapper's DTensor (FSDP2) check. Neither leaves the wrapper a full local
``.grad`` to accumulate, so both are refused with the recipe that does give fp32 accumulation.

Detection is by duck typing: DeepSpeed is not a dependency, and nothing here imports it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["foreign_engine_error", "refuse_foreign_engines"]

SUPPORTED = (
    "Supported recipes: DistributedDataParallel (the wrapper, with accumkernels.ddp_comm_hook); "
    "FSDP2 (fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
    "reduce_dtype=torch.float32)) on an fp32 model, and AccumulatingOptimizer(optimizer, "
    "model=<the fully_shard root>)); DeepSpeed's own fp32 accumulation (\"data_types\": {\"grad_accum_dtype\": "
    "\"fp32\"} in its config, and DeepSpeed's optimizer).")

# Attributes DeepSpeed ZeRO-3 sets on every partitioned param (deepspeed/runtime/zero/
# partition_parameters.py); two of them together are not a coincidence.
_ZERO3_PARAM_ATTRS = ("ds_id", "ds_status", "ds_numel", "ds_tensor")
_DEEPSPEED_ENGINES = {"DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine"}
_DEEPSPEED_OPTIMIZERS = {"DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3",
                         "DeepSpeedOptimizer", "ZeROOptimizer", "BF16_Optimizer",
                         "FP16_Optimizer", "FP16_UnfusedOptimizer"}


def _class_names(obj: object) -> set[str]:
    return {cls.__name__ for cls in type(obj).__mro__}


def _is_deepspeed_engine(module: object) -> bool:
    """DeepSpeedEngine by class name, or by the methods only an engine has."""
    if _class_names(module) & _DEEPSPEED_ENGINES:
        return True
    return (callable(getattr(module, "zero_optimization_stage", None))
            and callable(getattr(module, "gradient_accumulation_steps", None))
            and isinstance(getattr(module, "module", None), torch.nn.Module))


def _fsdp1_class() -> type | None:
    if not torch.distributed.is_available():
        return None
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover - torch without FSDP
        return None
    return FullyShardedDataParallel


def foreign_engine_error(what: str) -> ValueError:
    """The refusal for an engine that owns the gradient path, naming the supported recipes."""
    return ValueError(f"accumkernels: {what}. It owns the gradient path (it reduces and "
                      f"accumulates gradients itself), so AccumulatingOptimizer cannot take them "
                      f"over. {SUPPORTED}")


def _refuse(what: str) -> None:
    raise foreign_engine_error(what)


def refuse_foreign_engines(params: Iterable[torch.Tensor], model: object | None = None, *,
                           optimizer: object | None = None) -> None:
    """Raise ValueError if ``params``, ``model`` or ``optimizer`` belong to DeepSpeed or FSDP1.

    Checks only; nothing is changed. ``model`` may be any object (a framework may hand over an
    engine that is not an ``nn.Module``); its submodules are searched when it is a module.
    """
    if model is not None:
        if _is_deepspeed_engine(model):
            _refuse(f"the model is a DeepSpeed engine ({type(model).__name__})")
        if isinstance(model, torch.nn.Module):
            fsdp = _fsdp1_class()
            for name, sub in model.named_modules():
                if fsdp is not None and isinstance(sub, fsdp):
                    where = f"submodule {name!r}" if name else "the model"
                    _refuse(f"{where} is FSDP1 FullyShardedDataParallel")
                if sub is not model and _is_deepspeed_engine(sub):
                    _refuse(f"submodule {name!r} is a DeepSpeed engine")
    if optimizer is not None:
        names = _class_names(optimizer) & _DEEPSPEED_OPTIMIZERS
        if names:
            _refuse(f"the optimizer is DeepSpeed's {sorted(names)[0]}")
    for i, p in enumerate(params):
        if getattr(p, "_is_flat_param", False) or getattr(p, "_fsdp_flattened", False):
            _refuse(f"param {i} is an FSDP1 FlatParameter (or a view FSDP1 flattened)")
        if sum(hasattr(p, attr) for attr in _ZERO3_PARAM_ATTRS) >= 2:
            _refuse(f"param {i} is partitioned by DeepSpeed ZeRO-3 (it has ds_* attributes)")
