"""The public op ``accumulate_``: argument checks, backend dispatch, torch.library registration.

Eager calls go straight to the backend. With the compiled extension, one C++ call checks every
tensor (dtype, shape, device, contiguity, memory overlap, the autograd rules of in-place ops),
bumps the version counters of what it writes and runs the kernel (csrc/tensor_calls.cpp); a
pair in another dense layout (both tensors with one set of strides) is handed to it as 1-D views
in memory order, since the kernels are elementwise; other
backends get the same checks first; the Python rules in ``backends/validate.py`` take over
wherever that reader cannot look (tensor subclasses, no extension).

Under tracing (torch.compile, FakeTensorMode, make_fx, functorch) the call goes through the custom
op ``torch.ops.accumkernels.accumulate_``, whose schema declares that it mutates ``dst``,
``found_inf`` and ``norm_sq``. Its fake implementation checks what needs no data (shapes, dtypes,
devices); its real implementation is the eager path, so compiled code gets the same memory checks
as eager. ``LaunchPlan`` (plan.py) is this op with the dst side checked once, for a bucket.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch

import accumkernels.ops.backends as backends
from accumkernels.ops.backends import native
from accumkernels.ops import validate
from accumkernels.ops.validate import CHECK_AUTOGRAD, CHECK_INFERENCE, fail

__all__ = ["accumulate_", "available_backends"]

# The smallest double that float32 rounds to inf: a finite Python scale at or above it is not.
_FP32_OVERFLOW = 2.0**128 - 2.0**103
_KNOWN_BACKENDS = frozenset(("auto", *backends.BACKENDS, *backends.TEST_BACKENDS))

# Looked up once: a call on a short list costs about as much as these lookups.
_is_compiling = torch.compiler.is_compiling
_dispatch_modes = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_grad_enabled = torch.is_grad_enabled
_inference_mode = torch.is_inference_mode_enabled
_CPU = torch.device("cpu")
# Backend names that mean the compiled CPU kernels for a CPU tensor ("auto" picks them first).
_NATIVE_CPU = frozenset(("auto", "cpu")) if native.is_available(_CPU) else frozenset()


def available_backends(device: torch.device | str) -> list[str]:
    """Backends that can run ``accumulate_`` on ``device``, fastest first."""
    return backends.available_backends(device)


# No argument has a default: torch 2.11's ADInplaceOrView kernel of a custom op finds the mutated
# arguments by schema index in the args the dispatcher passes, which omit trailing defaults.
@torch.library.custom_op("accumkernels::accumulate_",
                         mutates_args=("dst", "found_inf", "norm_sq"))
def _accumulate_op(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
    backend: str,
    norm_sq: torch.Tensor | None,
    norm_slots: list[int] | None,
) -> None:
    if dst:
        _run(dst, src, scale, scale_tensor, overwrite, found_inf, backend, dst[0].device,
             norm_sq, norm_slots)


@_accumulate_op.register_fake
def _accumulate_fake(dst, src, scale, scale_tensor, overwrite, found_inf, backend, norm_sq,
                     norm_slots) -> None:
    validate.check_shapes(dst, src, scale_tensor, found_inf, norm_sq,
                          _norm_len(dst, norm_sq, norm_slots))  # no data: nothing else to check


def _norm_len(dst: Sequence, norm_sq: torch.Tensor | None, norm_slots: list[int] | None) -> int:
    """The elements norm_sq must have: one per dst, or (slots given by a plan or the buffer,
    which checked its size) its own."""
    return len(dst) if norm_slots is None or norm_sq is None else norm_sq.numel()


def as_list(name: str, tensors: object) -> Sequence:
    if type(tensors) is list or type(tensors) is tuple:
        return tensors
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, Sequence):
        fail(TypeError, f"{name} must be a list or tuple of tensors, got {type(tensors).__name__}")
    return list(tensors)


def _scale_arg(scale: object) -> tuple[float, torch.Tensor | None]:
    """(float scale, scale tensor or None); any real number, finite in float32."""
    if isinstance(scale, torch.Tensor):
        return 1.0, scale
    if type(scale) is not float:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            fail(TypeError,
                 f"scale must be a float or a float32 tensor, got {type(scale).__name__}")
        try:
            value = float(scale)  # numpy and other real scalars
        except OverflowError:
            value = float("inf")
    else:
        value = scale
    if not -_FP32_OVERFLOW < value < _FP32_OVERFLOW:  # NaN fails too
        fail(ValueError, f"scale must be finite in float32, got {scale!r}")
    return value, None


def check_call(src: object, overwrite: object, scale: object, found_inf: object,
                norm_sq: object = None) -> tuple[Sequence, float, torch.Tensor | None]:
    """The checks every launch makes on its non-tensor arguments."""
    src = as_list("src", src)
    if overwrite is not True and overwrite is not False:
        fail(TypeError, f"overwrite must be a bool, got {type(overwrite).__name__}")
    value, scale_tensor = _scale_arg(scale)
    for name, t in (("found_inf", found_inf), ("norm_sq", norm_sq)):
        if t is not None and not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a tensor or None, got {type(t).__name__}")
    return src, value, scale_tensor


def check_backend(backend: object) -> None:
    if not isinstance(backend, str):
        fail(TypeError, f"backend must be a string, got {type(backend).__name__}")
    if backend not in _KNOWN_BACKENDS:
        fail(ValueError, f"unknown backend {backend!r}; choose from 'auto', "
             + ", ".join(repr(b) for b in backends.BACKENDS))


def accumulate_(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    scale: float | torch.Tensor = 1.0,
    *,
    overwrite: bool = False,
    found_inf: torch.Tensor | None = None,
    norm_sq: torch.Tensor | None = None,
    backend: str = "auto",
) -> None:
    """In place, in fp32: ``dst[i] = (0 if overwrite else dst[i]) + scale * float32(src[i])``.

    One fused launch for the whole list (per src dtype on Triton). ``scale`` is a real number or
    a 1-element float32 tensor on the device (read by the kernel: no host sync). Each ``dst[i]``
    is dense in any dimension order (contiguous, ``channels_last``, a transpose) and ``src[i]``
    has its layout (equal strides): elements pair in memory order. ``found_inf``,
    if given, is a 1-element float32 tensor set to 1.0 when any written ``dst`` element is
    inf/NaN: a non-finite ``src`` element, or a sum that overflowed fp32 (never reset; ``dst`` is
    written all the same). ``norm_sq``, if given, is a contiguous float32 tensor of ``len(dst)``
    elements on the device, overwritten with ``norm_sq[i] = sum(dst[i]**2)`` of the values just
    written, in the same pass (fp32 squares and sums; 0 for an empty dst; inf/NaN when a value
    is, or when the sum overflows). Its relative error is at most about ``n * 2**-24`` for a dst
    of n elements, and in practice far less: every backend adds short partial sums (per SIMD
    lane, thread or block) before combining them; on CUDA and Triton, blocks combine by atomic
    adds in no fixed order. Every argument is validated before anything is written; errors name
    the offending index.
    """
    # Fast paths first (lists, a float scale): this prologue is most of a short call's cost.
    if type(dst) is not list and type(dst) is not tuple:
        dst = as_list("dst", dst)
    if (type(src) is list or type(src) is tuple) and type(scale) is float \
            and -_FP32_OVERFLOW < scale < _FP32_OVERFLOW \
            and (overwrite is False or overwrite is True) \
            and (found_inf is None or isinstance(found_inf, torch.Tensor)) \
            and (norm_sq is None or isinstance(norm_sq, torch.Tensor)):
        value, scale_tensor = scale, None
    else:
        src, value, scale_tensor = check_call(src, overwrite, scale, found_inf, norm_sq)
    if len(dst) != len(src):
        fail(ValueError, f"dst has {len(dst)} tensors but src has {len(src)}")
    if type(backend) is not str or backend not in _KNOWN_BACKENDS:
        check_backend(backend)
    if not dst:
        return
    first = dst[0]
    if not isinstance(first, torch.Tensor):
        fail(TypeError, f"dst[0] must be a torch.Tensor, got {type(first).__name__}")
    if first.is_cpu and backend in _NATIVE_CPU:  # what resolve() answers, without a device
        name, device = "cpu", _CPU
    else:
        device = first.device
        name = backends.resolve(backend, device)
    if not (_is_compiling() or _dispatch_modes() or _functorch_active()):  # plain eager
        if name == "cpu" and native.READER:  # the common case, straight to the extension
            flags = ((CHECK_AUTOGRAD if _grad_enabled() else 0)  # kernel_flags(), inlined
                     | (0 if _inference_mode() else CHECK_INFERENCE))
            if native.run_cpu(dst, src, value, scale_tensor, overwrite, found_inf, flags,
                              norm_sq) is None:
                return
        # Any other case, and a refused call (checked again there, to raise or go portable).
        _run(dst, src, value, scale_tensor, overwrite, found_inf, name, device, norm_sq)
    else:
        _traced(dst, src, value, scale_tensor, overwrite, found_inf, name, norm_sq, None)


def _traced(dst, src, value, scale_tensor, overwrite, found_inf, name, norm_sq, norm_slots):
    """Under tracing: check what needs no data now; the op's real kernel checks the rest."""
    norm_len = _norm_len(dst, norm_sq, norm_slots)
    validate.check_shapes(dst, src, scale_tensor, found_inf, norm_sq, norm_len)
    if torch.is_grad_enabled():  # the op's kernel runs with grad mode off: check here
        refused = validate.find_unwritable(dst, found_inf, CHECK_AUTOGRAD, norm_sq)
        if refused is not None:
            validate.raise_failure(refused, dst, src, scale_tensor, found_inf, norm_sq, norm_len)
    torch.ops.accumkernels.accumulate_(list(dst), list(src), value, scale_tensor, overwrite,
                                       found_inf, name, norm_sq, norm_slots)


