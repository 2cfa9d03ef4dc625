"""Memory layouts for the elementwise multi-tensor ops (the fused master step, the master-weight
ops): every stride pattern goes to the kernels, which pass over raw memory.

An entry i of such an op is a group of tensors of one shape (master, weight, gradient, state)
updated element by element. The kernels pair elements by memory position, so:

* a group whose tensors are all contiguous goes as it is;
* a group whose tensors are dense and share one layout (``channels_last``, a transpose: equal
  strides) goes as 1-D views in memory order: the same pairs, the same memory order as torch's
  own fused kernels, so the same bits;
* any other group (layouts that differ, gaps, a neg-bit tensor) is copied into the first
  tensor's layout (row-major if that one is not dense), run there, and the written tensors are
  copied back: exact copies, so element i of each tensor still pairs with element i of the others.
"""

from __future__ import annotations

import torch

from accumkernels.ops.validate import flat, is_dense, same_layout

__all__ = ["in_memory_order", "write_back"]


def in_memory_order(rows: list[list[torch.Tensor]], written: list[bool]
                    ) -> tuple[list[list[torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
    """``rows`` (row 0 the layout reference; an empty row is left out) as the kernels take them,
    and the (original, copy) pairs to copy back after the op (rows marked ``written``)."""
    live = [r for r in rows if r]
    if all(t.is_contiguous() and not t.is_neg() for r in live for t in r):
        return rows, []
    out = [list(r) for r in rows]
    back: list[tuple[torch.Tensor, torch.Tensor]] = []
    ref_row = rows[0]
    for i, ref in enumerate(ref_row):
        group = [r[i] for r in live]
        if all(t.is_contiguous() and not t.is_neg() for t in group):
            continue
        if is_dense(ref) and not any(t.is_neg() for t in group) \
                and all(same_layout(ref, t) for t in group):
            for r in out:
                if r:
                    r[i] = flat(r[i])
            continue
        strides = ref.stride() if is_dense(ref) else _row_major(ref.shape)
        for k, r in enumerate(rows):
            if not r:
                continue
            t = r[i]
            copy = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device)
            copy.copy_(t)
            if written[k]:
                back.append((t, copy))
            out[k][i] = flat(copy)
    return out, back


def write_back(back: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy what the op wrote into the copies back into the tensors the caller gave."""
    for original, copy in back:
        original.copy_(copy)


def _row_major(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
