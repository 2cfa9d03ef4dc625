"""The wrapper's rooms, built once, and the layout policy that picks the flat or FSDP2 variants.

``Parts`` holds the rooms that live as long as the wrapper (config, inner optimizer, names,
masters, non-finite policy, loss scale, outside params) and those rebuilt with the managed
params (params, window, sync). A layout policy builds what differs between a flat fp32 buffer
and FSDP2's sharded window: the storage, the intake, the synchronisation, the norm, the
checkpoint. :func:`layout_for` picks it (FSDP2 when the inner optimizer holds DTensor params),
so the face never subclasses or swaps its class.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from accumkernels._util import WINDOW_DTYPES
from accumkernels.buffer import MasterGradBuffer
from accumkernels.ops import host
from accumkernels.optim.checkpoint import assemble as checkpoint
from accumkernels.optim.config import Config
from accumkernels.optim.fsdp2.recipe import is_sharded, refuse_sharded
from accumkernels.optim.intake.intake import Intake
from accumkernels.optim.masters import MasterWeights
from accumkernels.optim.nonfinite import NonFinite
from accumkernels.optim.outside import OutsideParams
from accumkernels.optim.scaling import LossScaler
from accumkernels.optim.step.step import Step, flat_norm
from accumkernels.optim.sync.local import make_sync
from accumkernels.optim.sync.protocol import Sync
from accumkernels.optim.window import Window
from accumkernels.slot import SLOT_ATTR


@dataclass(slots=True, weakref_slot=True)
class Parts:
    """The rooms a wrapper is made of (see the face's docstring for the map). Slots: a room
    cannot grow an attribute nobody declared here."""

    config: Config
    optimizer: torch.optim.Optimizer
    names: dict[int, str]
    masters: MasterWeights
    scaler: LossScaler
    outside: OutsideParams
    nonfinite: NonFinite | None = None  # built with the first storage (its device)
    params: list[torch.Tensor] = field(default_factory=list)
    window: Window | None = None
    sync: Sync | None = None
    show_window: bool = False  # state_dict() holds every view, also at a window boundary
    # why the face refuses to be used, once another wrapper took over its params (refusals.py)
    taken_over: str | None = None


class Layout(Protocol):
    """What differs between the flat fp32 buffer and FSDP2's sharded window (FlatLayout,
    fsdp2.layout.ShardedLayout): the face and build_rooms ask only this."""

    can_fold: bool  # the step may fold its factors into one pass over the flat buffers
    fuses_inexact_mean: bool  # "mean" with any N fuses 1/N into the adds (window.py)
    measure: Callable
    checkpoint: object  # the module that assembles and restores the state dict

    def check(self, params: list[torch.Tensor]) -> None: ...
    def storage(self, params: list[torch.Tensor], config: Config): ...
    def show(self, params: list[torch.Tensor], storage) -> None: ...
    def intake(self, parts: Parts, storage, events, outside: list[torch.Tensor]): ...
    def sync(self, config: Config, process_group, ddp, window: Window,
             params: list[torch.Tensor]) -> Sync: ...


def managed(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The params the fp32 window holds: trainable, fp32/bf16/fp16 (float64 trains natively)."""
    return [p for g in optimizer.param_groups for p in g["params"]
            if p.requires_grad and p.dtype in WINDOW_DTYPES]


def resolve_backends(config, params: list[torch.Tensor]) -> None:
    """An unusable backend fails here, before anything is touched."""
    for device in {p.device for p in params}:
        host.resolve(config.backend, device)


class FlatLayout:
    """One contiguous fp32 buffer per device (MasterGradBuffer), the core intake, local,
    ``process_group`` or DDP synchronisation, the norm as ``clip_grad_norm_`` measures it."""

    can_fold = True
    # "mean" with N given: the window is normalised once its N-th backward is in (seal,
    # process_group, DDP), so 1/N is fused into the adds only where it is exact (window.py)
    fuses_inexact_mean = False
    measure = staticmethod(flat_norm)
    checkpoint = checkpoint

    def check(self, params: list[torch.Tensor]) -> None:
        refuse_sharded(params)

    def storage(self, params: list[torch.Tensor], config) -> MasterGradBuffer:
        return MasterGradBuffer(params, bucket_size_mb=config.bucket_size_mb)

    def show(self, params: list[torch.Tensor], storage) -> None:
        for p in params:
            p.grad = None

    def intake(self, parts: Parts, storage, events, outside: list[torch.Tensor]) -> Intake:
        return Intake(parts, parts.params, storage, events, outside=outside)

    def sync(self, config, process_group, ddp, window, params):
        return make_sync(config, process_group, ddp, window, params)


def layout_for(optimizer, model, kwargs: dict) -> Layout:
    """FSDP2's layout when the inner optimizer holds DTensor params, else the flat one."""
    if is_sharded(optimizer):
        from accumkernels.optim.fsdp2.layout import ShardedLayout  # imports FSDP2's modules
        return ShardedLayout(managed(optimizer), model, kwargs)
    return FlatLayout()


