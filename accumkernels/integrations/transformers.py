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
wrapper's default ``reduction="sum"``. DeepSpeed and FSDP are refused. For a Trainer subclass
(TRL's ``SFTTrainer``, your own), put the mixin first:
``class MyTrainer(AccumulatingTrainerMixin, SFTTrainer)``. ``transformers`` is imported when
``AccumulatingTrainer`` is first used.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping

import torch

from accumkernels import integrations as common
from accumkernels._engines import foreign_engine_error

__all__ = ["AccumulatingTrainer", "AccumulatingTrainerMixin"]


class AccumulatingTrainerMixin:
    """Turns fp32 accumulation on in a ``transformers.Trainer`` (subclass); see the module.

    Args: those of the Trainer, and ``accumkernels``: a dict of AccumulatingOptimizer keyword
    arguments (``master_weights``, ``max_grad_norm``, ``nonfinite``, ...) passed through.
    """

    def __init__(self, *args, accumkernels: Mapping | None = None, **kwargs):
        options = common.check_options(accumkernels)
        super().__init__(*args, **kwargs)
        self.accumkernels_options = options
        if getattr(self, "is_deepspeed_enabled", False):
            raise foreign_engine_error("the Trainer is configured for DeepSpeed")
        if getattr(self, "is_fsdp_enabled", False):
            raise foreign_engine_error("the Trainer is configured for FSDP")
        self.add_callback(_attach_callback()(self))

    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, wrapped (once) in an AccumulatingOptimizer."""
        optimizer = super().create_optimizer(model)
        if common.inner_wrapper(optimizer) is None:
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
