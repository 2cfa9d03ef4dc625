"""The master-weight ops: ``resync_masters_`` and ``copy_back_`` on (fp32 master, weight) pairs.

``optim/masters.py`` keeps fp32 masters of bf16/fp16 model weights; these two ops are its only
way to the kernels. Both check their lists first (types, dtypes, shapes, devices: TypeError or
ValueError naming the pair, nothing written), then dispatch each pair once:

* on the CPU, contiguous pairs: one native pass per dtype (csrc, raw pointers, no temporaries);
* on a GPU with Triton, contiguous pairs: one launch per device and dtype (re-sync only);
* every other pair (no extension, another device): torch ops, the readable definition of both.

Pairs that are not contiguous go as layouts.py says: in memory order when both share one dense
layout, else through exact copies.

Neither records anything about what it wrote: the re-sync compares every pair exactly each
time (a user may write a weight through ``.data``, numpy or its storage, which bumps no version
counter).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from accumkernels.ops import layouts
from accumkernels._util import LOW_PRECISION
from accumkernels.ops.backends import native
from accumkernels.ops.backends import triton as triton_backend

__all__ = ["copy_back_", "resync_masters_"]


@torch.no_grad()
def resync_masters_(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """In place: ``masters[i] = where(weights[i] != masters[i].to(dtype), weights[i].float(),
    masters[i])``, elementwise (NaN differs): the weights a user changed are taken in, the
    others keep the master's extra bits. Reads 6 B per element, writes only what differs."""
    masters, weights = _check_pairs("resync_masters_", masters, weights)
    (masters, weights), back = layouts.in_memory_order([list(masters), list(weights)],
                                                       [True, False])
    rest = range(len(masters))
    if native.resync_masters_cpu is not None:
        rest = _resync_native(masters, weights, rest)
    rest = _resync_triton(masters, weights, rest)
    for i in rest:
        m, w = masters[i], weights[i]
        changed = w.ne(m.to(w.dtype))
        torch.where(changed, w.float(), m, out=m)
    layouts.write_back(back)


@torch.no_grad()
def copy_back_(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
    """In place: ``weights[i] = masters[i]`` rounded to the weight's dtype, bit for bit torch's
    cast (round to nearest even). The native pass bumps each weight's version counter, as
    torch's own copy does."""
    masters, weights = _check_pairs("copy_back_", masters, weights)
    (masters, weights), back = layouts.in_memory_order([list(masters), list(weights)],
                                                       [False, True])
    rest = range(len(masters))
    if native.copy_back_cpu is not None:
        rest = _copy_back_native(masters, weights, rest)
    if rest:
        torch._foreach_copy_([weights[i] for i in rest], [masters[i] for i in rest])
    layouts.write_back(back)


def _check_pairs(op: str, masters: object, weights: object
                 ) -> tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]]:
    """Both lists, checked: pair i is a float32 master and a bf16/fp16 weight of one shape on
    one device (pairs may sit on different devices). Any strides are accepted (layouts.py)."""
    for name, tensors in (("masters", masters), ("weights", weights)):
        if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
            raise TypeError(f"{op}: {name} must be a list or tuple of tensors, got "
                            f"{type(tensors).__name__}")
    if len(masters) != len(weights):
        raise ValueError(f"{op}: {len(masters)} masters but {len(weights)} weights")
    tensor, f32, strided = torch.Tensor, torch.float32, torch.strided
    pairs = tuple(zip(masters, weights))
    if not (all(isinstance(m, tensor) and isinstance(w, tensor) for m, w in pairs)
            and all(m.dtype is f32 and w.dtype in LOW_PRECISION for m, w in pairs)
            and all(m.layout is strided and w.layout is strided and m.shape == w.shape
                    and m.device == w.device for m, w in pairs)):
        for i, (m, w) in enumerate(pairs):  # the quick test failed: find the pair, say why
            _check_pair(op, i, m, w)
    return masters, weights


def _check_pair(op: str, i: int, m: object, w: object) -> None:
    """Raise for the first rule pair ``i`` breaks."""
    for name, t in ((f"masters[{i}]", m), (f"weights[{i}]", w)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
        if t.layout is not torch.strided:
            raise TypeError(f"{op}: {name} is {t.layout}; only dense (strided) tensors are "
                            "supported")
    if m.dtype is not torch.float32:
        raise TypeError(f"{op}: masters[{i}] has dtype {m.dtype}; expected torch.float32")
    if w.dtype not in LOW_PRECISION:
        raise TypeError(f"{op}: weights[{i}] has dtype {w.dtype}; expected torch.bfloat16 or "
                        "torch.float16")
    if m.shape != w.shape:
        raise ValueError(f"{op}: masters[{i}] has shape {tuple(m.shape)} but weights[{i}] has "
                         f"shape {tuple(w.shape)}")
    if m.device != w.device:
        raise ValueError(f"{op}: masters[{i}] is on {m.device} but weights[{i}] is on "
                         f"{w.device}; a pair must be on one device")


def _plain_pair(m: torch.Tensor, w: torch.Tensor, device_type: str) -> bool:
    """A pair the raw-pointer passes can take: both contiguous, on one device of
    ``device_type``, the weight without a negative bit."""
    return w.device.type == device_type and m.device == w.device and w.is_contiguous() \
        and m.is_contiguous() and not w.is_neg()


def _resync_native(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                   pairs: Sequence[int]) -> list[int]:
    """Re-sync the CPU pairs of one dtype in one native call each; returns the pairs it could
    not take (another device, a non-contiguous tensor, no fp16 support on this build)."""
    rest: list[int] = []
    for dtype in LOW_PRECISION:
        group = [i for i in pairs if weights[i].dtype == dtype]
        if not group:
            continue
        fits = [i for i in group if _plain_pair(masters[i], weights[i], "cpu")]
        if not fits or native.resync_masters_cpu(
                [masters[i].data_ptr() for i in fits], [weights[i].data_ptr() for i in fits],
                [weights[i].numel() for i in fits], native.DTYPE_CODES[dtype]) < 0:
            fits = []
        done = set(fits)
        rest.extend(i for i in group if i not in done)
    return rest


def _resync_triton(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                   pairs: Sequence[int]) -> list[int]:
    """The GPU pairs Triton can take: one launch per device and dtype; returns the rest."""
    groups: dict[tuple, list[int]] = {}
    rest: list[int] = []
    for i in pairs:
        w = weights[i]
        if _plain_pair(masters[i], w, "cuda") and triton_backend.is_available(w.device):
            groups.setdefault((w.device, w.dtype), []).append(i)
        else:
            rest.append(i)
    for group in groups.values():
        triton_backend.resync_masters([masters[i] for i in group], [weights[i] for i in group])
    return rest


def _copy_back_native(masters: Sequence[torch.Tensor], weights: Sequence[torch.Tensor],
                      pairs: Sequence[int]) -> list[int]:
    """weight = master rounded for the CPU pairs, one native call per dtype; returns the pairs
    it could not take (another device, a non-contiguous tensor, no fp16 support on this
    build)."""
    done: set[int] = set()
    plain = [i for i in pairs if _plain_pair(masters[i], weights[i], "cpu")]
    for dtype in LOW_PRECISION:
        group = [i for i in plain if weights[i].dtype == dtype]
        if not group or native.copy_back_cpu(
                [masters[i].data_ptr() for i in group], [weights[i].data_ptr() for i in group],
                [weights[i].numel() for i in group], native.DTYPE_CODES[dtype]) is None:
            continue
        for i in group:
            torch.autograd.graph.increment_version(weights[i])  # written around autograd
        done.update(group)
    return [i for i in pairs if i not in done]
