"""When a window ends and what a real step does: normalise, reduce, check, clip, step, reset."""

from __future__ import annotations

import torch

from accumkernels._util import LOW_PRECISION
from accumkernels.optim import protocol
from accumkernels.optim.nonfinite import grad_norm

_NO_WEIGHTS = "reduction='weighted' needs add_weight() for the window's micro-batches"


class StepMixin:
    """The step half of AccumulatingOptimizer (kept apart so each file stays readable)."""

    @torch.no_grad()
    def step(self, closure=None):
        """Run ``closure`` (if any), then end the window if it is due; returns the closure's loss.

        The window ends when ``accumulation_steps`` is None, when N micro-batches are in, or
        (learned from this wrapper's own calls) when the caller has so far called ``step()``
        only on complete windows: such a caller (Trainer-style) ends a short last window the
        same way. A caller that calls ``step()`` before the window is complete (every
        micro-batch, Accelerate-style) gets no-ops until it is. Step hooks run around real
        steps only. An inner optimizer that requires a closure (LBFGS) gets it: it evaluates
        the closure itself, each evaluation filling a fresh window.
        """
        args = (self,) if closure is None else (self, closure)
        if closure is not None and self._needs_closure:
            return protocol.run_step(self, args, {}, lambda: self._closure_step(closure))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._maybe_step(force=False, args=args)
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Take the step now, for a short last window (e.g. at the end of an epoch)."""
        self._maybe_step(force=True, args=(self,))

    def _maybe_step(self, force: bool, args: tuple) -> None:
        self._settle()
        w = self._window
        if w.empty and not self._outside.with_grad():
            return
        if w.micro_steps == 0:  # gradients assigned (or zeroed) without a backward: one
            self._microbatch_ended(True)  # micro-batch, as accumulate_in_backward=False counts
        if self.config.reduction == "weighted" and not self._dp.active and w.kept \
                and w.local_weight() <= 0 and (force or self.sync_step or w.boundary_only):
            raise ValueError(_NO_WEIGHTS)
        if not (force or self.config.accumulation_steps is None or w.complete):
            if w.boundary_only is not True:
                w.boundary_only = False  # this caller steps before windows are complete
                return
        elif w.complete and w.boundary_only is None:
            w.boundary_only = True  # its first step() came on a complete window
        protocol.run_step(self, args, {}, self._real_step)

    def _real_step(self) -> None:
        w = self._window
        self._dp.check_world()
        self._zero_untouched()
        totals = self._dp.finish(w.micro_steps, w.kept, w.local_weight(),
                                 self._nonfinite.found_inf,
                                 [id(p) in w.touched for p in self._params])
        if totals is not None:
            w.touched = {id(p) for p, t in zip(self._params, totals.touched) if t}
        kept = totals.kept if totals is not None else w.kept
        if kept == 0:  # every micro-batch was dropped (on every rank)
            return self._skip()
        target = self._target_divisor(totals)
        if target is None:
            raise ValueError(_NO_WEIGHTS)
        flats = list(self._buffer.buffers.values())
        outside = [p.grad for p in self._outside.with_grad() if not p.grad.is_sparse]
        # a fused inner optimizer divides by grad_scale in its own pass: 1/N and the clip
        # coefficient go there (never a factor above 1: its divide could overflow unseen)
        factor = w.divisor / target
        fold = self._foldable() and not outside and factor <= 1.0
        if not fold:
            self._normalise(target)
            factor = 1.0
        self._outside.scale(1.0 / (self._scaler.scale * target))
        # finiteness and the clip norm from the window as it is now (one read pass), agreed
        # over the ranks; where fp32 overflows with finite values, in float64
        norm = self._window_norm(outside)
        if not bool(torch.isfinite(norm)):
            return self._nonfinite_window()
        if self.config.max_grad_norm is None:
            norm = None
        else:
            norm = (norm * factor if factor != 1.0 else norm).float()
            self.last_grad_norm = norm
        self._scale_grads(flats + outside, norm, factor, fold)
        if fold:
            w.divisor = target  # the inner optimizer writes the divided gradients back
        cast = self._hand_grads()
        if cast and not self._nonfinite.all_finite([p.grad for p in cast]):
            for p in cast:  # the fp32 window overflows the param dtype
                p.grad = None
            self._intake.expose()
            return self._nonfinite_window()
        self._masters.resync_changed()
        try:
            protocol.inner_step(self.optimizer)
        finally:
            self._unfold_scale()
        self._after_inner_step(cast)
        self._scaler.update(found_inf=False)
        self._reset_window()

    def _window_norm(self, outside: list[torch.Tensor]) -> torch.Tensor:
        """The 2-norm of what the step hands over (the touched views and the native ``.grad``
        of params outside the window), as ``clip_grad_norm_`` measures it, and non-finite on
        every rank if it is on one (the data-parallel room agrees on it)."""
        touched = self._window.touched
        views = [v for p, v in zip(self._params, self._intake.views) if id(p) in touched]
        return self._dp.agree_norm(grad_norm(views + outside))

    def _foldable(self) -> bool:
        """A fused inner optimizer (Adam, AdamW, SGD with ``fused=True``) that no GradScaler
        drives now: it divides the gradients by its ``grad_scale`` in its own pass."""
        inner = self.optimizer
        return bool(getattr(inner, "_step_supports_amp_scaling", False)) \
            and getattr(inner, "grad_scale", None) is None \
            and getattr(inner, "found_inf", None) is None

    def _scale_grads(self, grads: list[torch.Tensor], norm: torch.Tensor | None, factor: float,
                     fold: bool) -> None:
        """Multiply the gradients by ``factor`` (the normalisation not yet applied) and by the
        clip coefficient ``min(1, max_grad_norm / (norm + 1e-6))`` (as
        ``torch.nn.utils.clip_grad_norm_``). Folded: the fused inner optimizer gets the inverse as
        its ``grad_scale`` (the hook GradScaler uses) and there is no pass of its own."""
        if norm is None and factor == 1.0:
            return
        if fold:
            device = self._nonfinite.found_inf.device
            inv = torch.tensor(1.0 / factor, device=device) if norm is None else \
                torch.clamp((norm + 1e-6) / self.config.max_grad_norm, min=1.0) / factor
            self.optimizer.grad_scale, self.optimizer.found_inf = inv, torch.zeros_like(inv)
            self._folded_scale = True
            return
        coef = torch.clamp(self.config.max_grad_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))

    def _unfold_scale(self) -> None:
        if getattr(self, "_folded_scale", False):
            self._folded_scale = False
            del self.optimizer.grad_scale, self.optimizer.found_inf

    def _nonfinite_window(self) -> None:
        if self._nonfinite.policy == "raise":
            raise FloatingPointError(f"non-finite gradient in {self._first_nonfinite()}")
        self._skip()

    def _closure_step(self, closure):
        """An inner optimizer that requires a closure (LBFGS) evaluates it itself, maybe
        several times: each evaluation runs at the inner optimizer's current point (masters
        copied into the model), fills a fresh window and hands it over as ``.grad``."""
        cast: list[torch.Tensor] = []

        def evaluate():
            self._masters.copy_back()
            self._reset_window()
            with torch.enable_grad():
                loss = closure()
            with torch.no_grad():
                self._settle()
                if not self._window.empty and self._window.micro_steps == 0:
                    self._microbatch_ended(True)
                self._zero_untouched()
                self._normalise(self._target_divisor(None) or 1.0)
                self._outside.scale(1.0 / (self._scaler.scale * self._window.divisor))
                cast[:] = self._hand_grads()
            return loss

        loss = protocol.inner_step(self.optimizer, evaluate)
        self._after_inner_step(cast)
        self._reset_window()
        return loss

    def _skip(self) -> None:
        self._nonfinite.skipped_steps += 1
        self._scaler.update(found_inf=True)
        self._reset_window()

    def _target_divisor(self, totals) -> float | None:
        """What the window's gradient sum is divided by (over all ranks with process_group)."""
        w = self._window
        if self.config.reduction == "sum":  # data parallel: the average over ranks, like DDP
            target = float(totals.world) if totals else 1.0
        elif self.config.reduction == "mean":
            target = float(totals.kept if totals else w.kept)
        else:
            target = totals.weight if totals else w.local_weight()
            if not target > 0:
                return None
        if totals is not None and totals.averaged:  # DDP averaged (not summed) the window
            target /= totals.world
        return target

    def _zero_untouched(self) -> None:
        """Views without data of this window hold an earlier one's: zero them, so norms,
        reductions and ``p.main_grad`` see 0 (the first write of a window skips this pass)."""
        touched = self._window.touched
        untouched = [v for p, v in zip(self._params, self._intake.views) if id(p) not in touched]
        if untouched:
            torch._foreach_zero_(untouched)

    def _seal(self) -> None:
        """The window is complete (N known): zero what it did not touch, normalise it."""
        self._zero_untouched()
        self._normalise(self._target_divisor(None))

    def _normalise(self, target: float | None) -> None:
        """Rescale the buffer so it holds ``sum(g) / target``."""
        w = self._window
        if target is None or target == w.divisor:
            return
        torch._foreach_mul_(list(self._buffer.buffers.values()), w.divisor / target)
        w.divisor = target

    def _first_nonfinite(self) -> str:
        for i, (p, view) in enumerate(zip(self._params, self._intake.views)):
            if not bool(torch.isfinite(view).all()):
                return self._names.get(id(p), f"parameter {i} (shape {tuple(p.shape)})")
        return "the window (the gradient was non-finite when accumulated)"

    def _check_unfrozen(self) -> None:
        """A param outside the window (frozen when it was built, float64, added behind its
        back) now gets a gradient: it trains natively, its ``.grad`` normalised at the step
        like the window (DDP averages it natively). A micro-batch cannot be dropped from a native
        ``.grad``: with ``nonfinite="skip_microbatch"`` this raises, naming the fix."""
        if self.config.nonfinite != "skip_microbatch":
            return
        for p in self._outside.refresh():
            if p.requires_grad:
                name = self._names.get(id(p), f"a param of shape {tuple(p.shape)}")
                raise ValueError(
                    f"{name} is outside the fp32 window (frozen when the AccumulatingOptimizer "
                    "was built, float64, or added to param_groups directly) and now has a "
                    "gradient that nonfinite='skip_microbatch' cannot drop; unfreeze it "
                    "before wrapping, or pass its params to add_param_group() between windows")

    def _hand_grads(self) -> list[torch.Tensor]:
        """Give the window to the inner optimizer as ``.grad``; returns the params that got an
        own copy in their dtype (``master_weights=False`` with bf16/fp16 params)."""
        touched = self._window.touched
        cast = []
        for p, view in zip(self._params, self._intake.views):
            master = self._masters.get(p)
            target = master if master is not None else p
            if id(p) not in touched:
                target.grad = None  # the inner optimizer skips params without .grad
            elif master is None and p.dtype in LOW_PRECISION:
                p.grad = view.to(p.dtype)  # master_weights=False: grads in the param dtype
                cast.append(p)
            else:
                target.grad = view
        return cast

    def _after_inner_step(self, cast: list[torch.Tensor]) -> None:
        self._masters.copy_back()
        for p in cast:
            p.grad = None
        self._intake.expose()  # as native: after the step .grad still shows what it used
