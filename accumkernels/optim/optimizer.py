"""AccumulatingOptimizer: the face. It composes the rooms and decides when a window ends.

Rooms: ``config`` (arguments), ``window`` (counts and normalisation), ``intake`` (hooks, fused
launches, what ``p.grad`` shows), ``masters`` (fp32 master weights), ``nonfinite`` (flag and
policy), ``scaling`` (loss scale), ``distributed`` (ranks). Each owns its piece of the
checkpoint; this file only assembles them.
"""

from __future__ import annotations

import math
import weakref

import torch

from accumkernels import backends
from accumkernels._engines import refuse_foreign_engines
from accumkernels._util import LOW_PRECISION, finite_positive
from accumkernels.buffer import Bucket, MasterGradBuffer
from accumkernels.checks import check_model
from accumkernels.optim import checkpoint, protocol
from accumkernels.optim.config import make_config
from accumkernels.optim.distributed import DataParallel, refuse_sharded
from accumkernels.optim.intake import Intake
from accumkernels.optim.masters import MasterWeights
from accumkernels.optim.nonfinite import NonFinite
from accumkernels.optim.outside import OutsideParams
from accumkernels.optim.refusals import check_inner, refuse_sparse_modules, take_over
from accumkernels.optim.scaling import LossScaler
from accumkernels.optim.stepping import StepMixin
from accumkernels.optim.window import Window
from accumkernels.slot import SLOT_ATTR

__all__ = ["AccumulatingOptimizer"]

_OWNER_ATTR = "_accumkernels_wrapper"
# Params summed in the fp32 window; float64 params train natively (see optim.outside).
_WINDOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class _Slot:
    """The wrapper's side of the slot protocol (accumkernels.slot); holds its owner weakly."""

    def __init__(self, owner: AccumulatingOptimizer):
        self._owner = weakref.ref(owner)

    @property
    def owner(self):
        return self._owner()

    def check_fusable(self) -> None:
        owner = self._owner()
        if owner is not None and owner._nonfinite.per_microbatch:
            raise ValueError("fused gradient writes cannot be undone: nonfinite='skip_microbatch' "
                             "is not supported with fuse_wgrad_accumulation")

    def __reduce__(self):  # a pickled or copied param carries a slot with no owner
        return _dead_slot, ()

    def claim(self, p: torch.Tensor):
        owner = self._owner()
        if owner is None:
            raise RuntimeError("the AccumulatingOptimizer that managed this param is gone")
        return owner._intake.claim(p)


def _dead_slot() -> _Slot:
    slot = _Slot.__new__(_Slot)
    slot._owner = lambda: None
    return slot


