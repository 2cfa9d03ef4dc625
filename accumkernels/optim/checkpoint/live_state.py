"""What ``opt.state`` and ``opt.param_groups`` show: the inner optimizer's, with the wrapper's keys.

``torch.distributed.checkpoint``'s ``set_optimizer_state_dict`` with
``flatten_optimizer_state_dict=True`` rebuilds the state dict it loads from the keys the *loading*
optimizer shows: each param's ``opt.state[p]`` and each group of ``opt.param_groups``. A key the
live optimizer does not show is dropped. So the live optimizer shows every key a checkpoint of
this wrapper holds (the module docstring of checkpoint.py lists them):

* each managed param's entry of ``opt.state`` is a :class:`ParamState`: the inner optimizer's
  entry, plus ``"accumkernels_master"`` (the fp32 master of a bf16/fp16 param) and
  ``"accumkernels_window"`` (its fp32 window, ``p.main_grad``), live views of the wrapper's
  tensors. A param the inner optimizer holds no state for yet (before its first step) shows
  the keys that state will have: zeros of its shapes, as an lr=0 step on zero gradients creates
  them (what DCP does to a fresh native optimizer), found once on ``meta`` copies;
* every group holds ``"accumkernels"`` (:data:`LIVE` between ``state_dict()`` calls, which write
  the bookkeeping there).

The keys of ``opt.state`` are the inner optimizer's (the params it holds state for), and every
dict operation (``clear``, ``pop``, ``popitem``, ``del``, ``len``, iteration, ``in``, ``get``,
``setdefault``, assigning an entry) means what it means on a torch optimizer's ``state``; only
``bool(opt.state)`` is True for a wrapper with params also before its first step (DCP would
otherwise run its state-creating lr=0 step through the wrapper). The inner optimizer never sees
the extra state keys (its ``state`` is its own); its groups do hold the group key, which it
ignores. Writing an entry's key writes the inner optimizer's state (as natively; a
low-precision tensor of a param with a master is taken in fp32, the masters' dtype), and an
extra key copies into the wrapper's tensor (a tool moving the state to a device writes the same
values back).
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from collections.abc import Iterator, Mapping, MutableMapping
from itertools import chain

import torch

from accumkernels._torch_private import init_hook_registries, initial_state_hook
from accumkernels._util import LOW_PRECISION

OWN_KEY = "accumkernels"
MASTER_KEY = "accumkernels_master"
WINDOW_KEY = "accumkernels_window"
EXTRA_KEYS = (MASTER_KEY, WINDOW_KEY)
LIVE = ""  # the group key's value outside state_dict(): "no bookkeeping here"


def groups_with_own_key(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The inner optimizer's ``param_groups`` (the same list), each holding :data:`OWN_KEY`."""
    groups = optimizer.param_groups
    for group in groups:
        if OWN_KEY not in group:
            group[OWN_KEY] = LIVE
    return groups


class _Index:
    """Per intake (the params and their windows): param positions and the template keys."""

    def __init__(self, parts, intake):
        self.managed = {id(p): i for i, p in enumerate(intake.params)}
        inner = chain.from_iterable(g["params"] for g in parts.optimizer.param_groups)
        self.position = {id(p): i for i, p in enumerate(inner)}
        self.template: dict | None = None


_INDEX: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _index(parts, intake) -> _Index:
    index = _INDEX.get(intake)
    if index is None or len(index.position) != sum(len(g["params"])
                                                   for g in parts.optimizer.param_groups):
        index = _INDEX[intake] = _Index(parts, intake)
    return index


def live_state(parts, intake) -> LiveState:
    """``opt.state`` of the wrapper built from ``parts`` and ``intake``."""
    return LiveState(parts, intake, _index(parts, intake))


def set_state(parts, intake, value: Mapping) -> None:
    """``opt.state = value``: the inner optimizer's state, without the wrapper's keys."""
    if isinstance(value, LiveState) and value.inner is parts.optimizer.state:
        return
    state = defaultdict(dict)
    for key, entry in value.items():
        if isinstance(entry, ParamState):
            entry = entry.inner_part()
        elif isinstance(entry, Mapping):
            entry = {k: v for k, v in entry.items() if k not in EXTRA_KEYS}
        state[key] = entry
    parts.optimizer.state = state


