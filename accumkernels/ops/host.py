"""The op layer's host helpers for the wrapper: one pass of the C tensor reader over many tensors
(``lists_plain``, ``metas_snapshot``/``metas_same``, ``grads_are``), the C backward hooks'
types, and which backend runs where. The wrapper (accumkernels/optim) asks these, never the
backends' loader itself; each answers conservatively (False, ``b""``, None) without ``_C`` or
with the reader off, and the caller then applies its own rules.
"""

from __future__ import annotations

from accumkernels.ops.backends import BACKENDS, native, resolve

__all__ = ["BACKENDS", "LIST_FP32", "LIST_LOW", "LIST_STEP", "grad_hook_types", "grads_are",
           "lists_plain", "metas_same", "metas_snapshot", "resolve"]

# what a list of lists_plain holds
LIST_FP32, LIST_LOW, LIST_STEP = (0, 1, 2) if native._C is None else (
    native._C.LIST_FP32, native._C.LIST_LOW, native._C.LIST_STEP)


def lists_plain(lists: list, kinds: list) -> bool:
    """Whether every entry of ``lists`` (lists of tensors, ``lists[0]`` the masters of a fused
    master step) is plain for its list's kind (``LIST_FP32``, ``LIST_LOW``: bf16/fp16,
    ``LIST_STEP``: fp32 of one element): an exact torch.Tensor/nn.Parameter, contiguous, without
    the neg bit, on ``lists[0][0]``'s device, of its master's sizes. One pass of the tensor
    reader (csrc/list_meta.cpp); False when the reader is off, and for anything it cannot read
    (the caller then applies its own rules, which name a broken one)."""
    return native.READER and native._C.lists_plain(lists, kinds)


def metas_snapshot(tensors: list, full: int | None = None) -> bytes:
    """The tensors' metadata as the tensor reader reads it, one record: of the first ``full``
    (default: all) the address, numel, sizes, dtype, device and neg bit, of the rest the
    address only. ``b""`` (compares equal to nothing) when the reader is off or an entry is
    unreadable, or one of the first ``full`` is not contiguous or of over 8 dims
    (csrc/list_meta.cpp)."""
    if not native.READER or not hasattr(native._C, "metas_snapshot"):
        return b""
    return native._C.metas_snapshot(tensors, len(tensors) if full is None else full)


def metas_same(tensors: list, snapshot: bytes) -> bool:
    """Whether ``tensors`` reads now exactly as ``snapshot`` (:func:`metas_snapshot`) recorded
    it: one pass of the reader; False for ``b""``."""
    return bool(snapshot) and native.READER and native._C.metas_same(tensors, snapshot)


def grad_hook_types() -> tuple[type, type] | None:
    """The intake's hooks as C callables (``_C.PreHook``, ``_C.PostHook``,
    csrc/grad_hooks.cpp), or None where the extension lacks them."""
    if native._C is None or not hasattr(native._C, "PreHook"):
        return None
    return native._C.PreHook, native._C.PostHook


def grads_are(params: list, views: list) -> bool:
    """Whether every ``params[i].grad`` is ``views[i]`` (the same object), read once each."""
    if native._C is not None and hasattr(native._C, "grads_are"):
        return native._C.grads_are(params, views)
    return len(params) == len(views) and all(p.grad is v for p, v in zip(params, views))
