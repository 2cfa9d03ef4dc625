"""torchao's optimizers by name: ``accumkernels.optimizers.torchao.AdamW8bit`` and the others of
``torchao.optim`` (``AdamW4bit``, ``AdamWFp8``, ``Adam8bit``, ...), each an ``AccumulatingOptimizer``
class as in ``accumkernels.optimizers``; ``AdamW`` is torchao's plain AdamW (``torchao.optim.AdamW``,
in torchao 0.13 ``torchao.optim._AdamW``), the one that takes ``bf16_stochastic_round``.

torchao is imported when a name is first looked up; without it, a lookup is an AttributeError
(``MissingPackageError``) saying ``pip install torchao``. What was checked (tests/integrations/
test_low_bit_optimizers.py, torchao 0.13.0 on torch 2.13, CPU): on fp32 params each steps bit for
bit what it steps natively, through a state dict saved and loaded mid-training; on bf16 params the
wrapper steps fp32 master weights (``master_weights="auto"``), which ends closer to the fp32 run
than native bf16. ``bf16_stochastic_round`` rounds bf16 params; with master weights the params it
steps are fp32 and it has nothing to round: pass ``master_weights=False`` to keep bf16 weights
rounded stochastically (the fp32 window still sums the micro-batches).
``CPUOffloadOptimizer`` is not offered: it moves gradients and steps on its own schedule.
"""

from __future__ import annotations

from accumkernels.optimizers.factory import cached_class, import_package

_ALIASES = {"AdamW": ("AdamW", "_AdamW")}  # public name first, then torchao 0.13's
_NOT_OFFERED = {"CPUOffloadOptimizer": "it offloads and steps on its own schedule; wrap the "
                                       "optimizer it builds with AccumulatingOptimizer instead"}


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    if name in _NOT_OFFERED:
        raise AttributeError(f"accumkernels.optimizers.torchao.{name} is not offered: "
                             f"{_NOT_OFFERED[name]}")
    torchao_optim = import_package(__name__, name, "torchao", "torchao.optim")
    torchao = import_package(__name__, name, "torchao")

    made = cached_class(globals(), __name__, torchao_optim, name, _ALIASES.get(name))
    if made is not None:
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: torchao.optim "
                         f"{torchao.__version__} has no optimizer {name!r}")