class LiveState(MutableMapping):
    """The inner optimizer's ``state`` with each managed param's entry a :class:`ParamState`."""

    def __init__(self, parts, intake, index: _Index):
        self._parts, self._intake, self._idx = parts, intake, index
        self.inner = parts.optimizer.state

    def _managed(self, key) -> int | None:
        return self._idx.managed.get(id(key)) if isinstance(key, torch.Tensor) else None

    def __getitem__(self, key):
        i = self._managed(key)
        if i is None:
            return self.inner[key]  # (a defaultdict, as natively)
        return ParamState(self, self._intake.params[i], i)

    def __setitem__(self, key, value) -> None:
        i = self._managed(key)
        if i is None or not isinstance(value, Mapping):
            self.inner[key] = value
            return
        entry = ParamState(self, self._intake.params[i], i)
        for k in entry.extras:
            if k in value:
                entry[k] = value[k]
        self.inner[key] = {k: v for k, v in value.items() if k not in EXTRA_KEYS}
        self._parts.masters.fp32_state()

    # The keys are the inner optimizer's (the params it holds state for), as natively: a param
    # without inner state is not "in" the state, and every dict operation means what it means on
    # a torch optimizer's ``state``. Only ``opt.state[p]`` of a managed param without state shows
    # the keys its state will have (and the wrapper's tensors), without creating an entry.
    def __delitem__(self, key) -> None:
        del self.inner[key]  # (the extra keys stay: they are the wrapper's tensors)

    def __iter__(self) -> Iterator:
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __bool__(self) -> bool:
        # True for a wrapper with params, also before its first step: DCP's
        # get/set_optimizer_state_dict would otherwise run its lr=0 "init" step through the
        # wrapper (a micro-batch of zeros in the window); the wrapper's state_dict() carries the
        # template state itself.
        return bool(self._idx.managed) or bool(self.inner)

    def __contains__(self, key) -> bool:
        return key in self.inner

    def get(self, key, default=None):
        return self[key] if key in self.inner else default  # (never creates an entry)

    def pop(self, key, *default):
        return self.inner.pop(key, *default)

    def popitem(self):
        return self.inner.popitem()

    def clear(self) -> None:
        self.inner.clear()

    def setdefault(self, key, default=None):
        if key not in self.inner:
            self[key] = default
        return self[key]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"

    # -- what the entries need --------------------------------------------------------------------
    def extras(self, p: torch.Tensor, i: int) -> dict[str, torch.Tensor]:
        out = {}
        master = self._parts.masters.current(p)  # (with the weight the user wrote taken in)
        if master:
            out[MASTER_KEY] = master[0].detach()
        out[WINDOW_KEY] = self._intake.views[i].detach()
        return out

    def template(self, p: torch.Tensor) -> dict:
        """The keys (and zero values, as descriptors) the inner state of ``p`` will have."""
        idx = self._idx
        if idx.template is None:
            idx.template = _template_keys(self._parts)
        return idx.template.get(idx.position.get(id(p)), {})


class ParamState(MutableMapping):
    """One managed param's ``opt.state[p]``: the inner optimizer's entry (or the keys it will
    have, before it has one) and the wrapper's master and window."""

    def __init__(self, live: LiveState, p: torch.Tensor, i: int):
        self._live, self._p = live, p
        self.extras = live.extras(p, i)
        self.entry = live.inner.get(p)  # (None: no entry yet; an empty one shows empty)
        self.template = live.template(p) if self.entry is None else {}

    def inner_part(self) -> dict:
        """The inner optimizer's own entry (nothing shown on its behalf)."""
        return dict(self.entry) if self.entry is not None else {}

    def _keys(self) -> list:
        own = list(self.entry) if self.entry is not None else list(self.template)
        return own + [k for k in self.extras if k not in own]

    def __getitem__(self, key):
        if key in self.extras:
            return self.extras[key]
        if self.entry is not None:
            return self.entry[key]
        if key in self.template:
            return _materialise(self.template[key], self._p)
        raise KeyError(key)

    def __setitem__(self, key, value) -> None:
        if key in self.extras:
            _write_extra(key, self.extras[key], value)
            return
        if self.entry is None:  # (created, as natively; a tool moving the state to a device
            self.entry = self._live.inner[self._p]  # writes back only the entries that exist)
            self.template = {}
        self.entry[key] = value
        if torch.is_tensor(value) and value.dtype in LOW_PRECISION:
            self._live._parts.masters.fp32_state()  # (a param with a master: its state is fp32)

    def __delitem__(self, key) -> None:
        if key in self.extras:
            raise KeyError(f"{key!r} is the AccumulatingOptimizer's own tensor; it cannot be "
                           "deleted (reset_window() empties the window)")
        if self.entry is None:
            if key in self.template:
                return
            raise KeyError(key)
        del self.entry[key]

    def __iter__(self) -> Iterator:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())

    def __contains__(self, key) -> bool:
        return key in self.extras or (key in self.entry if self.entry is not None
                                       else key in self.template)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({dict(self.items())!r})"


class _Zeros:
    """A template value too large to keep: zeros of this shape and dtype on the param's device."""

    def __init__(self, t: torch.Tensor):
        self.shape, self.dtype = t.shape, t.dtype


def _materialise(value, p: torch.Tensor):
    if isinstance(value, _Zeros):
        return torch.zeros(value.shape, dtype=value.dtype, device=p.device)
    return value.clone() if isinstance(value, torch.Tensor) else value


