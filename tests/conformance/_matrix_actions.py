"""The ``loop`` and ``hooks`` axes of the conformance matrix (_matrix_axes.LOOPS, HOOKS): what a
training loop does to the model and the optimizer, and the hooks a user registers, done alike on
the wrapper's side (_matrix_loop) and the judge's (_matrix_oracle). Plain torch only."""

from __future__ import annotations

import functools

import torch


def last_layer(model) -> list:
    """The params of the model's last child with params (add_param_group's layer)."""
    mods = [m for m in model.children() if any(True for _ in m.parameters(recurse=False))]
    return list(mods[-1].parameters())


def first_layer(model) -> list:
    """The params of the model's first child with params (the layer loop=freeze-* freezes)."""
    mods = [m for m in model.children() if any(True for _ in m.parameters(recurse=False))]
    return list(mods[0].parameters())


def initial_params(ctx, model) -> list:
    """The params the optimizer is built on: all, or (add_param_group-*) all but the last
    layer's, which is frozen until it is added."""
    if not ctx.loop.startswith("add_param_group"):
        return list(model.parameters())
    withheld = {id(p) for p in last_layer(model)}
    for p in last_layer(model):
        p.requires_grad_(False)
    return [p for p in model.parameters() if id(p) not in withheld]


def shrink(params) -> None:
    """A projection a step hook applies: every param scaled by 0.99, in place."""
    with torch.no_grad():
        for p in params:
            p.mul_(0.99)


def install_model_hooks(ctx, model) -> None:
    """hooks=tensor-hook / module-hook on a model (once per model)."""
    if ctx.hooks not in ("tensor-hook", "module-hook") or getattr(model, "_matrix_hooked", 0):
        return
    model._matrix_hooked = True
    if ctx.hooks == "tensor-hook":
        next(model.parameters()).register_hook(lambda g: g * 0.5)
    else:
        model.register_full_backward_pre_hook(lambda m, go: tuple(
            None if g is None else g * 0.5 for g in go))


class MatrixRaise(RuntimeError):
    """grads=raise: the exception a backward raises half-way (the loop catches it)."""


def hooked_param(model):
    """The param the after-wrapping hooks (and grads=raise) sit on: the first trainable one
    when first asked (its AccumulateGrad runs late in the backward: others have theirs)."""
    if "_matrix_p0" not in model.__dict__:  # (not a registered param of the model's)
        model.__dict__["_matrix_p0"] = next(p for p in model.parameters() if p.requires_grad)
    return model.__dict__["_matrix_p0"]


def install_after_hooks(ctx, model, native: bool) -> None:
    """What the loop registers after wrapping (once per model): hooks=tensor-hook-after /
    post-hook-after, and grads=raise's raising hook (armed by :func:`raising_backward`). The
    native side runs post-accumulate hooks in the oracle (autograd.grad runs none)."""
    p0 = hooked_param(model)
    if model.__dict__.get("_matrix_after") == id(p0):  # (a deep copy of the model has none)
        return
    model.__dict__["_matrix_after"], model._matrix_armed = id(p0), False
    if ctx.hooks == "tensor-hook-after":
        p0.register_hook(lambda g: g * 0.5)
    elif ctx.hooks == "post-hook-after" and not native:
        def halve(p):
            if p.grad is not None:  # (natively None only before any gradient of the window)
                p.grad.mul_(0.5)
        p0.register_post_accumulate_grad_hook(halve)
    if ctx.grads == "raise":
        def bomb(g):
            if model._matrix_armed:
                raise MatrixRaise("a hook raised half-way through the backward")
            return g
        p0.register_hook(bomb)


def raising_backward(model, loss) -> None:
    """grads=raise: the backward with the raising hook armed; the raise caught, as a loop
    that logs and goes on does."""
    model._matrix_armed = True
    try:
        loss.backward()
    except MatrixRaise:
        pass
    else:
        raise AssertionError("grads=raise: the backward did not raise")
    finally:
        model._matrix_armed = False


def install_inner_hooks(ctx, inner) -> None:
    """hooks=inner-pre-hook / inner-post-hook on an inner (or native) optimizer: its own step
    hooks write its params (with masters, the masters)."""
    def hook(opt, args, kwargs):
        shrink(p for g in opt.param_groups for p in g["params"])

    if ctx.hooks == "inner-pre-hook":
        inner.register_step_pre_hook(hook)
    elif ctx.hooks == "inner-post-hook":
        inner.register_step_post_hook(hook)


class Frozen:
    """loop=freeze-*: the first layer's params frozen for a while (their flags restored)."""

    def __init__(self, model):
        self.params = first_layer(model)
        self.flags = [p.requires_grad for p in self.params]

    def __enter__(self):
        for p in self.params:
            p.requires_grad_(False)
        return self

    def __exit__(self, *exc):
        for p, f in zip(self.params, self.flags):
            p.requires_grad_(f)
        return False


def frozen_micro(ctx, w: int, i: int) -> bool:
    """Is micro-batch (w, i) one the freeze-* loops freeze the first layer in?"""
    return ctx.loop.startswith("freeze") and w >= 1 and i % 2 == 1


def clear(ctx, opt, model) -> None:
    """The loop's clear after a step() call, the case's way."""
    keep = ctx.hands == "zero_grad-keep"
    if ctx.loop in ("model-zero_grad", "model-zero_grad-every"):
        model.zero_grad(set_to_none=not keep)
    elif ctx.loop == "grad-none":
        for p in model.parameters():
            p.grad = None
    elif ctx.loop != "no-zero_grad":
        opt.zero_grad(set_to_none=not keep)


@functools.cache
def native_steps_after_add_param_group(cls_name: str) -> bool:
    """Whether the installed torch's own optimizer steps a group added by add_param_group
    (torch 2.11's Adagrad makes its state in __init__ only: KeyError 'sum' natively)."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = getattr(torch.optim, cls_name)([a], lr=0.1)
    opt.add_param_group({"params": [b]})
    (a.sum() + b.sum()).backward()
    try:
        opt.step()
    except KeyError:
        return False
    return True
