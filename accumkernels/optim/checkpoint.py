"""The wrapper's checkpoint: each room writes and checks its own piece; loading is atomic.

The state dict is a plain torch optimizer state dict, and the wrapper's own state travels
inside what every checkpoint tool already carries (format 4):

* ``state[i]``: the inner optimizer's state of param ``i`` (keyed like the model's params, so
  ``torch.distributed.checkpoint`` maps it to the parameter names, flattens, reshards and
  offloads it; before the inner optimizer's first step the state an lr=0 step would create),
  plus ``"accumkernels_master"`` (the fp32 master of a bf16/fp16 param) and
  ``"accumkernels_window"`` (the param's fp32 window, or its FSDP2 shard; zeros between
  windows): every key always there, so the state dict of a fresh wrapper is a template that a
  tool loading into it (``dcp.load``) fills completely;
* ``param_groups[g]["accumkernels"]``: the bookkeeping (format version, param shapes, window
  counts and weights, loss-scale state, non-finite counters) as one JSON string, the same in
  every group (one opaque leaf, so a tool that loads into a template matches its keys).

The live optimizer shows the same keys (``opt.state[p]``, ``opt.param_groups``:
live_state.py), so a tool that rebuilds the loaded state dict from the keys the loading optimizer
has finds them all. Carried, mid-window included, bit-identical to not stopping (tests in
tests/optim/test_checkpoint_dcp.py and tests/distributed/): ``torch.save`` (weights_only);
``get_state_dict``/``set_state_dict`` with the default options, ``full_state_dict``,
``cpu_offload``, ``flatten_optimizer_state_dict`` and their combinations; ``dcp.save``/
``dcp.load`` into a fresh wrapper's state dict (flattened or not; under FSDP2 resharded to
another world size). One combination is torch's own limit: ``set_state_dict`` with
``flatten_optimizer_state_dict`` and ``full_state_dict`` together raises KeyError in torch 2.13
for every optimizer, native ones too; load such a checkpoint with ``flatten`` alone.

A native optimizer's state dict loads too (masters from the model, an empty window), and the
wrapper's loads into a native optimizer (the extra keys are ignored by torch's optimizers once
they have state; DCP's flattening drops them). A native optimizer's *flattened* DCP state dict
lacks the group key the wrapper shows, and DCP's unflattening raises KeyError naming it: load it
into the inner optimizer before wrapping it (or save it unflattened). A state dict that carries
the wrapper's tensors without its bookkeeping, or an open window without its tensors (a tool that
strips what it does not know, or a template built without the window) is refused with a
ValueError naming what is lost, never taken as an empty window.

``restore`` first parses every piece (raising ``ValueError`` on anything that does not fit this
wrapper), then loads the inner optimizer with a rollback, and only then writes the rooms: a
state that fails changes nothing. Format 3 (the wrapper's parts under a top-level
``"accumkernels"`` key) and formats 1 and 2 (everything at the top level, the inner state under
``"optimizer"``) still load.

Under data parallelism a window is each rank's own until it is reduced across the ranks (DDP's
sync backward, ``process_group``'s step). A state dict taken before that records the rank and
world size that saved it, warns, and loads only there: every rank saving and loading its own
resumes exactly, while rank 0's loaded on another rank (frameworks that save rank 0's only) is
refused, not silently substituted for that rank's window. With ``process_group`` and N given,
the window's last backward sums its buckets across the ranks: a state dict taken after it names
those buckets (``window["summed"]``), and the resumed wrapper does not sum them again; only a
wrapper reducing over the same ranks loads it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import warnings
from collections import defaultdict
from itertools import chain

import torch
import torch.distributed as dist

from accumkernels.optim import live_state as live
from accumkernels.optim.live_state import LIVE, MASTER_KEY, OWN_KEY, WINDOW_KEY
from accumkernels.optim.window import Window

VERSION = 4  # OWN_KEY: per group (format 4); the top-level key of format 3


def _shapes_digest(params: list) -> str:
    """The managed params' shapes, in order, as a short digest (checked at load)."""
    text = json.dumps([list(p.shape) for p in params])
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def _index(parts) -> dict[int, int]:
    """id(param) -> its key in ``state`` (its position over the inner optimizer's groups)."""
    params = chain.from_iterable(g["params"] for g in parts.optimizer.param_groups)
    return {id(p): i for i, p in enumerate(params)}


