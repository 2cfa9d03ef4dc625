"""Lightning: the ``FP32Accumulation`` callback; the LightningModule is unchanged.

    from accumkernels.integrations.lightning import FP32Accumulation
    trainer = L.Trainer(accumulate_grad_batches=4, callbacks=[FP32Accumulation()])  # one line

At ``on_fit_start`` (the strategy has built the DDP module and run ``configure_optimizers``;
the checkpoint's optimizer state is not loaded yet) the callback

* wraps every optimizer the LightningModule configured in ``AccumulatingOptimizer(...,
  accumulation_steps=None, **options)``: Lightning calls ``step(closure)`` only on a window's
  last micro-batch (the short one at an epoch's end included); its clipping
  (``gradient_clip_val``) and ``on_before_optimizer_step`` see ``p.grad``, the fp32 window;
  LR schedulers keep working (they share ``param_groups`` with the wrapper); checkpoints
  save and load the wrapper's ``state_dict``;
* registers ``accumkernels.ddp_comm_hook`` on the strategy's ``DistributedDataParallel``
  module (``strategy="ddp"``, several devices or nodes), which Lightning's own
  ``ddp_comm_hook`` argument does only on CUDA.

Lightning divides the loss by ``accumulate_grad_batches`` itself, hence the wrapper's default
``reduction="sum"``; ``FP32Accumulation(reduction="mean")`` (a second division) is refused. A
window the wrapper skips (non-finite) is a step skipped the way a GradScaler overflow is in
Lightning: no weight update, and the LR scheduler still advances (Lightning does not ask whether
a step was skipped). DeepSpeed and FSDP strategies are
refused. ``lightning`` is imported when ``FP32Accumulation`` is first used.
"""

from __future__ import annotations

import functools

from accumkernels import integrations as common
from accumkernels._engines import foreign_engine_error

__all__ = ["FP32Accumulation"]

_FOREIGN_STRATEGIES = {"DeepSpeedStrategy": "DeepSpeed", "FSDPStrategy": "FSDP"}

# What Lightning does to the loss, for the refusal of reduction="mean" (a second division).
_LIGHTNING_DIVIDES = ("Lightning's automatic optimization divides the loss by "
                      "accumulate_grad_batches before backward (under manual optimization, "
                      "where Lightning divides nothing, build AccumulatingOptimizer(..., "
                      "reduction='mean') in configure_optimizers instead)")


def _attach(trainer, pl_module, options: dict) -> None:
    """Wrap the configured optimizers, register the comm hook (checks first, then changes)."""
    strategy = trainer.strategy
    for cls in type(strategy).__mro__:
        if cls.__name__ in _FOREIGN_STRATEGIES:
            raise foreign_engine_error(
                f"the Lightning strategy is {_FOREIGN_STRATEGIES[cls.__name__]} "
                f"({type(strategy).__name__})")
    ddp = common.find_ddp(strategy.model)
    if ddp is not None:
        common.check_ddp_hook(ddp)  # a foreign hook is refused before anything is wrapped
    optimizers = list(strategy.optimizers)
    for opt in optimizers:  # options for a wrapper built in configure_optimizers: not dropped
        common.refuse_options_for_wrapped(common.inner_wrapper(opt), options,
                                          "an optimizer configure_optimizers returned")
    params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    common.refuse_foreign_engines(params, strategy.model)
    wrapped = [common.wrap_optimizer(opt, options, model=pl_module) for opt in optimizers]
    if ddp is not None:
        common.register_ddp_hook(ddp)
    if any(w is not o for w, o in zip(wrapped, optimizers)):
        strategy.optimizers = wrapped  # Lightning rebuilds its LightningOptimizers for them


@functools.cache
def _callback_class() -> type:
    from lightning.pytorch import Callback

    class FP32Accumulation(Callback):
        """Lightning callback: fp32 gradient accumulation for the module's optimizers.

        Keyword arguments are AccumulatingOptimizer's (``master_weights``, ``max_grad_norm``,
        ``nonfinite``, ...), passed through to every wrapper it builds; checked (names and
        values) here, before Lightning sets anything up. ``reduction="mean"`` is refused:
        Lightning already divides the loss by ``accumulate_grad_batches``.
        """

        def __init__(self, **options):
            super().__init__()
            self.options = common.check_options(options, normalised_by=_LIGHTNING_DIVIDES)

        def on_fit_start(self, trainer, pl_module) -> None:
            _attach(trainer, pl_module, self.options)

    return common.module_level(FP32Accumulation, __name__)


def __getattr__(name: str):
    if name == "FP32Accumulation":  # built on first use: lightning is imported then
        return _callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
