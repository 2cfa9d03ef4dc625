"""The judge of the conformance matrix: the case's loop with native PyTorch semantics.

Gradients are summed per param in fp32 in arrival order (for an fp32 model exactly what autograd's
``.grad`` accumulation does: ``old + g``), normalised at the step (``mean``: by the micro-batches
kept, ``weighted``: by their reported weights), clipped like ``clip_grad_norm_``, handed to the
same inner optimizer class and kwargs. Low-precision params with master weights: hand-kept fp32
masters stepped by that optimizer and cast back (a weight the user changed is taken into its
master before the next step); without masters the fp32 sum is cast to the param dtype as its
``.grad``. This is the native loop: nothing of accumkernels is imported here.
"""

from __future__ import annotations

import torch
from _matrix_actions import (hooked_param, initial_params, install_after_hooks,
                             install_inner_hooks, install_model_hooks, shrink)
from torch import nn

LOWP = (torch.bfloat16, torch.float16)
CLIP = 0.5
CLIP_LOOSE = 1e3  # max_grad_norm that never acts: the clip coefficient must stay 1


def finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def clip_(grads: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """What clip_grad_norm_ does to ``grads`` (foreach total norm, clamped coefficient)."""
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef)
    return norm


class Reference:
    """One side of a case trained with native semantics (the judge; also the side that a
    checkpoint handed to a native optimizer continues on)."""

    def __init__(self, ctx, model: nn.Module, inner: torch.optim.Optimizer | None = None):
        self.ctx, self.model = ctx, model
        self.params = list(model.parameters())
        install_model_hooks(ctx, model)
        install_after_hooks(ctx, model, native=True)
        # hooks=post-hook-after: natively it halves .grad after each AccumulateGrad of p0
        self.post_halved = id(hooked_param(model)) if ctx.hooks == "post-hook-after" else None
        built = initial_params(ctx, model) if inner is None else self.params
        self.masters, self.casts = {}, {}
        # (a param frozen when the optimizer was built trains in its dtype if unfrozen)
        self._master(p for p in built if p.requires_grad)
        stepped = [self.masters.get(id(p), p) for p in built]
        if inner is None:
            inner = ctx.opt.build(stepped)
            install_inner_hooks(ctx, inner)
            if ctx.hooks == "wrapper-post-hook":  # (fp32 only: the params are the model's)
                inner.register_step_post_hook(lambda o, a, k: shrink(model.parameters()))
        self.inner = inner
        self.acc: dict[int, torch.Tensor] = {}
        self.kept, self.weights, self.nonfinite_seen = 0, [], False
        self.pending: dict[int, torch.Tensor] = {}  # accumulate_in_backward=False: in .grad
        self.pending_weights: list = []
        self.pending_n = 0
        self.scale = ctx.loss_scale or 1.0

    def _master(self, params) -> None:
        if self.ctx.masters != "auto":
            return
        for p in params:
            if p.dtype in LOWP:
                self.masters[id(p)] = nn.Parameter(p.detach().float().clone())
                self.casts[id(p)] = p.detach().clone()

    # -- the loop axis ------------------------------------------------------------------------
    def reset(self) -> None:
        """opt.reset_window(): the window discarded, as zero_grad() (p.grad None)."""
        self.acc, self.kept, self.weights = {}, 0, []
        self.pending, self.pending_weights, self.pending_n = {}, [], 0

    def add_group(self, layer: list) -> None:
        """add_param_group: the withheld layer unfrozen and added (its masters made now)."""
        for p in layer:
            p.requires_grad_(True)
        self._master(layer)
        self.inner.add_param_group({"params": [self.masters.get(id(p), p) for p in layer]})

    # -- a micro-batch ------------------------------------------------------------------------
    def add(self, grads: dict[int, torch.Tensor], weight: float | None) -> None:
        """One micro-batch's gradients (param id -> its gradient, unscaled by the loop)."""
        if not self.ctx.in_backward:  # autograd sums them in .grad, in the param dtype
            for k, g in grads.items():
                self.pending[k] = g if k not in self.pending else self.pending[k] + g
            self.pending_n += 1
            self.pending_weights.append(weight)
            return
        self._add(grads, weight)

    def post_hook_without_grad(self) -> None:
        """hooks=post-hook-after on a param frozen since the forward: AccumulateGrad added
        nothing, its post-accumulate hook halved ``.grad`` as it was (if any)."""
        if self.post_halved in self.acc:
            self.acc[self.post_halved].mul_(0.5)

    def flush(self) -> None:
        """accumulate_in_backward=False: what ``.grad`` holds joins the window as one move."""
        if not self.pending_n:
            return
        grads, weights = self.pending, self.pending_weights
        self.pending, self.pending_weights, self.pending_n = {}, [], 0
        if self.ctx.nonfinite.policy == "skip_microbatch" and not finite(grads.values()):
            return
        for k, g in grads.items():
            self._acc(k, g)
        self.kept += len(weights)
        self.weights += [x for x in weights if x is not None]

    def _acc(self, k: int, g: torch.Tensor) -> None:
        g32 = g.float()
        if self.scale != 1.0:
            g32 = g32 * (1.0 / self.scale)
        self.acc[k] = g32 if k not in self.acc else self.acc[k] + g32

    def _add(self, grads: dict, weight) -> None:
        if self.ctx.nonfinite.policy == "skip_microbatch" and not finite(grads.values()):
            return  # dropped (it still counts towards N: the loop counts)
        for k, g in grads.items():
            self._acc(k, g)
            if k == self.post_halved:
                self.acc[k].mul_(0.5)
        self.kept += 1
        if weight is not None:
            self.weights.append(weight)

    def grad_view(self, p) -> torch.Tensor | None:
        """What native ``p.grad`` would hold now (fp32, before the step's normalisation)."""
        return self.acc.get(id(p))

    # -- the step -----------------------------------------------------------------------------
    def divisor(self) -> float:
        red = self.ctx.reduction.name
        if red == "sum":
            return 1.0
        if red == "mean":
            return float(self.kept)
        return float(sum(self.weights))

    def step(self, grad_mul: bool) -> dict:
        """The window's step; returns {'norm', 'skipped', 'raised'}."""
        out = {"norm": None, "skipped": False, "raised": False}
        self.flush()
        if self.acc and not finite(self.acc.values()):
            out["raised" if self.ctx.nonfinite.policy == "raise" else "skipped"] = True
            if self.ctx.clip == "user":  # the user's clip_grad_norm_ measures it all the same
                out["norm"] = torch.nn.utils.get_total_norm(list(self.acc.values()), 2.0)
            self.drop()
            return out
        order = [p for p in self.params if id(p) in self.acc]
        div = self.divisor() if order else 1.0
        grads = [self.acc[id(p)] / div if div != 1.0 else self.acc[id(p)] for p in order]
        if grad_mul and grads:
            torch._foreach_mul_(grads, 0.5)
        if self.ctx.clip != "none" and grads:
            out["norm"] = clip_(grads, CLIP_LOOSE if self.ctx.clip.endswith("loose") else CLIP)
        for p in self.params:
            p.grad = None
            if id(p) in self.masters:
                self.masters[id(p)].grad = None
        for p, g in zip(order, grads):
            master = self.masters.get(id(p))
            if master is not None:
                master.grad = g
            else:
                p.grad = g.to(p.dtype)
        self.resync()
        self.inner.step()
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None:
                    p.copy_(master)
                    self.casts[id(p)] = p.detach().clone()
        self.after_step(order)
        return out

    def resync(self) -> None:
        """A weight the user changed since the last copy-back goes into its master."""
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is not None and not torch.equal(p, self.casts[id(p)]):
                    master.copy_(p.float())

    def after_step(self, order) -> None:
        if self.ctx.loop == "no-zero_grad":  # .grad never cleared: the next window adds to it
            self.kept, self.weights = 0, []
            return
        keep = self.ctx.hands == "zero_grad-keep"
        self.acc = {id(p): torch.zeros_like(self.acc[id(p)]) for p in order} if keep else {}
        self.kept, self.weights = 0, []

    def drop(self) -> None:
        """A skipped window (or the one a raise discarded): gradients gone, as zero_grad()."""
        keep = self.ctx.hands == "zero_grad-keep"
        self.acc = {k: torch.zeros_like(v) for k, v in self.acc.items()} if keep else {}
        self.kept, self.weights = 0, []

    def transpose(self, p) -> None:
        """``p.data = p.data.t()``: the same memory seen transposed; a master is the weight's
        fp32 value, so it is seen transposed too (no value changed, none taken in)."""
        with torch.no_grad():
            p.data = p.data.t()
            master = self.masters.get(id(p))
            if master is not None:
                master.data = master.data.t()
                self.casts[id(p)] = p.detach().clone()

    def reload_like_native(self) -> None:
        """What a native optimizer's state dict loaded into an optimizer over the model's params
        means: torch casts the state to the param's dtype; the masters come from the model."""
        with torch.no_grad():
            for p in self.params:
                master = self.masters.get(id(p))
                if master is None:
                    continue
                for key, v in self.inner.state.get(master, {}).items():
                    if torch.is_tensor(v) and v.is_floating_point() and key != "step":
                        v.copy_(v.to(p.dtype).float())
                master.copy_(p.float())

    def observed(self) -> dict[str, torch.Tensor]:
        """What is compared after each step: the model's params and the fp32 masters (a master
        read is the weight's value as the user left it: a write is taken in, issue 38 item 4)."""
        self.resync()
        out = {f"param[{n}]": p.detach().clone() for n, p in self.model.named_parameters()}
        masters = [self.masters[id(p)] for p in self.params if id(p) in self.masters]
        for i, m in enumerate(masters):
            out[f"master[{i}]"] = m.detach().clone()
        return out
