"""The wrapper's checkpoint: each room writes and checks its own piece; loading is atomic.

The state dict is a plain torch optimizer state dict, and the wrapper's own state travels
inside what every checkpoint tool already carries (format 4):

* ``state[i]``: the inner optimizer's state of param ``i`` (keyed like the model's params, so
  ``torch.distributed.checkpoint`` maps it to the parameter names, flattens, reshards and
  offloads it; for a param without any yet, the state a fresh optimizer is loaded with: an
  lr=0 step's with ``step`` 0, listed in the bookkeeping's ``"fresh"`` and not loaded back into
  the wrapper's inner optimizer; a native optimizer takes it as a fresh one), plus
  ``"accumkernels_master"`` (the fp32 master of a bf16/fp16 param, with any weight the user
  wrote since the last step taken in) and, in the middle of a window only,
  ``"accumkernels_window"`` (the param's fp32 window, or its FSDP2 shard). At a window boundary
  the state dict holds what a native optimizer's holds plus the masters and one string. A tool
  loading into a state dict as a template (``dcp.load``) reads only the keys the template has:
  a template built at a boundary cannot receive a mid-window checkpoint's window, and loading
  the result is refused (ValueError naming the recipe); one built inside
  :func:`showing_window` (``opt.window_template()``) holds every window (zeros) and can;
* ``param_groups[g]["accumkernels"]``: the bookkeeping (format version, param shapes, window
  counts and weights, loss-scale state, non-finite counters) as one JSON string, the same in
  every group (one opaque leaf, so a tool that loads into a template matches its keys).

The live optimizer shows the same keys (``opt.state[p]``, ``opt.param_groups``:
live_state.py), so a tool that rebuilds the loaded state dict from the keys the loading optimizer
has finds them all. Carried, mid-window included, bit-identical to not stopping (tests in
tests/optim/checkpoint/test_checkpoint_dcp.py, tests/integrations/test_checkpoint_size.py and
tests/distributed/): ``torch.save`` (weights_only); ``get_state_dict``/``set_state_dict`` with
the default options, ``full_state_dict``, ``cpu_offload``, ``flatten_optimizer_state_dict`` and
their combinations; ``dcp.save``/``dcp.load`` into a template (flattened or not; under FSDP2
resharded to another world size). One combination is torch's own limit: ``set_state_dict`` with
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
wrapper, a master holding NaN/inf included), then loads the inner optimizer with a rollback
(re-keyed to the model's params on the way out, loaded or rolled back), and only then writes the
rooms: a state that fails changes nothing. Masters that a wrapper built with
``master_weights=False`` has no place for are dropped with a warning naming them. Format 3
(the wrapper's parts under a top-level ``"accumkernels"`` key) and formats 1 and 2 (everything
at the top level, the inner state under ``"optimizer"``) still load.

Under data parallelism a window is each rank's own until it is reduced across the ranks (DDP's
sync backward, ``process_group``'s step). A state dict taken before that records the rank and
world size that saved it, warns, and loads only there: every rank saving and loading its own
resumes exactly, while rank 0's loaded on another rank (frameworks that save rank 0's only, or
``torch.distributed.checkpoint``, which writes each key from one rank) is refused, not silently
substituted for that rank's window -- on every rank alike (the ranks agree in one small
all-reduce, made only for such a checkpoint), so no rank trains on alone. With ``process_group`` and N given,
the window's last backward sums its buckets across the ranks: a state dict taken after it names
those buckets (``window["summed"]``), and the resumed wrapper does not sum them again; only a
wrapper reducing over the same ranks loads it.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from collections import defaultdict
from itertools import chain

import torch

from accumkernels.optim.checkpoint import live_state as live
from accumkernels.optim.checkpoint.parse import VERSION, parse, shapes_digest
from accumkernels.optim.checkpoint.live_state import MASTER_KEY, OWN_KEY, WINDOW_KEY

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
        "shapes": shapes_digest(parts.params),  # (fixed size: DCP's flattening repeats it
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
    if not window.empty or parts.show_window:
        for p, view in zip(parts.params, intake.views):  # a copy: a tool loading into this
            extra.setdefault(id(p), {})[WINDOW_KEY] = (  # dict as a template writes it before
                view.detach().clone() if not window.empty  # load_state_dict, while DCP's state
                else torch.zeros_like(view))  # init may still run a backward-less step
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
    before, parts.show_window = parts.show_window, True
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
    parsed = parse(parts, sd)
    with parts.masters.swapped():  # the inner state of bf16/fp16 params is the masters' (fp32)
        _load_inner(parts.optimizer, parsed["inner"])
    # Nothing below can fail.
    intake.pending.clear()
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
