"""What the wrapper refuses at construction, and taking params over from another wrapper."""

from __future__ import annotations

import warnings

import torch

from accumkernels.slot import get_slot


def check_inner(optimizer: object, wrapper_cls: type, owner_attr: str) -> None:
    """Refuse an inner optimizer the wrapper cannot take, before any state is built."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if isinstance(optimizer, wrapper_cls):
        raise TypeError("optimizer is already an AccumulatingOptimizer")
    previous = getattr(optimizer, owner_attr, None)
    if previous is not None and previous() is not None:
        raise ValueError("this optimizer is already wrapped by a live AccumulatingOptimizer; "
                         "wrap each inner optimizer once (build a new one to start over)")
    if previous is not None and getattr(optimizer, "_accumkernels_masters", False):
        raise ValueError("this optimizer was wrapped before with master weights: its state was "
                         "remapped to that wrapper's fp32 master weights, which a new wrapper "
                         "would not have; build a new optimizer")
    seen: set[int] = set()
    for g, group in enumerate(optimizer.param_groups):
        if group.get("differentiable"):
            raise ValueError(f"param_groups[{g}] has differentiable=True: a step through which "
                             "autograd differentiates cannot run on an accumulated window; use "
                             "the optimizer without AccumulatingOptimizer")
        for i, p in enumerate(group["params"]):
            where = f"param_groups[{g}]['params'][{i}]"
            if id(p) in seen:
                raise ValueError(f"{where} appears more than once in the optimizer")
            if p.device.type == "meta":
                raise ValueError(f"{where} is on the meta device; materialise the model first")
            if p.is_complex():
                raise ValueError(f"{where} is complex ({p.dtype}); the fp32 window holds real "
                                 "gradients only (view it with torch.view_as_real first)")
            if not p.is_floating_point():
                raise TypeError(f"{where} has dtype {p.dtype}; expected a floating-point param")
            seen.add(id(p))
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("SparseAdam steps sparse gradients, which the fp32 window cannot hold; "
                         "use it without AccumulatingOptimizer (autograd sums sparse gradients)")


def refuse_sparse_modules(model: torch.nn.Module) -> None:
    """Sparse embeddings give sparse gradients, which the dense window cannot hold."""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            raise ValueError(f"{name or 'model'} is an {type(module).__name__} with sparse=True: "
                             "its sparse gradients cannot be summed in the dense fp32 window; "
                             "use sparse=False, or train without AccumulatingOptimizer")


def take_over(params: list[torch.Tensor], new_owner: object) -> None:
    """A live wrapper already managing these params stops, with a warning."""
    for p in params:
        slot = get_slot(p)
        if slot is not None and slot.owner is not None and slot.owner is not new_owner:
            warnings.warn("AccumulatingOptimizer: these params were managed by another live "
                          "wrapper; it is detached (its hooks removed) and this one takes over",
                          stacklevel=3)
            slot.owner.remove_hooks()
            return
