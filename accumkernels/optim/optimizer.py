"""AccumulatingOptimizer: the face. It builds the rooms once and answers the optimizer protocol.

The rooms (each owns its state and its piece of the checkpoint; none holds the face):

* ``config`` (config.py): every argument, checked once; ``cadence`` (cadence.py): the caller's
  cadence as the face sees it (the warnings for a scheduler stepped on no-op steps, windows of
  one micro-batch);
* ``window`` (window.py): counts, weights, which params hold data, the divisor, the cadence;
* ``intake`` (intake/): hooks, fused launches (moves.py), what ``p.grad`` shows (showing.py);
  it reports upward through one seam (:class:`_Events`: a micro-batch ended, the window was
  dropped from outside, the params moved);
* ``step`` (step/): gather -> decide -> apply -> finish; with fp32 masters and a fused torch
  AdamW/Adam/SGD whose groups hold only what it implements, ``apply`` runs the fused master
  step (step/fused_master.py) in the inner optimizer's place;
* ``sync`` (sync/; FSDP2: fsdp2/layout.py): local, ``process_group``, DDP or the FSDP2 mesh,
  one protocol (sync/protocol.py); pipeline stages share a norm round (``StageNorm``, joined
  through ``join_stage_norm``);
* ``masters`` (masters.py), ``nonfinite`` (nonfinite.py), ``scaler`` (scaling.py), ``outside``
  (outside.py): fp32 master weights, the non-finite policy, loss scaling, params outside the
  window;
* the layout (parts.py's ``Layout``; fsdp2/): flat buffer or FSDP2 shards, picked by a factory;
* ``checkpoint`` (checkpoint/, fsdp2/checkpoint.py): assembles the rooms' pieces;
  checkpoint/live_state.py: what ``opt.state``/``opt.param_groups`` show.
"""

from __future__ import annotations

import weakref

import torch

from accumkernels._engines import refuse_foreign_engines
from accumkernels._util import finite_positive, known_keywords
from accumkernels.checks import check_model
from accumkernels.optim import protocol
from accumkernels.optim.cadence import Cadence
from accumkernels.optim.checkpoint import copies
from accumkernels.optim.config import make_config
from accumkernels.optim.intake.backward import remove_handles, weight_pass
from accumkernels.optim.intake.guard import follow_move
from accumkernels.optim.masters import MasterWeights
from accumkernels.optim.outside import OutsideParams
from accumkernels.optim.parts import (
    Parts,
    add_group,
    attach_slots,
    build_rooms,
    layout_for,
    managed,
    resolve_backends,
)
from accumkernels.optim.refusals import check_inner, refuse_sparse_modules, take_over
from accumkernels.optim.refusals import refuse_when_taken_over
from accumkernels.optim.scaling import LossScaler
from accumkernels.optim.sync.ddp import ddp_sync_for
from accumkernels.optim.sync.ddp_hook import register as register_ddp_hook

__all__ = ["AccumulatingOptimizer"]

_OWNER_ATTR = "_accumkernels_wrapper"


class _Events:
    """The intake's one seam upward: the step room and the move-following of the current
    rooms (``AccumulatingOptimizer._build`` binds them; nothing here holds the face)."""

    def __init__(self):
        self.step = None
        self.moved = None

    def bind(self, step, moved) -> None:
        self.step, self.moved = step, moved

    def microbatch_ended(self, kept: bool) -> None:
        self.step.microbatch_ended(kept)

    def window_dropped(self) -> None:
        self.step.reset_window()

    def params_moved(self) -> None:
        self.moved()


@refuse_when_taken_over(  # a wrapper whose params another took over refuses these (refusals.py)
    lambda face: getattr(face.__dict__.get("_parts"), "taken_over", None),
    "step", "flush", "accumulate", "reset_window", "zero_grad", "add_weight", "add_param_group",
    "weight_pass", "scale_loss", "state_dict", "window_template", "load_state_dict",
    "join_stage_norm", "micro_steps", "sync_step", "master_params", "__reduce__")
