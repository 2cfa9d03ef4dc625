"""fp32 master weights for bf16/fp16 params: the inner optimizer steps these, the model gets a copy.

The model's low-precision weights are what the user sees and may change behind the
optimizer's back (``model.load_state_dict`` after wrapping, ``p.data.clamp_()``, a re-init).
Such a change is never reverted: before each step, every master whose model weight no longer
equals the master rounded to the model dtype is re-synced from the model weight.

The check is exact, at every step, on every (master, weight) pair: element by element, with
no cached picture of the weights standing in for it (a fingerprint, a version counter: writes
through ``.data``, a numpy view or ``untyped_storage()`` bypass the version counter, and a
fingerprint can be matched by a crafted write). It reads 6 B per element (the master 4, the
weight 2) and writes only the elements that differ. The kernels are reached through the ops of
``accumkernels/ops/master_passes.py`` alone (``resync_masters_``, ``copy_back_``), which pick the native
pass, Triton or torch ops per pair. A later fused master step is to fold that read into the
inner optimizer's own pass over the masters.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from accumkernels._util import LOW_PRECISION
from accumkernels.ops.host import grads_are
from accumkernels.ops.validate import is_dense
from accumkernels.buffer import grad_strides
from accumkernels.ops.master_passes import copy_back_, resync_masters_


_NONE = object()  # (no state entry)


class MasterWeights:
    """The fp32 copies (by ``id`` of the model param), the inner optimizer's state remap and
    the copy-back."""

    def __init__(self, optimizer: torch.optim.Optimizer, enabled: bool):
        self.optimizer = optimizer
        self.enabled = enabled
        self.masters: dict[int, torch.nn.Parameter] = {}
        self.model_params: list[torch.Tensor] = []  # in registration order, those with masters
        self._targets = None  # (masters count, params, targets) of the last targets() call
        self._load_hooks = None  # the inner optimizer's load_state_dict hooks (handles)
        self._loading = None  # the state dict an inner.load_state_dict() is loading

    def retarget(self, params: list[torch.Tensor]) -> None:
        """fp32 copies of the low-precision ``params``. The inner optimizer keeps the model
        params in its groups and its state keyed by them (so checkpoint tools map that state to
        the model's parameter names), its state tensors of those params in fp32; it steps the
        masters inside :meth:`swapped`."""
        if not self.enabled:
            return
        wanted = [p for p in params if p.dtype in LOW_PRECISION and id(p) not in self.masters]
        if wanted:
            self.optimizer._accumkernels_masters = True
            if self._load_hooks is None:
                self._load_hooks = _keep_loaded_state_fp32(self)
        state = self.optimizer.state
        for p in wanted:  # in the layout of p's .grad (the window's view), which it pairs with
            master = torch.empty_strided(p.shape, grad_strides(p), dtype=torch.float32,
                                         device=p.device)
            self.masters[id(p)] = torch.nn.Parameter(master.copy_(p.detach()))
            self.model_params.append(p)
            if p in state:
                state[p] = {k: v.float() if torch.is_tensor(v) and v.dtype in LOW_PRECISION
                            else v for k, v in state[p].items()}

    def targets(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per param what the inner optimizer steps: its master, else the param itself (masters
        are only ever added: the list is kept until one is)."""
        cached = self._targets
        if cached is None or cached[0] != len(self.masters) or cached[1] is not params:
            masters = self.masters
            cached = self._targets = (len(masters), params, [masters.get(id(p), p)
                                                             for p in params])
        return cached[2]

    def grads_are(self, params: list[torch.Tensor], views: list[torch.Tensor]) -> bool:
        """Whether each master of ``params`` shows its param's view as ``.grad``."""
        return not self.masters or grads_are(self.targets(params), views)

    @contextlib.contextmanager
    def swapped(self):
        """The inner optimizer over the fp32 masters for the block (a step, a state load): its
        groups' params and its state keys are the masters, and the model params again after.
        The state is re-keyed in whatever ``state`` dict the inner optimizer holds on leaving
        (a load inside the block replaces it)."""
        if not self.masters:
            yield
            return
        inner, masters = self.optimizer, self.masters
        self.fp32_state()
        state = inner.state
        # in place: an optimizer that keeps its groups' lists (LBFGS's ``_params``) sees them too
        for group in inner.param_groups:
            group["params"][:] = [masters.get(id(p), p) for p in group["params"]]
        for p in self.model_params:
            entry = state.pop(p, _NONE)  # (a tensor's hash is a Python call: twice per param)
            if entry is not _NONE:
                state[masters[id(p)]] = entry
        try:
            yield
        finally:
            model_of = {id(masters[id(p)]): p for p in self.model_params}
            for group in inner.param_groups:
                group["params"][:] = [model_of.get(id(q), q) for q in group["params"]]
            state = inner.state
            for p in self.model_params:
                entry = state.pop(masters[id(p)], _NONE)
                if entry is not _NONE:
                    state[p] = entry

    @torch.no_grad()
    def relayout(self, p: torch.Tensor, same_memory: bool) -> None:
        """p's layout changed (``p.data = p.data.t()``): its master takes it too, as the inner
        optimizer would see p natively. If p still lies in the same memory (a re-striding),
        each master element keeps its memory position, as p's elements kept theirs (its extra
        bits stay with its weight); otherwise the master keeps its values element by element.
        The next step's re-sync takes in whatever differs from p."""
        m = self.masters.get(id(p))
        strides = grad_strides(p)
        if m is None or m.stride() == strides or m.shape != p.shape:
            return
        if same_memory and is_dense(m):
            m.data = m.data.as_strided(p.shape, strides, m.storage_offset())
        else:
            fresh = torch.empty_strided(p.shape, strides, dtype=m.dtype, device=m.device)
            m.data = fresh.copy_(m)

    def fp32_state(self) -> None:
        """The inner state of params with masters in fp32 (the masters' dtype): a state written
        in the model's dtype (``inner.load_state_dict`` after wrapping casts to the param's
        dtype; a user's ``opt.state[p]["exp_avg"] = torch.zeros_like(p)``) is cast up."""
        state, low, tensor = self.optimizer.state, LOW_PRECISION, torch.Tensor
        cast = [(entry, k, v) for p in self.model_params for entry in (state.get(p),) if entry
                for k, v in entry.items()
                if isinstance(v, tensor) and v.dtype in low and v.shape == p.shape]
        for entry, k, v in cast:
            entry[k] = v.float()

    def get(self, p: torch.Tensor) -> torch.nn.Parameter | None:
        return self.masters.get(id(p))

    def master_list(self) -> list[torch.nn.Parameter]:
        return [self.masters[id(p)] for p in self.model_params]

    @torch.no_grad()
    def current(self, p: torch.Tensor | None = None) -> list[torch.nn.Parameter]:
        """The masters (of ``p`` alone, if given) as they are read or saved: each first takes
        in the model weight the user changed since the last step (as the next step would), so a
        master always equals the weight as the user left it."""
        pairs = [(self.masters[id(q)], q) for q in ([p] if p is not None else self.model_params)
                 if id(q) in self.masters]
        if pairs:
            resync_masters_([m for m, _ in pairs], [q for _, q in pairs])
        return [m for m, _ in pairs]

    @torch.no_grad()
    def resync_changed(self) -> None:
        """Take the model's weight wherever it differs from the rounded master (changed outside):
        every pair compared exactly (6 B/element), nothing cached trusted."""
        resync_masters_(self.master_list(), self.model_params)

    @torch.no_grad()
    def follow(self, old_devices: list[torch.device], params: list[torch.Tensor]) -> None:
        """Masters of params that moved to another device move too (from ``meta``, which holds
        no values, they are taken from the model's weights)."""
        old = {id(p): d for p, d in zip(params, old_devices)}
        for p in self.model_params:
            m = self.masters[id(p)]
            if m.device == p.device:
                continue
            if old.get(id(p), m.device).type == "meta" or m.device.type == "meta":
                m.data = p.detach().float().clone()
            else:
                m.data = m.data.to(p.device)

    @torch.no_grad()
    def take_from_model(self) -> None:
        """Masters equal to the model's weights (a native optimizer's state was loaded)."""
        for p in self.model_params:
            self.masters[id(p)].copy_(p)

    @torch.no_grad()
    def copy_back(self) -> None:
        """The model's weights = the masters rounded (torch's cast). Nothing about what it wrote
        is recorded: ``resync_changed`` compares exactly."""
        copy_back_(self.master_list(), self.model_params)

    def state_dict(self) -> list[torch.Tensor]:
        return self.master_list()

    def parse(self, saved: object, names: dict | None = None) -> list[torch.Tensor | None]:
        """Saved masters in registration order; None where the checkpoint has none (the master
        then equals the model weight: taken from the model at load)."""
        mine = self.master_list()
        if not isinstance(saved, (list, tuple)) or len(saved) != len(mine) or any(
                t is not None and (not isinstance(t, torch.Tensor) or t.shape != m.shape)
                for t, m in zip(saved, mine)):
            raise ValueError("load_state_dict: master_weights do not match this optimizer's params")
        out = [None if t is None else _local(t).detach().clone() for t in saved]
        bad = [i for i, t in enumerate(out) if t is not None and not bool(torch.isfinite(t).all())]
        if bad:
            p = self.model_params[bad[0]]
            name = (names or {}).get(id(p), f"param {bad[0]} of shape {tuple(p.shape)}")
            raise ValueError(f"load_state_dict: the checkpoint's fp32 master weight of {name} "
                             "holds NaN or inf; loading it would write it into the model's "
                             "weights. Nothing was loaded: resume from an earlier checkpoint")
        return out

    @torch.no_grad()
    def load(self, parsed: list[torch.Tensor | None]) -> None:
        for p, m, t in zip(self.model_params, self.master_list(), parsed):
            m.copy_(t if t is not None else p)
        self.copy_back()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a checkpoint tool may hand masters over as DTensors)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _keep_loaded_state_fp32(masters: MasterWeights) -> tuple:
    """Hooks on the inner optimizer's ``load_state_dict``: a state loaded into it directly
    (``opt.optimizer.load_state_dict(sd)`` after wrapping) is cast by torch to its groups'
    params, the model's bf16/fp16 ones, and would step the fp32 masters rounded (or, for state
    of another shape or a scalar, in a dtype the step refuses). After the load, every floating
    state value (``step`` aside) of a param with a master is the saved value in fp32, as a
    load into an optimizer over hand-kept fp32 masters gives. (The wrapper's own load runs
    inside :meth:`MasterWeights.swapped`: its groups hold the masters, nothing to do.)"""
    me = weakref.ref(masters)

    def before(optimizer, state_dict):
        owner = me()
        if owner is not None:
            owner._loading = state_dict

    def after(optimizer):
        owner = me()
        if owner is None or owner._loading is None:
            return
        saved, owner._loading = owner._loading, None
        ids = [k for g in saved["param_groups"] for k in g["params"]]
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for k, p in zip(ids, params):
            master, entry = owner.masters.get(id(p)), optimizer.state.get(p)
            if master is None or entry is None or k not in saved["state"]:
                continue
            for name, v in saved["state"][k].items():
                if name != "step" and name in entry and torch.is_tensor(v) \
                        and v.is_floating_point():
                    entry[name] = v.to(device=master.device, dtype=master.dtype, copy=True)

    return (masters.optimizer.register_load_state_dict_pre_hook(before),
            masters.optimizer.register_load_state_dict_post_hook(after))