@torch.no_grad()
def _write_extra(key: str, live: torch.Tensor, value) -> None:
    """Writing the wrapper's master or window: a copy into it (the same values, when a tool
    moves the state to a device and back), never a rebinding."""
    if not isinstance(value, torch.Tensor) or value.shape != live.shape:
        raise ValueError(f"opt.state[p][{key!r}] is the AccumulatingOptimizer's own tensor of "
                         f"shape {tuple(live.shape)}; it takes a tensor of that shape (load a "
                         "checkpoint with opt.load_state_dict())")
    local = live.to_local() if hasattr(live, "to_local") else live
    src = value.to_local() if hasattr(value, "to_local") else value
    if src.data_ptr() == local.data_ptr() and src.stride() == local.stride():
        return
    local.copy_(src)


def _template_keys(parts) -> dict:
    """position -> {key: value} of the state an lr=0 step on zero gradients creates, from
    ``meta`` copies (no memory); values are descriptors (:class:`_Zeros`) or small tensors."""
    try:
        state = template_state(parts, meta=True)
    except Exception:  # noqa: BLE001 - an optimizer whose step needs real values
        state = template_state(parts)
    return {i: {k: (_Zeros(v) if isinstance(v, torch.Tensor) and (v.is_meta or v.numel() > 1)
                    else v) for k, v in entry.items()}
            for i, entry in state.items()}


@torch.no_grad()
def template_state(parts, meta: bool = False, only: set[int] | None = None) -> dict:
    """The state a fresh inner optimizer would be loaded with, so that a native optimizer
    loading it takes its first step as a fresh one does: the keys a zero-gradient step creates
    (what ``get_state_dict`` makes a fresh native optimizer hold), each valued as that step's
    ``_init_group`` made it before the update (AdamW's zero moments, Rprop's ``step_size`` = lr,
    ASGD's ``eta``/``mu``, NAdam's ``mu_product`` = 1); a key the update makes (SGD's momentum
    buffer) holds that step's value without weight decay (zeros; with ``dampening`` a native SGD
    then scales its first gradient by 1 - dampening, as after native DCP's own state init). A
    class without ``_init_group``: an lr=0 step's state, each ``step`` set back to 0. Keyed by
    position over the inner optimizer's groups; ``only``: the ids of the params wanted (default:
    all). Taken on a copy over copies of the params: the live optimizer, params and masters are
    untouched. ``meta``: over ``meta`` copies with the plain (single-tensor) implementation, for
    its keys and shapes only; an optimizer whose step needs values then raises."""
    inner = parts.optimizer
    step = getattr(type(inner).step, "__wrapped__", type(inner).step)
    want = [only is None or id(p) in only for g in inner.param_groups for p in g["params"]]
    with parts.masters.swapped():  # over the fp32 masters: the template state is fp32 too
        positions = [torch.nn.Parameter(torch.empty_like(p, device="meta") if meta
                                        else p.detach().clone(), requires_grad=p.requires_grad)
                     if w else None
                     for p, w in zip((p for g in inner.param_groups for p in g["params"]), want)]
        sizes = [len(g["params"]) for g in inner.param_groups]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    groups = [{**g, "params": [c for c in positions[a:a + n] if c is not None]}
              for g, a, n in zip(inner.param_groups, starts, sizes)]
    clones = [c for c in positions if c is not None]
    copy = object.__new__(type(inner))
    copy.__dict__.update({k: v for k, v in inner.__dict__.items()
                          if not k.startswith("_accumkernels")})
    init_hook_registries(copy)  # the copy's own (empty) hook registries, as a fresh optimizer's
    plain = {k: False for k in ("foreach", "fused", "capturable") if meta and k in inner.defaults}
    copy.state = defaultdict(dict)
    initial: dict[int, dict] = {}  # id(clone) -> its state as _init_group made it

    def seen(group: dict) -> None:
        for c in group["params"]:
            entry = copy.state.get(c)
            if entry and id(c) not in initial:
                initial[id(c)] = {k: v.clone() if torch.is_tensor(v) else v
                                  for k, v in entry.items()}

    by_init = initial_state_hook(copy, seen)
    # lr 0 (unless _init_group reads it: Rprop's step_size, ASGD's eta) and no weight decay (L2
    # decay on a zero gradient would put wd * p into SGD's momentum buffer and Adam's moments)
    quiet = {"weight_decay": 0.0} if by_init else {"lr": 0.0, "weight_decay": 0.0}
    copy.param_groups = [{**g, **plain, **{k: torch.zeros_like(g[k]) if torch.is_tensor(g[k])
                                           else v for k, v in quiet.items() if k in g}}
                         for g in groups]
    for c in clones:
        c.grad = torch.zeros_like(c) if c.requires_grad else None
    try:
        step(copy)
    except Exception:  # noqa: BLE001 - an optimizer that needs a closure: no template state
        if meta:
            raise
        return {}
    # the keys are those after the step (a checkpoint tool's template needs SGD's momentum buffer
    # too); a key _init_group made holds the value it made
    return {i: {**{k: (torch.zeros_like(v) if torch.is_tensor(v) else type(v)(0))
                   if k == "step" else v for k, v in copy.state[c].items()},
                **initial.get(id(c), {})}
            for i, c in enumerate(positions) if c is not None and copy.state.get(c)}
