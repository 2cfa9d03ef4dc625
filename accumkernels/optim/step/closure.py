"""The step of an inner optimizer that requires a closure (LBFGS): each evaluation of the closure
fills, normalises, checks and clips a window as a window at ``step()`` is (accumkernels.optim.step.step),
and a non-finite evaluation puts everything back as it was."""

from __future__ import annotations

import torch

from accumkernels.optim import protocol


class _NonFinite(Exception):
    """A closure evaluation's window is not finite: the closure step is abandoned."""


def _snapshot(optimizer: torch.optim.Optimizer) -> tuple:
    """What a closure step may change: the params the inner optimizer holds now (the masters,
    inside ``swapped``) and its state, one level deep (LBFGS keeps lists it appends to and
    tensors it writes in place, such as ``prev_flat_grad``)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    values = [p.detach().clone() for p in params]
    state = {k: {n: v.clone() if torch.is_tensor(v) else list(v) if isinstance(v, list) else v
                 for n, v in entry.items()} for k, entry in optimizer.state.items()}
    return params, values, state


@torch.no_grad()
def _restore(optimizer: torch.optim.Optimizer, saved: tuple) -> None:
    params, values, state = saved
    for p, v in zip(params, values):
        p.copy_(v)
    optimizer.state.clear()
    optimizer.state.update(state)


def closure_step(step, closure):
    """An inner optimizer that requires a closure (LBFGS) evaluates it itself, maybe
    several times: each evaluation runs at the inner optimizer's current point (masters
    copied into the model), fills a fresh window (``take_in()`` takes in and counts what the
    closure's backward left) that is normalised, checked and clipped as a window at
    ``step()`` is (``decide``), and hands it over as ``.grad`` (to the masters, which the
    inner optimizer steps). An evaluation whose gradient is not finite (or that
    ``skip_microbatch`` dropped) ends the step: the params, masters and the inner
    optimizer's state are put back as they were before it, and the non-finite policy
    applies (``skipped_steps``, or ``FloatingPointError`` naming the param)."""
    cast: list[torch.Tensor] = []
    last: list = [None]

    def evaluate():
        step.masters.copy_back()
        step.reset_window()
        with torch.enable_grad():
            last[0] = loss = closure()
        with torch.no_grad():
            step.take_in()
            window = step.window
            if window.micro_steps and not window.kept:  # skip_microbatch dropped it
                raise _NonFinite
            window.zero_untouched(step.params, step.intake.views)
            d = step.decide(None)  # (a closure optimizer is never fused: no fold)
            if d is None:
                raise _NonFinite
            flats = list(window.storage.buffers.values())
            step.scale_grads(flats + d.outside, d.norm, d.factor, False)
            cast[:] = step.hand_grads()
            if cast and not step.nonfinite.all_finite([p.grad for p in cast]):
                raise _NonFinite  # the window overflows the params' dtype
        return loss

    if step.masters.model_params:
        step.masters.resync_changed()  # weights the user wrote since the last step
    bad = False
    with step.masters.swapped():
        saved = _snapshot(step.optimizer)
        try:
            loss = protocol.inner_step(step.optimizer, evaluate)
        except _NonFinite:
            _restore(step.optimizer, saved)
            bad, loss = True, last[0]
    if bad:
        for p in cast:
            p.grad = None
        step.masters.copy_back()
        step.intake.expose()
        if step.window.kept:
            step.nonfinite_window()
        else:
            step.skip()
        return loss
    step.after_inner_step(cast)
    step.reset_window()
    return loss
