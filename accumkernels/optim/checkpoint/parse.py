"""Parsing a state dict for ``checkpoint.restore``: formats 4, 3, 1/2 and a native optimizer's,
each piece checked against this wrapper (``ValueError`` naming what does not fit) before anything
is loaded. See checkpoint.py for the format."""

from __future__ import annotations

import hashlib
import json
from itertools import chain

import torch
import torch.distributed as dist

from accumkernels.optim.checkpoint.live_state import LIVE, MASTER_KEY, OWN_KEY, WINDOW_KEY
from accumkernels.optim.window import parse_window

VERSION = 4  # OWN_KEY: per group (format 4); the top-level key of format 3


def shapes_digest(params: list) -> str:
    """The managed params' shapes, in order, as a short digest (checked at load)."""
    text = json.dumps([list(p.shape) for p in params])
    return hashlib.sha1(text.encode(), usedforsecurity=False).hexdigest()[:16]


def _check_rank(parts, window: dict) -> None:
    """A rank-local window loads only on the rank (and world size) that saved it, and only if
    every rank loads its own: the ranks agree (one small all-reduce, made only for such a
    checkpoint), and where one refuses every rank refuses, so none trains on into a collective
    the others never reach. (``torch.distributed.checkpoint`` writes each key once, from one
    rank: rank 0's bookkeeping with a window mixed from several ranks' reaches every rank.)"""
    if "rank" not in window:
        return
    saved = (window["rank"], window["world"])
    here = parts.sync.rank_local_window()
    here = here if here is not None else ((dist.get_rank(), dist.get_world_size())
                                          if dist.is_available() and dist.is_initialized()
                                          else (0, 1))
    mine = tuple(saved) != tuple(here)
    if parts.sync.any_rank(mine, "load_state_dict() of a mid-window checkpoint") and not mine:
        raise ValueError(
            f"load_state_dict: this checkpoint was taken in the middle of a window, when each "
            f"rank's window was its own (not yet reduced across the ranks), and another rank "
            f"cannot resume its part from it (a checkpoint saved by one rank, or through "
            f"torch.distributed.checkpoint, which writes each key from one rank only). Rank "
            f"{here[0]} refuses it too, so that the ranks stay in step; nothing was loaded. "
            "Each rank must save and load its own opt.state_dict() (torch.save), or "
            "checkpoint at a window boundary, after step()")
    if mine:
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
    """Format 4 in the form of the older formats' pieces (checked in ``parse``)."""
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


def parse(parts, sd: object) -> dict:
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
            or old.get("shapes", shapes_digest(parts.params)) != shapes_digest(parts.params):
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
        "window": None if window is None else parse_window(window, parts.params),
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