def accumulate_slots(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor],
                      scale: float | torch.Tensor, overwrite: bool, found_inf, norm_sq,
                      norm_slots: list[int], backend: str) -> None:
    """``accumulate_`` with dst[i]'s squared norm into ``norm_sq[norm_slots[i]]``: what a
    LaunchPlan or MasterGradBuffer launch takes when it cannot use the C++ plan (the caller
    checked norm_sq's size and the slots: in range, distinct)."""
    src, value, scale_tensor = check_call(src, overwrite, scale, found_inf, norm_sq)
    if len(dst) != len(src):
        fail(ValueError, f"dst has {len(dst)} tensors but src has {len(src)}")
    check_backend(backend)
    if not dst:
        return
    if not isinstance(dst[0], torch.Tensor):
        fail(TypeError, f"dst[0] must be a torch.Tensor, got {type(dst[0]).__name__}")
    device = dst[0].device
    name = backends.resolve(backend, device)
    if plain_eager():
        _run(dst, src, value, scale_tensor, overwrite, found_inf, name, device, norm_sq,
             list(norm_slots))
    else:
        _traced(dst, src, value, scale_tensor, overwrite, found_inf, name, norm_sq,
                list(norm_slots))


def kernel_flags() -> int:
    """Which autograd rules of in-place ops apply now."""
    return ((CHECK_AUTOGRAD if _grad_enabled() else 0)
            | (0 if _inference_mode() else CHECK_INFERENCE))