class AccumulatingOptimizer(StepMixin, torch.optim.Optimizer):
    """Wraps a constructed optimizer; accumulates micro-batch gradients in fp32, then steps it.

    It shares ``param_groups`` with the inner optimizer, so LR schedulers and training
    frameworks accept it unchanged. Between backwards every managed param's ``p.grad`` is the
    running window, summed in fp32: a zero-copy view of the master buffer (also ``p.main_grad``).

    Args:
        optimizer: the inner optimizer, already built on the model's params.
        accumulation_steps: N, or None. With N, ``step()`` is a no-op until N micro-batches
            (backwards) are in the window, so it may be called every micro-batch. With None,
            every ``step()`` ends the window: the recipe for the HF Trainer, a prepared
            Accelerate optimizer and Lightning, which call ``step()`` only at window ends.
        reduction: ``"sum"`` (native accumulation, in fp32), ``"mean"`` (divide by the
            micro-batches kept) or ``"weighted"`` (divide by the ``add_weight`` total).
        master_weights: ``"auto"`` (True when any param is bf16/fp16), True or False.
        accumulate_in_backward: move gradients with fused launches during backward (True) or
            let autograd keep them in ``.grad`` until ``accumulate()``/``step()`` (False).
        max_grad_norm: fused global-norm clipping at the step; ``last_grad_norm`` reports it.
        nonfinite: ``"skip_step"``, ``"skip_microbatch"`` or ``"raise"``.
        loss_scale: None, a float, or ``"dynamic"``; use ``scale_loss(loss)``.
        process_group: all-reduce (average) the fp32 window across ranks once per step.
        bucket_size_mb: size of the buckets (unit of fused launches and of reduction).
        backend: kernel backend for ``accumulate_`` (``"auto"``, ``"cuda"``, ...).
        model: optional module: names params in errors and runs ``check_model``. A
            ``DistributedDataParallel`` module: DDP reduces the fp32 window (the wrapper
            registers ``accumkernels.ddp_comm_hook`` on it; see accumkernels.optim.ddp).
        independent_ranks: allow a multi-rank job without ``process_group`` or DDP (ranks
            train apart).
    """

    _takes_dtensors = False  # FSDP2 (issue 22): True in accumkernels.optim.fsdp2's subclass

    def __new__(cls, optimizer=None, *args, **kwargs):
        # FSDP2 (issue 22): DTensor params get their own room, accumkernels.optim.fsdp2
        if cls is AccumulatingOptimizer and torch.distributed.is_available():
            from accumkernels.optim import fsdp2
            if fsdp2.is_sharded(optimizer):
                cls = fsdp2.ShardedAccumulatingOptimizer
        return super().__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, *, accumulation_steps=None,
                 reduction="sum", master_weights="auto", accumulate_in_backward=True,
                 max_grad_norm=None, nonfinite="skip_step", loss_scale=None,
                 process_group=None, bucket_size_mb=25, backend="auto", model=None,
                 independent_ranks=False):
        check_inner(optimizer, AccumulatingOptimizer, _OWNER_ATTR)
        self.config = cfg = make_config(
            accumulation_steps=accumulation_steps, reduction=reduction,
            master_weights=master_weights, accumulate_in_backward=accumulate_in_backward,
            max_grad_norm=max_grad_norm, nonfinite=nonfinite, loss_scale=loss_scale,
            bucket_size_mb=bucket_size_mb, backend=backend, independent_ranks=independent_ranks)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if p.requires_grad and p.dtype in _WINDOW_DTYPES]
        refuse_foreign_engines(params, model=model, optimizer=optimizer)  # DeepSpeed, FSDP1
        if not self._takes_dtensors:  # FSDP2 (issue 22): the fsdp2 room checks its own
            refuse_sharded(params)  # stray DTensor params: refused before any state is built
        # torch.optim.Optimizer.__init__ would build its own param_groups and patch step() to
        # run hooks on every call; the wrapper shares the inner optimizer's groups and runs the
        # hooks around real steps only (optim.protocol).
        protocol.init_hook_registries(self)
        self._warned_capturable_if_run_uncaptured = True
        self.optimizer = optimizer
        self._needs_closure = protocol.needs_closure(optimizer)
        self._outside = OutsideParams(optimizer)
        self._names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if model is not None:
            check_model(model)
            refuse_sparse_modules(model)
        self._scaler = LossScaler(cfg.loss_scale)
        self._window = Window(cfg)
        self._masters = MasterWeights(optimizer, master_weights == "auto" and any(
            p.dtype in LOW_PRECISION for p in params) or master_weights is True)
        self.last_grad_norm: torch.Tensor | None = None
        self._params: list[torch.Tensor] = []
        self._intake = None
        self._build(params)
        self._nonfinite = NonFinite(cfg, next(iter(self._buffer.buffers), torch.device("cpu")))
        self._dp = DataParallel(self, process_group, independent_ranks=cfg.independent_ranks,
                                ddp=ddp)
        setattr(optimizer, _OWNER_ATTR, weakref.ref(self))

    def _build(self, params: list[torch.Tensor]) -> None:
        """(Re)build the buffer, the masters and the hooks for the managed ``params``."""
        for device in {p.device for p in params}:  # an unusable backend fails here, before
            backends.resolve(self.config.backend, device)  # anything is touched
        take_over(params, self)
        buffer = MasterGradBuffer(params, bucket_size_mb=self.config.bucket_size_mb)
        if self._intake is not None:
            self._intake.hide_all()
            self._intake.remove()
        self._masters.retarget(params)
        self._params, self._buffer = params, buffer
        slot = _Slot(self)
        for p in params:
            setattr(p, SLOT_ATTR, slot)
            p.grad = None
        self._outside.rebuild({id(p) for p in self._masters.master_list()}
                              | {id(p) for p in self._params})
        self._intake = Intake(self, params, buffer,
                              move_in_backward=self.config.accumulate_in_backward,
                              outside=[p for p in self._outside.params
                                       if p.is_leaf and p.requires_grad])

    def _rebase_buffer(self) -> None:
        """A new buffer on the params' current devices (they moved); the hooks stay."""
        for device in {p.device for p in self._params}:
            backends.resolve(self.config.backend, device)
        self._buffer = MasterGradBuffer(self._params, bucket_size_mb=self.config.bucket_size_mb)
        self._intake.rebase(self._buffer)

    # -- sharing the inner optimizer ----------------------------------------------------------
    param_groups = property(lambda self: self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self.optimizer.state,
                     lambda self, v: setattr(self.optimizer, "state", v))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, v: setattr(self.optimizer, "defaults", v))

    def __getattr__(self, name):
        """The options (``opt.reduction``, ...), then the inner optimizer's public attributes
        (what frameworks duck-type; ``train()``/``eval()`` of schedule-free optimizers)."""
        config = self.__dict__.get("config")
        if config is not None and name in config.__dataclass_fields__:
            return getattr(config, name)
        inner = self.__dict__.get("optimizer")
        if inner is not None and not name.startswith("_") and hasattr(inner, name):
            value = getattr(inner, name)
            if name in ("train", "eval") and callable(value):
                return self._moving_weights(value)
            return value
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _moving_weights(self, method):
        """An inner method that moves the weights it steps (schedule-free ``train``/``eval``):
        with master weights the model gets the moved masters."""
        def call(*args, **kwargs):
            out = method(*args, **kwargs)
            self._masters.copy_back()
            return out
        return call

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer; its trainable params join the window.

        Only between windows (after ``step()`` or ``reset_window()``): the master buffer is
        rebuilt to hold the new params (Lightning's ``BackboneFinetuning`` does this).
        """
        self._intake.settle()
        if not self._window.empty:
            raise ValueError(
                "add_param_group: the current window holds gradients; call it between windows "
                "(after step() or reset_window()), e.g. at the start of an epoch")
        self.optimizer.add_param_group(param_group)
        new = [p for p in self.optimizer.param_groups[-1]["params"] if p.requires_grad]
        self._build(self._params + new)

    # -- the window --------------------------------------------------------------------------
    @property
    def micro_steps(self) -> int:
        """Micro-batches (backwards) in the current window, dropped ones included."""
        return self._window.micro_steps + self._intake.unmoved

    @property
    def sync_step(self) -> bool:
        """Whether ``step()`` now ends the window (a real optimizer step)."""
        n = self.config.accumulation_steps
        return n is None or self.micro_steps >= n

    @property
    def skipped_steps(self) -> int:
        return self._nonfinite.skipped_steps

    @property
    def skipped_microbatches(self) -> int:
        return self._nonfinite.skipped_microbatches

    @property
    def master_params(self) -> list[torch.nn.Parameter]:
        """The fp32 master copies the inner optimizer steps (registration order)."""
        return self._masters.master_list()

    @property
    def collective_timeout(self) -> float | None:
        """Seconds to wait for peers' all-reduces (process_group) before raising."""
        return self._dp.reducer.timeout_s if self._dp.active else None

    @collective_timeout.setter
    def collective_timeout(self, seconds: float) -> None:
        if not self._dp.active:
            raise ValueError("collective_timeout needs process_group")
        self._dp.reducer.timeout_s = finite_positive("collective_timeout", seconds)

    @property
    def loss_scale(self) -> float:
        return self._scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; the matching 1/S is fused into accumulation."""
        return self._scaler.scale_loss(loss)

    def add_weight(self, weight: float | torch.Tensor) -> None:
        """Report the weight (e.g. token count) of a micro-batch whose loss is a sum."""
        if self.config.reduction != "weighted":
            raise ValueError(
                f"add_weight() needs reduction='weighted' (this one is {self.config.reduction!r})")
        if isinstance(weight, torch.Tensor) and weight.numel() != 1:
            raise TypeError("weight must be a number or a 1-element tensor")
        if isinstance(weight, bool) or not isinstance(weight, (int, float, torch.Tensor)) \
                and not hasattr(weight, "__float__"):
            raise TypeError(f"weight must be a number or a 1-element tensor, got "
                            f"{type(weight).__name__}")
        value = float(weight)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"weight must be finite and positive, got {value}")
        self._window.weights.append(value)
        self._dp.weight_added()  # DDP: a weight after the sync's agreement is agreed at step()
        if self._window.complete and not self._dp.active:
            self._normalise(self._target_divisor(None))

    def _prescale(self) -> float:
        """The scale fused into each launch: unscale the loss, and 1/N for 'mean' with known N."""
        return (1.0 / self._scaler.scale) / self._window.divisor

    def _microbatch_ended(self, kept: bool) -> None:
        """Intake's report: one backward (micro-batch) finished."""
        self._window.add_microbatch(kept)
        if not kept:
            self._nonfinite.skipped_microbatches += 1
            self._scaler.update(found_inf=True)
        if self._dp.end_backward():
            pass  # DDP synced this backward: the window is averaged, agreed on and normalised
        elif self._window.complete and not self._dp.active and self._window.kept:
            self._seal()  # N known and reached: show the window as the step will use it

    def _bucket_moved(self, bucket: Bucket) -> None:
        n = self.config.accumulation_steps
        self._dp.bucket_moved(bucket, n is not None and self._window.micro_steps == n - 1)

    def _settle(self) -> None:
        """Before any decision: close a failed backward, take in what ``.grad`` holds."""
        if self.config.accumulate_in_backward:
            self._intake.absorb_assigned()
        else:
            self._intake.move_unmoved()

    def accumulate(self) -> None:
        """Move the model's ``.grad`` into the window (``accumulate_in_backward=False``)."""
        self._settle()

    def _reset_window(self) -> None:
        self._window.reset()
        self._nonfinite.reset()
        self._dp.reset()

    def reset_window(self) -> None:
        """Discard the accumulated window; ``p.grad`` becomes None."""
        self._intake.settle()
        self._intake.pending = {}
        self._reset_window()
        self._intake.hide_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` like the inner optimizer would.

        With ``accumulation_steps=N`` a window still filling is kept (loops that call
        ``zero_grad()`` every micro-batch keep working). A window that is complete (e.g.
        GradScaler skipped its ``step()``), or any window with ``accumulation_steps=None``, is
        discarded, as native PyTorch drops those gradients.
        """
        self._settle()
        w = self._window
        keep = self._keeps_window()
        if not keep and not w.empty:
            self._reset_window()
        if set_to_none:
            self._intake.hide_all()
        elif not keep:  # native: zero grads stay, and the step still acts on those params
            for p, view in zip(self._params, self._intake.views):
                if p.grad is view:
                    view.zero_()
                    w.touched.add(id(p))
        if not keep:  # outside the window: cleared the native way, on the window's rule
            self._outside.clear(set_to_none)

    def _keeps_window(self) -> bool:
        """A clear now keeps the window: N given and the window still filling."""
        w = self._window
        return w.micro_steps > 0 and self.config.accumulation_steps is not None \
            and not w.complete

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume mid-window exactly (loadable with weights_only=True)."""
        self._settle()
        return protocol.state_dict_with_hooks(self, lambda: checkpoint.assemble(self))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict()``; a state that does not fit changes nothing (ValueError)."""
        protocol.load_with_hooks(self, state_dict, lambda sd: checkpoint.restore(self, sd))

    def __reduce__(self):
        """``copy.deepcopy`` and pickle: a new wrapper over a copy of the inner optimizer (and,
        as for any torch optimizer, of the params), with the window and masters restored."""
        if self._dp.active or self._dp.ddp_group is not None:
            raise TypeError("an AccumulatingOptimizer that reduces across ranks (process_group "
                            "or DDP) cannot be pickled or deep-copied; save its state_dict()")
        self._settle()
        kwargs = {f: getattr(self.config, f) for f in self.config.__dataclass_fields__}
        own = checkpoint.assemble(self)[checkpoint.OWN_KEY]
        return _rebuild, (checkpoint.native_copy(self), kwargs, own)

    def remove_hooks(self) -> None:
        """Detach from the model's params (the wrapper stops accumulating during backward)."""
        self._intake.remove()


def _rebuild(inner: torch.optim.Optimizer, kwargs: dict, own: dict) -> AccumulatingOptimizer:
    opt = AccumulatingOptimizer(inner, **kwargs)
    opt.load_state_dict({**inner.state_dict(), checkpoint.OWN_KEY: own})
    return opt