def assemble(parts, intake, agree=None) -> dict:
    """The wrapper's state dict (format 4, see the module docstring). ``intake.views``: what
    shows each param's window; ``agree(own)``: the FSDP2 room's agreed bookkeeping.

    Every param the inner optimizer steps has its state entry (a param without one yet: the
    state a fresh optimizer is loaded with, listed in ``own["fresh"]``), every bf16/fp16 param
    its master, and every param its window when the window is not empty (or inside
    :func:`showing_window`): a checkpoint tool that loads into this state dict as a template
    (``dcp.load``) finds every key a saved one of the same kind brings. At a boundary it holds
    what a native optimizer's holds, plus the masters and one JSON string."""
    parts.masters.current()  # a weight the user wrote since the last step: taken in first
    parts.masters.fp32_state()
    sd = parts.optimizer.state_dict()
    own = {
        "version": VERSION,
        "shapes": _shapes_digest(parts.params),  # (fixed size: DCP's flattening repeats it
        # for every param)
        "loss_scale": parts.scaler.state_dict(),
        **parts.nonfinite.state_dict(),
        "inner_state": bool(sd["state"]),
        "masters": bool(parts.masters.model_params),
    }
    state, index = sd["state"], _index(parts)
    inner = [p for g in parts.optimizer.param_groups for p in g["params"]]
    stateless = {id(p) for i, p in enumerate(inner) if i not in state and p.requires_grad}
    if stateless:  # (an empty entry where the optimizer keeps no state: what DCP's strict
        fresh = live.template_state(parts, only=stateless)  # loading needs for every param)
        state.update({i: fresh.get(i, {}) for i, p in enumerate(inner) if id(p) in stateless})
        if fresh:
            own["fresh"] = sorted(fresh)
    own["found_inf"] = float(own["found_inf"].item())
    extra = {id(p): {MASTER_KEY: m.detach()} for p, m in zip(parts.masters.model_params,
                                                            parts.masters.master_list())}
    window = parts.window
    if not window.empty or getattr(parts, "show_window", False):
        for p, view in zip(parts.params, intake.views):  # a copy: a tool loading into this
            extra.setdefault(id(p), {})[WINDOW_KEY] = view.detach().clone()  # dict as a
            # template writes it before load_state_dict, while DCP's state init may still run
            # a backward-less step
    for key, entries in extra.items():
        state[index[key]] = {**state.get(index[key], {}), **entries}
    if not window.empty:
        own["window"] = window.state_dict(parts.params)
        local = parts.sync.rank_local_window()
        if local is not None:  # only this rank's part of the window: only this rank may load it
            own["window"]["rank"], own["window"]["world"] = local
            warnings.warn(_RANK_LOCAL_SAVED.format(*local), stacklevel=3)
        summed = parts.sync.summed_buckets()
        if summed:  # process_group: buckets the last backward summed across the ranks
            own["window"]["summed"] = summed
    if agree is not None:
        agree(own)
    packed = json.dumps(own)  # one opaque leaf: tools that flatten nested containers into
    for group in sd["param_groups"]:  # keys (DCP) then match a template's whatever it holds
        group[OWN_KEY] = packed
    return sd


@contextlib.contextmanager
def showing_window(parts):
    """``state_dict()`` inside the block holds every param's window also at a window boundary
    (zeros): the template a checkpoint taken in the middle of a window loads into."""
    before = getattr(parts, "show_window", False)
    parts.show_window = True
    try:
        yield
    finally:
        parts.show_window = before


_RANK_LOCAL_SAVED = (
    "AccumulatingOptimizer.state_dict() in the middle of a window under data parallelism: the "
    "window is rank {0}'s own until the window's sync backward reduces it, so this checkpoint "
    "holds rank {0}'s part only and only rank {0} (of {1}) can resume from it. Every rank must "
    "save and load its own; frameworks that save rank 0's optimizer state only (Accelerate's "
    "save_state, the HF Trainer) must checkpoint at a window boundary (after step())")


def _check_rank(parts, window: dict) -> None:
    """A rank-local window loads only on the rank (and world size) that saved it."""
    if "rank" not in window:
        return
    saved = (window["rank"], window["world"])
    here = parts.sync.rank_local_window()
    here = here if here is not None else ((dist.get_rank(), dist.get_world_size())
                                          if dist.is_available() and dist.is_initialized()
                                          else (0, 1))
    if tuple(saved) != tuple(here):
        raise ValueError(
            f"load_state_dict: this checkpoint was taken in the middle of a window and holds "
            f"rank {saved[0]}'s window of a {saved[1]}-rank job (not yet reduced across the "
            f"ranks); this process is rank {here[0]} of {here[1]}. Each rank must load the state "
            "dict it saved itself; a checkpoint saved by rank 0 only (Accelerate's save_state, "
            "the HF Trainer) must be taken at a window boundary, after step()")


