"""The step: what a real optimizer step does, in named phases.

``gather`` (the window reduced and agreed on across ranks, stale views zeroed) -> ``decide``
(normalisation target; finiteness and the clip norm measured from the window as it is now) ->
``apply`` (normalise or fold, clip, hand the window to the inner optimizer, re-sync the masters,
step, copy back) -> ``finish`` (reset the window). Each phase returns what the next needs.

The step decides from the window itself: writes through ``.data``, numpy or the storage change
it without a flag or a version bump, so no cached picture of it stands in (one read pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from accumkernels._torch_private import takes_grad_scale
from accumkernels._util import LOW_PRECISION
from accumkernels.ops.host import grads_are
from accumkernels.optim.step import fused_master
from accumkernels.optim import protocol
from accumkernels.optim.step.closure import closure_step
from accumkernels.optim.nonfinite import grad_norm

NO_WEIGHTS = "reduction='weighted' needs add_weight() for the window's micro-batches"


@dataclass
class Decision:
    """What ``decide`` found: the target divisor, the factor still to apply (folded into a fused
    inner optimizer's ``grad_scale``, else already applied: 1.0), the clip norm of the
    normalised window (None without ``max_grad_norm``) and the native grads outside it."""

    target: float
    factor: float
    fold: bool
    norm: torch.Tensor | None
    outside: list[torch.Tensor]


def flat_norm(sync, views: list[torch.Tensor], outside: list[torch.Tensor]) -> torch.Tensor:
    """The window's norm as ``clip_grad_norm_`` measures it, agreed over the ranks."""
    return sync.agree_norm(grad_norm(views + outside))


def finite_flag(sync, flats: list[torch.Tensor], outside: list[torch.Tensor]) -> torch.Tensor:
    """What the step needs of the window without clipping: whether it is finite. 0 if every
    element of the flat buffers (the views, the stale ones zeroed by ``gather``, the zero
    padding) and of the gradients outside the window is finite, else NaN, agreed over the ranks
    as the norm is. One read pass: each buffer's sum, which is finite whenever every element is
    but for an fp32 overflow of the sum itself; only a non-finite sum is looked at again,
    element by element."""
    tensors = [t for t in flats + outside if t.numel()]
    if not tensors:
        return sync.agree_norm(torch.zeros(()))
    device = tensors[0].device
    sums = torch.stack([t.sum(dtype=torch.float32).to(device) for t in tensors])
    finite = bool(torch.isfinite(sums).all()) or all(bool(torch.isfinite(t).all())
                                                     for t in tensors)
    return sync.agree_norm(torch.zeros((), device=device) if finite
                           else torch.full((), float("nan"), device=device))


class Step:
    """A real step over the wrapper's rooms (``parts``) and the intake that fills the window.

    ``measure(sync, views, outside)``: the norm of the window (non-finite on every rank if on
    one): :func:`flat_norm`, or the FSDP2 room's mesh norm. ``can_fold``: whether the
    normalisation may go into a fused inner optimizer's ``grad_scale``.
    """

    def __init__(self, parts, intake, *, measure=flat_norm, can_fold: bool = True):
        self.config, self.optimizer, self.params = parts.config, parts.optimizer, parts.params
        self.window, self.nonfinite, self.scaler = parts.window, parts.nonfinite, parts.scaler
        self.masters, self.outside, self.names = parts.masters, parts.outside, parts.names
        self._parts = parts
        self.intake = intake
        self.measure, self.can_fold = measure, can_fold
        self.last_grad_norm: torch.Tensor | None = None
        # (master_weights=False with bf16/fp16 params: they get .grad in their dtype)
        self._may_cast = not self.masters.enabled and any(
            p.dtype in LOW_PRECISION for p in self.params)
        self._carry_scale: torch.Tensor | None = None

    def microbatch_ended(self, kept: bool) -> None:
        """One backward (micro-batch) finished: count it; show the window as the step will
        use it once it is complete (N known), or as DDP's sync left it."""
        window = self.window
        window.add_microbatch(kept)
        if not kept:
            self.nonfinite.skipped_microbatches += 1
            self.scaler.update(found_inf=True)
        if self.sync.end_backward():
            pass  # DDP synced this backward: the window is averaged, agreed on and normalised
        elif window.complete and not self.sync.active and window.kept:
            window.seal(self.params, self.intake.views)
        elif window.complete and self.sync.agrees_at_last_backward and window.kept \
                and not window.weights_pending():
            # process_group: reduce and agree now, so p.grad shows the final average over the
            # ranks before step() (a user's clip measures native's); step() reuses the totals
            totals = self.gather()
            window.normalise(window.target_divisor(totals))

    @property
    def sync(self):
        """The window's synchronisation (it changes once when DDP is met)."""
        return self._parts.sync

    def reset_window(self) -> None:
        """A new window: counts, the kernels' flag and the ranks' reduction state."""
        self.window.reset()
        self.nonfinite.reset()
        self.sync.reset()

    def end_window(self, force: bool, sync_step: bool, run) -> None:
        """``step()``/``flush()``: take in what is in ``.grad``, then ``run()`` (the real step,
        with the step hooks) if the window is due (``sync_step``: N micro-batches are in)."""
        self.intake.take_in()
        window = self.window
        if window.empty and not self.outside.with_grad():
            return
        if window.micro_steps == 0:  # gradients assigned (or zeroed) without a backward: one
            self.microbatch_ended(True)  # micro-batch, as accumulate_in_backward=False
        if not self.sync.active and window.needs_weights(force, sync_step):
            raise ValueError(NO_WEIGHTS)
        if window.due(force):
            run()

    def take_in(self) -> None:
        """Take in what a closure's backward left in ``.grad`` (one micro-batch if none was
        counted)."""
        self.intake.take_in()
        if not self.window.empty and self.window.micro_steps == 0:
            self.microbatch_ended(True)

    def clear(self, set_to_none: bool) -> None:
        """``zero_grad()``: a window still filling (N given) is kept; a complete one, or any
        with N None, is dropped, as native PyTorch drops those gradients."""
        intake, window = self.intake, self.window
        intake.take_in()
        keep = window.keeps_on_clear()
        if not keep and (not window.empty or window.carried_only):
            self.reset_window()
        if set_to_none:
            intake.hide_all()
        elif not keep:  # native: zero grads stay, and the step still acts on those params
            window.zero_held(intake.params, intake.views,
                             [p.grad is v for p, v in zip(intake.params, intake.views)])
        if not keep:  # outside the window: cleared the native way, on the window's rule
            self.outside.clear(set_to_none)

    # -- the phases ------------------------------------------------------------------------------
    def run(self, hooks=None) -> None:
        """The real step; ``hooks`` (protocol.StepHooks): the wrapper's step hooks, run around
        the inner step once the window is found finite (a dropped window fires none)."""
        totals = self.gather()
        kept = totals.kept if totals is not None else self.window.kept
        if kept == 0:  # every micro-batch was dropped (on every rank)
            return self.skip()
        decision = self.decide(totals)
        if decision is None or not self.apply(decision, hooks):
            return self.nonfinite_window()
        self.finish()
        if hooks is not None:
            hooks.post()

    def gather(self):
        """Zero stale views, reduce the window across ranks and agree on its bookkeeping."""
        self.sync.check_world()
        self.window.zero_untouched(self.params, self.intake.views)
        totals = self.sync.finish(self.nonfinite.found_inf)
        if totals is not None:
            self.window.keep_only(self.params, totals.touched)
        return totals

    def decide(self, totals) -> Decision | None:
        """Normalise (or plan the fold), then measure: None if the window is not finite."""
        window = self.window
        target = window.target_divisor(totals)
        if target is None:
            raise ValueError(NO_WEIGHTS)
        outside = [p.grad for p in self.outside.with_grad() if not p.grad.is_sparse]
        # a fused inner optimizer divides by grad_scale in its own pass: 1/N and the clip
        # coefficient go there (never a factor above 1: its divide could overflow unseen)
        factor = window.divisor / target
        fold = self.can_fold and self._foldable() and not outside and factor <= 1.0
        if not fold:
            window.normalise(target)
            factor = 1.0
        self.outside.scale(1.0 / (self.scaler.scale * target))
        if self.config.max_grad_norm is None and self.measure is flat_norm \
                and self.sync.stage_norm is None:
            norm = finite_flag(self.sync, list(window.storage.buffers.values()), outside)
        else:
            views = [v for v, held in zip(self.intake.views, window.held(self.params)) if held]
            norm = self.measure(self.sync, views, outside)
        if not bool(torch.isfinite(norm)):
            return None
        if self.config.max_grad_norm is None:
            norm = None
        else:
            norm = (norm * factor if factor != 1.0 else norm).float()
            self.last_grad_norm = norm
        return Decision(target, factor, fold, norm, outside)

    def apply(self, d: Decision, hooks=None) -> bool:
        """Clip and normalise, hand the window over, run the step pre-hooks (``hooks``), step
        the inner optimizer; False if the window overflows the params' dtype
        (``master_weights=False`` with bf16/fp16 params)."""
        flats = list(self.window.storage.buffers.values())
        scaled = self.scale_grads(flats + d.outside, d.norm, d.factor, d.fold)
        cast = self.hand_grads()
        if cast and not self.nonfinite.all_finite([p.grad for p in cast]):
            for p in cast:
                p.grad = None
            self.intake.expose()
            return False
        if hooks is not None:  # (before the masters take in what the hooks write)
            hooks.pre()
        one_pass = fused_master.applies(self.optimizer, self.masters)
        # the fused master step leaves the window undivided (a write it does not need) unless a
        # torch step over params without masters writes its share back divided
        write_grad = not one_pass or fused_master.any_rest(self.optimizer, self.masters)
        if d.fold and write_grad:
            self.window.normalised_outside(d.target)  # the inner optimizer wrote them back
        run = None
        if one_pass:
            run = lambda: fused_master.step(self.optimizer, self.masters,  # noqa: E731
                                            write_grad=write_grad)
        elif self.masters.model_params:
            self.masters.resync_changed()
        try:
            with self.masters.swapped():
                protocol.inner_step(self.optimizer, run=run)
        finally:
            if scaled:
                if not write_grad:  # the window still holds the gradients times grad_scale
                    self._carry_scale = torch.reciprocal(self.optimizer.grad_scale)
                del self.optimizer.grad_scale, self.optimizer.found_inf
        self.after_inner_step(cast, copied=one_pass)
        return True

    def finish(self) -> None:
        """The window ends; what the step used stays in it until a clear (native ``.grad``)."""
        self.scaler.update(found_inf=False)
        self.window.carry(self._carry_scale)
        self._carry_scale = None
        self.nonfinite.reset()
        self.sync.reset()

    # -- measured ahead of the step (pipeline stages clip by one norm: stage_norm.StageNorm) ---
    def due(self) -> bool:
        """Whether the next ``step()`` ends this window (a real step that takes part in a norm
        round)."""
        return self.window.step_ends_it(self.intake.unmoved) and not self.window.empty

    def pending_factor(self) -> float:
        """What the step still multiplies the measured norm by: the window holds sum / divisor,
        the step uses sum / target (1.0 once it normalised)."""
        target = self.window.target_divisor(self.sync.agreed_totals())
        return self.window.divisor / target if target else 1.0

    def final_square(self, must: bool = False) -> float:
        """The squared norm this step will measure, measured before it (``must``: this wrapper
        is stepping now): the window gathered (``gather``, which the step then finds done) and
        normalised as ``decide`` normalises it. 0.0 for a window that will not step now, or
        that dropped every micro-batch."""
        if not (must or self.due()):
            return 0.0
        self.intake.take_in()
        totals = self.gather()
        window = self.window
        kept = totals.kept if totals is not None else window.kept
        target = window.target_divisor(totals)
        if kept == 0 or not target:
            return 0.0
        views = [v for p, v in zip(self.params, self.intake.views) if window.holds(p)]
        square = (float(grad_norm(views)) * window.divisor / target) ** 2
        outside = [p.grad for p in self.outside.with_grad() if not p.grad.is_sparse]
        if outside:
            square += (float(grad_norm(outside)) / (self.scaler.scale * target)) ** 2
        return square

    # -- outcomes other than a step ---------------------------------------------------------------
    def skip(self) -> None:
        self.nonfinite.skipped_steps += 1
        self.scaler.update(found_inf=True)
        self.reset_window()

    def nonfinite_window(self) -> None:
        if self.nonfinite.policy == "raise":
            raise FloatingPointError(f"non-finite gradient in {self._first_nonfinite()}")
        self.skip()

    def closure_step(self, closure):
        """A closure optimizer's step (LBFGS): accumkernels.optim.step.closure."""
        return closure_step(self, closure)

    # -- pieces ------------------------------------------------------------------------------------
    def _foldable(self) -> bool:
        """A fused inner optimizer (Adam, AdamW, SGD with ``fused=True``) that no GradScaler
        drives now: it divides the gradients by its ``grad_scale`` in its own pass."""
        inner = self.optimizer
        return takes_grad_scale(inner) and getattr(inner, "grad_scale", None) is None \
            and getattr(inner, "found_inf", None) is None

    def scale_grads(self, grads: list[torch.Tensor], norm: torch.Tensor | None, factor: float,
                     fold: bool) -> bool:
        """Multiply the gradients by ``factor`` and the clip coefficient
        ``min(1, max_grad_norm / (norm + 1e-6))`` (as ``torch.nn.utils.clip_grad_norm_``).
        Folded, as GradScaler does it: the fused inner optimizer gets the inverse as its
        ``grad_scale`` (and a clear ``found_inf``) for this step; returns True then."""
        if norm is None and factor == 1.0:
            return False
        if fold:
            device = self.nonfinite.found_inf.device
            inv = torch.tensor(1.0 / factor, device=device) if norm is None else \
                torch.clamp((norm + 1e-6) / self.config.max_grad_norm, min=1.0) / factor
            self.optimizer.grad_scale, self.optimizer.found_inf = inv, torch.zeros_like(inv)
            return True
        coef = torch.clamp(self.config.max_grad_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
        return False

    def _first_nonfinite(self) -> str:
        storage = self.window.storage
        for i, p in enumerate(self.params):
            view = storage.view(p)
            if view.numel() and not bool(torch.isfinite(view).all()):
                return self.names.get(id(p), f"parameter {i} (shape {tuple(p.shape)})")
        return "the window (non-finite on another rank, or outside the window)"

    def hand_grads(self) -> list[torch.Tensor]:
        """Give the window to the inner optimizer as ``.grad``; returns the params that got an
        own copy in their dtype (``master_weights=False`` with bf16/fp16 params)."""
        if not self._may_cast and self.window.holds_all(map(id, self.params)) \
                and grads_are(self.masters.targets(self.params), self.intake.views):
            return []  # each param's (or its master's) .grad is its view already
        cast = []
        masters = self.masters.masters  # id(param) -> master
        for p, view, held in zip(self.params, self.intake.views, self.window.held(self.params)):
            master = masters.get(id(p)) if masters else None
            target = master if master is not None else p
            if not held:
                if target.grad is not None:
                    target.grad = None  # the inner optimizer skips params without .grad
            elif master is None and p.dtype in LOW_PRECISION:
                p.grad = view.to(p.dtype)  # master_weights=False: grads in the param dtype
                cast.append(p)
            elif target.grad is not view:  # (reading is cheaper than the setter's checks)
                target.grad = view
        return cast

    def after_inner_step(self, cast: list[torch.Tensor], copied: bool = False) -> None:
        if not copied:  # (the fused master step wrote the weights itself)
            self.masters.copy_back()
        for p in cast:
            p.grad = None
        self.intake.expose()  # as native: after the step .grad still shows what it used
