"""MasterGradBuffer: flat fp32 master-gradient storage with per-param views and buckets."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from accumkernels.ops import validate
from accumkernels.ops.accumulate import accumulate_slots, accumulate_
from accumkernels.ops.plan import LaunchPlan

__all__ = ["Bucket", "MasterGradBuffer"]

# Each param's view starts on a 128-byte boundary so the kernels' 16-byte vector path applies
# to every view (and views never share a cache line). Padding stays zero.
_ALIGN_ELEMS = 32


@dataclass
class Bucket:
    """A contiguous range of one device's buffer: the unit of fused launches and of reduction."""

    index: int
    device: torch.device
    params: list[torch.Tensor]
    views: list[torch.Tensor]
    flat: torch.Tensor  # the bucket's range of the device buffer, padding included
    # Each param's element of the buffer's norm_sq (its index in buffer.params), and their count.
    norm_slots: list[int] = field(default_factory=list, repr=False, compare=False)
    norm_size: int = 0
    _plans: dict[str, LaunchPlan] = field(default_factory=dict, repr=False, compare=False)

    def plan(self, backend: str = "auto") -> LaunchPlan:
        """The launch plan of this bucket's views (built on first use, then kept): the views'
        side is checked once, so a launch checks only the gradients."""
        plan = self._plans.get(backend)
        if plan is None:
            plan = LaunchPlan(self.views, keys=self.params, owner=self.flat, backend=backend,
                              norm_slots=self.norm_slots, norm_size=self.norm_size, reorder=True)
            self._plans[backend] = plan
        return plan


