"""``accumulating(optimizer_cls)``: an optimizer class that a config names and calls as
``Cls(params, lr=..., ..., <wrapper options>)``, and that builds an ``AccumulatingOptimizer``.

Stacks that name their optimizer by a dotted path (litgpt's ``optimizer.class_path``,
LightningCLI's ``class_path``/``init_args``, torchtune's ``_component_``, Hydra's ``_target_``)
import the class, read its signature (litgpt and jsonargparse keep only the keywords it names)
and call it with the params. The class made here has the inner optimizer's own parameters,
followed by the wrapper's options as keyword-only parameters, annotated, so that a YAML file or
a command line can set either and a misspelt one is refused by name. An instance *is* an
``AccumulatingOptimizer`` (and so a ``torch.optim.Optimizer``): state dicts, pickling and
``deepcopy`` (which give back the same class, or the subclass, with the instance's attributes:
the wrapper's own copies), the integrations and the frameworks' checks see the wrapper they know.
"""

from __future__ import annotations

import inspect
import keyword
import sys
import threading
from typing import Literal

import torch

from accumkernels._util import did_you_mean
from accumkernels.optim import AccumulatingOptimizer

__all__ = ["COLLISION_PREFIX", "MissingPackageError", "accumulating", "wrapper_options"]

# A wrapper option whose name the inner optimizer also takes keeps the inner meaning; the
# wrapper's is then spelt with this prefix (``wrapper_max_grad_norm``) for that class.
COLLISION_PREFIX = "wrapper_"

# The wrapper's options a config can name, with the types a CLI parser checks them against.
# ``model`` and ``process_group`` take live objects (a module, a process group), which no config
# holds: they stay with ``AccumulatingOptimizer(...)`` in code.
_OPTION_TYPES = {
    "accumulation_steps": int | None,
    "reduction": Literal["sum", "mean", "weighted"],
    "master_weights": bool | Literal["auto"],
    "accumulate_in_backward": bool,
    "max_grad_norm": float | None,
    "nonfinite": Literal["skip_step", "skip_microbatch", "raise"],
    "loss_scale": float | Literal["dynamic"] | None,
    "bucket_size_mb": float,
    "backend": str,
    "independent_ranks": bool,
}
_IN_CODE_ONLY = ("model", "process_group")

_made: dict[tuple, type] = {}
_lock = threading.Lock()


def wrapper_options() -> dict[str, inspect.Parameter]:
    """The ``AccumulatingOptimizer`` options a by-name class takes, as keyword-only
    parameters with the wrapper's defaults and the annotations above."""
    signature = inspect.signature(AccumulatingOptimizer.__init__)
    options = {}
    for name, p in signature.parameters.items():
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or name in _IN_CODE_ONLY:
            continue
        if name not in _OPTION_TYPES:  # an option added to the wrapper must be declared here
            raise RuntimeError(f"accumkernels.optimizers: wrapper option {name!r} has no "
                               f"declared type (factory._OPTION_TYPES)")
        options[name] = p.replace(annotation=_OPTION_TYPES[name])
    return options


