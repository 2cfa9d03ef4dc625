"""The hooks the intake (accumkernels.optim.intake) puts on each managed param: a tensor pre-hook
(the incoming gradient: hide the view), the post-accumulate-grad hook (take the gradient out of
``.grad``), a front post-accumulate hook where the user's own hooks were registered before
wrapping (accumkernels.optim.user_hooks), and on params outside the window a hook that only
marks the backward as a micro-batch. Each holds the intake weakly."""

from __future__ import annotations

import weakref

import torch

from accumkernels._torch_private import (
    has_post_accumulate_hooks,
    run_post_accumulate_hook_first,
)
from accumkernels._util import LOW_PRECISION

HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def install_hooks(intake, params: list[torch.Tensor], outside) -> list:
    """Hook ``params`` (and ``outside``) up to ``intake``; the handles."""
    handles: list = []
    me = weakref.ref(intake)
    for i, p in enumerate(params):
        if HAS_GRAD_DTYPE and p.dtype in LOW_PRECISION:
            p.grad = None
            p.grad_dtype = None  # any dtype may sit in .grad: the fp32 view, or bf16 grads
        user_hooks = has_post_accumulate_hooks(p)  # registered before wrapping
        handles.append(p.register_hook(_pre_hook(me, i)))
        if user_hooks:
            front = p.register_post_accumulate_grad_hook(_front_hook(me, i))
            run_post_accumulate_hook_first(p, front)
            handles.append(front)
        handles.append(p.register_post_accumulate_grad_hook(_post_hook(me, i)))
    for p in outside:  # params outside the window (float64, frozen): their backwards count
        handles.append(p.register_post_accumulate_grad_hook(_outside_hook(me)))
    return handles


def _pre_hook(intake_ref, i: int):
    def hook(grad):
        intake = intake_ref()
        if intake is not None:
            intake.before_grad(i, grad)
    return hook


def _outside_hook(intake_ref):
    def hook(param):
        intake = intake_ref()
        if intake is not None and param.requires_grad:  # (frozen since the forward: nothing)
            intake.arrived()
    return hook


def _front_hook(intake_ref, i: int):
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.front.front_grad(i)
    return hook


def _post_hook(intake_ref, i: int):
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.after_grad(i)
    return hook
