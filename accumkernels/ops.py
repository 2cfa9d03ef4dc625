"""The public op ``accumulate_``: argument checks, backend dispatch, torch.library registration.

Eager calls go straight to the backend. With the compiled extension, one C++ call checks every
tensor (dtype, shape, device, contiguity, memory overlap, the autograd rules of in-place ops),
bumps the version counters of what it writes and runs the kernel (csrc/tensor_calls.cpp); other
backends get the same checks first; the Python rules in ``backends/validate.py`` take over
wherever that reader cannot look (tensor subclasses, no extension).

Under tracing (torch.compile, FakeTensorMode, make_fx, functorch) the call goes through the custom
op ``torch.ops.accumkernels.accumulate_``, whose schema declares that it mutates ``dst``,
``found_inf`` and ``norm_sq``. Its fake implementation checks what needs no data (shapes, dtypes,
devices); its real implementation is the eager path, so compiled code gets the same memory checks
as eager.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence

import torch

from accumkernels import backends
from accumkernels.backends import native, validate
from accumkernels.backends.validate import CHECK_AUTOGRAD, CHECK_INFERENCE, fail

__all__ = ["LaunchPlan", "accumulate_", "available_backends", "call_layers"]

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
    norm_sq: torch.Tensor | None = None,
    norm_slots: list[int] | None = None,
) -> None:
    if dst:
        _run(dst, src, scale, scale_tensor, overwrite, found_inf, backend, dst[0].device,
             norm_sq, norm_slots)


@_accumulate_op.register_fake
def _accumulate_fake(dst, src, scale, scale_tensor, overwrite, found_inf, backend, norm_sq=None,
                     norm_slots=None) -> None:
    validate.check_shapes(dst, src, scale_tensor, found_inf, norm_sq,
                          _norm_len(dst, norm_sq, norm_slots))  # no data: nothing else to check


def _norm_len(dst: Sequence, norm_sq: torch.Tensor | None, norm_slots: list[int] | None) -> int:
    """The elements norm_sq must have: one per dst, or (slots given by a plan or the buffer,
    which checked its size) its own."""
    return len(dst) if norm_slots is None or norm_sq is None else norm_sq.numel()


def _as_list(name: str, tensors: object) -> Sequence:
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


def _check_call(src: object, overwrite: object, scale: object, found_inf: object,
                norm_sq: object = None) -> tuple[Sequence, float, torch.Tensor | None]:
    """The checks every launch makes on its non-tensor arguments."""
    src = _as_list("src", src)
    if overwrite is not True and overwrite is not False:
        fail(TypeError, f"overwrite must be a bool, got {type(overwrite).__name__}")
    value, scale_tensor = _scale_arg(scale)
    for name, t in (("found_inf", found_inf), ("norm_sq", norm_sq)):
        if t is not None and not isinstance(t, torch.Tensor):
            fail(TypeError, f"{name} must be a tensor or None, got {type(t).__name__}")
    return src, value, scale_tensor


def _check_backend(backend: object) -> None:
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
    a 1-element float32 tensor on the device (read by the kernel: no host sync). ``found_inf``,
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
        dst = _as_list("dst", dst)
    if (type(src) is list or type(src) is tuple) and type(scale) is float \
            and -_FP32_OVERFLOW < scale < _FP32_OVERFLOW \
            and (overwrite is False or overwrite is True) \
            and (found_inf is None or isinstance(found_inf, torch.Tensor)) \
            and (norm_sq is None or isinstance(norm_sq, torch.Tensor)):
        value, scale_tensor = scale, None
    else:
        src, value, scale_tensor = _check_call(src, overwrite, scale, found_inf, norm_sq)
    if len(dst) != len(src):
        fail(ValueError, f"dst has {len(dst)} tensors but src has {len(src)}")
    if type(backend) is not str or backend not in _KNOWN_BACKENDS:
        _check_backend(backend)
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
            flags = ((CHECK_AUTOGRAD if _grad_enabled() else 0)  # _flags(), inlined
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


def _accumulate_slots(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor],
                      scale: float | torch.Tensor, overwrite: bool, found_inf, norm_sq,
                      norm_slots: list[int], backend: str) -> None:
    """``accumulate_`` with dst[i]'s squared norm into ``norm_sq[norm_slots[i]]``: what a
    LaunchPlan or MasterGradBuffer launch takes when it cannot use the C++ plan (the caller
    checked norm_sq's size and the slots: in range, distinct)."""
    src, value, scale_tensor = _check_call(src, overwrite, scale, found_inf, norm_sq)
    if len(dst) != len(src):
        fail(ValueError, f"dst has {len(dst)} tensors but src has {len(src)}")
    _check_backend(backend)
    if not dst:
        return
    if not isinstance(dst[0], torch.Tensor):
        fail(TypeError, f"dst[0] must be a torch.Tensor, got {type(dst[0]).__name__}")
    device = dst[0].device
    name = backends.resolve(backend, device)
    if _plain_eager():
        _run(dst, src, value, scale_tensor, overwrite, found_inf, name, device, norm_sq,
             list(norm_slots))
    else:
        _traced(dst, src, value, scale_tensor, overwrite, found_inf, name, norm_sq,
                list(norm_slots))


def _flags() -> int:
    """Which autograd rules of in-place ops apply now."""
    return ((CHECK_AUTOGRAD if _grad_enabled() else 0)
            | (0 if _inference_mode() else CHECK_INFERENCE))


def _run(dst, src, scale, scale_tensor, overwrite, found_inf, backend, device, norm_sq=None,
         norm_slots=None) -> None:
    """The op on real tensors: check everything, bump versions, compute. ``norm_slots``: where
    each dst's squared norm goes (None: norm_sq[i]; given: the portable path checks)."""
    norm_len = _norm_len(dst, norm_sq, norm_slots)
    if device.type == "meta":  # no data: check what can be checked, write nothing
        validate.check_shapes(dst, src, scale_tensor, found_inf, norm_sq, norm_len)
        return
    flags = _flags()
    if native.READER and norm_slots is None:
        failed = native.run(dst, src, scale, scale_tensor, overwrite, found_inf, flags, backend,
                            device, norm_sq)
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


def call_layers(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], scale: float = 1.0, *,
                overwrite: bool = False, backend: str = "auto") -> dict[str, Callable[[], None]]:
    """The layers of one ``accumulate_`` call as callables, for host-overhead benchmarks.

    Each does the whole call's work from its layer down: ``"accumulate_"`` the public call;
    ``"custom_op"`` the torch.library op (the path compiled graphs take; eager calls skip its
    dispatcher); ``"backend"`` the op's implementation (checks, version bumps, launch);
    ``"binding"`` the extension's entry point alone (with the C++ tensor reader: checks and
    launch in one call; without: the launch on addresses marshalled once, up front). Backends
    other than ``cpu``/``cuda`` have no ``"binding"``.
    """
    dst, src = list(dst), list(src)
    device = dst[0].device
    name = backends.resolve(backend, device)
    layers: dict[str, Callable[[], None]] = {
        "accumulate_": lambda: accumulate_(dst, src, scale, overwrite=overwrite, backend=backend),
        "custom_op": lambda: torch.ops.accumkernels.accumulate_(dst, src, scale, None, overwrite,
                                                                None, name),
        "backend": lambda: _run(dst, src, scale, None, overwrite, None, name, device),
    }
    if name in native.KERNELS:
        if native.READER:
            layers["binding"] = lambda: native.run(dst, src, scale, None, overwrite, None,
                                                   _flags(), name, device)
        else:
            layers["binding"] = native.prepared_launch(dst, src, scale, overwrite)
    return layers


