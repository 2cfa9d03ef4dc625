"""The FSDP2 room: AccumulatingOptimizer over ``fully_shard`` models (DTensor params).

The supported recipe is torchtitan's: fp32 params sharded by ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``. The window is
fp32 storage shaped like each param's local shard (accumkernels.optim.fsdp2_intake), so it costs
about 4 B/param / world per rank and never an unsharded copy; the fp32 shards are the master
weights. FSDP2 reduces (reduce-scatter, HSDP all-reduce, its ``set_requires_gradient_sync``
cadence) and averages over the data-parallel ranks as natively; ``reduction="sum"`` is then
native FSDP2's result, ``"mean"`` divides it by the micro-batches, and ``"weighted"`` makes FSDP2
sum (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``) and
divides by the weight total of all ranks. Clipping, the non-finite check and the window
bookkeeping are agreed over the whole mesh.

``AccumulatingOptimizer(...)`` builds this class itself when the inner optimizer holds DTensor
params; ``model=`` (the ``fully_shard`` root) is required.
"""

from __future__ import annotations

import datetime
import inspect

import torch
import torch.distributed as dist

from accumkernels import backends
from accumkernels._util import LOW_PRECISION
from accumkernels.distributed import WindowTotals
from accumkernels.optim import fsdp2_checkpoint, protocol
from accumkernels.optim.fsdp2_intake import ShardedIntake, ShardedWindow
from accumkernels.optim.nonfinite import sum_of_squares
from accumkernels.optim.optimizer import _WINDOW_DTYPES, AccumulatingOptimizer

__all__ = ["ShardedAccumulatingOptimizer", "is_sharded"]

RECIPE = ("fully_shard(module, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
          "reduce_dtype=torch.float32)) on an fp32 model, and AccumulatingOptimizer(optimizer, "
          "model=<the fully_shard root>)")


def _dtensor_type():
    if not dist.is_available():
        return None
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return None
    return DTensor


def is_sharded(optimizer: object) -> bool:
    """Whether ``optimizer`` holds a DTensor param (AccumulatingOptimizer then builds this room)."""
    dtensor = _dtensor_type()
    groups = getattr(optimizer, "param_groups", None)
    if dtensor is None or not isinstance(groups, list):
        return False
    return any(isinstance(p, dtensor) for g in groups if isinstance(g, dict)
               for p in g.get("params", ()))


def _fsdp_groups(model: torch.nn.Module, params: list[torch.Tensor]):
    """The FSDP modules of ``model`` and, per module, the indices of the managed params it owns."""
    from torch.distributed.fsdp import FSDPModule

    index = {id(p): i for i, p in enumerate(params)}
    owned: set[int] = set()
    modules, groups = [], []
    for module in reversed(list(model.modules())):  # inner fully_shard modules first
        if not isinstance(module, FSDPModule):
            continue
        members = [index[id(p)] for p in module.parameters()
                   if id(p) in index and index[id(p)] not in owned]
        owned.update(members)
        modules.append(module)
        if members:
            groups.append(sorted(members))
    return modules, groups, owned


