"""The wrapper's checkpoint: each room writes and checks its own piece; loading is atomic.

``restore`` first parses every piece (raising ``ValueError`` on anything that does not fit this
wrapper), then loads the inner optimizer with a rollback, and only then writes the rooms: a
state that fails changes nothing. Format version 2 adds ``version`` and ``param_shapes``;
version-1 checkpoints (no ``version`` key) still load.
"""

from __future__ import annotations

import torch

from accumkernels.optim.window import Window

VERSION = 2
_REQUIRED = ("optimizer", "master_weights", "main_grad", "window", "found_inf", "loss_scale",
             "skipped_steps", "skipped_microbatches")


def assemble(opt) -> dict:
    return {
        "version": VERSION,
        "optimizer": opt.optimizer.state_dict(),
        "param_shapes": [list(p.shape) for p in opt._params],
        "master_weights": opt._masters.state_dict(),
        "main_grad": list(opt._buffer.buffers.values()),
        "window": opt._window.state_dict(opt._params),
        "loss_scale": opt._scaler.state_dict(),
        **opt._nonfinite.state_dict(),
    }


def _parse_buffers(opt, saved: object) -> list[torch.Tensor]:
    mine = list(opt._buffer.buffers.values())
    if not isinstance(saved, (list, tuple)) or len(saved) != len(mine) or any(
            not isinstance(t, torch.Tensor) or t.shape != m.shape for t, m in zip(saved, mine)):
        raise ValueError("load_state_dict: main_grad does not match this optimizer's params")
    return [t.detach().clone() for t in saved]


def _parse(opt, sd: object) -> dict:
    if not isinstance(sd, dict) or any(k not in sd for k in ("optimizer", "master_weights",
                                                             "main_grad", "window")):
        raise ValueError(
            "load_state_dict: not an AccumulatingOptimizer state_dict; to load the inner "
            "optimizer's own state use opt.optimizer.load_state_dict() before wrapping it")
    version = sd.get("version", 1)
    if version not in (1, VERSION):
        raise ValueError(f"load_state_dict: checkpoint format version {version!r} is not "
                         f"supported (this accumkernels writes version {VERSION})")
    missing = [k for k in _REQUIRED if k not in sd]
    if missing:
        raise ValueError(f"load_state_dict: the state_dict lacks {missing}")
    shapes = sd.get("param_shapes")
    if shapes is not None and [list(s) for s in shapes] != [list(p.shape) for p in opt._params]:
        raise ValueError("load_state_dict: param_shapes does not match this optimizer's params "
                         "(a checkpoint of a different model?)")
    return {
        "masters": opt._masters.parse(sd["master_weights"]),
        "buffers": _parse_buffers(opt, sd["main_grad"]),
        "window": Window.parse(sd["window"], opt._params),
        "nonfinite": opt._nonfinite.parse(sd),
        "scaler": opt._scaler.parse(sd["loss_scale"]),
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
def restore(opt, sd: dict) -> None:
    opt._intake.settle()
    parsed = _parse(opt, sd)
    _load_inner(opt.optimizer, sd["optimizer"])
    # Nothing below can fail.
    opt._masters.load(parsed["masters"])
    for flat, saved in zip(opt._buffer.buffers.values(), parsed["buffers"]):
        flat.copy_(saved)
    opt._intake.pending = {}
    opt._dp.reset()
    opt._window.load(parsed["window"])
    opt._nonfinite.load(parsed["nonfinite"])
    opt._scaler.load(parsed["scaler"])
    opt._intake.hide_all()
    opt._intake.expose()
