"""Argument checks of the fused master step (``accumkernels.ops.master_step``): metadata only, so
they also run on FakeTensors. Each raises ``TypeError``/``ValueError`` naming the argument (and
the index of a list entry) before anything is written."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

import torch

from accumkernels._util import LOW_PRECISION
from accumkernels.ops import host

_F32 = torch.float32


def as_list(op: str, name: str, value: object) -> list | tuple:
    if type(value) is list or type(value) is tuple:
        return value
    if isinstance(value, torch.Tensor) or isinstance(value, (str, bytes)) \
            or not isinstance(value, Sequence):
        raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got "
                        f"{type(value).__name__}")
    return list(value)


def adam_lists(op, masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
                amsgrad) -> tuple[tuple[list, ...], bool]:
    """The checked lists (masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    state_steps) and whether all are plain for the kernels (:func:`lists_plain`)."""
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError(f"{op}: amsgrad=True needs max_exp_avg_sqs (one fp32 tensor per master)")
    if not amsgrad and max_exp_avg_sqs is not None and len(as_list(op, "max_exp_avg_sqs",
                                                                     max_exp_avg_sqs)):
        raise ValueError(f"{op}: max_exp_avg_sqs given but amsgrad=False (pass None)")
    named = {"masters": masters, "weights": weights, "grads": grads, "exp_avgs": exp_avgs,
             "exp_avg_sqs": exp_avg_sqs}
    if amsgrad:
        named["max_exp_avg_sqs"] = max_exp_avg_sqs
    named["state_steps"] = state_steps
    lists, plain = check_lists(op, named)
    steps = lists.pop("state_steps")
    mx = lists.pop("max_exp_avg_sqs", [])
    return (*lists.values(), mx, steps), plain


def sgd_lists(op, masters, weights, grads, momentum_buffers, has_momentum
              ) -> tuple[tuple[list, ...], bool]:
    """The checked lists (masters, weights, grads, momentum_buffers) and whether all are plain
    for the kernels (:func:`lists_plain`)."""
    if has_momentum and momentum_buffers is None:
        raise ValueError(f"{op}: momentum != 0 needs momentum_buffers (one fp32 tensor per "
                         "master; with is_first_step their content is not read)")
    if not has_momentum and momentum_buffers is not None and len(as_list(
            op, "momentum_buffers", momentum_buffers)):
        raise ValueError(f"{op}: momentum_buffers given but momentum is 0 (pass None)")
    named = {"masters": masters, "weights": weights, "grads": grads}
    if has_momentum:
        named["momentum_buffers"] = momentum_buffers
    lists, plain = check_lists(op, named)
    return (*(lists[k] for k in ("masters", "weights", "grads")),
            lists.get("momentum_buffers", [])), plain


def check_lists(op: str, named: dict) -> tuple[dict[str, list], bool]:
    """Every list the same length; entry i of each a dense tensor on masters[i]'s device, of
    masters[i]'s shape (steps: one element), fp32 (weights: bf16/fp16). Returns the lists and
    whether every entry is also plain for the kernels (:func:`lists_plain`)."""
    lists = {name: as_list(op, name, value) for name, value in named.items()}
    masters = lists["masters"]
    n = len(masters)
    for name, tensors in lists.items():
        if len(tensors) != n:
            raise ValueError(f"{op}: {n} masters but {len(tensors)} {name}")
    plain = lists_plain(lists)
    if not plain and not _lists_ok(lists):
        for i in range(n):  # the quick test failed: find the entry, say why
            for name, tensors in lists.items():
                _check_entry(op, name, i, tensors[i], masters[i])
    return lists, plain


def lists_plain(lists: dict[str, list]) -> bool:
    """Every entry plain for the native kernels (host.lists_plain: contiguous, no neg bit, on
    the first master's device), which implies the rules of check_lists: one C++ pass."""
    kinds = [host.LIST_STEP if name == "state_steps" else
             host.LIST_LOW if name == "weights" else host.LIST_FP32 for name in lists]
    return host.lists_plain(list(lists.values()), kinds)


def _lists_ok(lists: dict[str, list]) -> bool:
    """The rules of check_lists, tested in bulk (most calls pass)."""
    tensor, strided, low = torch.Tensor, torch.strided, LOW_PRECISION
    masters = lists["masters"]
    if not masters:
        return True
    if not all(isinstance(m, tensor) for m in masters):
        return False
    first = masters[0].device
    one_device = all(m.device == first for m in masters)
    shapes = [m.shape for m in masters]
    for name, tensors in lists.items():
        if not all(isinstance(t, tensor) and t.layout is strided for t in tensors):
            return False
        if name == "weights":
            if not all(t.dtype in low for t in tensors):
                return False
        elif not all(t.dtype is _F32 for t in tensors):
            return False
        if one_device:
            if not all(t.device == first for t in tensors):
                return False
        elif not all(t.device == m.device for t, m in zip(tensors, masters)):
            return False
        if name == "state_steps":
            if not all(t.numel() == 1 for t in tensors):
                return False
        elif name != "masters" and not all(t.shape == s for t, s in zip(tensors, shapes)):
            return False
    return True


def _check_entry(op: str, name: str, i: int, t: object, m: object) -> None:
    """Raise for the first rule ``name[i]`` breaks."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise TypeError(f"{op}: {name}[{i}] is {t.layout}; only dense tensors are supported")
    if name == "weights":
        if t.dtype not in LOW_PRECISION:
            raise TypeError(f"{op}: weights[{i}] has dtype {t.dtype}; expected torch.bfloat16 "
                            "or torch.float16")
    elif t.dtype is not _F32:
        raise TypeError(f"{op}: {name}[{i}] has dtype {t.dtype}; expected torch.float32")
    if not isinstance(m, torch.Tensor):
        return  # masters[i] itself is reported when its turn comes
    if t.device != m.device:
        raise ValueError(f"{op}: {name}[{i}] is on {t.device} but masters[{i}] is on {m.device}")
    if name == "state_steps":
        if t.numel() != 1:
            raise ValueError(f"{op}: state_steps[{i}] has {t.numel()} elements; expected one")
    elif t.shape != m.shape:
        raise ValueError(f"{op}: {name}[{i}] has shape {tuple(t.shape)} but masters[{i}] has "
                         f"shape {tuple(m.shape)}")


def check_real(op: str, name: str, value: object, low: float, high: float) -> None:
    """A real number (not a bool) in [low, high) (high = inf: any finite value >= low; low =
    -inf: any finite value)."""
    if type(value) is not float and (isinstance(value, bool)
                                     or not isinstance(value, numbers.Real)):
        raise TypeError(f"{op}: {name} must be a number, got {type(value).__name__}")
    v = float(value)
    if math.isfinite(v) and low <= v and (v < high or high == math.inf):
        return
    if low == -math.inf:
        bounds = "finite"
    else:
        bounds = f">= {low}" if high == math.inf else f"in [{low}, {high})"
    raise ValueError(f"{op}: {name} must be {bounds}, got {value}")


def check_bool(op: str, name: str, value: object) -> None:
    if value is not True and value is not False:
        raise TypeError(f"{op}: {name} must be a bool, got {type(value).__name__}")


def check_lr(op: str, lr: object) -> tuple[float, torch.Tensor | None]:
    """(lr as a number, the tensor or None). A tensor lr is read by the kernels (no host sync on
    CUDA); it must hold one floating value."""
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1 or not lr.is_floating_point():
            raise ValueError(f"{op}: a tensor lr must hold one floating value, got "
                             f"{lr.numel()} elements of {lr.dtype}")
        return 0.0, lr
    check_real(op, "lr", lr, 0.0, math.inf)
    return float(lr), None


def check_no_overlap(op: str, rows: dict[str, list]) -> None:
    """No two tensors of the call share memory (the kernels read and write each element once).
    Extents are compared per device; the native CPU kernel makes the same check itself."""
    spans = []
    for name, tensors in rows.items():
        for i, t in enumerate(tensors):
            n = t.numel()
            if n:
                if not t.is_contiguous():  # its extent: first to last element
                    n = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
                start = t.data_ptr()
                spans.append((t.device, start, start + n * t.element_size(), name, i))
    if len({s[0] for s in spans}) == 1:
        spans.sort(key=lambda s: s[1])
    else:
        spans.sort(key=lambda s: (str(s[0]), s[1]))
    reach, widest = None, None
    for span in spans:
        if reach is not None and span[0] == widest[0] and span[1] < reach:
            raise ValueError(f"{op}: {widest[3]}[{widest[4]}] and {span[3]}[{span[4]}] share "
                             "memory; every tensor of the step must have its own")
        if reach is None or span[0] != widest[0] or span[2] > reach:
            reach, widest = span[2], span