class AccumulatingOptimizer(torch.optim.Optimizer):
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
        master_weights: ``"auto"`` (True when any param is bf16/fp16), True or False;
            ``opt.master_weights`` answers what it resolved to.
        accumulate_in_backward: move gradients with fused launches during backward (True) or
            let autograd keep them in ``.grad`` until ``accumulate()``/``step()`` (False).
        max_grad_norm: global-norm clipping at the step; ``last_grad_norm`` reports it.
        nonfinite: ``"skip_step"``, ``"skip_microbatch"`` or ``"raise"``.
        loss_scale: None, a float, or ``"dynamic"``; use ``scale_loss(loss)``.
        process_group: all-reduce (average) the fp32 window across ranks once per step.
        bucket_size_mb: size of the buckets (unit of fused launches and of reduction).
        backend: kernel backend for ``accumulate_`` (``"auto"``, ``"cuda"``, ...).
        model: optional module: names params in errors and runs ``check_model``. A
            ``DistributedDataParallel`` module: DDP reduces the fp32 window (the wrapper
            registers ``accumkernels.ddp_comm_hook`` on it); a ``fully_shard`` root: required
            for FSDP2 (DTensor params).
        independent_ranks: allow a multi-rank job without ``process_group`` or DDP (ranks
            train apart).

    A misspelt keyword is a TypeError suggesting the option meant. With N given, each of these
    warns once per wrapper, naming its fix (``accumkernels.optim.AccumulationWarning``; silence
    with ``warnings.filterwarnings("ignore", category=AccumulationWarning)``): an LR scheduler
    stepped on ``step()`` calls that did not step; 3 windows in a row of one micro-batch (N > 1).
    """

    @known_keywords  # (a misspelt option: "did you mean", before anything is touched)
    def __init__(self, optimizer: torch.optim.Optimizer, *, accumulation_steps=None,
                 reduction="sum", master_weights="auto", accumulate_in_backward=True,
                 max_grad_norm=None, nonfinite="skip_step", loss_scale=None,
                 process_group=None, bucket_size_mb=25, backend="auto", model=None,
                 independent_ranks=False):
        check_inner(optimizer, AccumulatingOptimizer, _OWNER_ATTR)
        config = make_config(
            accumulation_steps=accumulation_steps, reduction=reduction,
            master_weights=master_weights, accumulate_in_backward=accumulate_in_backward,
            max_grad_norm=max_grad_norm, nonfinite=nonfinite, loss_scale=loss_scale,
            bucket_size_mb=bucket_size_mb, backend=backend, independent_ranks=independent_ranks)
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        ddp = model if isinstance(model, torch.nn.parallel.DistributedDataParallel) else None
        layout = layout_for(optimizer, model, {
            "model": model, "process_group": process_group, "nonfinite": nonfinite,
            "accumulate_in_backward": accumulate_in_backward})
        params = managed(optimizer)
        config = config.with_masters(params)  # (opt.master_weights answers True or False)
        refuse_foreign_engines(params, model=model, optimizer=optimizer)  # DeepSpeed, FSDP1
        layout.check(params)  # stray DTensor params: refused before any state is built
        # torch.optim.Optimizer.__init__ would build its own param_groups and patch step() to run
        # hooks on every call; the wrapper shares the inner's groups, hooks real steps only.
        protocol.init_hook_registries(self)
        self._warned_capturable_if_run_uncaptured = True
        self.optimizer, self.config, self._layout = optimizer, config, layout
        self._needs_closure = protocol.needs_closure(optimizer)
        names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        if model is not None:
            check_model(model)
            refuse_sparse_modules(model)
        masters = MasterWeights(optimizer, config.master_weights)
        self._parts = Parts(config, optimizer, names, masters, LossScaler(config.loss_scale),
                            OutsideParams(optimizer))
        self._events, self._cadence = _Events(), Cadence(config.accumulation_steps)
        self._intake = self._step = None
        self._build(params, process_group=process_group)
        if ddp is not None:
            _sync_for_ddp(self, ddp.process_group)
            register_ddp_hook(ddp)
        setattr(optimizer, _OWNER_ATTR, weakref.ref(self))

    def _build(self, params: list[torch.Tensor], process_group=None) -> None:
        """(Re)build the storage, window, sync, intake and step for the managed ``params``."""
        resolve_backends(self.config, params)
        take_over(params, self)
        if self._intake is not None:
            self._intake.hide_all()
            self._intake.remove()
        old = self._step
        self._intake, self._step = build_rooms(self._parts, self._layout, params, self._events,
                                               process_group)
        intake, parts, layout = self._intake, self._parts, self._layout
        self._events.bind(self._step, lambda: follow_move(parts, layout, intake))
        if old is not None:  # (the last step's norm outlives the rebuild)
            self._step.last_grad_norm = old.last_grad_norm
        if old is not None and parts.sync.stage_norm is not None:
            parts.sync.stage_norm.replace(old, self._step)
        weakref.finalize(self, remove_handles, self._intake.handles)  # hooks go with the wrapper
        attach_slots(self, self._intake, params, self._parts, _sync_for_ddp)

    # -- sharing the inner optimizer ----------------------------------------------------------
    # what state/param_groups show: the inner optimizer's, with the keys a checkpoint of the
    # wrapper holds (a tool that loads by the live keys finds them: optim/live_state.py)
    param_groups = property(lambda self: self._layout.checkpoint.groups_with_own_key(
                                self.optimizer) if "_intake" in self.__dict__
                            else self.optimizer.param_groups,
                            lambda self, v: setattr(self.optimizer, "param_groups", v))
    state = property(lambda self: self._layout.checkpoint.live_state(self._parts, self._intake)
                     if self.__dict__.get("_intake") is not None else self.optimizer.state,
                     lambda self, v: self._layout.checkpoint.set_state(self._parts, self._intake,
                                                                       v))
    defaults = property(lambda self: self.optimizer.defaults,
                        lambda self, v: setattr(self.optimizer, "defaults", v))

    def __getattr__(self, name):
        """The options (``opt.reduction``, ...), then the inner optimizer's public attributes
        (what frameworks duck-type; ``train()``/``eval()`` of schedule-free optimizers)."""
        d = self.__dict__
        return protocol.forward_attribute(self, d.get("config"), d.get("optimizer"), name,
                                          d["_parts"].masters if d.get("_parts") else None)

    def add_param_group(self, param_group: dict) -> None:
        """Add a group to the inner optimizer; its trainable params join the window.

        As natively, also in the middle of a window: what the window holds (and what ``.grad``
        holds: assigned gradients, unmoved ones with ``accumulate_in_backward=False``, the new
        params' own ``.grad``) stays and the step uses it. The master buffer is rebuilt to hold
        the new params (Lightning's ``BackboneFinetuning`` does this). A window reduced across
        ranks (``process_group``, DDP, FSDP2) is not rebuilt mid-window: there it is refused
        with nothing changed (call it between windows).
        """
        new, restore = add_group(self._intake, self._parts, self._layout, param_group)
        self._build(self._parts.params + new)
        restore(self._intake)

    # -- the step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        """Run ``closure`` (if any), then end the window if it is due; returns the closure's loss.

        The window ends when ``accumulation_steps`` is None, when N micro-batches are in, or
        (learned from this wrapper's own calls) when the caller has so far called ``step()``
        only on complete windows: such a caller (Trainer-style) ends a short last window the
        same way. A caller that calls ``step()`` before the window is complete (every
        micro-batch, Accelerate-style) gets no-ops until it is. Step hooks run around real
        steps only (not around a window dropped as non-finite: GradScaler skips
        ``optimizer.step()``). An inner optimizer that requires a closure (LBFGS) gets it: it
        evaluates the closure itself, each evaluation filling a fresh window.
        """
        args = (self,) if closure is None else (self, closure)
        if closure is not None and self._needs_closure:
            return protocol.run_step(self, args, {}, lambda: self._step.closure_step(closure))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._cadence.end_window(self._step, self.optimizer.param_groups, False, self.sync_step,
                                 lambda: self._step.run(protocol.StepHooks(self, args, {})))
        return loss

    @torch.no_grad()
    def flush(self) -> None:
        """Take the step now, for a short last window (e.g. at the end of an epoch)."""
        self._cadence.end_window(self._step, self.optimizer.param_groups, True, self.sync_step,
                                 lambda: self._step.run(protocol.StepHooks(self, (self,), {})))

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The window's global norm at the last real step (with ``max_grad_norm``)."""
        return self._step.last_grad_norm

    # -- the window ---------------------------------------------------------------------------
    @property
    def micro_steps(self) -> int:
        """Micro-batches (backwards) in the current window, dropped ones included."""
        return self._parts.window.micro_steps + self._intake.unmoved

    @property
    def sync_step(self) -> bool:
        """Whether ``step()`` now ends the window (a real optimizer step)."""
        return self._parts.window.step_ends_it(self._intake.unmoved)

    skipped_steps = property(lambda self: self._parts.nonfinite.skipped_steps)
    skipped_microbatches = property(lambda self: self._parts.nonfinite.skipped_microbatches)
    loss_scale = property(lambda self: self._parts.scaler.scale)

    @property
    def master_params(self) -> list[torch.nn.Parameter]:
        """The fp32 master copies the inner optimizer steps (registration order); a weight the
        user wrote since the last step is taken in first (as the next step would)."""
        return self._parts.masters.current()

    @property
    def process_group(self):
        """The group ``process_group=`` reduces the window over (else None; DDP: its own)."""
        sync = self._parts.sync
        return sync.reducer.group if sync.active and sync.ddp_group is None else None

    def join_stage_norm(self, stage_norm) -> None:
        """Clip by a norm measured with other pipeline stages' wrappers (``clip_across_stages``)."""
        sync = self._parts.sync
        if not sync.joins_stage_norm:
            raise TypeError("clip_across_stages expects the AccumulatingOptimizers of this "
                            "rank's stages (flat, DDP or process_group windows; not FSDP2)")
        stage_norm.add(self._step)
        sync.stage_norm = stage_norm

    @property
    def collective_timeout(self) -> float | None:
        """Seconds to wait for peers' all-reduces (process_group) before raising."""
        return self._parts.sync.timeout_s if self._parts.sync.active else None

    @collective_timeout.setter
    def collective_timeout(self, seconds: float) -> None:
        if not self._parts.sync.active:
            raise ValueError("collective_timeout needs process_group")
        self._parts.sync.timeout_s = finite_positive("collective_timeout", seconds)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * S``; the matching 1/S is fused into accumulation."""
        return self._parts.scaler.scale_loss(loss)

    def add_weight(self, weight: float | torch.Tensor) -> None:
        """Report the weight (e.g. token count) of a micro-batch whose loss is a sum."""
        if not self.config.weighted:
            raise ValueError(
                f"add_weight() needs reduction='weighted' (this one is {self.config.reduction!r})")
        parts = self._parts
        value = parts.sync.take_weight(weight)
        if value is None:  # refused on this rank: every rank raises at the ranks' next agreement
            return
        self._intake.notice_clears()  # (a clear since the last call ends the window first)
        parts.window.add_weight(value)
        parts.sync.weight_added()  # DDP: a weight after the sync's agreement is agreed at step()
        if parts.window.complete and not parts.sync.active:
            parts.window.normalise(parts.window.target_divisor())

    def weight_pass(self):
        """Context manager for a weight pass that computes weight gradients with
        ``torch.autograd.grad`` and assigns (or adds) them to ``.grad`` itself, as the split
        backward of pipeline schedules does (``accumkernels.integrations.pipelining`` enters it
        for every stage): what lands in ``.grad`` inside is one micro-batch, accumulated in fp32
        with the fused kernel, scaled, checked and counted like a backward's."""
        return weight_pass(self._intake)

    def accumulate(self) -> None:
        """Move the model's ``.grad`` into the window (``accumulate_in_backward=False``)."""
        self._intake.take_in()

    def reset_window(self) -> None:
        """Discard the accumulated window (with ``accumulate_in_backward=False`` also the
        gradients not yet moved, and their count); ``p.grad`` becomes None."""
        self._intake.discard()
        self._step.reset_window()
        self._intake.hide_all()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear ``.grad`` like the inner optimizer would.

        With ``accumulation_steps=N`` a window still filling is kept (loops that call
        ``zero_grad()`` every micro-batch keep working). A window that is complete (e.g.
        GradScaler skipped its ``step()``), or any window with ``accumulation_steps=None``, is
        discarded, as native PyTorch drops those gradients.
        """
        self._step.clear(set_to_none)

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to resume mid-window exactly (loadable with weights_only=True)."""
        self._intake.take_in()
        return protocol.state_dict_with_hooks(
            self, lambda: self._layout.checkpoint.assemble(self._parts, self._intake))

    def window_template(self):
        """Context manager: ``state_dict()`` inside (and so DCP's ``get_state_dict``) holds each
        param's window also at a window boundary (zeros), the template that a checkpoint taken
        in the middle of a window loads into with ``dcp.load`` (docs/checkpoints.md)."""
        return self._layout.checkpoint.showing_window(self._parts)

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict()``; a state that does not fit changes nothing (ValueError)."""
        protocol.load_with_hooks(self, state_dict, lambda sd: self._layout.checkpoint.restore(
            self._parts, self._intake, self._step, sd))

    def __reduce__(self):  # -- copies (checkpoint/copies.py)
        """``copy.deepcopy``, pickle, ``torch.save``: this class over a copy of the inner optimizer
        (and of the params), the window and masters restored, the instance's own attributes
        (a subclass's) kept; refused across ranks. ``copy.copy``: refused."""
        return copies.reduce(self, AccumulatingOptimizer)

    __getstate__, __setstate__, __copy__ = copies.getstate, copies.setstate, copies.refuse_copy

    def remove_hooks(self) -> None:
        """Detach from the model's params (the wrapper stops accumulating during backward)."""
        self._intake.remove()


def _sync_for_ddp(face: AccumulatingOptimizer, group):
    """DDP reduces this window over ``group`` (met at construction or at its first sync)."""
    parts, ref = face._parts, weakref.ref(face)
    parts.sync = ddp_sync_for(parts.sync, group, face.config, parts.window, parts.params,
                              lambda ps: ref()._intake.flush(ps), parts.nonfinite.found_inf)
    return parts.sync

