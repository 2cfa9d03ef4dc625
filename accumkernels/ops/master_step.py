"""The fused master step: ``master_adam_step_`` and ``master_sgd_step_``.

A bf16/fp16 model trained with fp32 master weights usually steps in three passes: a re-sync that
takes in the weights the user wrote, torch's fused optimizer on the masters, and a copy-back of
the rounded masters into the weights. These ops do all of it in one pass per element. For each
tensor i and element, unless ``found_inf`` is given and nonzero (then nothing is written):

1. ``masters[i]`` takes ``weights[i]`` where ``weights[i] != masters[i].to(weights[i].dtype)``
   (NaN differs): a weight written outside the optimizer is taken in exactly;
2. ``g = grads[i] / grad_scale`` in fp32 (stored back into ``grads[i]`` with ``write_grad``, as
   torch's fused kernels do);
3. the master and its state get the update of ``torch.optim.AdamW/Adam/SGD(fused=True)`` on an
   fp32 param, bit for bit as torch's fused kernel on that device computes it;
4. ``weights[i] = masters[i]`` rounded to nearest even (torch's cast, bit for bit).

Adam's ``state_steps`` (fp32 scalar tensors) are incremented before the update and, with
``found_inf``, decremented by it afterwards, as torch's ``_fused_adam`` does.

Backends, per device: ``"cpu"`` (csrc/master_step_cpu.cpp: AVX-512 or AVX2 picked at run time,
a portable fallback, threaded), ``"cuda"`` (csrc/master_step_kernel.h, one launch per weight dtype), ``"triton"``,
``"torch"`` (backends/master_step_ref.py, the readable definition); ``"auto"`` picks the first
available of cpu/cuda, triton, torch. Every stride pattern takes the kernels (layouts.py): tensors
that share a dense layout in memory order, others through exact copies. Every
argument is checked first (TypeError/ValueError naming the offending index; nothing written).
Under torch.compile, FakeTensorMode and functorch the call goes through the custom ops
``torch.ops.accumkernels.master_adam_step_`` / ``master_sgd_step_``, whose schemas declare what
they write.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

import accumkernels.ops.master_step_checks as checks
from accumkernels.ops import layouts
from accumkernels.ops.backends import master_step_cpu
from accumkernels.ops.master_step_backends import (
    KNOWN_BACKENDS,
    BACKENDS,
    backend_fn,
    resolve_backend,
    available_backends,
)

__all__ = ["master_adam_step_", "master_sgd_step_", "available_backends", "BACKENDS"]

_F32 = torch.float32


def master_adam_step_(
    masters: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    max_exp_avg_sqs: Sequence[torch.Tensor] | None,
    state_steps: Sequence[torch.Tensor],
    *,
    lr: float | torch.Tensor,
    beta1: float,
    beta2: float,
    weight_decay: float,
    eps: float,
    amsgrad: bool = False,
    maximize: bool = False,
    adamw: bool = True,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    write_grad: bool = True,
    backend: str = "auto",
) -> None:
    """One fused AdamW (``adamw=True``: decoupled weight decay) or Adam step of fp32 masters and
    their bf16/fp16 weights, bit for bit ``torch.optim.AdamW/Adam(fused=True)`` on the masters
    followed by ``weights[i].copy_(masters[i])``, after taking in user-written weights.

    ``masters``, ``grads``, ``exp_avgs``, ``exp_avg_sqs`` (and ``max_exp_avg_sqs``, required with
    ``amsgrad``, else None): fp32; ``weights``: bf16/fp16 (mixed allowed) of the masters' shapes;
    ``state_steps``: fp32 one-element tensors, incremented (and decremented by ``found_inf``, as
    torch does). ``lr``: a number or a one-element tensor. ``grad_scale``/``found_inf``: None or
    one-element fp32 tensors: the gradients are divided by ``grad_scale`` (stored back with
    ``write_grad``); a nonzero ``found_inf`` writes nothing. The step reads the window, the
    master, the state and the weight and writes master, state and weight once (32 B per element
    for AdamW with bf16 weights, vs 28 B for torch's fused step on fp32 params alone).
    """
    op = "master_adam_step_"
    lists, plain = checks.adam_lists(op, masters, weights, grads, exp_avgs, exp_avg_sqs,
                                     max_exp_avg_sqs, state_steps, amsgrad)
    lr_value, lr_tensor = checks.check_lr(op, lr)
    for name, value, low, high in (("beta1", beta1, 0.0, 1.0), ("beta2", beta2, 0.0, 1.0),
                                   ("weight_decay", weight_decay, 0.0, math.inf),
                                   ("eps", eps, 0.0, math.inf)):
        checks.check_real(op, name, value, low, high)
    for name, value in (("amsgrad", amsgrad), ("maximize", maximize), ("adamw", adamw),
                        ("write_grad", write_grad)):
        checks.check_bool(op, name, value)
    check_call(op, lists[0], grad_scale, found_inf, lr_tensor, backend, plain)
    if not lists[0]:
        return
    args = (*lists, float(lr_value), lr_tensor, float(beta1), float(beta2), float(weight_decay),
            float(eps), amsgrad, maximize, adamw, grad_scale, found_inf, write_grad, backend)
    if _tracing():
        torch.ops.accumkernels.master_adam_step_(*args)
    else:
        _adam_impl(*args, plain=plain)  # (checked just above: nothing ran in between)


def master_sgd_step_(
    masters: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    momentum_buffers: Sequence[torch.Tensor] | None,
    *,
    lr: float | torch.Tensor,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool = False,
    maximize: bool = False,
    is_first_step: bool = False,
    grad_scale: torch.Tensor | None = None,
    found_inf: torch.Tensor | None = None,
    write_grad: bool = True,
    backend: str = "auto",
) -> None:
    """One fused SGD step of fp32 masters and their bf16/fp16 weights, bit for bit
    ``torch.optim.SGD(fused=True)`` on the masters followed by ``weights[i].copy_(masters[i])``,
    after taking in user-written weights.

    ``momentum_buffers``: fp32 tensors, required when ``momentum != 0`` (else None); with
    ``is_first_step`` they are overwritten with the gradient (their content is not read), as in
    torch's first fused SGD step. ``lr``, ``grad_scale``, ``found_inf``, ``write_grad`` as in
    :func:`master_adam_step_`.
    """
    op = "master_sgd_step_"
    checks.check_real(op, "momentum", momentum, 0.0, math.inf)
    lists, plain = checks.sgd_lists(op, masters, weights, grads, momentum_buffers, momentum != 0)
    lr_value, lr_tensor = checks.check_lr(op, lr)
    checks.check_real(op, "dampening", dampening, -math.inf, math.inf)
    checks.check_real(op, "weight_decay", weight_decay, 0.0, math.inf)
    for name, value in (("nesterov", nesterov), ("maximize", maximize),
                        ("is_first_step", is_first_step), ("write_grad", write_grad)):
        checks.check_bool(op, name, value)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov requires a momentum and zero dampening (got momentum="
                         f"{momentum}, dampening={dampening}), as torch.optim.SGD")
    check_call(op, lists[0], grad_scale, found_inf, lr_tensor, backend, plain)
    if not lists[0]:
        return
    args = (*lists, float(lr_value), lr_tensor, float(momentum), float(dampening),
            float(weight_decay), nesterov, maximize, is_first_step, grad_scale, found_inf,
            write_grad, backend)
    if _tracing():
        torch.ops.accumkernels.master_sgd_step_(*args)
    else:
        _sgd_impl(*args, plain=plain)


# -- custom ops (torch.compile, FakeTensorMode, functorch) ----------------------------------------

_ADAM_WRITES = ("masters", "weights", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
                "state_steps")


@torch.library.custom_op("accumkernels::master_adam_step_", mutates_args=_ADAM_WRITES)
def _adam_op(masters: list[torch.Tensor], weights: list[torch.Tensor],
             grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
             exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor],
             state_steps: list[torch.Tensor], lr: float, lr_tensor: torch.Tensor | None,
             beta1: float, beta2: float, weight_decay: float, eps: float, amsgrad: bool,
             maximize: bool, adamw: bool, grad_scale: torch.Tensor | None,
             found_inf: torch.Tensor | None, write_grad: bool, backend: str) -> None:
    _adam_impl(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr,
               lr_tensor, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
               found_inf, write_grad, backend)


@_adam_op.register_fake
def _adam_fake(*args) -> None:
    return None  # checked by the public function; it returns nothing and allocates nothing


@torch.library.custom_op("accumkernels::master_sgd_step_",
                         mutates_args=("masters", "weights", "grads", "momentum_buffers"))
def _sgd_op(masters: list[torch.Tensor], weights: list[torch.Tensor], grads: list[torch.Tensor],
            momentum_buffers: list[torch.Tensor], lr: float, lr_tensor: torch.Tensor | None,
            momentum: float, dampening: float, weight_decay: float, nesterov: bool,
            maximize: bool, is_first_step: bool, grad_scale: torch.Tensor | None,
            found_inf: torch.Tensor | None, write_grad: bool, backend: str) -> None:
    _sgd_impl(masters, weights, grads, momentum_buffers, lr, lr_tensor, momentum, dampening,
              weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf, write_grad,
              backend)


@_sgd_op.register_fake
def _sgd_fake(*args) -> None:
    return None


def _tracing() -> bool:
    return bool(torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._are_functorch_transforms_active())


# -- the step on real tensors ----------------------------------------------------------------------

_ADAM_LISTS = ("masters", "weights", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs",
               "state_steps")
_SGD_LISTS = ("masters", "weights", "grads", "momentum_buffers")


@torch.no_grad()
def _adam_impl(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr,
               lr_tensor, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
               found_inf, write_grad, backend, plain: bool | None = None) -> None:
    """The step on checked lists; ``plain``: checks.lists_plain's verdict on them, if known."""
    op = "master_adam_step_"
    if plain is None:
        named = {"masters": masters, "weights": weights, "grads": grads, "exp_avgs": exp_avgs,
                 "exp_avg_sqs": exp_avg_sqs}
        if amsgrad:
            named["max_exp_avg_sqs"] = max_exp_avg_sqs
        plain = checks.lists_plain(dict(named, state_steps=state_steps))
    if plain:  # as the kernels take them
        rows, back = [masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs], []
    else:
        rows, back = layouts.in_memory_order(
            [masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else []],
            [True, True, write_grad and grad_scale is not None, True, True, True])
    if back:  # copies hide shared memory from the kernels: check the tensors given
        checks.check_no_overlap(op, dict(zip(_ADAM_LISTS, (
            masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps))))
    masters, weights, grads, exp_avgs, exp_avg_sqs = rows[:5]
    max_exp_avg_sqs = rows[5] if amsgrad else max_exp_avg_sqs
    _adam_lists(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr,
                lr_tensor, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
                found_inf, write_grad, backend, plain)
    layouts.write_back(back)


def _adam_lists(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, lr,
                lr_tensor, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
                found_inf, write_grad, backend, plain: bool) -> None:
    """``_adam_impl`` on lists the kernels take as they are (see layouts.py)."""
    op = "master_adam_step_"
    lists = (masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps)
    state = (exp_avgs, exp_avg_sqs) + ((max_exp_avg_sqs,) if amsgrad else ())
    plan = _plan(backend, masters, weights, grads, state, plain)
    if len(plan) > 1:  # several devices or backends: check the whole call before any part runs
        checks.check_no_overlap(op, dict(zip(_ADAM_LISTS, lists)))
    for device, name, part in plan:
        gs, fi = _on(grad_scale, device), _on(found_inf, device)
        sub = [[t[i] for i in part] for t in lists[:5]]
        mx = [max_exp_avg_sqs[i] for i in part] if amsgrad else None
        steps = [state_steps[i] for i in part]
        kw = dict(lr=_lr_for(lr, lr_tensor), beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                  eps=eps, amsgrad=amsgrad, maximize=maximize, adamw=adamw, grad_scale=gs,
                  found_inf=fi, write_grad=write_grad)
        if name == "cpu":  # the native kernel also counts the steps (torch's _fused_adam does)
            _raise_overlap(op, _ADAM_LISTS, part, master_step_cpu.adam(*sub, mx, steps, **kw))
            _bump(sub, (mx or []) + steps, gs is not None and write_grad)
            continue
        if len(plan) == 1:
            checks.check_no_overlap(op, dict(zip(_ADAM_LISTS, lists)))
        torch._foreach_add_(steps, 1)  # torch's _fused_adam: the kernel reads the new steps
        backend_fn(name, "adam")(*sub, mx, steps, **kw)
        if fi is not None:
            torch._foreach_sub_(steps, [fi.reshape(())] * len(steps))


@torch.no_grad()
def _sgd_impl(masters, weights, grads, momentum_buffers, lr, lr_tensor, momentum, dampening,
              weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf, write_grad,
              backend, plain: bool | None = None) -> None:
    """The step on checked lists; ``plain``: checks.lists_plain's verdict on them, if known."""
    op = "master_sgd_step_"
    has_buf = momentum != 0
    if plain is None:
        named = {"masters": masters, "weights": weights, "grads": grads}
        if has_buf:
            named["momentum_buffers"] = momentum_buffers
        plain = checks.lists_plain(named)
    if plain:  # as the kernels take them
        rows, back = [masters, weights, grads, momentum_buffers], []
    else:
        rows, back = layouts.in_memory_order(
            [masters, weights, grads, momentum_buffers if has_buf else []],
            [True, True, write_grad and grad_scale is not None, True])
    if back:  # copies hide shared memory from the kernels: check the tensors given
        checks.check_no_overlap(op, dict(zip(_SGD_LISTS, (masters, weights, grads,
                                                          momentum_buffers))))
    masters, weights, grads = rows[:3]
    momentum_buffers = rows[3] if has_buf else momentum_buffers
    lists = (masters, weights, grads, momentum_buffers)
    plan = _plan(backend, masters, weights, grads, (momentum_buffers,) if has_buf else (), plain)
    if len(plan) > 1 or plan[0][1] != "cpu":
        checks.check_no_overlap(op, dict(zip(_SGD_LISTS, lists)))
    for device, name, part in plan:
        gs, fi = _on(grad_scale, device), _on(found_inf, device)
        sub = [[t[i] for i in part] for t in lists[:3]]
        bufs = [momentum_buffers[i] for i in part] if has_buf else None
        kw = dict(lr=_lr_for(lr, lr_tensor), momentum=momentum, dampening=dampening,
                  weight_decay=weight_decay, nesterov=nesterov, maximize=maximize,
                  is_first_step=is_first_step, grad_scale=gs, found_inf=fi,
                  write_grad=write_grad)
        if name == "cpu":
            _raise_overlap(op, _SGD_LISTS, part, master_step_cpu.sgd(*sub, bufs, **kw))
            _bump(sub, bufs, gs is not None and write_grad)
        else:
            backend_fn(name, "sgd")(*sub, bufs, **kw)
    layouts.write_back(back)


def _plan(backend, masters, weights, grads, state, plain: bool = False
          ) -> list[tuple[torch.device, str, list[int]]]:
    """(device, backend, indices) parts of a call: per device, the plain tensors for the resolved
    backend and the others (a non-contiguous tensor, a weight with the neg bit) for the torch
    reference. ``plain``: every entry is known plain, on one device (checks.lists_plain)."""
    first = masters[0].device
    if plain:
        return [(first, resolve_backend(backend, first), list(range(len(masters))))]
    if all(m.device == first for m in masters):
        groups = {first: range(len(masters))}
    else:
        groups = {}
        for i, m in enumerate(masters):
            groups.setdefault(m.device, []).append(i)
    plan = []
    for device, idx in groups.items():
        name = resolve_backend(backend, device)
        if name == "torch":
            plan.append((device, name, list(idx)))
            continue
        plain, rest = [], []
        for i in idx:
            ok = masters[i].is_contiguous() and weights[i].is_contiguous() \
                and not weights[i].is_neg() and grads[i].is_contiguous() \
                and all(s[i].is_contiguous() for s in state)
            (plain if ok else rest).append(i)
        plan += [(device, n, p) for n, p in ((name, plain), ("torch", rest)) if p]
    return plan


def _raise_overlap(op: str, names: tuple, part: list, hit) -> None:
    """The native kernels report two arrays that share memory (and wrote nothing)."""
    if hit is not None:
        a, i, b, j = hit
        raise ValueError(f"{op}: {names[a]}[{part[i]}] and {names[b]}[{part[j]}] share memory; "
                         "every tensor of the step must have its own")


def _on(t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """A scalar tensor on ``device`` (torch's fused optimizers copy grad_scale/found_inf too)."""
    return t if t is None or t.device == device else t.to(device)


def _lr_for(lr: float, lr_tensor: torch.Tensor | None) -> float | torch.Tensor:
    return lr if lr_tensor is None else lr_tensor


def _bump(sub, extra, grads_written: bool) -> None:
    """Version counters of what the native kernel wrote around autograd."""
    written = [t for ts in sub[:2] + sub[3:] for t in ts] + list(extra or ())
    if grads_written:
        written += sub[2]
    torch._C._increment_version(written)


def check_call(op: str, masters: list, grad_scale, found_inf, lr_tensor, backend,
                one_device: bool = False) -> None:
    """The scalars and the backend; ``one_device``: every master is on ``masters[0]``'s."""
    for name, t in (("grad_scale", grad_scale), ("found_inf", found_inf)):
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor or None, got {type(t).__name__}")
        if t.dtype is not _F32 or t.numel() != 1:
            raise ValueError(f"{op}: {name} must be a one-element float32 tensor, got "
                             f"{t.numel()} elements of {t.dtype}")
    if not isinstance(backend, str):
        raise TypeError(f"{op}: backend must be a string, got {type(backend).__name__}")
    if backend not in KNOWN_BACKENDS:
        raise ValueError(f"{op}: unknown backend {backend!r}; choose from "
                         + ", ".join(repr(b) for b in ("auto", *BACKENDS)))
    for device in {masters[0].device} if one_device and masters else {m.device for m in masters}:
        resolve_backend(backend, device, op)  # raises for an unavailable backend
