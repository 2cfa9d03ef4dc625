"""FSDP2 checkpoints through ``torch.distributed.checkpoint``.

The wrapper's state dict is the core's (format 4, checkpoint.py: the inner optimizer's ``state``
and ``param_groups``, each param's window and the bookkeeping inside them) with three FSDP2
changes:

* each param's window is its DTensor shard (same mesh and placements as the param), so DCP
  saves each rank's shard and, loading into a wrapper of another world size, reshards it like
  the params and the inner optimizer's state;
* the bookkeeping that differs between ranks is saved in its agreed form (found_inf: the OR
  of every rank's; ``add_weight`` total: every rank's share of the world total), so the
  replicated copy DCP keeps is right for every rank of any world size;
* a param whose inner optimizer has no state yet is saved with the state a fresh optimizer is
  loaded with (the core's template: an lr=0 step on copies, ``step`` 0, listed as ``"fresh"``),
  so ``opt.state_dict()`` of a fresh wrapper is a complete template for ``dcp.load``. The
  inner optimizer itself is never stepped to make it: AdamW's step count (its bias correction)
  would then be one ahead in the run that saved and in the one that resumes.

Recipes, mid-window included: torchtitan's (``get_state_dict(model, opt, options=...)``, any
options, ``flatten_optimizer_state_dict=True`` included; ``dcp.save``; to resume, build the model
and wrapper, ``get_state_dict`` again as the template, ``dcp.load`` into it, ``set_state_dict``),
or ``dcp.save({"model": model.state_dict(), "optim": opt.state_dict()})`` and, to resume,
``dcp.load`` into ``{"model": model.state_dict(), "optim": opt.state_dict()}`` of the new ones,
then ``model.load_state_dict`` and ``opt.load_state_dict``. Both reshard to another world size
(tests/distributed/test_fsdp2.py, test_fsdp2_checkpoint.py).
"""

from __future__ import annotations

import torch

from accumkernels.optim.checkpoint import assemble as checkpoint


@torch.no_grad()
def init_inner_state(optimizer: torch.optim.Optimizer) -> None:
    """Create a native torch optimizer's lazy state (lr=0 step on zero grads; grads kept as they
    were), as DCP's ``get_optimizer_state_dict`` does: for a native template, never the
    wrapper's inner optimizer (it would count a step)."""
    if optimizer.state:
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optimizer.param_groups]
    for p in params:
        p.grad = torch.zeros_like(p)
    for g in optimizer.param_groups:
        if "lr" in g:
            g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                g["lr"] = lr
        for p, g in zip(params, grads):
            p.grad = g


OWN_KEY = checkpoint.OWN_KEY
native_copy = checkpoint.native_copy
showing_window = checkpoint.showing_window
live_state, set_state, groups_with_own_key = (checkpoint.live_state, checkpoint.set_state,
                                              checkpoint.groups_with_own_key)


def assemble(parts, intake) -> dict:
    """The wrapper's state dict (format 4: the window per param, as the DTensor shards
    ``intake.views``), its bookkeeping in agreed form. Collective: every rank calls it."""
    weights = parts.window.weights

    def agree(own: dict) -> None:
        found, weight = parts.sync.agree_for_checkpoint(parts.nonfinite.found_inf,
                                                        parts.window.local_weight())
        own["found_inf"] = float(found.item())
        if "window" in own and weights:
            own["window"]["weights"], own["window"]["dropped"] = [weight / parts.sync.world], []

    return checkpoint.assemble(parts, intake, agree)


def _flats(storage, saved: object) -> list[torch.Tensor]:
    """Window shards (DTensors, or local tensors) laid out as this wrapper's flat buffers."""
    views = storage.views
    if not isinstance(saved, (list, tuple)) or len(saved) != len(views):
        raise ValueError("load_state_dict: the saved window does not match this optimizer's "
                         "params")
    flats = {dev: torch.zeros_like(flat) for dev, flat in storage.buffers.items()}
    for i, (t, view) in enumerate(zip(saved, views)):
        local = t.to_local() if hasattr(t, "to_local") else t
        if not isinstance(local, torch.Tensor) or local.shape != view.shape:
            raise ValueError(
                f"load_state_dict: window shard {i} has shape "
                f"{tuple(getattr(local, 'shape', ()))}, this rank's is {tuple(view.shape)} (saved "
                "at another world size: load it with torch.distributed.checkpoint into this "
                "wrapper's state_dict(), which reshards it)")
        flat = flats[view.device]
        start = view.storage_offset() - storage.buffers[view.device].storage_offset()
        flat[start:start + view.numel()].copy_(local.reshape(-1))
    return list(flats.values())


@torch.no_grad()
def restore(parts, intake, step, sd: object) -> None:
    """Load a state dict written by :func:`assemble` (or any the core accepts)."""
    own = sd.get(checkpoint.OWN_KEY) if isinstance(sd, dict) else None
    window = own.get("window") if isinstance(own, dict) else None
    if isinstance(window, dict) and "main_grad" in window:
        flats = _flats(parts.window.storage, window["main_grad"])
        sd = {**sd, checkpoint.OWN_KEY: {**own, "window": {**window, "main_grad": flats}}}
    checkpoint.restore(parts, intake, step, sd)
