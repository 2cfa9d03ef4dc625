"""HF Accelerate: ``AccumulatingAccelerator`` instead of ``Accelerator``; the loop is unchanged.

    from accumkernels.integrations.accelerate import AccumulatingAccelerator
    accelerator = AccumulatingAccelerator(gradient_accumulation_steps=4)  # the one line
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

It is an ``accelerate.Accelerator`` whose ``prepare`` also

* wraps every optimizer it prepares in ``AccumulatingOptimizer(..., accumulation_steps=None,
  **accumkernels)``: the prepared optimizer forwards ``step()``/``zero_grad()`` only on sync
  micro-batches, so every ``step()`` the wrapper receives ends a window (the short one at the
  end of a loader included);
* registers ``accumkernels.ddp_comm_hook`` on every ``DistributedDataParallel`` module it builds
  (``accelerate launch`` with several processes), where Accelerate itself accepts only its
  ``DDPCommunicationHookType`` enum;
* makes a window the wrapper skipped (non-finite, ``nonfinite="skip_step"``) a skipped step for
  Accelerate, as a GradScaler overflow is: the prepared optimizer's ``step_was_skipped`` is
  True, so ``accelerator.optimizer_step_was_skipped`` is, and a prepared LR scheduler does not
  advance.

DeepSpeed, FSDP and Megatron-LM (engines that own the gradient path) are refused when it is
built; so is ``reduction="mean"`` with ``gradient_accumulation_steps`` > 1 (``backward`` already
divides the loss by it). ``accelerate`` is imported when ``AccumulatingAccelerator`` is first used.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping

import torch

from accumkernels import integrations as common
from accumkernels._engines import foreign_engine_error

__all__ = ["AccumulatingAccelerator", "make_skips_visible"]


class _SkipTracker:
    """Whether the wrapper's last window end dropped the window: ``skipped_steps`` went up since
    its last real step (marked by a step post-hook on the wrapper, which fires on real steps
    only, as torch's fires only when GradScaler lets ``optimizer.step()`` run)."""

    def __init__(self, wrapper):
        self.wrapper = wrapper
        self.mark = wrapper.skipped_steps
        wrapper.register_step_post_hook(self._post)

    def _post(self, wrapper, args, kwargs) -> None:
        self.mark = wrapper.skipped_steps

    @property
    def skipped(self) -> bool:
        return self.wrapper.skipped_steps != self.mark


@functools.cache
def _skip_aware_class() -> type:
    from accelerate.optimizer import AcceleratedOptimizer

    class SkipAwareAcceleratedOptimizer(AcceleratedOptimizer):
        """An AcceleratedOptimizer whose ``step_was_skipped`` also reports a window the
        AccumulatingOptimizer inside it dropped."""

        _accumkernels_tracker: _SkipTracker | None = None

        @property
        def step_was_skipped(self) -> bool:
            """Whether the last step was skipped: GradScaler overflow or a dropped window."""
            tracker = self._accumkernels_tracker
            return bool(self._is_overflow or (tracker is not None and tracker.skipped))

    return common.module_level(SkipAwareAcceleratedOptimizer, __name__)


def make_skips_visible(prepared: object) -> None:
    """Let Accelerate (and the HF Trainer, which asks ``accelerator.optimizer_step_was_skipped``)
    see a window the wrapper skipped, as it sees a GradScaler skip.

    ``Accelerator.prepare_optimizer`` always builds a plain ``AcceleratedOptimizer``; the
    prepared object is given a subclass that only changes the ``step_was_skipped`` property,
    in place, so every reference Accelerate, the Trainer and LR schedulers already hold (a
    scheduler may have patched ``step`` on the instance) sees it.
    """
    from accelerate.optimizer import AcceleratedOptimizer

    cls = _skip_aware_class()
    if isinstance(prepared, cls):
        return
    if type(prepared) is not AcceleratedOptimizer:
        raise TypeError(f"accumkernels: cannot report skipped windows through "
                        f"{type(prepared).__name__} (expected Accelerate's AcceleratedOptimizer)")
    wrapper = common.inner_wrapper(prepared)
    if wrapper is None:
        raise TypeError("accumkernels: this prepared optimizer holds no AccumulatingOptimizer")
    prepared._accumkernels_tracker = _SkipTracker(wrapper)
    prepared.__class__ = cls


def _refuse_engines(accelerator) -> None:
    from accelerate.utils import DDPCommunicationHookType, DistributedType

    foreign = {DistributedType.DEEPSPEED: "DeepSpeed", DistributedType.FSDP: "FSDP",
               DistributedType.MEGATRON_LM: "Megatron-LM"}
    engine = foreign.get(accelerator.distributed_type)
    if engine is not None:
        raise foreign_engine_error(f"the Accelerator is configured for {engine}")
    handler = accelerator.ddp_handler
    if handler is not None and handler.comm_hook != DDPCommunicationHookType.NO:
        raise ValueError(
            f"accumkernels: DistributedDataParallelKwargs(comm_hook={handler.comm_hook!r}) asks "
            "for another DDP communication hook; DDP takes one, and the wrapper needs "
            "accumkernels.ddp_comm_hook to reduce its fp32 window. Leave comm_hook out.")


def _divides(steps: int) -> str | None:
    """What Accelerate does to the loss with ``steps`` micro-batches per window (for the refusal
    of ``reduction="mean"``): ``backward`` divides by them when there are more than one."""
    if steps <= 1:
        return None
    return (f"Accelerate's accelerator.backward(loss) divides the loss by "
            f"gradient_accumulation_steps={steps}")


def _steps_before_init(init, accelerator, args: tuple, kwargs: dict) -> int:
    """``gradient_accumulation_steps`` as ``Accelerator.__init__`` will resolve it (its
    argument, a ``GradientAccumulationPlugin``, or ``ACCELERATE_GRADIENT_ACCUMULATION_STEPS``),
    read before it builds its process-wide state. Arguments it refuses: 1 (it says why)."""
    from accelerate.utils import parse_choice_from_env

    try:
        given = inspect.signature(init).bind_partial(accelerator, *args, **kwargs).arguments
        plugin = given.get("gradient_accumulation_plugin")
        if plugin is not None:
            return int(plugin.num_steps)
        steps = given.get("gradient_accumulation_steps", 1)
        return int(parse_choice_from_env("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", steps))
    except (TypeError, ValueError, AttributeError):
        return 1


def _build_class() -> type:
    from accelerate import Accelerator

    class AccumulatingAccelerator(Accelerator):
        """``accelerate.Accelerator`` that turns on fp32 accumulation for what it prepares.

        Args: those of ``Accelerator``, and ``accumkernels``: a dict of AccumulatingOptimizer
        keyword arguments (``reduction``, ``master_weights``, ``max_grad_norm``,
        ``nonfinite``, ...), passed through to every wrapper it builds; checked (names and
        values) before Accelerate builds anything. With ``gradient_accumulation_steps`` > 1
        ``accelerator.backward`` divides the loss, and ``reduction="mean"`` (a second
        division) is refused; with 1 it divides nothing, and ``"mean"`` divides the windows of
        a hand loop (several backwards per ``step()``) as the loop asks.
        """

        def __init__(self, *args, accumkernels: Mapping | None = None, **kwargs):
            steps = _steps_before_init(Accelerator.__init__, self, args, kwargs)
            options = common.check_options(accumkernels, normalised_by=_divides(steps))
            super().__init__(*args, **kwargs)
            self.accumkernels_options = options
            _refuse_engines(self)

        def _check_before_wrapping(self, optimizers) -> None:
            """``gradient_accumulation_steps`` may have been raised since construction (its
            setter): the second division is refused before anything is prepared; so are options
            for an optimizer that is already a wrapper."""
            common.check_options(self.accumkernels_options,
                                 normalised_by=_divides(self.gradient_accumulation_steps))
            for optimizer in optimizers:
                common.refuse_options_for_wrapped(common.inner_wrapper(optimizer),
                                                  self.accumkernels_options)

        def prepare(self, *args, device_placement=None):
            """Accelerate's ``prepare``, after every object is checked (nothing is wrapped
            when one of them is refused, whatever the order of the arguments)."""
            self._check_before_wrapping(
                [obj for obj in args if isinstance(obj, torch.optim.Optimizer)])
            for obj in args:
                if isinstance(obj, torch.nn.Module):
                    common.refuse_foreign_engines(list(obj.parameters()), obj)
                    ddp = common.find_ddp(obj)
                    if ddp is not None:
                        common.check_ddp_hook(ddp)
                elif isinstance(obj, torch.optim.Optimizer) and common.inner_wrapper(obj) is None:
                    common.refuse_foreign_engines(
                        [p for g in obj.param_groups for p in g["params"]], optimizer=obj)
            return super().prepare(*args, device_placement=device_placement)

        def prepare_model(self, model: torch.nn.Module, device_placement=None,
                          evaluation_mode: bool = False):
            """Accelerate's ``prepare_model``; a DDP module it builds gets the comm hook."""
            common.refuse_foreign_engines(list(model.parameters()), model)
            ddp = common.find_ddp(model)
            if ddp is not None:  # a DDP module built by the user: check before Accelerate sees it
                common.check_ddp_hook(ddp)
            prepared = super().prepare_model(model, device_placement=device_placement,
                                             evaluation_mode=evaluation_mode)
            ddp = common.find_ddp(prepared)
            if ddp is not None and not evaluation_mode:
                common.register_ddp_hook(ddp)
            return prepared

        def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
            """Accelerate's ``prepare_optimizer`` on ``AccumulatingOptimizer(optimizer)``."""
            self._check_before_wrapping([optimizer])
            if getattr(optimizer, "_is_accelerate_prepared", False):
                return super().prepare_optimizer(optimizer, device_placement=device_placement)
            wrapper = common.wrap_optimizer(optimizer, self.accumkernels_options)
            prepared = super().prepare_optimizer(wrapper, device_placement=device_placement)
            make_skips_visible(prepared)
            return prepared

    return common.module_level(AccumulatingAccelerator, __name__)


@functools.cache
def _accelerator_class() -> type:
    return _build_class()


def __getattr__(name: str):
    if name == "AccumulatingAccelerator":  # built on first use: accelerate is imported then
        return _accelerator_class()
    if name == "SkipAwareAcceleratedOptimizer":
        return _skip_aware_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
