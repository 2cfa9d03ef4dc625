"""The rules ``accumulate_`` checks its tensors against, in plain Python, and their messages.

The fast path checks the same rules in C++ (csrc/tensor_calls.cpp) and reports a broken one as
``(code, i, j)``; :func:`raise_failure` turns that into the exception this module raises for the
same input. These Python checks also run on their own where the C++ reader does not: tensor
subclasses, FakeTensors while tracing (shapes and dtypes only), a build without the extension.
Every error is raised before anything is written and names the offending index.
"""

from __future__ import annotations

import torch

from accumkernels._util import SRC_DTYPES

# Flags of a call (same values as CallFlags in csrc/tensor_calls.h).
CHECK_AUTOGRAD = 1  # grad mode is on: a leaf that requires grad may not be written
CHECK_INFERENCE = 2  # outside inference mode: an inference tensor may not be written

_LEAF = "a leaf Variable that requires grad is being used in an in-place operation."
_VIEW_OF_LEAF = ("a view of a leaf Variable that requires grad is being used in an in-place "
                 "operation.")
_INFERENCE = "Inplace update to inference tensor outside InferenceMode is not allowed."
_NEG = ("is a negative view (its neg bit is set, e.g. x.conj().imag): its memory holds minus "
        "its values, which accumulate_ does not read or write; call .resolve_neg() first")
_DISABLED_DISPATCH = torch._C._disabled_torch_dispatch_impl
_is_compiling = torch.compiler.is_compiling


def _neg(t: torch.Tensor) -> bool:
    """Whether ``t`` has the neg bit. Not asked while dynamo traces (is_neg() would break the
    graph): the compiled op's real kernel checks the real tensors at run time."""
    return not _is_compiling() and t.is_neg()


def fail(kind: type[Exception], message: str) -> None:
    raise kind(f"accumulate_: {message}")


def _type_name(t: object) -> str:
    return type(t).__name__


def _pairs_ok(dst: list, src: list, device: torch.device) -> bool:
    """Every rule of check_pair, one property per pass: the quick answer for valid input."""
    strided, f32, tensor = torch.strided, torch.float32, torch.Tensor
    return (
        all(isinstance(t, tensor) for t in dst) and all(isinstance(t, tensor) for t in src)
        and all(d.layout is strided for d in dst) and all(x.layout is strided for x in src)
        and not any(d.is_nested for d in dst) and not any(x.is_nested for x in src)
        and all(d.dtype is f32 for d in dst) and all(x.dtype in SRC_DTYPES for x in src)
        and all(d.shape == x.shape for d, x in zip(dst, src))
        and all(d.device == device for d in dst) and all(x.device == device for x in src)
        and all(d.is_contiguous() or _dense(d) for d in dst)
        and all((x.is_contiguous() and d.is_contiguous()) or same_layout(d, x)
                for d, x in zip(dst, src))
        and (_is_compiling() or not (any(d.is_neg() for d in dst)
                                     or any(x.is_neg() for x in src)))
    )


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill its memory span once, in some dimension order (torch's
    "non-overlapping and dense": contiguous, ``channels_last``, a transpose, ...)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1)
    if any(sz == 0 for _, sz in dims):
        return True
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


is_dense = _dense


def same_layout(d: torch.Tensor, x: torch.Tensor) -> bool:
    """Both dense, of one shape, with equal strides over the dimensions of size > 1: element k
    of one's memory is element k of the other's, so a pass in memory order pairs them."""
    if d.shape != x.shape or not (_dense(d) and _dense(x)):
        return False
    if d.stride() == x.stride() or d.numel() == 0:
        return True
    return all(sz == 1 or a == b for sz, a, b in zip(d.shape, d.stride(), x.stride()))


def flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements as a 1-D view in memory order."""
    return t if t.dim() == 1 and t.is_contiguous() else t.as_strided((t.numel(),), (1,))


def in_memory_order(dst: list, src: list) -> tuple[list, list] | None:
    """(dst, src) with every pair that is not contiguous given as 1-D views in memory order,
    for the C++ reader (it takes contiguous tensors only); None if no pair needs it. Pairs are
    checked first (:func:`check_pair`: dense, one layout). The views share their tensors'
    memory and version counters."""
    bent = [i for i, (d, x) in enumerate(zip(dst, src))
            if isinstance(d, torch.Tensor) and isinstance(x, torch.Tensor)
            and not (d.is_contiguous() and x.is_contiguous())]
    if not bent:
        return None
    device = dst[0].device if isinstance(dst[0], torch.Tensor) else None
    dst, src = list(dst), list(src)
    for i in bent:
        check_pair(i, dst[i], src[i], device)
        dst[i], src[i] = flat(dst[i]), flat(src[i])
    return dst, src


def in_layout_of(d: torch.Tensor, x: object) -> object:
    """``x`` with ``d``'s layout: itself when it has it (or is not dense, or cannot be paired
    with ``d`` at all: the checks then say why), else a copy in ``d``'s strides (exact)."""
    if not isinstance(x, torch.Tensor) or x.stride() == d.stride() or x.shape != d.shape \
            or x.layout is not torch.strided or x.device != d.device or same_layout(d, x) \
            or not (_dense(d) and _dense(x)):
        return x
    return torch.empty_strided(d.shape, d.stride(), dtype=x.dtype, device=x.device).copy_(x)


def _layout(t: torch.Tensor) -> str:
    return f"strides {tuple(t.stride())}"


def _check_dense(names: tuple, tensors: tuple) -> None:
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a torch.Tensor, got {_type_name(t)}")
    for name, t in zip(names, tensors):
        if t.layout != torch.strided:
            fail(TypeError, f"{name} is sparse ({t.layout}); only dense (strided) tensors are "
                 "supported")
        if t.is_nested:
            fail(TypeError, f"{name} is a nested tensor; only dense tensors are supported")


def check_pair(i: int, d: object, x: object, device: torch.device | None) -> None:
    """Raise for the first rule that pair ``i`` breaks (``device``: that of dst[0])."""
    _check_dense((f"dst[{i}]", f"src[{i}]"), (d, x))
    if d.dtype != torch.float32:
        fail(TypeError, f"dst[{i}] has dtype {d.dtype}; expected torch.float32")
    if x.dtype not in SRC_DTYPES:
        fail(TypeError, f"src[{i}] has dtype {x.dtype}; expected float32, bfloat16 or float16")
    if d.shape != x.shape:
        fail(ValueError, f"src[{i}] has shape {tuple(x.shape)} but dst[{i}] has shape "
             f"{tuple(d.shape)}")
    device = d.device if device is None else device
    if d.device != device:
        fail(ValueError, f"dst[{i}] is on {d.device} but dst[0] is on {device}; "
             "all tensors of one call must be on one device")
    if x.device != device:
        fail(ValueError, f"src[{i}] is on {x.device} but dst[{i}] is on {device}")
    if not _dense(d):
        fail(ValueError, f"dst[{i}] is not dense ({_layout(d)} for shape {tuple(d.shape)}: its "
             "elements overlap or leave gaps in memory); accumulate_ writes dense tensors, in "
             "any dimension order (contiguous, channels_last, transposed)")
    if not _dense(x):
        fail(ValueError, f"src[{i}] is not dense ({_layout(x)} for shape {tuple(x.shape)}: its "
             f"elements overlap or leave gaps in memory); pass src[{i}].contiguous()")
    if not same_layout(d, x):
        fail(ValueError, f"src[{i}] has {_layout(x)} but dst[{i}] has {_layout(d)}: "
             "accumulate_ pairs the elements of a dst and its src in memory order, so both "
             "need one layout; pass the src in its dst's layout (torch.empty_like(dst[i], "
             "dtype=src[i].dtype).copy_(src[i]))")
    if _neg(d):
        fail(ValueError, f"dst[{i}] {_NEG}")
    if _neg(x):
        fail(ValueError, f"src[{i}] {_NEG}")


