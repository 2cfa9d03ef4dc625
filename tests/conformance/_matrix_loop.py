"""One single-process case of the conformance matrix: the loop with the wrapper, the same loop
with native semantics (_matrix_oracle.Reference), compared after every step.

The loop: 3 windows of 3 micro-batches (the last one 2 with ``N-short-last``); odd micro-batches
bring their gradients the case's way (``grads``), even ones by a plain backward; a NaN micro-batch
at (window 1, micro-batch 1) when the case has one; a mid-window checkpoint after (1, 0); the
user's hands between windows (or before each step).
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import torch
from _matrix_axes import ACCUMS, DTYPES, NONFINITES, OPTIMIZERS, REDUCTIONS
from _matrix_models import extra_used, loss_fn
from _matrix_actions import (Frozen, clear, frozen_micro, hooked_param, initial_params,
                             install_after_hooks, install_inner_hooks, install_model_hooks,
                             last_layer, raising_backward, shrink)
from _matrix_oracle import CLIP, CLIP_LOOSE, Reference

from accumkernels import AccumulatingOptimizer

NAN_AT, CKPT_AT = (1, 1), (1, 0)
ADD_AT, RESET_AT = (1, 0), (1, 2)  # loop=add_param_group-mid, reset_window
WINDOWS, MICRO = 3, 3
LOSS_SCALE = 1024.0


@dataclass
class Ctx:
    """A case's values resolved to their dataclasses."""

    case: dict
    cid: str

    def __post_init__(self):
        c = self.case
        self.params, self.dtype = c["params"], DTYPES[c["dtype"]]
        self.opt, self.reduction = OPTIMIZERS[c["optimizer"]], REDUCTIONS[c["reduction"]]
        self.accum, self.nonfinite = ACCUMS[c["accum"]], NONFINITES[c["nonfinite"]]
        self.clip, self.grads, self.hands = c["clip"], c["grads"], c["hands"]
        self.in_backward, self.masters, self.checkpoint = (c["in_backward"], c["masters"],
                                                          c["checkpoint"])
        self.loop, self.hooks = c.get("loop", "opt-zero_grad"), c.get("hooks", "none")
        self.autograd = c.get("autograd", "eager")
        self.loss_scale = LOSS_SCALE if self.dtype == torch.float16 else None
        self.seed = zlib.crc32(self.cid.encode()) % 10_000
        self.exact = (self.dtype == torch.float32 and self.params != "mixed"
                      and self.reduction.name == "sum" and self.clip == "none")

    def windows(self) -> list[int]:
        return [MICRO] * (WINDOWS - 1) + [MICRO - 1 if self.accum.short_last else MICRO]

    def wrap(self, model, inner=None) -> AccumulatingOptimizer:
        install_model_hooks(self, model)
        options = {"accumulation_steps": self.accum.n, "reduction": self.reduction.name,
                   "master_weights": self.masters, "accumulate_in_backward": self.in_backward,
                   "max_grad_norm": {"max_grad_norm": CLIP,
                                     "max_grad_norm-loose": CLIP_LOOSE}.get(self.clip),
                   "nonfinite": self.nonfinite.policy, "loss_scale": self.loss_scale,
                   "bucket_size_mb": 0.0005}
        if self.case.get("construct") == "by-name" and inner is None:
            import accumkernels.optimizers

            cls = getattr(accumkernels.optimizers, self.opt.cls)
            opt = cls(initial_params(self, model), **self.opt.kwargs_with_impl(), **options)
        else:
            if inner is None:
                inner = self.opt.build(initial_params(self, model))
                install_inner_hooks(self, inner)
            cls = MatrixSubclass if self.case.get("construct") == "subclass" \
                else AccumulatingOptimizer
            opt = cls(inner, **options, model=model)
        if self.hooks == "wrapper-post-hook":
            opt.register_step_post_hook(lambda o, args, kwargs: shrink(model.parameters()))
        install_after_hooks(self, model, native=False)
        return opt


class MatrixSubclass(AccumulatingOptimizer):
    """construct=subclass: a user's subclass with its own __init__, an attribute and a step
    override (it counts the step() calls; copies must keep the class and the count)."""

    def __init__(self, inner, **options):
        super().__init__(inner, **options)
        self.step_calls = 0

    def step(self, closure=None):
        self.step_calls += 1
        return super().step(closure)


def roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


class Departure(AssertionError):
    pass


# -- one micro-batch's gradients, either side ------------------------------------------------------

def trainable(model) -> list:
    return [p for p in model.parameters() if p.requires_grad]


def _assign(pairs) -> None:
    """What user code does with gradients it computed itself: add them into ``.grad``."""
    for p, g in pairs:
        if g is not None:
            p.grad = g if p.grad is None else p.grad + g


