"""AccumulatingOptimizer: gradient accumulation in fp32 master buffers around any optimizer.

Window logic, reductions, master weights, loss scaling, clipping and state_dict live here; the
fp32 storage is a MasterGradBuffer and every gradient move is one fused ``accumulate_`` launch
per bucket.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict

import torch

from accumkernels import backends
from accumkernels.buffer import MasterGradBuffer
from accumkernels.checks import check_model
from accumkernels.distributed import WindowReducer, WindowTotals
from accumkernels.scaling import LossScaler
from accumkernels.slot import SLOT_ATTR, SlotWrite

__all__ = ["AccumulatingOptimizer"]

REDUCTIONS = ("sum", "mean", "weighted")
NONFINITE_POLICIES = ("skip_step", "skip_microbatch", "raise")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Tensor.grad_dtype lets an fp32 .grad sit on a bf16/fp16 param (recent PyTorch).
_HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")


def _is_lightning_closure(closure: object) -> bool:
    func = getattr(closure, "func", closure)  # Lightning passes a functools.partial
    module = getattr(func, "__module__", None) or type(func).__module__ or ""
    return module.split(".")[0] in ("lightning", "pytorch_lightning")


def _check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


class _Slot:
    """The wrapper's side of the slot protocol (accumkernels.slot); holds its owner weakly."""

    def __init__(self, owner: "AccumulatingOptimizer"):
        import weakref
        self._owner = weakref.ref(owner)

    @property
    def owner(self):
        return self._owner()

    def check_fusable(self) -> None:
        owner = self._owner()
        if owner is not None and owner.nonfinite == "skip_microbatch":
            raise ValueError("fused gradient writes cannot be undone: nonfinite='skip_microbatch' "
                             "is not supported with fuse_wgrad_accumulation")

    def claim(self, p: torch.Tensor) -> SlotWrite:
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the AccumulatingOptimizer that managed this param is gone")
        return SlotWrite(*owner._fused_gradient_slot(p))


