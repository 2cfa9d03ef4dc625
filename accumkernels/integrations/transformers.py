"""HF Trainer: ``AccumulatingTrainer`` instead of ``Trainer``; nothing else changes.

    from accumkernels.integrations.transformers import AccumulatingTrainer
    trainer = AccumulatingTrainer(model=model, args=args, train_dataset=ds)  # the one line

It is a ``transformers.Trainer`` that

* builds its optimizer as the Trainer does (``args.optim``, ``args.learning_rate``, the
  weight-decay groups; or the one given through ``optimizers=``/``optimizer_cls_and_kwargs=``)
  and wraps it in ``AccumulatingOptimizer(..., accumulation_steps=None, **accumkernels)``
  before Accelerate prepares it: the Trainer calls ``step()`` only at window ends (the short
  one at the end of an epoch included), clips ``p.grad`` (the fp32 window) with
  ``max_grad_norm`` and saves/loads the wrapper's ``state_dict`` in its checkpoints;
* registers ``accumkernels.ddp_comm_hook`` on the ``DistributedDataParallel`` module the
  Trainer builds in ``train()`` (several processes), before the first backward;
* reports a window the wrapper skipped (non-finite, ``nonfinite="skip_step"``) as a skipped
  optimizer step (``accelerator.optimizer_step_was_skipped``), so the Trainer does not advance
  its LR scheduler, as after a GradScaler overflow.

The loss stays as the Trainer computes it (already normalised over the window), hence the
wrapper's default ``reduction="sum"``; ``accumkernels={"reduction": "mean"}`` (a second division)
is refused. ``gradient_accumulation_steps=1`` warns once (``AccumulationWarning``) unless
``fp32_masters_only=True`` says it is meant. DeepSpeed and FSDP are refused. For a Trainer subclass
(TRL's ``SFTTrainer``, your own), put the mixin first:
``class MyTrainer(AccumulatingTrainerMixin, SFTTrainer)``. ``transformers`` is imported when
``AccumulatingTrainer`` is first used.
"""

from __future__ import annotations

import functools
import inspect
import warnings
import weakref
from collections.abc import Mapping

import torch

from accumkernels import integrations as common
from accumkernels._engines import foreign_engine_error
from accumkernels.optim import AccumulatingOptimizer

__all__ = ["AccumulatingTrainer", "AccumulatingTrainerMixin"]


# What the Trainer does to the loss, for the refusal of reduction="mean" (a second division).
_TRAINER_DIVIDES = ("the Trainer divides each micro-batch's loss by gradient_accumulation_steps "
                    "(or, for a model that takes loss kwargs, by the window's token count "
                    "num_items_in_batch)")