def _inner_signature(optimizer_cls: type) -> inspect.Signature:
    try:
        signature = inspect.signature(optimizer_cls.__init__, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # annotations that do not evaluate here
        signature = inspect.signature(optimizer_cls.__init__)
    return signature


def accumulating(optimizer_cls: type, *, name: str | None = None,
                 module: str | None = None) -> type:
    """The ``AccumulatingOptimizer`` class of ``optimizer_cls``, called as the optimizer is.

    ``Cls(params, lr=1e-3, betas=(0.9, 0.95), reduction="mean", max_grad_norm=1.0)`` builds
    ``optimizer_cls(params, lr=1e-3, betas=(0.9, 0.95))`` and wraps it:
    ``AccumulatingOptimizer(inner, reduction="mean", max_grad_norm=1.0)``. The wrapper's
    options (``accumulation_steps``, ``reduction``, ``master_weights``, ``max_grad_norm``,
    ``nonfinite``, ``loss_scale``, ...) are keyword-only and keep their defaults; one the inner
    optimizer also takes is spelt ``wrapper_<name>``. A keyword neither takes is refused by
    name (TypeError) before anything is built.

    Like ``collections.namedtuple``, the class is named ``name`` (default: the inner class's)
    in ``module`` (default: the caller's), and pickling finds it there: assign it to that name
    at the top of that module. The same arguments give the same class.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TypeError(f"accumulating() takes a torch.optim.Optimizer subclass, got "
                        f"{optimizer_cls!r}")
    if issubclass(optimizer_cls, AccumulatingOptimizer):
        raise TypeError(f"{optimizer_cls.__qualname__} is already an AccumulatingOptimizer")
    if name is None:
        name = optimizer_cls.__name__
    elif not isinstance(name, str):
        raise TypeError(f"accumulating(): name must be a str (the class's name), got "
                        f"{type(name).__name__} {name!r}")
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"accumulating(): name must be an identifier (not a keyword), got "
                         f"{name!r}")
    if module is None:
        module = sys._getframe(1).f_globals.get("__name__", "__main__")
    elif not isinstance(module, str):
        raise TypeError(f"accumulating(): module must be a str (the dotted name of the module "
                        f"that holds the class), got {type(module).__name__} {module!r}")
    elif not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"accumulating(): module must be a dotted module name "
                         f"('package.module'), got {module!r}")
    key = (optimizer_cls, name, module)
    with _lock:
        if key not in _made:
            _made[key] = _make(optimizer_cls, name, module)
        return _made[key]


def _make(inner_cls: type, name: str, module: str) -> type:
    P = inspect.Parameter
    inner = list(_inner_signature(inner_cls).parameters.values())
    self_param, inner = inner[0], inner[1:]
    taken = {p.name for p in inner if p.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)}
    var_keyword = [p for p in inner if p.kind is P.VAR_KEYWORD]
    spelling: dict[str, str] = {}  # keyword in a config -> wrapper option
    wrapper_params = []
    for option, p in wrapper_options().items():
        spelt = COLLISION_PREFIX + option if option in taken else option
        spelling[spelt] = option
        wrapper_params.append(p.replace(name=spelt))
    both = [option for option in wrapper_options()
            if option in taken and COLLISION_PREFIX + option in taken]
    if both:
        option, spelt = both[0], COLLISION_PREFIX + both[0]
        raise TypeError(
            f"accumulating({inner_cls.__qualname__}): its constructor takes both {option!r} and "
            f"{spelt!r}. A by-name class keeps the optimizer's own {option!r} and spells the "
            f"wrapper's option {spelt!r}, which this optimizer takes too, so no keyword would "
            f"reach the wrapper's {option}. Wrap it in code instead: "
            f"AccumulatingOptimizer({inner_cls.__name__}(params, ...), {option}=...)")
    params = [self_param] + [p for p in inner if p.kind is not P.VAR_KEYWORD]
    params += wrapper_params + var_keyword
    signature = inspect.Signature(params)
    accepts_any = bool(var_keyword)

    def __init__(self, *args, **kwargs):
        options = {spelling[k]: kwargs.pop(k) for k in list(kwargs) if k in spelling}
        unknown = [k for k in kwargs if k not in taken]
        if unknown and not accepts_any:
            raise TypeError(_unknown_message(name, unknown[0], taken | set(spelling)))
        AccumulatingOptimizer.__init__(self, inner_cls(*args, **kwargs), **options)

    __init__.__signature__ = signature
    __init__.__annotations__ = {p.name: p.annotation for p in params[1:]
                                if p.annotation is not P.empty}
    __init__.__qualname__ = f"{name}.__init__"
    __init__.__module__ = module
    __init__.__doc__ = (f"Build ``{inner_cls.__module__}.{inner_cls.__qualname__}(params, ...)`` "
                        f"and wrap it in ``AccumulatingOptimizer(inner, <wrapper options>)``.")

    namespace = {
        "__init__": __init__,
        "__module__": module,
        "__qualname__": name,
        "__doc__": (f"``AccumulatingOptimizer`` over ``{inner_cls.__module__}."
                    f"{inner_cls.__qualname__}``, built from the optimizer's own arguments "
                    f"and the wrapper's options (keyword-only): a class a config names."),
        "inner_class": inner_cls,
        "wrapper_keywords": dict(spelling),
    }
    return type(name, (AccumulatingOptimizer,), namespace)


def _unknown_message(cls_name: str, keyword: str, known: set[str]) -> str:
    return (f"{cls_name}() got an unknown option {keyword!r}{did_you_mean(keyword, known)}: "
            f"it takes the inner "
            f"optimizer's arguments and the wrapper options "
            f"{sorted(k for k in known if k in _OPTION_TYPES or k.startswith(COLLISION_PREFIX))}")


class MissingPackageError(AttributeError):
    """A by-name optimizer of a package that is not installed (``accumkernels.optimizers.torchao``,
    ``.schedulefree``): an AttributeError, so ``hasattr`` answers False and ``getattr(mod, name,
    default)`` gives the default, whose message says what to install (``package``)."""

    def __init__(self, module: str, name: str, package: str, cause: ImportError):
        super().__init__(f"{module}.{name} needs the {package} package, which cannot be "
                         f"imported ({cause}): pip install {package}", name=name)
        self.package = package


def import_package(module: str, name: str, package: str, what: str | None = None):
    """``import <what>`` (default: ``package``) for the lookup of ``module.name``; not
    importable: MissingPackageError naming ``package`` (the distribution to install)."""
    import importlib

    try:
        return importlib.import_module(what or package)
    except ImportError as exc:
        raise MissingPackageError(module, name, package, exc) from exc


def cached_class(namespace: dict, module: str, source, name: str, candidates=None):
    """The by-name class of ``source.<candidate>``, the first of ``candidates`` (default:
    ``name``) that is an optimizer class, made once and kept in ``namespace`` (a lazily filled
    module's globals: torchao's, schedulefree's); None when there is none."""
    for candidate in candidates or (name,):
        cls = getattr(source, candidate, None)
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer):
            made = namespace[name] = accumulating(cls, name=name, module=module)
            return made
    return None
