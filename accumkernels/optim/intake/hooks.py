"""The hooks the intake (accumkernels.optim.intake.intake) puts on each managed param: a tensor pre-hook
(the incoming gradient: hide the view), the post-accumulate-grad hook (take the gradient out of
``.grad``), a front post-accumulate hook where the user's own post-accumulate hooks are (before
wrapping or after: :class:`HookOrder`; accumkernels.optim.intake.user_hooks), and on params
outside the window a hook that only marks the backward as a micro-batch. Each holds the intake
weakly.

The pre and post hooks are the extension's C callables where it has them (``C_HOOKS``;
``csrc/grad_hooks.cpp``): they do the common case themselves and call ``Intake.before_grad``
/ ``Intake.after_grad`` for the rest; the Python closures below call those methods always.
Both kinds give the same results (tests/optim/intake/test_host_paths.py runs each)."""

from __future__ import annotations

import weakref

import torch

from accumkernels._torch_private import (
    hook_registrations,
    post_accumulate_hook_ends,
    run_post_accumulate_hook_first,
)
from accumkernels._util import LOW_PRECISION
from accumkernels.optim.intake.compiled import eager
from accumkernels.ops.host import grad_hook_types

HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")
# The pre and post hooks as C callables (csrc/grad_hooks.cpp) where the extension has them: the
# same common case, without a Python frame per param; they call Intake.before_grad/after_grad
# for the rest. (None: the Python closures below; tests switch between the two.)
C_HOOKS = grad_hook_types()


class HookOrder:
    """The intake's hooks on its params (the handles) and where its post-accumulate hooks sit
    among the user's. A param with post-accumulate hooks of the user's, registered before the
    wrapper or after it, runs the front hook first (it moves the param's gradient alone and
    shows the running window: accumkernels.optim.intake.user_hooks) and the intake's Python
    post hook last, so the user's see native's ``p.grad`` and their writes count. The order
    is read again at each backward's begin (:meth:`look`) when a hook was registered anywhere
    since the last read; else that costs one int compare."""

    def __init__(self, intake, params: list[torch.Tensor], outside):
        self.me, self.params = weakref.ref(intake), params
        self.handles: list = []
        self.post: list = []  # per param: the handle of the intake's post hook
        self.front: dict[int, object] = {}  # param index -> the front hook's handle
        for i, p in enumerate(params):
            if HAS_GRAD_DTYPE and p.dtype in LOW_PRECISION:
                p.grad = None
                p.grad_dtype = None  # any dtype may sit in .grad: the fp32 view, or bf16 grads
            if C_HOOKS is not None:
                pre_type, post_type = C_HOOKS
                bucket = intake.moves.bucket_index[i]
                pre = pre_type(self.me, intake.state, i, weakref.ref(p))
                post = post_type(self.me, intake.state, i, intake.masters.get(p), bucket,
                                 intake.moves.bucket_len[bucket])
            else:
                pre, post = _calling(self.me, "before_grad", i), _calling(self.me, "after_grad", i)
            self.handles.append(p.register_hook(pre))
            self.post.append(p.register_post_accumulate_grad_hook(post))
            self.handles.append(self.post[i])
        for p in outside:  # params outside the window (float64, frozen): their backwards count
            self.handles.append(p.register_post_accumulate_grad_hook(_outside_hook(self.me)))
        self.mark = None
        self.look()

    def look(self) -> None:
        """Put the front hook first and the intake's post hook last on each param whose
        post-accumulate hooks are not so (the user registered one since)."""
        mark = hook_registrations()
        if mark == self.mark or not self.handles:
            return
        for i, p in enumerate(self.params):
            count, first, last = post_accumulate_hook_ends(p)
            front = self.front.get(i)
            if count > 1 and (last != self.post[i].id or front is None or first != front.id):
                self._arrange(i, p)
        self.mark = hook_registrations()

    def _arrange(self, i: int, p: torch.Tensor) -> None:
        # (with the user's hooks the post hook is the Python one: front_grad's early moves are
        # its to count, after theirs)
        if i not in self.front:
            self.front[i] = p.register_post_accumulate_grad_hook(_front_hook(self.me, i))
            self.handles.append(self.front[i])
        run_post_accumulate_hook_first(p, self.front[i])
        old = self.post[i]
        old.remove()
        self.handles[:] = [h for h in self.handles if h is not old]
        self.post[i] = p.register_post_accumulate_grad_hook(_calling(self.me, "after_grad", i))
        self.handles.append(self.post[i])


# (under compiled autograd Dynamo would trace the Python hooks: they run eagerly, a graph break
# each, as the C ones do, which it cannot trace; accumkernels.optim.intake.compiled)
def _calling(intake_ref, method: str, i: int):
    """The Python pre or post hook: ``intake.<method>(i, grad or param)``."""
    @eager
    def hook(arg):
        intake = intake_ref()
        if intake is not None:
            getattr(intake, method)(i, arg)
    return hook


def _outside_hook(intake_ref):
    @eager
    def hook(param):
        intake = intake_ref()
        if intake is not None and param.requires_grad:  # (frozen since the forward: nothing)
            intake.arrived()
    return hook


def _front_hook(intake_ref, i: int):
    @eager
    def hook(param):
        intake = intake_ref()
        if intake is not None:
            intake.front.front_grad(i)
    return hook