def wrapper_grads(ctx: Ctx, opt, model, loss, mode: str) -> None:
    """Bring micro-batch gradients in the case's way (``mode``) on the wrapper's side."""
    params = trainable(model)
    if mode == "backward":
        if ctx.autograd == "compiled":
            from torch._dynamo import compiled_autograd

            with compiled_autograd._enable(torch.compile(backend="eager")):
                loss.backward()
        else:
            loss.backward()
        return
    if mode == "raise":
        raising_backward(model, loss)
        return
    half = len(params) // 2
    if mode == "wp-mixed":  # one block: a backward for some params, assigned grads for the rest
        with opt.weight_pass():
            used = [p for p in params[:half]]
            loss.backward(inputs=used, retain_graph=True)
            rest = params[half:]
            _assign(zip(rest, torch.autograd.grad(loss, rest, allow_unused=True)))
        return
    gs = list(zip(params, torch.autograd.grad(loss, params, allow_unused=True)))
    if mode == "assigned":
        _assign(gs)
    elif mode == "wp-assign":
        with opt.weight_pass():
            _assign(gs)
    elif mode == "wp-nested":
        with opt.weight_pass():
            _assign(gs[:half])
            with opt.weight_pass():
                _assign(gs[half:])
    elif mode == "wp-raise":
        try:
            with opt.weight_pass():
                _assign(gs[:half])
                raise RuntimeError("the user's weight pass fails half-way")
        except RuntimeError:
            pass
    else:
        raise AssertionError(mode)