def _offload_unsafe() -> bool:
    """Whether this torch's FSDP2 may run the hooks before a pinned D2H gradient copy is done."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives
        return "has_post_acc_grad_hook" not in inspect.getsource(_fsdp_collectives.foreach_reduce)
    except (ImportError, OSError, TypeError):  # pragma: no cover - source not readable
        return True


def check_recipe(params: list[torch.Tensor], model: object, kwargs: dict) -> tuple:
    """Refuse (ValueError) what cannot work, before any state; return (modules, groups, mesh)."""
    dtensor = _dtensor_type()
    if not isinstance(model, torch.nn.Module):
        raise ValueError("AccumulatingOptimizer: the params are DTensors (FSDP2); pass model=<the "
                         f"fully_shard root module> so the wrapper can follow its backward. "
                         f"Supported recipe: {RECIPE}")
    if kwargs.get("process_group") is not None:
        raise ValueError("AccumulatingOptimizer (FSDP2): leave process_group out; FSDP2 "
                         "reduce-scatters the gradients itself")
    if kwargs.get("accumulate_in_backward", True) is not True:
        raise ValueError("AccumulatingOptimizer (FSDP2): accumulate_in_backward=False is not "
                         "supported (FSDP2 hands each reduced shard over during backward)")
    if kwargs.get("nonfinite") == "skip_microbatch":
        raise ValueError("AccumulatingOptimizer (FSDP2): nonfinite='skip_microbatch' is not "
                         "supported (each micro-batch is reduced across ranks before it could "
                         "be dropped); use 'skip_step' or 'raise'")
    modules, groups, owned = _fsdp_groups(model, params)
    if not modules:
        raise ValueError(f"AccumulatingOptimizer: model has no fully_shard module. {RECIPE}")
    meshes = []
    for i, p in enumerate(params):
        if not isinstance(p, dtensor) or i not in owned:
            raise ValueError(
                f"AccumulatingOptimizer (FSDP2): param {i} (shape {tuple(p.shape)}) is "
                f"{'not a DTensor' if not isinstance(p, dtensor) else 'a DTensor'} outside "
                "every fully_shard module of model; every trainable param of the optimizer must "
                f"be sharded by fully_shard (tensor parallel is not supported). {RECIPE}")
        if p.dtype in LOW_PRECISION:
            raise ValueError(
                f"AccumulatingOptimizer (FSDP2): param {i} is a {p.dtype} shard; FSDP2 rounds "
                "each reduced micro-batch gradient to the param dtype before any hook, so no "
                f"window could be exact. Keep the sharded params fp32: {RECIPE}")
        if p.device.type != p.device_mesh.device_type and p.to_local().is_pinned() \
                and _offload_unsafe():
            raise ValueError(
                "AccumulatingOptimizer (FSDP2): CPU offload with pinned memory; this torch's "
                "FSDP2 may run gradient hooks before the device-to-host copy finished. Use "
                "CPUOffloadPolicy(pin_memory=False) or a newer torch")
        if p.device_mesh not in meshes:
            meshes.append(p.device_mesh)
    if len(meshes) != 1:
        raise ValueError("AccumulatingOptimizer (FSDP2): the params live on several device "
                         "meshes; one mesh per wrapper is supported")
    return modules, groups, meshes[0]


class MeshAgreement:
    """The wrapper's data-parallel room under FSDP2: FSDP2 reduces the gradients; this sums the
    window's bookkeeping (and non-finite flags) over every rank of the mesh."""

    ddp_group = None
    move_each_now = False
    active = True

    def __init__(self, mesh, averaged: bool):
        self.mesh = mesh
        self.world = mesh.size()
        self.averaged = averaged  # FSDP2 averaged the gradients over the mesh (not summed)
        self.timeout_s = 300.0
        self.totals: WindowTotals | None = None

    @property
    def reducer(self) -> MeshAgreement:  # the core reads reducer.timeout_s
        return self

    def all_reduce(self, values: torch.Tensor, what: str) -> torch.Tensor:
        """Sum ``values`` over the whole mesh (dimension by dimension), with a deadline."""
        for dim in range(self.mesh.ndim):
            work = dist.all_reduce(values, group=self.mesh.get_group(dim), async_op=True)
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as exc:
                raise RuntimeError(
                    f"AccumulatingOptimizer (FSDP2): waited {self.timeout_s:g} s for the {what} "
                    "all-reduce; a rank stopped early or took another step") from exc
        return values

    def finish(self, micro_steps: int, kept: int, weight: float, found_inf: torch.Tensor,
               touched: list[bool]) -> WindowTotals:
        head = torch.tensor([micro_steps, micro_steps**2, kept, weight], dtype=torch.float64)
        info = torch.cat([head.to(found_inf.device), found_inf.double().reshape(1),
                          torch.tensor(touched, dtype=torch.float64).to(found_inf.device)])
        values = self.all_reduce(info, "window bookkeeping").tolist()
        if values[1] * self.world != values[0] ** 2:  # Cauchy-Schwarz: every rank ran m
            raise RuntimeError(
                f"AccumulatingOptimizer (FSDP2): the ranks disagree on the window: this rank ran "
                f"{micro_steps} micro-batches, the {self.world} ranks {values[0]:g} in all")
        self.totals = WindowTotals(values, self.world, len(touched))
        self.totals.averaged = self.averaged
        return self.totals

    def agree_for_checkpoint(self, found_inf: torch.Tensor,
                             weight: float) -> tuple[torch.Tensor, float]:
        """The OR of every rank's non-finite flag and the world's weight total."""
        values = torch.cat([found_inf.double().reshape(1),
                            torch.tensor([weight], dtype=torch.float64).to(found_inf.device)])
        values = self.all_reduce(values, "checkpoint bookkeeping").tolist()
        return torch.full_like(found_inf, float(values[0] > 0)), values[1]

    def check_world(self) -> None:
        pass

    def bucket_moved(self, bucket, last_microbatch: bool) -> None:
        pass

    def end_backward(self) -> bool:
        return False

    def weight_added(self) -> None:
        pass

    def reset(self) -> None:
        self.totals = None