def check_dst(i: int, d: object, device: torch.device | None) -> None:
    """The dst half of check_pair (a LaunchPlan's dst list is checked before any src exists)."""
    _check_dense((f"dst[{i}]",), (d,))
    if d.dtype != torch.float32:
        fail(TypeError, f"dst[{i}] has dtype {d.dtype}; expected torch.float32")
    if device is not None and d.device != device:
        fail(ValueError, f"dst[{i}] is on {d.device} but dst[0] is on {device}; "
             "all tensors of one call must be on one device")
    if not _dense(d):
        fail(ValueError, f"dst[{i}] is not dense ({_layout(d)} for shape {tuple(d.shape)}: its "
             "elements overlap or leave gaps in memory); accumulate_ writes dense tensors, in "
             "any dimension order (contiguous, channels_last, transposed)")
    if _neg(d):
        fail(ValueError, f"dst[{i}] {_NEG}")


def check_plain(name: str, t: object) -> None:
    """Refuse a tensor subclass whose memory is not its values (``__torch_dispatch__``: DTensor,
    wrapper subclasses): the kernels read and write memory. Real tensors only (FakeTensors,
    while tracing, are such subclasses too)."""
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter or not isinstance(t, torch.Tensor):
        return
    if type(t).__torch_dispatch__ is not _DISABLED_DISPATCH:
        hint = " (for a DTensor pass .to_local())" if type(t).__name__ == "DTensor" else ""
        fail(TypeError, f"{name} is a {type(t).__name__}, a tensor subclass with its own "
             f"__torch_dispatch__, which accumulate_ does not support: pass plain tensors{hint}")


def check_scalar(name: str, t: torch.Tensor | None, device: torch.device) -> None:
    """``scale`` / ``found_inf``: a 1-element float32 tensor on the tensors' device."""
    if t is None:
        return
    if t.dtype != torch.float32 or t.numel() != 1:
        fail(TypeError, f"{name} must be a 1-element float32 tensor, got dtype {t.dtype} with "
             f"{t.numel()} elements")
    if t.device != device:
        fail(ValueError, f"{name} is on {t.device} but the tensors are on {device}")
    if _neg(t):
        fail(ValueError, f"{name} {_NEG}")


def check_norm_sq(norm_sq: object, size: int, device: torch.device) -> None:
    """``norm_sq``: a contiguous 1-D float32 tensor of ``size`` elements on the tensors' device."""
    if norm_sq is None:
        return
    _check_dense(("norm_sq",), (norm_sq,))
    if norm_sq.dtype != torch.float32:
        fail(TypeError, f"norm_sq has dtype {norm_sq.dtype}; expected torch.float32")
    if norm_sq.dim() != 1 or norm_sq.numel() != size:
        fail(ValueError, f"norm_sq must be a 1-D tensor of {size} elements (one per dst), got "
             f"shape {tuple(norm_sq.shape)}")
    if norm_sq.device != device:
        fail(ValueError, f"norm_sq is on {norm_sq.device} but the tensors are on {device}")
    if not norm_sq.is_contiguous():
        fail(ValueError, "norm_sq is not contiguous")
    if _neg(norm_sq):
        fail(ValueError, f"norm_sq {_NEG}")


