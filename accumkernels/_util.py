"""Argument checks, dtype constants and the warning category shared by every layer (written once,
here)."""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import inspect
import math
import numbers
import os
import sys
import warnings

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
# What the fp32 window holds (float64 params train natively: see optim.outside).
WINDOW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SRC_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_choice(name: str, value: object, choices: tuple) -> None:
    """ValueError unless ``value`` is one of ``choices``."""
    try:
        known = any(value is c or (type(value) is type(c) and value == c) for c in choices)
    except TypeError:
        known = False
    if not known:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


class AccumulationWarning(UserWarning):
    """A setup that runs but does not accumulate as it asked to (a mistake the wrapper or an
    integration can see from the calls it gets). Each is emitted once per wrapper and names its
    fix; ``warnings.filterwarnings("ignore", category=accumkernels.optim.AccumulationWarning)``
    silences them all (add ``message=`` with the start of one message to silence only that one).
    """


def warn_user(message: str, category: type[Warning] = AccumulationWarning) -> None:
    """``warnings.warn`` pointing at the first caller outside accumkernels and torch (its
    ``no_grad`` decorator, the step patch of LR schedulers), so a warning names the user's line
    whatever room raised it."""
    frame, level = sys._getframe(0), 1
    while frame is not None and str(frame.f_globals.get("__name__")).split(".")[0] in (
            "accumkernels", "torch"):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


def closest(word: str, known) -> str | None:
    """The one of ``known`` closest to a misspelt ``word`` (difflib's ratio), or None."""
    close = difflib.get_close_matches(word, sorted(known), n=1)
    return close[0] if close else None


def did_you_mean(word: str, known) -> str:
    """`` (did you mean 'x'?)`` with the one of ``known`` closest to a misspelt ``word``, or ''."""
    close = closest(word, known)
    return f" (did you mean {close!r}?)" if close else ""


def known_keywords(init):
    """Decorate an ``__init__``: a keyword it does not name is a TypeError that suggests the
    closest one (:func:`did_you_mean`), raised before its body runs (nothing changed yet);
    ``inspect.signature`` and ``help()`` still show ``init``'s own parameters (``__wrapped__``)."""
    P = inspect.Parameter
    params = list(inspect.signature(init).parameters.values())[1:]
    if any(p.kind is P.VAR_KEYWORD for p in params):
        return init  # (it takes any keyword)
    names = [p.name for p in params if p.kind is not P.VAR_POSITIONAL]
    options = [p.name for p in params if p.kind is P.KEYWORD_ONLY]

    @functools.wraps(init)
    def checked(self, *args, **kwargs):
        for key in kwargs:
            if key not in names:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                                f"{key!r}{did_you_mean(key, names)}; its options are "
                                f"{', '.join(options)}")
        return init(self, *args, **kwargs)

    return checked


def positive_int(name: str, value: object) -> int:
    """A positive int (bools refused): TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return int(value)


def finite_positive(name: str, value: object) -> float:
    """A finite positive real number (Python, numpy or 0-dim tensor scalars; bools refused)."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite positive number, got {value}")
    return value


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_usable(device: torch.device) -> bool:
    """Whether Triton kernels can run on ``device``: Triton is installed and the device is a GPU,
    or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, for tests)."""
    if not _triton_installed():
        return False
    if device.type == "cuda":
        return torch.cuda.is_available()
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """The context a Triton launch on ``device`` runs in: that CUDA device made current (Triton
    launches on the current device's current stream, and torch enqueues host-to-device copies on
    the destination device's current stream: both on the tensors' device, in order), a no-op for
    the CPU (interpreter)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def positive_weight(weight: object) -> float:
    """A micro-batch weight (``add_weight``): a number or 1-element tensor, finite and >= 0 (a
    micro-batch without tokens contributes nothing, as natively)."""
    if isinstance(weight, torch.Tensor) and weight.numel() != 1:
        raise TypeError("weight must be a number or a 1-element tensor")
    if isinstance(weight, bool) or not isinstance(weight, (int, float, torch.Tensor)) \
            and not hasattr(weight, "__float__"):
        raise TypeError(f"weight must be a number or a 1-element tensor, got "
                        f"{type(weight).__name__}")
    value = float(weight)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"weight must be finite and not negative, got {value}")
    return value
