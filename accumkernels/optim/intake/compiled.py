"""A backward under compiled autograd (``torch._dynamo.compiled_autograd``): what the intake
(accumkernels.optim.intake.intake) does differently there.

Compiled autograd reads every param's ``.grad`` when the backward starts, before any hook of
it runs, and its AccumulateGrad adds the new gradient into that tensor whatever a hook has
put in ``.grad`` since. So the pre-hook cannot hide a param's fp32 view: where ``.grad`` shows
the view, autograd adds the gradient into the window itself, in fp32, in place (native's
``grad += g``), and the post hook finds it there, already summed. Where ``.grad`` was None,
autograd stores the new gradient and the post hook moves it as usual (fused, scaled). The
final callback the intake queues is never run there but dropped when the backward ends, and
that closes the micro-batch (``Running.queue_end``), before ``backward()`` returns.

Gradients autograd adds into a view are not scaled, so the window's scale must be 1 then:
a 1/N fused for ``reduction="mean"`` is given up (the window is divided once when the N-th
backward is in, as for an N that is not a power of two); what cannot do without a scale or a
look at each gradient before it lands is refused at the backward's first hook, before any
gradient of it landed (:func:`refusal`). The hooks run eagerly (``torch.compiler.disable``),
so Dynamo graph-breaks around them; with ``fullgraph=True`` it cannot, and it raises before
the backward runs.
"""

from __future__ import annotations

import torch

from accumkernels._torch_private import compiled_autograd_on
from accumkernels._util import LOW_PRECISION, warn_user

__all__ = ["after_grad", "begins", "eager", "hide_low_precision", "prepare", "refusal"]

# What the hooks (and what they call) are wrapped in: Dynamo runs them eagerly, a graph break
# each; under fullgraph=True it raises with this reason.
eager = torch.compiler.disable(
    reason="AccumulatingOptimizer's gradient hooks run eagerly under compiled autograd: "
           "compile the backward with fullgraph=False")
_REFUSED = ("AccumulatingOptimizer: this backward runs under compiled autograd, which adds "
            "each gradient into the fp32 window as it finds it in .grad, unscaled and "
            "unchecked, so {what} cannot apply. Nothing of this backward was taken in and the "
            "window is as it was. {remedy}")


def begins(intake) -> bool:
    """Whether the backward that begins runs under compiled autograd; raises (before any of
    its gradients landed: this is its first hook) where the intake's options cannot meet it."""
    if not compiled_autograd_on():
        return False
    refused = refusal(intake)
    if refused is not None:
        raise RuntimeError(refused)
    return True


def refusal(intake) -> str | None:
    """Why the intake's options cannot meet compiled autograd (None: they can)."""
    if intake.scaler.scale != 1.0:
        what, remedy = f"loss_scale (now {intake.scaler.scale:g})", (
            "Train without loss_scale (bf16 needs none), or run backward() outside "
            "compiled autograd")
    elif intake.check_each_microbatch:
        what, remedy = 'nonfinite="skip_microbatch"', (
            'Use nonfinite="skip_step" (or "raise"), or run backward() outside compiled '
            'autograd')
    elif intake.sync.active or intake.sync.ddp_possible():
        what, remedy = "a multi-rank window (DDP, process_group)", (
            "Run backward() outside compiled autograd in a multi-rank job")
    else:
        return None
    return _REFUSED.format(what=what, remedy=remedy)


def prepare(intake) -> None:
    """At the backward's begin, before any gradient of it lands: the window's scale is 1, an
    ``.grad`` the user assigned is what p's gradient means from now on, and bf16/fp16 params
    no longer show their fp32 view in ``.grad`` (:func:`hide_low_precision`)."""
    if not intake.run.met_compiled and any(p.dtype in LOW_PRECISION for p in intake.params):
        warn_user("compiled autograd: the bf16/fp16 params' window is in p.main_grad, not "
                  "in p.grad (compiled autograd cannot capture a param whose .grad has another "
                  "dtype), so model.zero_grad() and p.grad = None cannot clear it: clear with "
                  "opt.zero_grad() (docs/troubleshooting.md, compiled autograd)")
    intake.run.met_compiled = True
    hide_low_precision(intake)
    window = intake.window
    window.settle_carry()  # (the carried gradients' scale, before autograd adds to them)
    window.unfuse_mean()
    if not intake.move_in_backward:
        return  # (a .grad that is not the view: unmoved gradients, autograd adds to them)
    held = window.held(intake.params)
    for i, (p, view) in enumerate(zip(intake.params, intake.views)):
        g = p.grad
        if held[i] and g is not None and g is not view:  # autograd adds into the assigned
            held[i] = False  # tensor; the post hook moves that sum: it replaces the window's
    window.keep_only(intake.params, held)


def after_grad(intake, i: int, p, g) -> None:
    """The post hook's part under compiled autograd (``g``: what ``p.grad`` holds, not None):
    autograd added the gradient into the view it found in ``.grad`` (summed in the window:
    nothing to move), or it stored it in an empty ``.grad``: moved now, alone (a hook of the
    user's that compiled autograd captured after ours then sees it in the window)."""
    intake.hidden.discard(i)
    if g is intake.views[i]:
        return
    if intake.run.show_now:
        intake.display.show(i, p)
    else:
        p.grad = None
    intake.launch_held(intake.moves.bucket_index[i], {i: g})


def hide_low_precision(intake) -> None:
    """Once a backward ran under compiled autograd, bf16/fp16 params show no fp32 view in
    ``.grad`` between backwards (it stays in ``p.main_grad``), as on a torch without
    ``grad_dtype``: compiled autograd cannot capture a backward whose param holds a gradient of
    another dtype (its fake copy of the param takes no ``grad_dtype``), so the next one would
    fail in torch before it ran."""
    if not intake.run.met_compiled:
        return
    for i, p in enumerate(intake.params):
        if p.dtype in LOW_PRECISION:
            intake.showable[i] = None
