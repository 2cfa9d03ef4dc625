"""The hooks the intake (accumkernels.optim.intake.intake) puts on each managed param: a tensor pre-hook
(the incoming gradient: hide the view), the post-accumulate-grad hook (take the gradient out of
``.grad``), a front post-accumulate hook where the user's own hooks were registered before
wrapping (accumkernels.optim.intake.user_hooks), and on params outside the window a hook that only
marks the backward as a micro-batch. Each holds the intake weakly.

The pre and post hooks are the extension's C callables where it has them (``C_HOOKS``;
``csrc/grad_hooks.cpp``): they do the common case themselves and call ``Intake.before_grad``
/ ``Intake.after_grad`` for the rest; the Python closures below call those methods always.
Both kinds give the same results (tests/optim/intake/test_host_paths.py runs each)."""

from __future__ import annotations

import weakref

import torch

from accumkernels._torch_private import has_post_accumulate_hooks, run_post_accumulate_hook_first
from accumkernels._util import LOW_PRECISION
from accumkernels.ops.host import grad_hook_types

HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")
# The pre and post hooks as C callables (csrc/grad_hooks.cpp) where the extension has them: the
# same common case, without a Python frame per param; they call Intake.before_grad/after_grad
# for the rest. (None: the Python closures below; tests switch between the two.)
C_HOOKS = grad_hook_types()


def install_hooks(intake, params: list[torch.Tensor], outside) -> list:
    """Hook ``params`` (and ``outside``) up to ``intake``; the handles."""
    handles: list = []
    me = weakref.ref(intake)
    for i, p in enumerate(params):
        if HAS_GRAD_DTYPE and p.dtype in LOW_PRECISION:
            p.grad = None
            p.grad_dtype = None  # any dtype may sit in .grad: the fp32 view, or bf16 grads
        user_hooks = has_post_accumulate_hooks(p)  # registered before wrapping
        if C_HOOKS is not None:
            pre_type, post_type = C_HOOKS
            bucket = intake.moves.bucket_index[i]
            pre = pre_type(me, intake.state, i, weakref.ref(p))
            # (with the user's hooks the Python one: front_grad's early moves are its to count)
            post = _calling(me, "after_grad", i) if user_hooks else post_type(
                me, intake.state, i, intake.masters.get(p), bucket,
                intake.moves.bucket_len[bucket])
        else:
            pre, post = _calling(me, "before_grad", i), _calling(me, "after_grad", i)
        handles.append(p.register_hook(pre))
        if user_hooks:
            front = p.register_post_accumulate_grad_hook(_front_hook(me, i))
            run_post_accumulate_hook_first(p, front)
            handles.append(front)
        handles.append(p.register_post_accumulate_grad_hook(post))
    for p in outside:  # params outside the window (float64, frozen): their backwards count
        handles.append(p.register_post_accumulate_grad_hook(_outside_hook(me)))
    return handles


def _calling(intake_ref, method: str, i: int):
    """The Python pre or post hook: ``intake.<method>(i, grad or param)``."""
    def hook(arg):
        intake = intake_ref()
        if intake is not None:
            getattr(intake, method)(i, arg)
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