def _parse_buffers(parts, saved: object) -> list[torch.Tensor]:
    mine = list(parts.window.storage.buffers.values())
    if not isinstance(saved, (list, tuple)) or len(saved) != len(mine) or any(
            not isinstance(t, torch.Tensor) or t.shape != m.shape for t, m in zip(saved, mine)):
        raise ValueError("load_state_dict: main_grad does not match this optimizer's params")
    return [t.detach().clone() for t in saved]


_STRIPPED = (
    "load_state_dict: this state dict carries AccumulatingOptimizer's per-param {what} but not "
    "its bookkeeping (param_groups[...]['accumkernels'] is missing: the tool that saved or loaded "
    "it dropped unknown param_group keys); the window counts, weights and loss-scale state "
    "are lost. Save with opt.state_dict() (torch.save), or a tool that keeps param_groups whole")
_STRIPPED_STATE = (
    "load_state_dict: this state dict lost AccumulatingOptimizer's {what} (per-param entries "
    "'accumkernels_*' of 'state'), which its bookkeeping says were saved: the tool that "
    "loaded it kept only the state keys the optimizer had before loading (e.g. "
    "torch.distributed.checkpoint with flatten_optimizer_state_dict=True). Load without "
    "flattening, or with opt.load_state_dict() of what opt.state_dict() saved")
_NO_WINDOW = (
    "load_state_dict: this checkpoint was taken in the middle of a window of {n} micro-batch(es), "
    "but the window's gradients are missing for {missing}: the template it was loaded into was "
    "built at a window boundary, where state_dict() holds no window (or a tool dropped them). "
    "Nothing of the optimizer's own state was changed. With torch.distributed.checkpoint, build "
    "the template inside `with opt.window_template():` (get_state_dict / opt.state_dict() then "
    "hold the window), dcp.load into it again and load that; or checkpoint at a window "
    "boundary, after step()")


def _own_of(sd: dict):
    """The format-4 bookkeeping of a state dict (first group's, a JSON string), or None."""
    groups = sd.get("param_groups")
    if isinstance(groups, list):
        for g in groups:
            if isinstance(g, dict) and g.get(OWN_KEY, LIVE) != LIVE:
                own = g[OWN_KEY]
                try:
                    return json.loads(own) if isinstance(own, (str, bytes)) else own
                except ValueError:
                    raise ValueError("load_state_dict: malformed 'accumkernels' bookkeeping in "
                                     "param_groups") from None
    return None


def _strip(sd: dict) -> dict:
    """The inner optimizer's part of a format-4 state dict (the wrapper's keys removed, and the
    empty dicts ``torch.distributed.checkpoint``'s unflattening makes of the keys a loading
    optimizer shows but the checkpoint lacks)."""
    state = {k: {n: v for n, v in entry.items() if n not in (MASTER_KEY, WINDOW_KEY)
                 and not (isinstance(v, dict) and not v)}
             if isinstance(entry, dict) else entry for k, entry in sd["state"].items()}
    state = {k: v for k, v in state.items() if not isinstance(v, dict) or v}
    groups = [{k: v for k, v in g.items() if k != OWN_KEY} for g in sd["param_groups"]]
    return {**sd, "state": state, "param_groups": groups}


def _saved_keys(parts, sd: dict) -> dict[int, object]:
    """id(param) -> its key in the saved ``state``, by position over the groups, as torch's
    ``load_state_dict`` maps them (ints from ``state_dict()``, parameter names from DCP)."""
    saved = chain.from_iterable(g.get("params", ()) for g in sd["param_groups"])
    mine = chain.from_iterable(g["params"] for g in parts.optimizer.param_groups)
    return {id(p): k for k, p in zip(saved, mine)}