def _given_arguments(init, args: tuple, kwargs: dict) -> dict:
    """The Trainer's arguments by name, as its ``__init__`` will bind them (a call it refuses:
    the keywords only; the Trainer then says what is wrong)."""
    try:
        return dict(inspect.signature(init).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def _refuse_before_init(given: dict, options: dict, fp32_masters_only: bool) -> None:
    """What the Trainer's arguments show before it builds anything: ``fp32_masters_only`` with
    accumulation asked for, and options for an optimizer the user already wrapped."""
    if not isinstance(fp32_masters_only, bool):
        raise TypeError(f"fp32_masters_only must be a bool, got {fp32_masters_only!r}")
    steps = getattr(given.get("args"), "gradient_accumulation_steps", 1)
    if fp32_masters_only and steps != 1:
        raise ValueError(
            f"AccumulatingTrainer(fp32_masters_only=True) says the windows hold one micro-batch "
            f"on purpose, but the TrainingArguments ask for gradient_accumulation_steps={steps}; "
            f"drop fp32_masters_only (it only silences the warning about "
            f"gradient_accumulation_steps=1)")
    optimizers = given.get("optimizers")
    if isinstance(optimizers, (tuple, list)) and optimizers:
        common.refuse_options_for_wrapped(common.inner_wrapper(optimizers[0]), options,
                                          "the optimizer given through optimizers=")
    cls_and_kwargs = given.get("optimizer_cls_and_kwargs")
    if isinstance(cls_and_kwargs, (tuple, list)) and cls_and_kwargs and options:
        cls = cls_and_kwargs[0]
        while isinstance(cls, functools.partial):
            cls = cls.func
        if isinstance(cls, type) and issubclass(cls, AccumulatingOptimizer):
            given = ", ".join(f"{k!r}: {v!r}" for k, v in sorted(options.items()))
            raise ValueError(
                f"accumkernels: the class given through optimizer_cls_and_kwargs, "
                f"{cls.__qualname__}, is already an AccumulatingOptimizer, so the integration "
                f"builds no wrapper and the options {{{given}}} would not reach it. Put them "
                f"in the class's keyword arguments, optimizer_cls_and_kwargs=({cls.__name__}, "
                f"{{..., {given}}}), or name the plain optimizer class")


class AccumulatingTrainerMixin:
    """Turns fp32 accumulation on in a ``transformers.Trainer`` (subclass); see the module.

    Args: those of the Trainer, and

    * ``accumkernels``: a dict of AccumulatingOptimizer keyword arguments (``master_weights``,
      ``max_grad_norm``, ``nonfinite``, ...) passed through; checked (names and values) before
      the Trainer builds anything. ``reduction="mean"`` is refused: the Trainer already
      normalises the loss over the window.
    * ``fp32_masters_only``: True says that ``gradient_accumulation_steps=1`` is meant (the
      wrapper is there for its fp32 master weights alone); otherwise a Trainer with windows of
      one micro-batch warns once (``accumkernels.integrations.AccumulationWarning``), naming the
      fix: ``TrainingArguments(gradient_accumulation_steps=N)``.
    """

    def __init__(self, *args, accumkernels: Mapping | None = None,
                 fp32_masters_only: bool = False, **kwargs):
        options = common.check_options(accumkernels, normalised_by=_TRAINER_DIVIDES)
        _refuse_before_init(_given_arguments(super().__init__, args, kwargs), options,
                            fp32_masters_only)
        super().__init__(*args, **kwargs)
        self.accumkernels_options = options
        if getattr(self, "is_deepspeed_enabled", False):
            raise foreign_engine_error("the Trainer is configured for DeepSpeed")
        if getattr(self, "is_fsdp_enabled", False):
            raise foreign_engine_error("the Trainer is configured for FSDP")
        self.add_callback(_attach_callback()(self))
        if self.args.gradient_accumulation_steps == 1 and not fp32_masters_only:
            warnings.warn(
                "AccumulatingTrainer: gradient_accumulation_steps is 1, so every window holds "
                "one micro-batch and there is nothing to accumulate in fp32. Set "
                "TrainingArguments(gradient_accumulation_steps=N) to accumulate N micro-batches "
                "per optimizer step. If one micro-batch per step is meant (the wrapper only for "
                "its fp32 master weights), pass AccumulatingTrainer(..., fp32_masters_only=True), "
                "or filter accumkernels.integrations.AccumulationWarning",
                common.AccumulationWarning, stacklevel=2)

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped (once) in an AccumulatingOptimizer."""
        optimizer = super().create_optimizer(model)
        self.optimizer = common.wrap_optimizer(
            optimizer, self.accumkernels_options,
            model=model if model is not None else self.model)
        return self.optimizer


@functools.cache
def _attach_callback() -> type:
    from transformers import TrainerCallback

    from accumkernels.integrations.accelerate import make_skips_visible

    class _AttachToTraining(TrainerCallback):
        """At ``on_train_begin`` (DDP built, optimizer prepared, before the first backward):
        register the comm hook on the Trainer's DDP module, make skipped windows visible."""

        def __init__(self, trainer):
            self._trainer = weakref.ref(trainer)

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            trainer = self._trainer()
            if trainer is None:
                return
            ddp = common.find_ddp(trainer.model_wrapped)
            if ddp is not None:
                common.register_ddp_hook(ddp)
            prepared = optimizer if optimizer is not None else trainer.optimizer
            if common.inner_wrapper(prepared) is None:
                raise RuntimeError(
                    "accumkernels: the Trainer's optimizer is not an AccumulatingOptimizer; a "
                    "subclass that overrides create_optimizer must call super().create_optimizer()")
            if prepared is not common.inner_wrapper(prepared):  # prepared by Accelerate
                make_skips_visible(prepared)

    return _AttachToTraining


@functools.cache
def _trainer_class() -> type:
    from transformers import Trainer

    class AccumulatingTrainer(AccumulatingTrainerMixin, Trainer):
        """``transformers.Trainer`` with fp32 gradient accumulation (AccumulatingOptimizer)."""

    return common.module_level(AccumulatingTrainer, __name__)


def __getattr__(name: str):
    if name == "AccumulatingTrainer":  # built on first use: transformers is imported then
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
