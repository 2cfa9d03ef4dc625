"""schedulefree's optimizers by name: ``accumkernels.optimizers.schedulefree.AdamWScheduleFree``,
``SGDScheduleFree``, ``RAdamScheduleFree`` and the others of the ``schedulefree`` package, each an
``AccumulatingOptimizer`` class as in ``accumkernels.optimizers``. ``opt.train()`` and
``opt.eval()`` reach the inner optimizer; call them as without the wrapper. ``schedulefree`` is
imported when a name is first looked up (tests/integrations/test_low_bit_optimizers.py); without
it, a lookup is an AttributeError (``MissingPackageError``) saying ``pip install schedulefree``.
"""

from __future__ import annotations

from accumkernels.optimizers.factory import cached_class, import_package


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    schedulefree = import_package(__name__, name, "schedulefree")

    made = cached_class(globals(), __name__, schedulefree, name)
    if made is not None:
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}: schedulefree has no "
                         f"optimizer {name!r}")