def check_shapes(dst: list, src: list, scale: torch.Tensor | None,
                 found_inf: torch.Tensor | None, norm_sq: torch.Tensor | None = None,
                 norm_len: int | None = None) -> None:
    """The rules that need no data: types, layouts, dtypes, shapes, devices, contiguity.

    What the meta/fake implementation checks (also while tracing, on FakeTensors). ``norm_sq``
    has ``norm_len`` elements (None: one per dst).
    """
    if not dst:
        return
    device = dst[0].device if isinstance(dst[0], torch.Tensor) else None
    if device is None or not _pairs_ok(dst, src, device):
        for i, (d, x) in enumerate(zip(dst, src)):
            check_pair(i, d, x, device)
    check_scalar("scale", scale, device)
    check_scalar("found_inf", found_inf, device)
    check_norm_sq(norm_sq, len(dst) if norm_len is None else norm_len, device)


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def find_overlap(dst: list, src: list, scale: torch.Tensor | None,
                 found_inf: torch.Tensor | None,
                 norm_sq: torch.Tensor | None = None) -> tuple | None:
    """The memory rules, as (code, i, j) like the C++ check, or None.

    No dst may overlap another dst, nor a src overlap a dst (unless it is exactly that dst's
    memory as float32: ``dst[i] += s * dst[i]`` is elementwise, like ``a.add_(a)``); found_inf
    and norm_sq, written by the kernel, may overlap nothing; scale may not overlap a dst.
    """
    spans = [(*_span(d), 0, i) for i, d in enumerate(dst) if d.numel()]  # 0: dst sorts first
    spans += [(*_span(x), 1, i) for i, x in enumerate(src) if x.numel()]
    spans.sort()
    last_dst = last_src = (0, 0, 0, -1)
    for span in spans:
        start, end, kind, i = span
        if kind == 0:
            if last_dst[1] > start:
                return ("dst_alias", min(last_dst[3], i), max(last_dst[3], i))
            if last_src[1] > start:
                return ("src_overlap", last_src[3], i)
            last_dst = max(last_dst, span, key=lambda s: s[1])
        else:
            twin = last_dst[3] == i and last_dst[:2] == span[:2] and src[i].dtype == torch.float32
            if last_dst[1] > start and not twin:
                return ("src_overlap", i, last_dst[3])
            last_src = max(last_src, span, key=lambda s: s[1])
    flag = _span(found_inf) if found_inf is not None else None
    scale_span = _span(scale) if scale is not None else None
    if flag and scale_span and flag[0] < scale_span[1] and scale_span[0] < flag[1]:
        return ("found_inf_scale", -1, -1)
    for start, end, kind, i in spans:
        if flag and flag[0] < end and start < flag[1]:
            return ("found_inf_dst" if kind == 0 else "found_inf_src", i, -1)
        if kind == 0 and scale_span and scale_span[0] < end and start < scale_span[1]:
            return ("scale_dst", i, -1)
    return None if norm_sq is None else _norm_overlap(_span(norm_sq), spans, flag, scale_span)


def _norm_overlap(norm: tuple[int, int], spans: list, flag: tuple | None,
                  scale_span: tuple | None) -> tuple | None:
    """norm_sq against found_inf, scale, then every dst and src (codes as the C++ check's)."""
    if norm[0] == norm[1]:
        return None
    for code, other in (("norm_sq_found_inf", flag), ("norm_sq_scale", scale_span)):
        if other and norm[0] < other[1] and other[0] < norm[1]:
            return (code, -1, -1)
    for start, end, kind, i in spans:
        if norm[0] < end and start < norm[1]:
            return ("norm_sq_dst" if kind == 0 else "norm_sq_src", i, -1)
    return None


def find_unwritable(dst: list, found_inf: torch.Tensor | None, flags: int,
                    norm_sq: torch.Tensor | None = None) -> tuple | None:
    """What may not be written, as (code, i, j): in grad mode, a tensor that requires grad
    (torch refuses leaves and views of leaves, and records history for the rest, which this op
    cannot); outside inference mode, an inference tensor (as torch refuses it)."""
    named = [("dst", i, d) for i, d in enumerate(dst)]
    if found_inf is not None:
        named.append(("found_inf", -1, found_inf))
    if norm_sq is not None:
        named.append(("norm_sq", -1, norm_sq))
    for name, i, t in named:
        if flags & CHECK_AUTOGRAD and t.requires_grad:
            return (f"{name}_grad", i, -1)
        if flags & CHECK_INFERENCE and t.is_inference():
            return (f"{name}_inference", i, -1)
    return None


