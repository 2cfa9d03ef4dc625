"""The wrapper's checkpoint: each room writes and checks its own piece; loading is atomic.

The state dict is a torch optimizer state dict: ``state`` and ``param_groups`` are the inner
optimizer's (so a native optimizer loads it, and ``torch.distributed.checkpoint`` walks it),
and the wrapper's own parts sit under ``"accumkernels"``: format version, param shapes, master
weights, loss-scale state, non-finite counters, and the window (counts, weights and its fp32
buffers) only when it is not empty. A native optimizer's state dict loads too: the masters are
then taken from the model and the window is empty.

``restore`` first parses every piece (raising ``ValueError`` on anything that does not fit this
wrapper), then loads the inner optimizer with a rollback, and only then writes the rooms: a
state that fails changes nothing. Versions 1 and 2 (everything at the top level, the inner
state under ``"optimizer"``) still load.

Under data parallelism a window is each rank's own until it is reduced across the ranks (DDP's
sync backward, ``process_group``'s step). A state dict taken before that records the rank and
world size that saved it, warns, and loads only there: every rank saving and loading its own
resumes exactly, while rank 0's loaded on another rank (frameworks that save rank 0's only) is
refused, not silently substituted for that rank's window.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import torch
import torch.distributed as dist

from accumkernels.optim.window import Window

VERSION = 3
OWN_KEY = "accumkernels"


def assemble(parts, intake) -> dict:
    """The wrapper's state dict from its rooms' pieces (``intake``: what shows the window)."""
    inner = parts.optimizer.state_dict()
    own = {
        "version": VERSION,
        "param_shapes": [list(p.shape) for p in parts.params],
        "master_weights": parts.masters.state_dict(),
        "loss_scale": parts.scaler.state_dict(),
        **parts.nonfinite.state_dict(),
    }
    window = parts.window
    if not window.empty:
        own["window"] = {**window.state_dict(parts.params),
                         "main_grad": list(window.storage.buffers.values())}
        local = parts.sync.rank_local_window()
        if local is not None:  # only this rank's part of the window: only this rank may load it
            own["window"]["rank"], own["window"]["world"] = local
            warnings.warn(_RANK_LOCAL_SAVED.format(*local), stacklevel=3)
    return {**inner, OWN_KEY: own}


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


def _parse(parts, sd: object) -> dict:
    """The pieces of a v3, v1/v2 or native state dict, checked; and the inner optimizer's."""
    if isinstance(sd, dict) and OWN_KEY in sd:
        own = sd[OWN_KEY]
        if not isinstance(own, dict) or own.get("version") != VERSION:
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
        return {"inner": sd, "native": True}  # a native optimizer's: masters from the model
    else:
        raise ValueError("load_state_dict: neither an optimizer state dict (no 'state' and "
                         "'param_groups') nor an AccumulatingOptimizer checkpoint")
    missing = [k for k in ("master_weights", "found_inf", "loss_scale", "skipped_steps",
                           "skipped_microbatches") if k not in old]
    if missing:
        raise ValueError(f"load_state_dict: the state_dict lacks {missing}")
    shapes = old.get("param_shapes")
    if shapes is not None and [list(s) for s in shapes] != [list(p.shape) for p in parts.params]:
        raise ValueError("load_state_dict: param_shapes does not match this optimizer's params "
                         "(a checkpoint of a different model?)")
    window = old["window"]
    if isinstance(window, dict):
        _check_rank(parts, window)
    return {
        "inner": old["optimizer"],
        "masters": parts.masters.parse(old["master_weights"]),
        "buffers": None if window is None else _parse_buffers(parts, old["main_grad"]),
        "window": None if window is None else Window.parse(window, parts.params),
        "nonfinite": parts.nonfinite.parse(old),
        "scaler": parts.scaler.parse(old["loss_scale"]),
    }


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
    _load_inner(parts.optimizer, parsed["inner"])
    # Nothing below can fail.
    intake.pending = {}
    step.reset_window()
    if parsed.get("native"):
        parts.masters.take_from_model()
    else:
        parts.masters.load(parsed["masters"])
        if parsed["window"] is not None:
            for flat, saved in zip(parts.window.storage.buffers.values(), parsed["buffers"]):
                flat.copy_(saved)
            parts.window.load(parsed["window"])
        parts.nonfinite.load(parsed["nonfinite"])
        parts.scaler.load(parsed["scaler"])
    intake.hide_all()
    intake.expose()


def native_copy(parts) -> torch.optim.Optimizer:
    """A shallow copy of the inner optimizer over the model's params (masters mapped back),
    with no tie to the wrapper: what pickling and ``copy.deepcopy`` carry."""
    inner, masters = parts.optimizer, parts.masters
    model_of = {id(masters.get(p)): p for p in parts.params if masters.get(p) is not None}
    copy = object.__new__(type(inner))
    copy.__dict__.update({k: v for k, v in inner.__dict__.items()
                          if not k.startswith("_accumkernels")})
    copy.param_groups = [{**g, "params": [model_of.get(id(p), p) for p in g["params"]]}
                         for g in inner.param_groups]
    state = type(inner.state)(dict) if isinstance(inner.state, defaultdict) else {}
    for p, value in inner.state.items():
        state[model_of.get(id(p), p)] = value
    copy.state = state
    return copy