def _from_v4(parts, sd: dict, own: object) -> dict:
    """Format 4 in the form of the older formats' pieces (checked in ``_parse``)."""
    if not isinstance(own, dict) or own.get("version") != VERSION:
        version = own.get("version") if isinstance(own, dict) else None
        raise ValueError(f"load_state_dict: checkpoint format version {version!r} is not "
                         f"supported (this accumkernels writes version {VERSION})")
    index, state = _saved_keys(parts, sd), sd["state"]

    def entry(p) -> dict:  # (an empty dict: what DCP's unflattening makes of a missing key)
        saved = state.get(index.get(id(p)), {})
        return {k: v for k, v in saved.items() if not (isinstance(v, dict) and not v)} \
            if isinstance(saved, dict) else {}
    inner = _strip(sd)
    if own.get("inner_state") is False:  # saved before the inner optimizer had any state
        inner = {**inner, "state": {}}
    elif own.get("fresh"):  # entries standing for "no state yet" (a fresh optimizer's)
        saved = list(chain.from_iterable(g.get("params", ()) for g in sd["param_groups"]))
        fresh = {saved[i] for i in own["fresh"] if isinstance(i, int) and 0 <= i < len(saved)}
        inner = {**inner, "state": {k: v for k, v in inner["state"].items() if k not in fresh}}
    masters = [entry(p).get(MASTER_KEY) for p in parts.masters.model_params]
    if own.get("masters") and any(m is None for m in masters):
        raise ValueError(_STRIPPED_STATE.format(what="fp32 master weights"))
    mine = {id(p) for p in parts.masters.model_params}
    old = {**own, "optimizer": inner,
           "master_weights": masters,
           "window_views": None, "window": own.get("window"),
           "unused_masters": [parts.names.get(id(p), f"param {i}")
                              for i, p in enumerate(parts.params)
                              if id(p) not in mine and MASTER_KEY in entry(p)]}
    window = own.get("window")
    views = [entry(p).get(WINDOW_KEY) for p in parts.params]
    if window is None and all(v is not None for v in views):
        old["window_views"] = views  # a boundary: taken as saved, nothing held
    if window is not None:
        missing = [parts.names.get(id(p), f"param {i}") for i, p in enumerate(parts.params)
                   if views[i] is None]
        if missing:
            raise ValueError(_NO_WINDOW.format(n=window.get("micro_steps")
                                               if isinstance(window, dict) else "?",
                                               missing=", ".join(missing[:3])
                                               + (" ..." if len(missing) > 3 else "")))
        old["window_views"] = views
    return old


def _parse(parts, sd: object) -> dict:
    """The pieces of a v4, v3, v1/v2 or native state dict, checked; and the inner optimizer's."""
    if isinstance(sd, dict) and OWN_KEY in sd:  # format 3
        own = sd[OWN_KEY]
        if not isinstance(own, dict) or own.get("version") != 3:
            version = own.get("version") if isinstance(own, dict) else None
            raise ValueError(f"load_state_dict: checkpoint format version {version!r} is not "
                             f"supported (this accumkernels writes version {VERSION})")
        inner = {k: v for k, v in sd.items() if k != OWN_KEY}
        window = own.get("window")
        old = {**own, "optimizer": inner, "main_grad": window["main_grad"] if window else None,
               "window": window}
    elif isinstance(sd, dict) and all(k in sd for k in ("optimizer", "master_weights",
                                                        "main_grad", "window")):
        old = sd
        if sd.get("version", 1) not in (1, 2):
            raise ValueError(f"load_state_dict: checkpoint format version {sd['version']!r} is "
                             f"not supported (this accumkernels writes version {VERSION})")
    elif isinstance(sd, dict) and "state" in sd and "param_groups" in sd:
        own = _own_of(sd)
        if own is None:
            for key, what in ((WINDOW_KEY, "window gradients"), (MASTER_KEY, "master weights")):
                if any(isinstance(e, dict) and key in e for e in sd["state"].values()):
                    raise ValueError(_STRIPPED.format(what=what))
            return {"inner": sd, "native": True}  # a native optimizer's: masters from the model
        old = _from_v4(parts, sd, own)
    else:
        raise ValueError("load_state_dict: neither an optimizer state dict (no 'state' and "
                         "'param_groups') nor an AccumulatingOptimizer checkpoint")
    missing = [k for k in ("master_weights", "found_inf", "loss_scale", "skipped_steps",
                           "skipped_microbatches") if k not in old]
    if missing:
        raise ValueError(f"load_state_dict: the state_dict lacks {missing}")
    shapes = old.get("param_shapes")
    if shapes is not None and [list(s) for s in shapes] != [list(p.shape) for p in parts.params] \
            or old.get("shapes", _shapes_digest(parts.params)) != _shapes_digest(parts.params):
        raise ValueError("load_state_dict: param_shapes does not match this optimizer's params "
                         "(a checkpoint of a different model?)")
    window = old["window"]
    if isinstance(window, dict):
        _check_rank(parts, window)
        parts.sync.check_summed(list(window.get("summed", [])))
    views = old.get("window_views")
    return {
        "inner": old["optimizer"],
        "masters": parts.masters.parse(old["master_weights"], parts.names),
        "unused_masters": old.get("unused_masters", []),
        "buffers": None if window is None or views is not None
        else _parse_buffers(parts, old["main_grad"]),
        "views": None if views is None else _parse_views(parts, views),
        "window": None if window is None else Window.parse(window, parts.params),
        "summed": list(window.get("summed", [])) if isinstance(window, dict) else [],
        "nonfinite": parts.nonfinite.parse(old),
        "scaler": parts.scaler.parse(old["loss_scale"]),
    }


