"""What the wrapper refuses at construction, and taking params over from another wrapper: the
other one is retired and refuses every further use (:func:`refuse_when_taken_over`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from accumkernels._util import warn_user
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


TAKEOVER = (
    "AccumulatingOptimizer: {count} of these params were managed by another live "
    "AccumulatingOptimizer; this one takes over: the other is detached (its hooks removed) and "
    "refuses any further use (RuntimeError), so that neither counts the other's backwards. "
    "Drop the old wrapper first (del opt) to build a new one silently, or copy.deepcopy(opt) "
    "for a second wrapper over copies of the params")
TAKEN_OVER = (
    "{call}: this AccumulatingOptimizer was taken over: another AccumulatingOptimizer was built "
    "over {count} of its params and now counts their backwards (this one's hooks were removed "
    "then). It refuses any further use instead of stepping with the wrong counts: use the "
    "wrapper built last, or build a new one over the params; for a second wrapper beside this "
    "one, copy.deepcopy(opt) (with the model) gives one over copies of the params")


def take_over(params: list[torch.Tensor], new_owner: object) -> None:
    """Every other live wrapper managing any of these params is retired, with a warning: its
    hooks are removed and from then on it refuses to be used (:func:`refuse_when_taken_over`),
    before anything it holds changes. A wrapper that was dropped is gone: nothing to say."""
    taken: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in params:
        slot = get_slot(p)  # (None for a gone or retired owner)
        if slot is not None and slot.owner is not new_owner:
            taken.setdefault(id(slot.owner), (slot, []))[1].append(p)
    for slot, theirs in taken.values():  # (all warned first: a warning raised changes nothing)
        warn_user(TAKEOVER.format(count=len(theirs)))
    for slot, theirs in taken.values():
        slot.owner.remove_hooks()
        slot.retire(TAKEN_OVER.replace("{count}", str(len(theirs))))


def refuse_when_taken_over(why: Callable[[object], str | None], *names: str):
    """Class decorator: each of ``names`` (a method, or a property's getter) raises RuntimeError
    when ``why(instance)`` (TAKEN_OVER with ``{call}`` to fill) is not None, before it does
    anything (a closure or hook it would run included)."""
    def guarded(fn, name: str):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            message = why(self)
            if message is not None:
                raise RuntimeError(message.format(call=f"{type(self).__name__}.{name}"))
            return fn(self, *args, **kwargs)
        return call

    def decorate(cls: type) -> type:
        for name in names:
            attr = cls.__dict__[name]
            if isinstance(attr, property):
                setattr(cls, name, attr.getter(guarded(attr.fget, name)))
            else:
                setattr(cls, name, guarded(attr, name))
        return cls
    return decorate
