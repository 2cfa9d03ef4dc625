"""The ``checkpoint`` axis of the conformance matrix, on the wrapper's side of a case.

- ``save-load``: mid-window ``opt.state_dict()`` and the model's through ``torch.save`` /
  ``torch.load(weights_only=True)`` into a fresh model and wrapper; the fresh wrapper's
  ``state_dict()`` right after the load must work and show what was loaded.
- ``dcp-flat``: mid-window DCP ``get_state_dict``/``set_state_dict`` with
  ``flatten_optimizer_state_dict`` (torchtitan's recipe), ``get_state_dict`` again right after.
- ``deepcopy``: ``save-load``, then ``copy.deepcopy((model, opt))`` trains on.
- ``native-step0``: the wrapper's state dict before its first step into a native optimizer,
  which trains the case's loop natively.
- ``to-native``: the same at the boundary after window 0.
- ``deepcopy-direct`` / ``pickle``: mid-window, ``copy.deepcopy`` / a pickle round trip of
  the model and the wrapper together, nothing loaded first (``copy.copy(opt)`` refused first).
- ``native-into-inner``: window 0 natively, then the native optimizer's state dict loaded into
  the inner optimizer of a wrapper built on it (after wrapping).
"""

from __future__ import annotations

import copy

import torch
from _matrix_loop import Departure, WrapperSide, roundtrip
from _matrix_models import build, match_layout, same_start
from _matrix_oracle import Reference


def _same_state(saved: dict, again: dict, where: str) -> None:
    """The per-param tensors of ``again`` equal those of ``saved`` (what was loaded)."""
    for k, entry in saved["state"].items():
        other = again["state"].get(k)
        if other is None:
            raise Departure(f"{where}: state of param {k} missing after the load")
        for name, v in entry.items():
            if torch.is_tensor(v) and v.numel() and name != "step":
                w = other.get(name)
                # (torch's load casts floating state but 'step' to the param's dtype: ASGD's
                # eta, NAdam's mu_product on a bf16 param without masters, natively too)
                if w is None or not torch.equal(v.to(w.dtype).float().nan_to_num(),
                                                w.float().nan_to_num()):
                    raise Departure(f"{where}: state[{k}][{name!r}] differs from what was "
                                    "loaded")


def _fresh(side: WrapperSide):
    ctx = side.ctx
    model = same_start(side.model, ctx.params, ctx.dtype, ctx.seed)
    return model, ctx.wrap(model)


def _swap(side: WrapperSide, model, opt) -> None:
    side.opt.remove_hooks()
    side.model, side.opt = model, opt


def save_load(side: WrapperSide, check: bool = True):
    sd = roundtrip(side.opt.state_dict())
    model, opt = _fresh(side)
    opt.load_state_dict(sd)
    if not check:
        _swap(side, model, opt)
        return
    try:
        again = opt.state_dict()
    except Exception as exc:  # noqa: BLE001 -- named in the departure
        raise Departure(f"state_dict() right after load_state_dict raised "
                        f"{type(exc).__name__}: {exc}") from exc
    _same_state(sd, again, "state_dict() after load_state_dict")
    _swap(side, model, opt)


def dcp_flat(side: WrapperSide):
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    options = StateDictOptions(flatten_optimizer_state_dict=True)
    msd, osd = roundtrip(get_state_dict(side.model, side.opt, options=options))
    ctx = side.ctx
    model = build(ctx.params, ctx.dtype, ctx.seed + 1)  # other weights: the load must set them
    match_layout(model, side.model)
    opt = ctx.wrap(model)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    try:
        get_state_dict(model, opt, options=options)
    except Exception as exc:  # noqa: BLE001
        raise Departure(f"get_state_dict right after set_state_dict raised "
                        f"{type(exc).__name__}: {exc}") from exc
    _swap(side, model, opt)


def deepcopy(side: WrapperSide):
    save_load(side, check=False)  # (save-load checks state_dict() after the load)
    old = side.opt
    try:
        model, opt = copy.deepcopy((side.model, side.opt))
    except Exception as exc:  # noqa: BLE001
        raise Departure(f"copy.deepcopy after load_state_dict raised "
                        f"{type(exc).__name__}: {exc}") from exc
    old.remove_hooks()
    side.model, side.opt = model, opt


def to_native(side: WrapperSide):
    """The wrapper's state dict into a native optimizer on the same model, which goes on."""
    sd = roundtrip(side.opt.state_dict())
    side.opt.remove_hooks()
    for p in side.model.parameters():
        p.grad = None
    native = side.ctx.opt.build(side.model.parameters())
    native.load_state_dict(sd)
    side.opt, side.ref = None, Reference(side.ctx, side.model, inner=native)


def native_into_inner(side: WrapperSide):
    """The native optimizer's state dict into a wrapper's inner optimizer, after wrapping."""
    sd = roundtrip(side.ref.inner.state_dict())
    inner = side.ctx.opt.build(side.model.parameters())
    side.opt = side.ctx.wrap(side.model, inner=inner)
    inner.load_state_dict(sd)
    side.ref = None


def _copy_refused(opt) -> None:
    """copy.copy(opt) is refused (TypeError) before anything changes: the run goes on
    against native as if it had not been called."""
    try:
        copy.copy(opt)
    except TypeError as exc:
        if "copy" not in str(exc):
            raise Departure(f"copy.copy(opt) raised an unclear TypeError: {exc}") from exc
    else:
        raise Departure("copy.copy(opt) built a second live wrapper")


def copy_direct(side: WrapperSide, through=None):
    """Mid-window, the model and the wrapper copied together with nothing loaded first
    (``copy.deepcopy``, or ``through``: a pickle round trip); the copy trains on, the original
    is dropped. Natively a Parameter's copy has no ``.grad``; the wrapper's copy carries its
    window in its state and shows it again."""
    _copy_refused(side.opt)
    old = side.opt
    try:
        model, opt = (through or copy.deepcopy)((side.model, side.opt))
    except Exception as exc:  # noqa: BLE001
        raise Departure(f"copying the model and the wrapper raised "
                        f"{type(exc).__name__}: {exc}") from exc
    if type(opt) is not type(old):
        raise Departure(f"the copy is a {type(opt).__name__}, not a {type(old).__name__}")
    old.remove_hooks()
    side.model, side.opt = model, opt


def pickled(side: WrapperSide):
    import pickle

    copy_direct(side, through=lambda obj: pickle.loads(pickle.dumps(obj)))


MID = {"save-load": save_load, "dcp-flat": dcp_flat, "deepcopy": deepcopy,
       "deepcopy-direct": copy_direct, "pickle": pickled}
START = {"native-step0": to_native}
BOUNDARY = {"to-native": to_native, "native-into-inner": native_into_inner}