class MasterGradBuffer:
    """One contiguous fp32 buffer per device holding a master gradient for every trainable param.

    ``view(p)`` (also set as ``p.main_grad``, Megatron's convention) is p's slice of the buffer.
    Params are laid out in reverse registration order (close to the order backward produces
    their gradients) and grouped into buckets of about ``bucket_size_mb``.

    Each view has its param's memory layout, as autograd lays out a ``.grad`` (its "layout
    contract"): a dense param's strides (``channels_last``, a transpose), row-major for any
    other param. So a view pairs with its param element by element in memory order too, which
    is how torch's fused optimizers pair a param with its ``.grad``. A gradient in another
    layout is copied into the view's before a launch; :meth:`relayout` follows a param whose
    layout changed (``p.data = p.data.t()``).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        *,
        dtype: torch.dtype = torch.float32,
        bucket_size_mb: float = 25,
    ):
        if dtype != torch.float32:
            raise ValueError(f"MasterGradBuffer: only dtype=torch.float32 is supported, got {dtype}")
        if isinstance(bucket_size_mb, bool) or not isinstance(bucket_size_mb, (int, float)) \
                or not bucket_size_mb > 0:
            raise ValueError(f"MasterGradBuffer: bucket_size_mb must be > 0, got {bucket_size_mb!r}")
        if isinstance(params, torch.Tensor):
            raise TypeError("MasterGradBuffer: params must be an iterable of tensors, not a tensor")
        params = list(params)
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"MasterGradBuffer: params[{i}] is {type(p).__name__}, not a tensor")
        params = [p for p in params if p.requires_grad]
        seen: set[int] = set()
        for i, p in enumerate(params):
            if id(p) in seen:
                raise ValueError(f"MasterGradBuffer: params[{i}] appears more than once")
            if p.device.type == "meta":
                raise ValueError(f"MasterGradBuffer: params[{i}] is on the meta device; "
                                 "materialise the model (e.g. to_empty) first")
            if not p.is_floating_point():
                raise TypeError(f"MasterGradBuffer: params[{i}] has dtype {p.dtype}; "
                                "expected a floating-point parameter")
            seen.add(id(p))
        self.params = params
        self.dtype = dtype
        # bucket_size_mb=math.inf: one bucket per device.
        self.bucket_size = max(1, int(min(bucket_size_mb * 2**20 / 4, 2**62)))
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.buckets: list[Bucket] = []
        self._views: dict[int, torch.Tensor] = {}
        self._bucket_of: dict[int, Bucket] = {}
        self._norm_slot = {id(p): i for i, p in enumerate(params)}
        self._build()

    def _build(self) -> None:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for p in reversed(self.params):
            by_device.setdefault(p.device, []).append(p)
        for device, params in by_device.items():
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += -(-p.numel() // _ALIGN_ELEMS) * _ALIGN_ELEMS
            flat = torch.zeros(total, dtype=self.dtype, device=device)
            self.buffers[device] = flat
            start = 0  # bucket start offset
            members: list[tuple[torch.Tensor, int]] = []
            for p, off in zip(params, offsets):
                if members and off + p.numel() - start > self.bucket_size:
                    self._add_bucket(device, flat, members, start, off)
                    start, members = off, []
                members.append((p, off))
            if members:
                self._add_bucket(device, flat, members, start, total)

    def _add_bucket(self, device, flat, members, start, end) -> None:
        bucket = Bucket(len(self.buckets), device, [], [], flat[start:end],
                        norm_size=len(self.params))
        for p, off in members:
            strides = grad_strides(p)
            view = flat[off:off + p.numel()].view(p.shape)
            if view.stride() != strides:
                view = flat.as_strided(p.shape, strides, flat.storage_offset() + off)
            bucket.params.append(p)
            bucket.views.append(view)
            bucket.norm_slots.append(self._norm_slot[id(p)])
            self._views[id(p)] = view
            self._bucket_of[id(p)] = bucket
            p.main_grad = view
        self.buckets.append(bucket)

    @torch.no_grad()
    def relayout(self, p: torch.Tensor) -> bool:
        """Give ``view(p)`` (the same tensor object) p's current layout, keeping its values
        (element by element); False if it had it. The launch plans of its bucket are rebuilt."""
        view = self.view(p)
        strides = grad_strides(p)
        if view.stride() == strides:
            return False
        held = view.clone()
        view.as_strided_(p.shape, strides, view.storage_offset())
        view.copy_(held)
        self._bucket_of[id(p)]._plans.clear()
        return True

    def view(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 master gradient: a view into the flat buffer."""
        try:
            return self._views[id(p)]
        except KeyError:
            raise KeyError("MasterGradBuffer.view: this tensor is not managed by the buffer") from None

    def bucket_of(self, p: torch.Tensor) -> Bucket:
        """The bucket holding p's master gradient."""
        return self._bucket_of[id(p)]

    def __contains__(self, p: object) -> bool:
        return id(p) in self._views

    @property
    def numel(self) -> int:
        """Elements over all devices, alignment padding included."""
        return sum(b.numel() for b in self.buffers.values())

    def zero_(self) -> None:
        """Zero every master gradient."""
        for flat in self.buffers.values():
            flat.zero_()

    def accumulate(
        self,
        params: list[torch.Tensor],
        grads: list[torch.Tensor],
        scale: float | torch.Tensor = 1.0,
        *,
        overwrite: bool = False,
        found_inf: torch.Tensor | None = None,
        norm_sq: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        """One fused launch: ``view(p) = (0 if overwrite else view(p)) + scale * grad``.

        Params of one bucket (all or some, in any order: what the wrapper passes) launch through
        the bucket's plan, which checks only the gradients; params of several buckets take the
        general ``accumulate_``. ``norm_sq`` (optional): a contiguous float32 vector of
        ``len(self.params)`` elements on the params' device; element ``norm_index(p)`` (p's
        index in ``self.params``) is overwritten with ``sum(view(p)**2)`` of the values just
        written, for each launched p only (the other elements keep their values).
        """
        if params:
            bucket = self._bucket_of.get(id(params[0]))
            if bucket is not None:
                try:
                    bucket.plan(backend)(grads, scale, keys=params, overwrite=overwrite,
                                         found_inf=found_inf, norm_sq=norm_sq)
                    return
                except KeyError:  # not all in this bucket: nothing was written
                    pass
        views = [self.view(p) for p in params]
        grads = [validate.in_layout_of(v, g) for v, g in zip(views, grads)]
        if norm_sq is None:
            accumulate_(views, grads, scale, overwrite=overwrite, found_inf=found_inf,
                        backend=backend)
            return
        if views:
            validate.check_norm_sq(norm_sq, len(self.params), views[0].device)
        accumulate_slots(views, grads, scale, overwrite, found_inf, norm_sq,
                          [self._norm_slot[id(p)] for p in params], backend)

    def norm_index(self, p: torch.Tensor) -> int:
        """p's element of an ``accumulate(..., norm_sq=...)`` vector: its index in params."""
        try:
            return self._norm_slot[id(p)]
        except KeyError:
            raise KeyError("MasterGradBuffer.norm_index: this tensor is not managed by the "
                           "buffer") from None


def grad_strides(p: torch.Tensor) -> tuple[int, ...]:
    """The strides autograd gives p's ``.grad``: p's own for a dense p (any dimension order),
    row-major otherwise (torch's gradient layout contract)."""
    if not p.is_contiguous() and validate.is_dense(p):
        return tuple(p.stride())
    strides, step = [], 1
    for size in reversed(p.shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