def reference_grads(model, loss, mode: str) -> dict:
    """The same micro-batch natively: param id -> gradient ('wp-raise': the first half only)."""
    params = trainable(model)
    if mode == "raise":  # a native backward into fresh .grad: what it added before the raise
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        raising_backward(model, loss)
        out = {id(p): p.grad for p in params if p.grad is not None}
        for p, g in zip(params, saved):
            p.grad = g
        return out
    gs = torch.autograd.grad(loss, params, allow_unused=True)
    if mode == "wp-raise":
        gs = list(gs[:len(params) // 2]) + [None] * (len(params) - len(params) // 2)
    return {id(p): g for p, g in zip(params, gs) if g is not None}


def make_loss(ctx: Ctx, model, w: int, i: int, x, y, scale) -> torch.Tensor:
    model.use_extra = extra_used(w, i)
    loss = loss_fn(model, x, y, summed=ctx.reduction.name == "weighted")
    if ctx.nonfinite.nan and (w, i) == NAN_AT:
        loss = loss * float("nan")
    return scale(loss) if ctx.loss_scale else loss


def reference_micro(ctx: Ctx, ref: Reference, w, i, x, y, weight) -> None:
    """The micro-batch natively. With accumulate_in_backward=False the wrapper's moves are
    where the gradients autograd summed in ``.grad`` (in the param dtype) join the fp32 sum:
    accumulate() after micro-batch 0, the N-th backward, a weight pass's start, every step()."""
    if ctx.loop == "reset_window" and (w, i) == RESET_AT:
        ref.reset()
    frozen = Frozen(ref.model) if frozen_micro(ctx, w, i) else None
    if frozen is not None and ctx.loop == "freeze-before":
        frozen.__enter__()
    loss = make_loss(ctx, ref.model, w, i, x, y, lambda t: t * ctx.loss_scale)
    if frozen is not None and ctx.loop == "freeze-between":
        frozen.__enter__()
    mode = ctx.grads if i % 2 else "backward"
    if not ctx.in_backward and mode.startswith("wp"):
        ref.flush()
    grads = reference_grads(ref.model, loss, mode)
    # (a param frozen between the forward and the backward: natively its post-accumulate hooks
    # run all the same, on .grad as it was)
    hooked_frozen = ctx.loop == "freeze-between" and not hooked_param(ref.model).requires_grad
    if frozen is not None:
        frozen.__exit__()
    ref.add(grads, weight if ctx.reduction.name == "weighted" else None)
    if hooked_frozen and mode == "backward":
        ref.post_hook_without_grad()
    if not ctx.in_backward and (i == 0 or i + 1 == ctx.accum.n or ctx.accum.step_every_micro
                                or ctx.loop == "model-zero_grad-every"):
        ref.flush()  # (a step() mid-window moves them too; so does a clear with N given)


def reference_finish(ctx: Ctx, ref: Reference, last: bool):
    return ref.step(grad_mul=ctx.hands == "grad-mul") if last else None


class WrapperSide:
    """The case's loop with the wrapper (or, after a checkpoint handed it to a native optimizer,
    a Reference continuing on the same model)."""

    def __init__(self, ctx: Ctx, model):
        self.ctx, self.model = ctx, model
        self.ref: Reference | None = None
        self.opt = None
        self.added = False  # loop=add_param_group-mid: the wrapper took the group
        if ctx.autograd == "compiled":
            torch._dynamo.reset()  # (no graph of an earlier case's model or hooks reused)
        if ctx.checkpoint == "native-into-inner":
            self.ref = Reference(ctx, model)  # window 0 natively, then into a wrapper's inner
        else:
            self.opt = ctx.wrap(model)

    def micro(self, w, i, x, y, weight):
        ctx, opt, model = self.ctx, self.opt, self.model
        if self.ref is not None:
            return reference_micro(ctx, self.ref, w, i, x, y, weight)
        if ctx.loop == "reset_window" and (w, i) == RESET_AT:
            opt.reset_window()
        frozen = Frozen(model) if frozen_micro(ctx, w, i) else None
        if frozen is not None and ctx.loop == "freeze-before":
            frozen.__enter__()
        loss = make_loss(ctx, model, w, i, x, y, opt.scale_loss)
        if frozen is not None and ctx.loop == "freeze-between":
            frozen.__enter__()
        weighted = ctx.reduction.name == "weighted"
        if weighted and not ctx.reduction.weight_after:
            opt.add_weight(weight)
        wrapper_grads(ctx, opt, model, loss, ctx.grads if i % 2 else "backward")
        if frozen is not None:
            frozen.__exit__()
        if weighted and ctx.reduction.weight_after:
            opt.add_weight(weight)
        if ctx.loop == "add_param_group-mid" and (w, i) == ADD_AT:
            self.added = self.add_group(mid=True)  # (before accumulate(): .grad unmoved)
        if not ctx.in_backward and i == 0:
            opt.accumulate()

    def add_group(self, mid: bool = False) -> bool:
        """add_param_group: the withheld last layer unfrozen and added; mid-window the wrapper
        may refuse with a ValueError naming add_param_group instead (the contract: keep the
        window as native does, or refuse with nothing changed): False then, the layer stays
        frozen and out, and the run goes on checking that nothing changed."""
        layer = last_layer(self.model)
        for p in layer:
            p.requires_grad_(True)
        try:
            self.opt.add_param_group({"params": layer})
        except ValueError as exc:
            if not mid or "add_param_group" not in str(exc):
                raise
            for p in layer:
                p.requires_grad_(False)
            return False
        return True

    def finish(self, last: bool):
        """After the micro-batch: step() where the loop calls it."""
        if self.ref is not None:
            return reference_finish(self.ctx, self.ref, last)
        if self.ctx.accum.step_every_micro or last:
            return self.step(last)
        if self.ctx.loop == "model-zero_grad-every":  # cleared every micro-batch all the same
            self.model.zero_grad()
        return None

    def step(self, last: bool):
        ctx, opt, model = self.ctx, self.opt, self.model
        rec = {"norm": None, "skipped": False, "raised": False}
        if last and (ctx.hands == "grad-mul" or ctx.clip == "user") and not ctx.in_backward:
            opt.accumulate()  # what p.grad shows then is the window
        if last and ctx.hands == "grad-mul":
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(0.5)
        if last and ctx.clip == "user":
            rec["norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        skipped = opt.skipped_steps
        try:
            opt.step()
        except FloatingPointError:
            if ctx.nonfinite.policy != "raise":
                raise
            rec["raised"] = True
        rec["skipped"] = opt.skipped_steps > skipped
        if last and ctx.clip.startswith("max") and not rec["skipped"] and not rec["raised"]:
            rec["norm"] = opt.last_grad_norm
        clear(ctx, opt, model)
        return rec if last else None

    def rewrite_state(self) -> None:
        """hands=state-rewrite: every param's state assigned a copy of itself (natively a no-op
        for the optimizer's behaviour)."""
        if self.opt is not None and self.ctx.hands == "state-rewrite":
            for p in list(self.opt.state):
                self.opt.state[p] = dict(self.opt.state[p])

    def grads_now(self) -> list:
        """(param, what p.grad shows as fp32) for the mid-window comparison."""
        return [(p, None if p.grad is None else p.grad.detach().float().clone())
                for p in self.model.parameters()]

    def observed(self) -> dict[str, torch.Tensor]:
        if self.ref is not None:
            return self.ref.observed()
        out = {f"param[{n}]": p.detach().clone() for n, p in self.model.named_parameters()}
        for i, m in enumerate(self.opt.master_params):
            out[f"master[{i}]"] = m.detach().clone()
        return out
