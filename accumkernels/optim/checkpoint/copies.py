"""Copies of a wrapper: the face's ``__reduce__``, ``__getstate__``, ``__setstate__`` and
``__copy__``.

``copy.deepcopy``, pickle and ``torch.save`` of the whole object rebuild the instance's own class
(a subclass of ``AccumulatingOptimizer``, a by-name class of ``accumkernels.optimizers`` or a
subclass of one) over a copy of the inner optimizer (``native_copy``: its groups and state hold
the params, which are copied with it), restore the window, the masters and the counts from the
state dict, then give it the instance's own attributes (:func:`getstate`: what a subclass set in
its ``__init__`` or later), as Python copies any object. The rooms are rebuilt, never copied.
Not carried, as torch's own ``Optimizer.__getstate__`` carries none of them: what torch's
machinery put on the instance (hook registries, an LR scheduler's records), and a patch of one of
the class's methods on the instance (the ``step`` an LR scheduler or Accelerate wraps), which
holds the original.

``copy.copy`` is refused: a shallow copy would be a second live wrapper over the same params and
the same window, and two wrappers cannot both count one backward.
"""

from __future__ import annotations

import inspect

from accumkernels._torch_private import optimizer_records

__all__ = ["ROOMS", "getstate", "rebuild", "reduce", "refuse_copy", "setstate"]

# what AccumulatingOptimizer.__init__ builds on the instance (besides torch's records): a copy
# rebuilds these from the state dict and never carries them
ROOMS = frozenset({"optimizer", "config", "_layout", "_needs_closure", "_parts", "_events",
                   "_cadence", "_intake", "_step"})

SHALLOW_COPY = (
    "copy.copy() of an AccumulatingOptimizer is refused: a shallow copy would be a second live "
    "wrapper over the same params and the same window, and two wrappers cannot both count one "
    "backward. Use copy.deepcopy(opt) for a wrapper over copies of the params, the window and "
    "the state (with the model: copy.deepcopy({'model': model, 'opt': opt})), or build a new "
    "wrapper")
ACROSS_RANKS = (
    "an AccumulatingOptimizer that reduces across ranks (process_group or DDP) cannot be "
    "pickled or deep-copied; save its state_dict()")


def reduce(face, base: type) -> tuple:
    """:func:`rebuild` of ``type(face)`` by ``base`` (AccumulatingOptimizer) over a copy of the
    inner optimizer, then ``face.__getstate__()`` (a subclass may override it, and
    ``__setstate__``) for the copy's ``__setstate__``."""
    parts = face._parts
    if parts.sync.active or parts.sync.ddp_group is not None:
        raise TypeError(ACROSS_RANKS)
    state = face.__getstate__()
    face._intake.take_in()
    config, checkpoint = face.config, face._layout.checkpoint
    options = {f: getattr(config, f) for f in config.__dataclass_fields__}
    sd = checkpoint.assemble(parts, face._intake)
    return rebuild, (base, type(face), checkpoint.native_copy(parts), options, sd), state


def rebuild(base: type, cls: type, inner, options: dict, sd: dict):
    """A copy: ``cls`` built as ``base`` builds a wrapper (a subclass's or a by-name class's
    ``__init__`` takes other arguments), its state dict loaded (not through an override)."""
    face = cls.__new__(cls)
    base.__init__(face, inner, **options)
    base.load_state_dict(face, sd)
    return face


def getstate(face) -> dict:
    """The instance's own attributes: its ``__dict__`` less the rooms, torch's records and the
    instance's patches of the class's methods."""
    cls, skip = type(face), ROOMS | optimizer_records()
    return {name: value for name, value in face.__dict__.items()
            if name not in skip and not _patches_method(cls, name, value)}


def setstate(face, state: dict) -> None:
    """Give a rebuilt wrapper the attributes :func:`getstate` carried (never rooms: a copy has
    rebuilt its own)."""
    face.__dict__.update({name: value for name, value in state.items() if name not in ROOMS})


def refuse_copy(face):
    """``copy.copy``: refused (TypeError) before anything changes."""
    raise TypeError(SHALLOW_COPY)


def _patches_method(cls: type, name: str, value) -> bool:
    return callable(value) and inspect.isroutine(inspect.getattr_static(cls, name, None))