def _plain_eager() -> bool:
    """No compiler, dispatch mode (FakeTensorMode, make_fx) or functorch transform is active."""
    return not (_is_compiling() or _dispatch_modes() or _functorch_active())


class LaunchPlan:
    """``accumulate_`` into a fixed list of dst tensors, checked once; launches check only src.

    The dst side (dtypes, devices, contiguity, no overlap, sizes) is read and checked when the
    plan is built, so a launch reads each src once and makes one call into the extension. Give
    ``keys`` (objects naming each dst, e.g. the params the dst belong to) to launch on a subset
    of the dst in any order. ``owner``, a tensor every dst is a view of (found by itself when the
    dst are views of one ``_base``), lets a launch bump one version counter instead of one per
    dst, and check one ``requires_grad`` (the dst must not be made to require grad on their
    own). The plan holds the dst tensors. Each launch first checks that their memory has not
    moved (one look at the owner's address; without an owner, at each launched dst's): after a
    move (``share_memory_``, a storage resized or swapped) it reads the dst again and launches on
    the new addresses, or raises ValueError, with nothing written, if a dst no longer lies in
    the owner's memory or no longer qualifies. With an owner, a dst view given other memory on
    its own (``view.data = t``) is not seen (the write lands in the owner's memory, which stays
    valid). Without the extension's tensor reader, or for backends other than ``cpu``/``cuda``,
    a launch is a plain ``accumulate_``.

    A launch's ``norm_sq`` (optional, see ``accumulate_``) is a float32 vector of ``norm_size``
    elements (default: one per dst); the squared norm of ``dst[i]`` goes to element
    ``norm_slots[i]`` (default: ``i``), and a launch writes only the elements of the dst it
    writes, the others keep their values.
    """

    def __init__(self, dst: Sequence[torch.Tensor], *, keys: Sequence | None = None,
                 owner: torch.Tensor | None = None, backend: str = "auto",
                 norm_slots: Sequence[int] | None = None, norm_size: int | None = None):
        dst = list(_as_list("dst", dst))
        _check_backend(backend)
        self.norm_slots, self.norm_size = _plan_norm_slots(len(dst), norm_slots, norm_size)
        if keys is not None:
            keys = list(keys)
            if len(keys) != len(dst) or len({id(k) for k in keys}) != len(keys):
                raise ValueError("LaunchPlan: keys must name each dst once")
        for i, d in enumerate(dst):
            validate.check_plain(f"dst[{i}]", d)
            validate.check_dst(i, d, dst[0].device)
        if owner is None and dst and dst[0]._base is not None \
                and all(d._base is dst[0]._base for d in dst):
            owner = dst[0]._base  # views of one tensor share its version counter
        self.dst, self.keys, self.owner = dst, keys, owner
        self.device = dst[0].device if dst else torch.device("cpu")
        self.backend = backends.resolve(backend, self.device)
        self._slot_of: dict[int, int] | None = None
        self._native = None
        if native.READER and self.backend in native.KERNELS and dst:
            inference = owner.is_inference() if owner is not None else any(
                d.is_inference() for d in dst)
            plan = native.make_plan(dst, keys, owner, inference,
                                    None if norm_slots is None else self.norm_slots,
                                    self.norm_size)
            if isinstance(plan, tuple):
                if plan[0] != "slow":
                    validate.raise_failure(plan, dst, dst, None, None)
            else:
                self._native = plan

    def __len__(self) -> int:
        return len(self.dst)

    def __call__(self, src: Sequence[torch.Tensor], scale: float | torch.Tensor = 1.0, *,
                 keys: Sequence | None = None, overwrite: bool = False,
                 found_inf: torch.Tensor | None = None,
                 norm_sq: torch.Tensor | None = None) -> None:
        """``dst_k = (0 if overwrite else dst_k) + scale * src[k]`` where ``dst_k`` is the dst of
        ``keys[k]`` (without keys: ``dst[k]``, and src covers every dst); with ``norm_sq``, its
        element ``norm_slots[j]`` = the squared norm of each written ``dst[j]``. A key that is not
        one of the plan's raises KeyError (before anything is written)."""
        src, value, scale_tensor = _check_call(src, overwrite, scale, found_inf, norm_sq)
        if keys is not None and len(keys) != len(src):
            fail(ValueError, f"dst has {len(keys)} tensors but src has {len(src)}")
        if keys is None and len(src) != len(self.dst):
            fail(ValueError, f"dst has {len(self.dst)} tensors but src has {len(src)}")
        if self._native is not None and _plain_eager():
            failed = native.run_plan(self._native, keys, src, value, scale_tensor, overwrite,
                                     found_inf, _flags(), self.backend, self.device, norm_sq)
            if failed is None:
                return
            if failed[0] == "plan_stale":
                self._raise_stale(failed)
            if failed[0] not in ("slow", "not_member"):
                validate.raise_failure(failed, self._select(keys), src, scale_tensor, found_inf,
                                       norm_sq, self.norm_size)
        if norm_sq is None:
            accumulate_(self._select(keys), src, scale, overwrite=overwrite, found_inf=found_inf,
                        backend=self.backend)
            return
        positions = self._positions(keys)
        if self.dst:
            validate.check_norm_sq(norm_sq, self.norm_size, self.device)
        _accumulate_slots([self.dst[i] for i in positions], src, scale, overwrite, found_inf,
                          norm_sq, [self.norm_slots[i] for i in positions], self.backend)

    def layers(self, src: Sequence[torch.Tensor], scale: float = 1.0, *,
               keys: Sequence | None = None,
               overwrite: bool = False) -> dict[str, Callable[[], None]]:
        """A launch's layers as callables, for host-overhead benchmarks: ``"plan"`` the call,
        ``"plan_binding"`` the extension's entry point alone (absent without the C++ plan)."""
        layers = {"plan": lambda: self(src, scale, keys=keys, overwrite=overwrite)}
        if self._native is not None:
            layers["plan_binding"] = lambda: native.run_plan(
                self._native, keys, src, scale, None, overwrite, None, _flags(), self.backend,
                self.device)
        return layers

    def _raise_stale(self, failed: tuple) -> None:
        """A dst moved since the plan read it and, read again, breaks a rule: nothing written."""
        _, i, why = failed
        if why == 1:
            validate.check_dst(i, self.dst[i], self.device)
        reason = {0: "no longer lies in the memory of the plan's owner (it is not a view of it "
                     "any more)",
                  2: "now overlaps another dst in memory"}.get(why, "cannot be used any more")
        fail(ValueError, f"LaunchPlan: dst[{i}] moved since the plan was built and {reason}; "
             "nothing was written; build a new plan")

    def _select(self, keys: Sequence | None) -> list[torch.Tensor]:
        return self.dst if keys is None else [self.dst[i] for i in self._positions(keys)]

    def _positions(self, keys: Sequence | None) -> list[int]:
        """The dst index of each key (without keys: every dst)."""
        if keys is None:
            return list(range(len(self.dst)))
        if self._slot_of is None:
            self._slot_of = {id(k): i for i, k in enumerate(self.keys or ())}
        try:
            return [self._slot_of[id(k)] for k in keys]
        except KeyError:
            raise KeyError("LaunchPlan: a key is not one of this plan's keys") from None


def _plan_norm_slots(n: int, slots: Sequence[int] | None,
                     size: int | None) -> tuple[list[int], int]:
    """A plan's norm_sq layout: (the element of each dst, the elements), checked."""
    if size is None:
        size = n
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"LaunchPlan: norm_size must be an int >= 0, got {size!r}")
    if slots is None:
        if size != n:
            raise ValueError("LaunchPlan: a norm_size other than len(dst) needs norm_slots")
        return list(range(n)), size
    slots = list(slots)
    if len(slots) != n or any(isinstance(s, bool) or not isinstance(s, int) for s in slots) \
            or len(set(slots)) != n or not all(0 <= s < size for s in slots):
        raise ValueError(f"LaunchPlan: norm_slots must give each dst a distinct int in "
                         f"[0, {size})")
    return slots, size