class ShardedAccumulatingOptimizer(AccumulatingOptimizer):
    """AccumulatingOptimizer for FSDP2 models; built by ``AccumulatingOptimizer(...)`` itself."""

    _takes_dtensors = True

    def __init__(self, optimizer: torch.optim.Optimizer, **kwargs):
        params = [p for g in getattr(optimizer, "param_groups", []) for p in g["params"]
                  if p.requires_grad and p.dtype in _WINDOW_DTYPES]  # as the core's window
        self._fsdp = check_recipe(params, kwargs.get("model"), kwargs)
        self._fsdp_model = kwargs["model"]
        super().__init__(optimizer, **kwargs)
        modules, _, mesh = self._fsdp
        weighted = self.config.reduction == "weighted"
        if weighted:  # the wrapper owns the normalisation: FSDP2 sums over ranks
            for module in modules:
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        self._dp = MeshAgreement(mesh, averaged=not weighted)

    def _build(self, params: list[torch.Tensor]) -> None:
        for device in {p.device for p in params}:
            backends.resolve(self.config.backend, device)
        modules, groups, _ = self._fsdp = check_recipe(params, self._fsdp_model, {})
        if self._intake is not None:
            self._intake.hide_all()
            self._intake.remove()
        window = ShardedWindow(params)
        self._params, self._buffer = params, window
        for p, shown in zip(params, window.shown):
            p.grad = None
            p.main_grad = shown
        self._outside.rebuild({id(p) for p in params})
        self._intake = ShardedIntake(self, params, window, groups, modules)

    def _foldable(self) -> bool:
        return False  # the window's factors stay explicit passes over the DTensor shards

    def _window_norm(self, outside: list[torch.Tensor]) -> torch.Tensor:
        """The global 2-norm of the window (and of the native ``.grad`` of params outside it),
        computed as ``clip_grad_norm_`` does on DTensors, so the same on every rank. Where it is
        not finite, a float64 sum of squares of the local shards summed over the mesh tells an
        fp32 overflow (finite values: that norm) from a non-finite value on any rank (NaN)."""
        touched = self._window.touched
        shown = [v for p, v in zip(self._params, self._intake.views) if id(p) in touched]
        norm = torch.nn.utils.get_total_norm(shown + outside, 2.0) if shown or outside \
            else torch.zeros((), device=self._nonfinite.found_inf.device)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if bool(torch.isfinite(norm)):
            return norm
        sumsq = sum_of_squares(shown + outside, norm.device)
        bad = ~torch.isfinite(sumsq)
        values = torch.stack([torch.where(bad, torch.zeros_like(sumsq), sumsq), bad.double()])
        values = self._dp.all_reduce(values, "non-finite check")
        return values[0].sqrt() if float(values[1]) == 0 else torch.full_like(sumsq, float("nan"))

    def state_dict(self) -> dict:
        """A torch optimizer state dict whose window is per-param DTensors (for DCP; see
        accumkernels.optim.fsdp2_checkpoint). Collective: every rank calls it."""
        self._settle()
        return protocol.state_dict_with_hooks(self, lambda: fsdp2_checkpoint.assemble(self))

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Restore a ``state_dict()`` (after ``dcp.load`` resharded it to this world size)."""
        protocol.load_with_hooks(self, state_dict,
                                 lambda sd: fsdp2_checkpoint.restore(self, sd))

    def _first_nonfinite(self) -> str:
        for i, (p, view) in enumerate(zip(self._params, self._buffer.views)):
            if view.numel() and not bool(torch.isfinite(view).all()):
                return self._names.get(id(p), f"parameter {i} (shape {tuple(p.shape)})")
        return "the window (non-finite on another rank, or when accumulated)"
