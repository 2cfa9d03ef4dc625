"""Counting what torch ops do, op by op: bytes moved (TrafficTally) and live tensor bytes
(LiveTensorBytes). Both are TorchDispatchModes, so they see every aten op a Python call issues
(autograd's backward ops included) but not the work inside one op's kernel; they slow every op
down, so they run in passes of their own, never while timing.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Ops whose mutated ``self`` is overwritten without being read first.
WRITE_ONLY_SELF = frozenset({
    "aten::copy_", "aten::_foreach_copy_", "aten::zero_", "aten::_foreach_zero_",
    "aten::fill_", "aten::_foreach_fill_", "aten::normal_", "aten::uniform_", "aten::random_",
})
# Allocations that write nothing.
NO_TRAFFIC = frozenset({"aten::empty", "aten::empty_like", "aten::empty_strided",
                        "aten::new_empty", "aten::new_empty_strided"})
# Fused optimizers mark their grads mutable (they unscale them in place with grad_scale): without
# grad_scale those lists are only read.
GRADS_WRITTEN_ONLY_WITH_SCALE = frozenset({"aten::_fused_adamw_", "aten::_fused_adam_",
                                           "aten::_fused_sgd_", "aten::_fused_adagrad_"})


def _tensors(value: object) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v


def _nbytes(value: object) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class TrafficTally(TorchDispatchMode):
    """Bytes read and written by every aten op, from its schema; also ops and host syncs.

    The model of one op: every tensor argument is read once, except an ``out=`` argument and
    the ``self`` of a write-only op (copy_, zero_, fill_); every argument the schema marks as
    written (``Tensor(a!)``) is written once; every fresh output is written once. View ops
    (outputs that alias an input) move nothing, nor do ``empty`` allocations. This is the
    traffic of an ideal kernel per op (no re-reads, no write-allocate); ``ops`` approximates
    kernel launches on a GPU. ``scalar_reads`` counts ``.item()``-style reads of a tensor's
    value by the host; ``syncs`` those of a tensor on a GPU (each one waits for the device).
    """

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.written = 0
        self.ops = 0
        self.scalar_reads = 0
        self.syncs = 0
        self.by_op: dict[str, list[int]] = {}  # name -> [calls, read, written]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        name = schema.name
        if name in NO_TRAFFIC or any(r.alias_info is not None and not r.alias_info.is_write
                                     for r in schema.returns):
            return out  # a view or an allocation: no data moves
        read = written = 0
        scaled = kwargs.get("grad_scale") is not None
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            n = _nbytes(value)
            if not n:
                continue
            writes = arg.alias_info is not None and arg.alias_info.is_write
            if writes and arg.name == "grads" and name in GRADS_WRITTEN_ONLY_WITH_SCALE:
                writes = scaled
            if writes:
                written += n
            write_only = arg.is_out or (i == 0 and name in WRITE_ONLY_SELF)
            if not (writes and write_only):
                read += n
        written += sum(_nbytes(o) for o, r in zip(_as_tuple(out), schema.returns)
                       if r.alias_info is None)
        self.read += read
        self.written += written
        self.ops += 1
        if name == "aten::_local_scalar_dense":
            self.scalar_reads += 1
            self.syncs += args[0].device.type != "cpu"
        entry = self.by_op.setdefault(name, [0, 0, 0])
        entry[0] += 1
        entry[1] += read
        entry[2] += written
        return out

    def summary(self) -> dict:
        return {"read_bytes": self.read, "written_bytes": self.written,
                "bytes": self.read + self.written, "ops": self.ops,
                "scalar_reads": self.scalar_reads, "syncs": self.syncs,
                "by_op": {k: {"calls": c, "read_bytes": r, "written_bytes": w}
                          for k, (c, r, w) in sorted(self.by_op.items())}}


def _as_tuple(out: object) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class LiveTensorBytes(TorchDispatchMode):
    """The peak of the bytes held by tensors created inside the mode: the CPU's stand-in for
    ``torch.cuda.max_memory_allocated``.

    Every fresh output storage of an op (one that no input shares: not a view, not an in-place
    result) is counted from its creation until it is freed (a finalizer on the storage, which
    torch keeps as one Python object for as long as the storage lives). Tensors made before
    the mode was entered are not counted, nor is memory an op's kernel uses internally.
    """

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self.allocations = 0

    def _free(self, nbytes: int) -> None:
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        inputs = {t.untyped_storage().data_ptr()
                  for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        seen: set[int] = set()
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in inputs or ptr in seen or not storage.nbytes():
                continue
            seen.add(ptr)
            n = storage.nbytes()
            self.current += n
            self.allocations += 1
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, n)
        return out