class AccumulatingOptimizer(torch.optim.Optimizer):
    """Wraps a constructed optimizer; accumulates micro-batch gradients in fp32, then steps it.

    It shares ``param_groups`` with the inner optimizer, so LR schedulers and training
    frameworks accept it unchanged. See DESIGN.md for the full semantics of every argument.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        accumulation_steps: int | None = None,
        reduction: str = "sum",
        master_weights: bool | str = "auto",
        accumulate_in_backward: bool = True,
        max_grad_norm: float | None = None,
        nonfinite: str = "skip_step",
        loss_scale: float | str | None = None,
        process_group: object | None = None,
        bucket_size_mb: float = 25,
        backend: str = "auto",
        model: torch.nn.Module | None = None,
    ):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(optimizer, AccumulatingOptimizer):
            raise TypeError("optimizer is already an AccumulatingOptimizer")
        if accumulation_steps is not None:
            if isinstance(accumulation_steps, bool) or not isinstance(accumulation_steps, int):
                raise TypeError(f"accumulation_steps must be an int or None, got {accumulation_steps!r}")
            if accumulation_steps <= 0:
                raise ValueError(f"accumulation_steps must be positive, got {accumulation_steps}")
        _check_choice("reduction", reduction, REDUCTIONS)
        _check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
        if not (master_weights == "auto" or isinstance(master_weights, bool)):
            raise ValueError(f"master_weights must be 'auto', True or False; got {master_weights!r}")
        _check_choice("backend", backend, ("auto",) + backends.BACKENDS)
        if not isinstance(accumulate_in_backward, bool):
            raise TypeError("accumulate_in_backward must be a bool")
        if max_grad_norm is not None:
            if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)):
                raise TypeError(f"max_grad_norm must be a float or None, got {max_grad_norm!r}")
            if not (math.isfinite(max_grad_norm) and max_grad_norm > 0):
                raise ValueError(f"max_grad_norm must be a finite positive number, got {max_grad_norm}")
        if model is not None and isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError(
                "model is wrapped in DistributedDataParallel, which all-reduces every micro-batch "
                "behind the wrapper's back; pass the plain module and process_group= instead (the "
                "wrapper all-reduces the fp32 window once per step)")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self._scaler = LossScaler(loss_scale)

        seen: set[int] = set()
        for g, group in enumerate(optimizer.param_groups):
            for i, p in enumerate(group["params"]):
                where = f"param_groups[{g}]['params'][{i}]"
                if id(p) in seen:
                    raise ValueError(f"{where} appears more than once in the optimizer")
                if p.device.type == "meta":
                    raise ValueError(f"{where} is on the meta device; materialise the model first")
                seen.add(id(p))

        # torch.optim.Optimizer.__init__ would build its own param_groups; we share the inner
        # optimizer's instead and only set up the hook registries the base class uses.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._warned_capturable_if_run_uncaptured = True
        self._patch_step_function()

        self.optimizer = optimizer
        self.accumulation_steps = accumulation_steps
        self.reduction = reduction
        self.nonfinite = nonfinite
        self.max_grad_norm = max_grad_norm
        self.accumulate_in_backward = accumulate_in_backward
        self.backend = backend
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if model is not None:
            check_model(model)

        self._params = [p for group in optimizer.param_groups for p in group["params"]
                        if p.requires_grad]
        self._buffer = MasterGradBuffer(self._params, bucket_size_mb=bucket_size_mb)
        for device in self._buffer.buffers:  # an unusable backend fails here, not mid-backward
            backends.resolve(backend, device)
        self._reducer = None
        if process_group is not None:
            self._reducer = WindowReducer(process_group, self._buffer)
            self._reducer.broadcast_params(self._params)
        self._dp_totals: WindowTotals | None = None
        if master_weights == "auto":
            master_weights = any(p.dtype in _LOW_PRECISION for p in self._params)
        self.master_weights = master_weights
        self._masters: dict[int, torch.Tensor] = {}
        if master_weights:
            self._retarget_to_masters()

        self.skipped_steps = 0
        self.skipped_microbatches = 0
        self._boundary_only = False  # learned: does the caller call step() only at window ends?
        self._framework_driven = False  # learned: does HF Accelerate's GradientState mark windows?
        self._closure_ends_window = False
        self.last_grad_norm: torch.Tensor | None = None
        devices = list(self._buffer.buffers)
        self._found_inf = torch.zeros(1, device=devices[0] if devices else "cpu")
        self._in_backward = False
        self._ready: dict[int, list[torch.Tensor]] = {}  # bucket index -> params with grads
        self._reset_window()
        self._hooks = []
        slot = _Slot(self)
        for p in self._params:
            setattr(p, SLOT_ATTR, slot)
            self._hooks.append(p.register_hook(self._before_grad_accumulation))
            if accumulate_in_backward:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    # -- sharing the inner optimizer ------------------------------------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value):
        self.optimizer.param_groups = value

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value):
        self.optimizer.state = value

    @property
    def defaults(self):
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value):
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError("AccumulatingOptimizer: add param groups to the inner "
                                  "optimizer before wrapping it")

    def _retarget_to_masters(self) -> None:
        """Point the inner optimizer at fp32 copies of low-precision params; remap its state."""
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if p.requires_grad and p.dtype in _LOW_PRECISION:
                    master = torch.nn.Parameter(p.detach().float().clone())
                    self._masters[id(p)] = master
                    if p in state:
                        state[master] = {
                            k: v.float() if torch.is_tensor(v) and v.dtype in _LOW_PRECISION else v
                            for k, v in state.pop(p).items()
                        }
                    p = master
                new_params.append(p)
            group["params"] = new_params

    # -- the window -----------------------------------------------------------------------
    @property
    def micro_steps(self) -> int:
        """Micro-batches in the current window (dropped ones included)."""
        return self._micro_steps

    @property
    def sync_step(self) -> bool:
        """Whether step() now ends the window (a real optimizer step)."""
        n = self.accumulation_steps
        return n is None or self._micro_steps + self._unmoved >= n

    @property
    def collective_timeout(self) -> float | None:
        """Seconds to wait for peers' all-reduces (process_group) before raising; None without."""
        return self._reducer.timeout_s if self._reducer is not None else None

    @collective_timeout.setter
    def collective_timeout(self, seconds: float) -> None:
        if self._reducer is None:
            raise ValueError("collective_timeout needs process_group")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"collective_timeout must be a positive number of seconds, got {seconds!r}")
        self._reducer.timeout_s = float(seconds)

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; the matching 1/S is fused into accumulation."""
        return self._scaler.scale_loss(loss)

    def add_weight(self, weight: float | torch.Tensor) -> None:
        """Report the weight (e.g. token count) of a micro-batch whose loss is a sum."""
        if self.reduction != "weighted":
            raise ValueError(f"add_weight() needs reduction='weighted' (this one is {self.reduction!r})")
        if isinstance(weight, bool) or not isinstance(weight, (int, float, torch.Tensor)):
            raise TypeError(f"weight must be a number or a 1-element tensor, got {type(weight).__name__}")
        value = float(weight)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"weight must be finite and positive, got {value}")
        if self._at_boundary and self._reducer is not None:
            raise RuntimeError("with process_group, add_weight() must come before the end of the "
                               "window's last backward (the weights are summed across ranks there)")
        self._weights.append(value)
        if self._at_boundary:
            self._normalise()

    def _prescale(self) -> float:
        """The scale fused into each launch: unscale the loss, and 1/N for 'mean' with known N."""
        return (1.0 / self._scaler.scale) / self._divisor

    def _reset_window(self) -> None:
        self._micro_steps = 0
        self._kept = 0
        self._unmoved = 0  # backwards whose grads still sit in .grad (accumulate_in_backward=False)
        self._step_calls = 0  # step() calls in this window
        # id() of params that got a gradient this window. Only their views hold data: the first
        # write of a window overwrites (no zeroing pass); untouched views are zeroed at the boundary.
        self._touched: set[int] = set()
        self._weights: list[float] = []
        self._dropped: set[int] = set()
        # The buffer holds sum(g) / _divisor. With 'mean' and known N, 1/N is fused up front.
        self._divisor = float(self.accumulation_steps) if (
            self.reduction == "mean" and self.accumulation_steps) else 1.0
        self._found_inf.zero_()
        self._at_boundary = False
        self._dp_totals = None
        if self._reducer is not None:
            self._reducer.reset()
        self._release_grads()

    def reset_window(self) -> None:
        """Discard the accumulated window."""
        self._ready = {}
        self._reset_window()

    def _release_grads(self) -> None:
        for p in self._params:
            p.grad = None
            if _HAS_GRAD_DTYPE and p.dtype in _LOW_PRECISION:
                p.grad_dtype = None
        for m in self._masters.values():
            m.grad = None

    def _before_grad_accumulation(self, grad: torch.Tensor) -> None:
        """Runs before autograd accumulates a param's gradient: marks the start of a micro-batch."""
        self._begin_gradient()

    def _begin_gradient(self) -> None:
        if self._at_boundary:
            raise RuntimeError(
                f"AccumulatingOptimizer: a backward pass started after the window of "
                f"{self.accumulation_steps} micro-batches was complete; call step() (or flush()) "
                "before the next backward")
        if not self._in_backward:
            self._in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket = self._buffer.bucket_of(p)
        ready = self._ready.setdefault(bucket.index, [])
        ready.append(p)
        if self.nonfinite != "skip_microbatch" and len(ready) == len(bucket.params):
            self._launch(ready)  # the bucket is complete: move it, free the grads
            del self._ready[bucket.index]
            n = self.accumulation_steps
            if self._reducer is not None and n is not None and self._micro_steps == n - 1:
                self._reducer.reduce_bucket(bucket)  # last micro-batch: overlap with backward

    def _fused_gradient_slot(self, p: torch.Tensor) -> tuple[torch.Tensor, float, bool,
                                                               torch.Tensor | None]:
        """For kernels that write p's gradient straight into the window (fuse_wgrad_accumulation).

        Called from backward instead of producing ``p.grad``. Returns ``(view, scale, overwrite,
        found_inf)``: the caller computes ``view = (0 if overwrite else view) + scale * grad`` in
        fp32 and, if ``found_inf`` is not None, sets it to 1 when that gradient is non-finite.
        The micro-batch is counted at the end of the backward like any other.
        """
        if self.nonfinite == "skip_microbatch":
            raise RuntimeError("fused gradient writes cannot be undone: nonfinite='skip_microbatch' "
                               "is not supported with fuse_wgrad_accumulation")
        self._begin_gradient()
        overwrite = id(p) not in self._touched
        self._touched.add(id(p))
        return self._buffer.view(p), self._prescale(), overwrite, self._found_inf

    def _framework_ends_window(self) -> bool:
        """HF Accelerate (``accelerator.accumulate``) and the HF Trainer set
        ``GradientState.sync_gradients`` for each micro-batch. Once it has been False for one of
        ours, True marks the last micro-batch of a window, short ones at the end of an epoch too."""
        module = sys.modules.get("accelerate.state")
        if module is None or module.GradientState._shared_state == {}:
            return False
        state = module.GradientState()
        sync = bool(state.sync_gradients)
        if not sync or state.num_steps > 1:  # Accelerator(gradient_accumulation_steps>1) drives
            self._framework_driven = True
        return sync and self._framework_driven

    def _end_of_backward(self) -> None:
        self._in_backward = False
        ends_window = self._closure_ends_window or self._framework_ends_window()
        if self.accumulate_in_backward:
            self._take_microbatch(1, end_window=ends_window)
            return
        self._unmoved += 1  # counted now, moved by accumulate()/step() ...
        if ends_window or (self.sync_step and self.accumulation_steps is not None):
            self.accumulate(end_window=ends_window)  # ... or now, so .grad shows the window

    def accumulate(self, *, end_window: bool = False) -> None:
        """Move the model's current ``.grad`` into the window as one micro-batch.

        Needed only with ``accumulate_in_backward=False`` (``step()`` calls it too). If several
        backwards ran since the last call, their summed ``.grad`` counts as that many micro-batches.
        """
        if self._at_boundary:
            return
        for p in self._params:
            if p.grad is not None:
                self._ready.setdefault(self._buffer.bucket_of(p).index, []).append(p)
        count, self._unmoved = self._unmoved, 0
        if self._ready and not count:  # grads set without a backward we saw: one micro-batch
            count = 1
        if count:
            self._take_microbatch(count, end_window=end_window)

    def _take_microbatch(self, count: int, end_window: bool = False) -> None:
        """Close ``count`` micro-batches: move the grads not yet moved, maybe end the window."""
        ready, self._ready = self._ready, {}
        kept = True
        if self.nonfinite == "skip_microbatch":
            grads = [p.grad for params in ready.values() for p in params if p.grad is not None]
            kept = not grads or bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        for params in ready.values():
            if kept:
                self._launch(params)
            else:
                for p in params:
                    p.grad = None
        first = self._micro_steps
        self._micro_steps += count
        if kept:
            self._kept += count
        else:
            self._dropped.update(range(first, self._micro_steps))
            self.skipped_microbatches += count
            self._scaler.update(found_inf=True)
        n = self.accumulation_steps
        if end_window or (n is not None and self._micro_steps >= n):
            self._finish_window()

    def _launch(self, params: list[torch.Tensor]) -> None:
        """Move the grads of ``params`` (all of one bucket) with one fused launch."""
        # AccumulateGrad runs (and calls the post-accumulate-grad hook) even when a gradient is
        # undefined: a custom autograd.Function returning None for it, or a weight whose
        # gradient fuse_wgrad_accumulation wrote straight into the window. Nothing to move.
        params = [p for p in params if p.grad is not None]
        if not params:
            return
        found_inf = self._found_inf if self.nonfinite != "skip_microbatch" else None
        first = [p for p in params if id(p) not in self._touched]
        # Normally all or none of a bucket's params are new to the window: one launch.
        for group, overwrite in ((first, True), ([p for p in params if id(p) in self._touched], False)):
            if group:
                self._buffer.accumulate(group, [p.grad for p in group], self._prescale(),
                                        overwrite=overwrite, found_inf=found_inf,
                                        backend=self.backend)
        for p in params:
            p.grad = None
            self._touched.add(id(p))

    def _local_weight(self) -> float:
        return sum(w for i, w in enumerate(self._weights) if i not in self._dropped)

    def _finish_window(self) -> None:
        """The boundary: (reduce across ranks,) normalise, show the result as the model's .grad."""
        untouched = [self._buffer.view(p) for p in self._params if id(p) not in self._touched]
        if untouched:  # stale data from an earlier window: zero, so norms and clipping see 0
            torch._foreach_zero_(untouched)
        if self._reducer is not None:
            totals = self._reducer.finish(self._micro_steps, self._kept, self._local_weight(),
                                          self._found_inf,
                                          [id(p) in self._touched for p in self._params])
            self._dp_totals = totals
            self._touched = {id(p) for p, t in zip(self._params, totals.touched) if t}
            if totals.found_inf:
                self._found_inf.fill_(1.0)
        self._normalise()
        self._expose_window()

    def _expose_window(self) -> None:
        """Both the model params and the inner optimizer's (master) params see the window as
        ``.grad``: frameworks clip either ``model.parameters()`` or ``optimizer.param_groups``."""
        for p in self._params:
            if id(p) not in self._touched:  # like native: no gradient, no .grad
                continue
            master = self._masters.get(id(p))
            if master is not None:
                master.grad = self._buffer.view(p)
            if p.dtype in _LOW_PRECISION:
                if not _HAS_GRAD_DTYPE:
                    continue
                p.grad_dtype = torch.float32
            p.grad = self._buffer.view(p)
        self._at_boundary = True

    def _target_divisor(self) -> float | None:
        """What the window's gradient sum is divided by (over all ranks with process_group)."""
        totals = self._dp_totals
        if self.reduction == "sum":  # data parallel: the average over ranks, like DDP
            return float(totals.world) if totals else 1.0
        if self.reduction == "mean":
            kept = totals.kept if totals else self._kept
            return float(kept) if kept else None
        total = totals.weight if totals else self._local_weight()
        return total if total > 0 else None

    def _normalise(self) -> None:
        target = self._target_divisor()
        if target is None or target == self._divisor:
            return
        factor = self._divisor / target
        for flat in self._buffer.buffers.values():
            flat.mul_(factor)
        self._divisor = target

    # -- the step -------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the model's ``.grad``; the accumulated window is kept (see reset_window)."""
        for p in self._params:
            if self._at_boundary or set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @torch.no_grad()
    def flush(self) -> None:
        """Take the step now, for a short last window (e.g. at the end of an epoch)."""
        self._step(force=True)

    @torch.no_grad()
    def step(self, closure=None):
        """Run ``closure`` (if any), then step if the window is complete; returns its loss.

        Lightning calls ``step(closure)`` only to end a window (a short one at the end of an
        epoch too) and runs the window's last forward/backward, and its clipping, inside the
        closure: so a Lightning closure's backward is the boundary, and the step is real.
        """
        loss = None
        if closure is not None:
            ends = _is_lightning_closure(closure)
            self._closure_ends_window = ends or self._boundary_only or self.accumulation_steps is None
            try:
                with torch.enable_grad():
                    loss = closure()
            finally:
                self._closure_ends_window = False
            self._step(force=ends)
        else:
            self._step(force=False)
        return loss

    def _step(self, force: bool) -> None:
        if not self.accumulate_in_backward:
            self.accumulate()
        self._step_calls += 1
        # A caller that has called step() only at window ends (HF Trainer, Accelerate, Lightning)
        # ends a short window (the end of an epoch) the same way: then it is a boundary too.
        short_window_end = self._boundary_only and self._micro_steps > 0
        ended = self._at_boundary  # e.g. a framework marked this micro-batch as the last
        if self._micro_steps == 0 or not (force or self.sync_step or short_window_end or ended):
            return
        self._boundary_only = self._step_calls == 1
        if not self._at_boundary:
            self._finish_window()
        kept = self._dp_totals.kept if self._dp_totals else self._kept
        if kept == 0:  # every micro-batch was dropped (on every rank)
            self.skipped_steps += 1
            self._reset_window()
            return
        if self.reduction == "weighted" and self._target_divisor() is None:
            raise ValueError("reduction='weighted' needs add_weight() for the window's micro-batches")
        if self.nonfinite != "skip_microbatch" and bool(self._found_inf.item()):
            if self.nonfinite == "raise":
                raise FloatingPointError(f"non-finite gradient in {self._first_nonfinite()}")
            self.skipped_steps += 1
            self._scaler.update(found_inf=True)
            self._reset_window()
            return
        if self.max_grad_norm is not None:
            self._clip(self.max_grad_norm)
        self._inner_step()
        self._scaler.update(found_inf=False)
        self._reset_window()

    def _first_nonfinite(self) -> str:
        for i, p in enumerate(self._params):
            if not bool(torch.isfinite(self._buffer.view(p)).all()):
                return self._names.get(id(p), f"parameter {i} (shape {tuple(p.shape)})")
        return "the window (the gradient was non-finite when accumulated)"

    def _clip(self, max_norm: float) -> None:
        norms = [torch.linalg.vector_norm(flat) for flat in self._buffer.buffers.values()]
        device = norms[0].device
        total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for flat in self._buffer.buffers.values():
            flat.mul_(coef.to(flat.device))
        self.last_grad_norm = total

    def _inner_step(self) -> None:
        lowp, masters = [], []
        for p in self._params:
            master = self._masters.get(id(p))
            if master is not None:
                lowp.append(p)
                masters.append(master)
            if id(p) not in self._touched:  # the inner optimizer skips params without .grad
                continue
            view = self._buffer.view(p)
            if master is not None:
                master.grad = view
            elif p.dtype in _LOW_PRECISION:  # master_weights=False: grads in the param dtype
                if _HAS_GRAD_DTYPE:
                    p.grad_dtype = None
                p.grad = view.to(p.dtype)
            else:
                p.grad = view
        self.optimizer.step()
        if lowp:
            torch._foreach_copy_(lowp, masters)

    # -- checkpointing ----------------------------------------------------------------------
    def _master_list(self) -> list[torch.Tensor]:
        return [self._masters[id(p)] for p in self._params if id(p) in self._masters]

    def state_dict(self) -> dict:
        """Everything needed to resume mid-window exactly (loadable with weights_only=True)."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "master_weights": self._master_list(),
            "main_grad": list(self._buffer.buffers.values()),
            "window": {
                "micro_steps": self._micro_steps,
                "step_calls": self._step_calls,
                "boundary_only": self._boundary_only,
                "unmoved": self._unmoved,
                "touched": [i for i, p in enumerate(self._params) if id(p) in self._touched],
                "kept": self._kept,
                "weights": list(self._weights),
                "dropped": sorted(self._dropped),
                "divisor": self._divisor,
                "at_boundary": self._at_boundary,
            },
            "found_inf": self._found_inf,
            "loss_scale": self._scaler.state_dict(),
            "skipped_steps": self.skipped_steps,
            "skipped_microbatches": self.skipped_microbatches,
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a state_dict() of a wrapper built the same way (same params and options)."""
        missing = {"optimizer", "master_weights", "main_grad", "window"} - set(state_dict)
        if missing:
            raise ValueError(
                f"load_state_dict: not an AccumulatingOptimizer state_dict (missing "
                f"{sorted(missing)}); to load the inner optimizer's own state use "
                "opt.optimizer.load_state_dict() before wrapping it")
        masters = self._master_list()
        buffers = list(self._buffer.buffers.values())
        for name, mine, theirs in (("master_weights", masters, state_dict["master_weights"]),
                                   ("main_grad", buffers, state_dict["main_grad"])):
            if len(mine) != len(theirs) or any(a.shape != b.shape for a, b in zip(mine, theirs)):
                raise ValueError(f"load_state_dict: {name} does not match this optimizer's params")
        window = state_dict["window"]
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self._scaler.load_state_dict(state_dict["loss_scale"])
        for mine, theirs in zip(masters + buffers, state_dict["master_weights"] + state_dict["main_grad"]):
            mine.copy_(theirs)
        lowp = [p for p in self._params if id(p) in self._masters]
        if lowp:
            torch._foreach_copy_(lowp, masters)
        self._reset_window()
        self._micro_steps = int(window["micro_steps"])
        self._step_calls = int(window["step_calls"])
        self._boundary_only = bool(window["boundary_only"])
        self._unmoved = int(window["unmoved"])
        self._touched = {id(self._params[int(i)]) for i in window["touched"]}
        self._kept = int(window["kept"])
        self._weights = [float(w) for w in window["weights"]]
        self._dropped = set(int(i) for i in window["dropped"])
        self._divisor = float(window["divisor"])
        self._found_inf.copy_(state_dict["found_inf"])
        self.skipped_steps = int(state_dict["skipped_steps"])
        self.skipped_microbatches = int(state_dict["skipped_microbatches"])
        if window["at_boundary"]:  # saved already normalised (and reduced): only show it again
            self._expose_window()

    def remove_hooks(self) -> None:
        """Detach from the model's params (the wrapper stops accumulating during backward)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