def plain_eager() -> bool:
    """No compiler, dispatch mode (FakeTensorMode, make_fx) or functorch transform is active."""
    return not (_is_compiling() or _dispatch_modes() or _functorch_active())


def _run(dst, src, scale, scale_tensor, overwrite, found_inf, backend, device, norm_sq=None,
         norm_slots=None) -> None:
    """The op on real tensors: check everything, bump versions, compute. ``norm_slots``: where
    each dst's squared norm goes (None: norm_sq[i]; given: the portable path checks)."""
    norm_len = _norm_len(dst, norm_sq, norm_slots)
    if device.type == "meta":  # no data: check what can be checked, write nothing
        validate.check_shapes(dst, src, scale_tensor, found_inf, norm_sq, norm_len)
        return
    flags = kernel_flags()
    if native.READER and norm_slots is None:
        failed = native.run(dst, src, scale, scale_tensor, overwrite, found_inf, flags, backend,
                            device, norm_sq)
        if failed is not None and failed[0] == "pair":
            # The reader takes contiguous pairs only: other dense pairs of one layout go as
            # 1-D views in memory order (elementwise, so the same sums); others raise here.
            flat = validate.in_memory_order(dst, src)
            if flat is not None:
                failed = native.run(*flat, scale, scale_tensor, overwrite, found_inf, flags,
                                    backend, device, norm_sq)
        if failed is None:
            if backend not in native.KERNELS:  # checked and bumped; the backend computes
                _compute(dst, src, scale, scale_tensor, overwrite, found_inf, backend, norm_sq)
            return
        if failed[0] != "slow":
            validate.raise_failure(failed, dst, src, scale_tensor, found_inf, norm_sq)
    # The portable path: the same rules in Python.
    validate.check_all(dst, src, scale_tensor, found_inf, flags, norm_sq, norm_len)
    if norm_slots is not None and (len(set(norm_slots)) != len(norm_slots)
                                   or not all(0 <= s < norm_len for s in norm_slots)):
        fail(ValueError, "norm slots must be distinct elements of norm_sq")
    torch._C._increment_version(dst)
    outputs = tuple(t for t in (found_inf, norm_sq) if t is not None)
    if outputs:
        torch._C._increment_version(outputs)
    _compute(dst, src, scale, scale_tensor, overwrite, found_inf, backend, norm_sq, norm_slots)


def _compute(dst, src, scale, scale_tensor, overwrite, found_inf, backend, norm_sq=None,
             norm_slots=None) -> None:
    slots = None
    if norm_sq is not None:
        slots = list(range(len(dst))) if norm_slots is None else list(norm_slots)
        for d, s in zip(dst, slots):
            if d.numel() == 0:
                norm_sq[s].zero_()
    # Empty tensors carry no work; dropping them here keeps every backend branch-free.
    if not all(d.numel() for d in dst):
        kept = [k for k, d in enumerate(dst) if d.numel() > 0]
        if not kept:
            return
        dst, src = [dst[k] for k in kept], [src[k] for k in kept]
        slots = None if slots is None else [slots[k] for k in kept]
    backends.get(backend).accumulate(dst, src, scale, scale_tensor, overwrite, found_inf,
                                     norm_sq, slots)