def check_all(dst: list, src: list, scale: torch.Tensor | None, found_inf: torch.Tensor | None,
              flags: int, norm_sq: torch.Tensor | None = None, norm_len: int | None = None) -> None:
    """Every rule, on real tensors: the portable path's whole check."""
    for name, tensors in (("dst", dst), ("src", src)):
        for i, t in enumerate(tensors):
            check_plain(f"{name}[{i}]", t)
    check_plain("scale", scale)
    check_plain("found_inf", found_inf)
    check_plain("norm_sq", norm_sq)
    check_shapes(dst, src, scale, found_inf, norm_sq, norm_len)
    for found in (find_overlap(dst, src, scale, found_inf, norm_sq),
                  find_unwritable(dst, found_inf, flags, norm_sq)):
        if found is not None:
            raise_failure(found, dst, src, scale, found_inf, norm_sq, norm_len)


def raise_failure(found: tuple, dst: list, src: list, scale: torch.Tensor | None,
                  found_inf: torch.Tensor | None, norm_sq: torch.Tensor | None = None,
                  norm_len: int | None = None) -> None:
    """Raise the exception for a failure reported as (code, i, j)."""
    code, i, j = found
    if code == "pair":
        check_pair(i, dst[i], src[i], dst[0].device)
        fail(TypeError, f"dst[{i}] or src[{i}] cannot be used (not a plain dense tensor with data)")
    device = dst[0].device
    if code in ("scale", "found_inf"):
        check_scalar(code, scale if code == "scale" else found_inf, device)
        fail(TypeError, f"{code} must be a plain 1-element float32 tensor")
    if code == "norm_sq":
        check_norm_sq(norm_sq, len(dst) if norm_len is None else norm_len, device)
        fail(TypeError, "norm_sq must be a plain float32 tensor")
    if code == "dst":
        check_dst(i, dst[i], device)
        fail(TypeError, f"dst[{i}] cannot be used (not a plain dense tensor with data)")
    where = {
        "dst_alias": f"dst[{j}] overlaps dst[{i}] in memory; each dst must be distinct",
        "src_overlap": f"src[{i}] overlaps dst[{j}] in memory; a src may overlap no dst other "
                       "than its own, and that one only exactly and as float32",
        "found_inf_dst": f"found_inf overlaps dst[{i}] in memory",
        "found_inf_src": f"found_inf overlaps src[{i}] in memory",
        "found_inf_scale": "found_inf overlaps scale in memory",
        "scale_dst": f"scale overlaps dst[{i}] in memory",
        "norm_sq_dst": f"norm_sq overlaps dst[{i}] in memory",
        "norm_sq_src": f"norm_sq overlaps src[{i}] in memory",
        "norm_sq_scale": "norm_sq overlaps scale in memory",
        "norm_sq_found_inf": "norm_sq overlaps found_inf in memory",
    }
    if code in where:
        fail(ValueError, where[code])
    name = (f"dst[{i}]" if code.startswith("dst")
            else "norm_sq" if code.startswith("norm_sq") else "found_inf")
    if code.endswith("_grad"):
        t = (dst[i] if code.startswith("dst")
             else norm_sq if code.startswith("norm_sq") else found_inf)
        if t.is_leaf:
            fail(RuntimeError, f"{name} is a leaf that requires grad: {_LEAF}")
        if t._base is not None and t._base.is_leaf:
            fail(RuntimeError, f"{name} is a view of a leaf that requires grad: {_VIEW_OF_LEAF}")
        fail(RuntimeError, f"{name} requires grad, and accumulate_ records no autograd history "
             "(call it under torch.no_grad(), or on a detached tensor)")
    if code.endswith("_inference"):
        fail(RuntimeError, f"{name} is an inference tensor: {_INFERENCE}")
    fail(RuntimeError, f"internal check failed ({code}, {i}, {j})")