def _parse_views(parts, saved: list) -> list[torch.Tensor | None]:
    """Per-param saved windows (DTensors: this rank's shard) checked against this storage."""
    out = []
    for i, (p, t) in enumerate(zip(parts.params, saved)):
        if t is None:
            out.append(None)
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        mine = parts.window.storage.view(p)
        if not isinstance(local, torch.Tensor) or local.shape != mine.shape:
            raise ValueError(f"load_state_dict: the saved window of param {i} has shape "
                             f"{tuple(getattr(local, 'shape', ()))}, this one's is "
                             f"{tuple(mine.shape)}")
        out.append(local.detach().clone())
    return out


def _check_inner_shapes(optimizer: torch.optim.Optimizer) -> None:
    """A loaded state tensor with a param's size but another shape: a different model."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0 and value.numel() == p.numel() \
                        and value.shape != p.shape:
                    raise ValueError(f"load_state_dict: optimizer state {key!r} has shape "
                                     f"{tuple(value.shape)} for a param of shape {tuple(p.shape)}")


def _load_inner(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    backup = optimizer.state_dict()  # references the live state, which loading replaces
    try:
        optimizer.load_state_dict(saved)
        _check_inner_shapes(optimizer)
    except Exception as exc:
        optimizer.load_state_dict(backup)
        raise ValueError(f"load_state_dict: the inner optimizer's state does not fit: {exc}") \
            from exc


@torch.no_grad()
def restore(parts, intake, step, sd: dict) -> None:
    """Load ``sd`` into the rooms: everything is parsed and the inner optimizer loaded (with a
    rollback) before any room changes."""
    intake.settle()
    parsed = _parse(parts, sd)
    with parts.masters.swapped():  # the inner state of bf16/fp16 params is the masters' (fp32)
        _load_inner(parts.optimizer, parsed["inner"])
    # Nothing below can fail.
    intake.pending = {}
    step.reset_window()
    if parsed.get("native"):
        parts.masters.take_from_model()
    else:
        parts.masters.load(parsed["masters"])
        if parsed["window"] is not None:
            if parsed["views"] is not None:
                _copy_views(parts, parsed["views"])
            else:
                for flat, saved in zip(parts.window.storage.buffers.values(),
                                       parsed["buffers"]):
                    flat.copy_(saved)
            parts.window.load(parsed["window"])
            parts.sync.take_summed(parsed["summed"])
        elif parsed.get("views") is not None:  # a boundary: the views as saved (not held)
            _copy_views(parts, parsed["views"])
        parts.nonfinite.load(parsed["nonfinite"])
        parts.scaler.load(parsed["scaler"])
    intake.hide_all()
    intake.expose()
    unused = parsed.get("unused_masters")
    if unused:
        warnings.warn(_MASTERS_DROPPED.format(n=len(unused), names=", ".join(unused[:3])),
                      stacklevel=4)


_MASTERS_DROPPED = (
    "load_state_dict: the checkpoint holds fp32 master weights for {n} param(s) ({names}, ...) "
    "that this AccumulatingOptimizer (master_weights=False) has no place for: they are not "
    "loaded, and the model keeps its own low-precision weights (the masters' extra bits are "
    "lost, and the moments step those weights from now on). Build the wrapper with "
    "master_weights=True (or 'auto') to resume them")


def _copy_views(parts, views: list) -> None:
    for p, saved in zip(parts.params, views):
        if saved is not None:
            parts.window.storage.view(p).copy_(saved)


def native_copy(parts) -> torch.optim.Optimizer:
    """A shallow copy of the inner optimizer (its groups and state hold the model's params),
    with no tie to the wrapper: what pickling and ``copy.deepcopy`` carry."""
    inner = parts.optimizer
    copy = object.__new__(type(inner))
    copy.__dict__.update({k: v for k, v in inner.__dict__.items()
                          if not k.startswith("_accumkernels")})
    copy.param_groups = [{k: v for k, v in g.items() if k != OWN_KEY}
                         for g in inner.param_groups]
    state = type(inner.state)(dict) if isinstance(inner.state, defaultdict) else {}
    state.update(inner.state)
    copy.state = state
    return copy


live_state, set_state, groups_with_own_key = (live.live_state, live.set_state,
                                              live.groups_with_own_key)