def build_rooms(parts: Parts, layout: Layout, params: list[torch.Tensor], events,
                process_group=None):
    """(Re)build the storage, window, sync, intake and step for the managed ``params``; returns
    the intake and the step. A rebuild (``add_param_group``, between windows) keeps the window's
    bookkeeping (the caller's cadence) and the sync (rebound to the new storage)."""
    config = parts.config
    storage = layout.storage(params, config)
    if parts.window is None:
        window = Window(config, storage, fuse_inexact_mean=layout.fuses_inexact_mean)
        # the sync first: a process_group that does not hold replicas is refused on every rank
        # before any of the rooms changes, and its broadcast precedes the master copies
        parts.sync = layout.sync(config, process_group, None, window, params)
        parts.window = window
        parts.nonfinite = NonFinite(config, next(iter(storage.buffers), torch.device("cpu")))
    else:
        parts.window.rebase(storage)
        parts.sync.rebind(parts.window, params)
    parts.masters.retarget(params)
    parts.params = params
    layout.show(params, storage)
    parts.outside.rebuild({id(p) for p in parts.masters.master_list()} | {id(p) for p in params})
    intake = layout.intake(parts, storage, events,
                           [p for p in parts.outside.params if p.is_leaf and p.requires_grad])
    return intake, Step(parts, intake, measure=layout.measure, can_fold=layout.can_fold)


class Slot:
    """The wrapper's side of the slot protocol (accumkernels.slot); holds its owner weakly. An
    owner whose params another wrapper took over is retired: its slots answer as a gone
    owner's (no owner: fused kernels and DDP's comm hook take the native path)."""

    def __init__(self, owner, intake: Intake, parts: Parts, sync_for_ddp: Callable):
        self._owner = weakref.ref(owner)
        self._intake = weakref.ref(intake)
        self._parts = weakref.ref(parts)
        self._per_microbatch = parts.nonfinite.per_microbatch
        self._sync_for_ddp = sync_for_ddp  # (owner, group) -> its sync: holds no owner

    def ddp_sync(self, group) -> Sync | None:
        """The owner's sync for DDP's ``group`` (met at its first sync backward), or None once
        the owner is gone (or retired): the DDP comm hook's way to the window."""
        owner = self.owner
        return None if owner is None else self._sync_for_ddp(owner, group)

    @property
    def owner(self):
        """The wrapper; None once it is gone or retired."""
        parts = self._parts()
        return None if parts is None or parts.taken_over is not None else self._owner()

    def retire(self, why: str) -> None:
        """Another wrapper took over (some of) the owner's params: the owner refuses any further
        use, raising ``why`` (its face's guard), and its slots answer as a gone owner's."""
        parts = self._parts()
        if parts is not None:
            parts.taken_over = why

    def check_fusable(self) -> None:
        if self._owner() is not None and self._per_microbatch:
            raise ValueError("fused gradient writes cannot be undone: nonfinite='skip_microbatch' "
                             "is not supported with fuse_wgrad_accumulation")

    def __reduce__(self):  # a pickled or copied param carries a slot with no owner
        return _dead_slot, ()

    def claim(self, p: torch.Tensor):
        parts = self._parts()
        if parts is not None and parts.taken_over is not None:
            raise RuntimeError(parts.taken_over.format(call="accumkernels_slot.claim"))
        intake = self._intake() if self._owner() is not None else None
        if intake is None:
            raise RuntimeError("the AccumulatingOptimizer that managed this param is gone")
        return intake.claim(p)


def _dead_slot() -> Slot:
    slot = Slot.__new__(Slot)
    slot._owner = slot._intake = slot._parts = lambda: None
    slot._sync_for_ddp = None
    slot._per_microbatch = False
    return slot


def attach_slots(owner, intake: Intake, params: list[torch.Tensor], parts: Parts,
                 sync_for_ddp: Callable):
    """Every managed param carries the slot fused weight-gradient kernels (and DDP's comm hook)
    reach the window through."""
    slot = Slot(owner, intake, parts, sync_for_ddp)
    for p in params:
        setattr(p, SLOT_ATTR, slot)


def add_group(intake: Intake, parts: Parts, layout: Layout, param_group: dict):
    """``add_param_group``: the group added to the inner optimizer (torch's checks first: a
    refusal changes nothing); returns its trainable params and the function that puts what the
    window holds into the intake rebuilt for them. A window reduced across ranks is not
    rebuilt mid-window: refused with nothing changed."""
    intake.settle()
    local = isinstance(layout, FlatLayout) and not parts.sync.active \
        and parts.sync.ddp_group is None
    if not local and not (parts.window.empty and not intake.unmoved):
        raise ValueError(
            "add_param_group: the current window holds gradients that are reduced across "
            "ranks; call it between windows (after step() or reset_window()), e.g. at the "
            "start of an epoch")
    parts.optimizer.add_param_group(param_group)
    new = [p for p in parts.optimizer.param_groups[-1]["params"] if p.requires_grad]
    intake.take_in()  # assigned (or unmoved) gradients join the window first
    return new, window_across_rebuild(intake, parts.window, new)


def window_across_rebuild(intake, window, new: list[torch.Tensor]):
    """``add_param_group`` rebuilds the rooms for the params added: what the window holds and
    ``.grad`` shows now, and a function that puts it into the rebuilt intake (the added params'
    own ``.grad``, natively summed there, joins as their gradient of the micro-batches counted)."""
    shown = {id(p) for p, v in zip(intake.params, intake.views) if p.grad is v}
    held = {id(p): v.clone() for p, v in zip(intake.params, intake.views) if window.holds(p)}
    own = {id(p): p.grad for p in new if p.grad is not None}

    def restore(rebuilt) -> None:
        with torch.no_grad():
            for p, view in zip(rebuilt.params, rebuilt.views):
                if id(p) in held:
                    view.copy_(held[id(p)])
                    if id(p) in shown:
                        p.grad = view
        rebuilt.guard.shown = bool(shown)
        for p, view in zip(rebuilt.params, rebuilt.views):
            if id(p) in own:
                rebuilt.absorb(p, own[id(p)])
                p.grad = view

    return restore
