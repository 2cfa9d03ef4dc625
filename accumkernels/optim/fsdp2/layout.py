"""The FSDP2 room: AccumulatingOptimizer over ``fully_shard`` models (DTensor params).

The supported recipe is torchtitan's: fp32 params sharded by ``fully_shard`` with
``MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)``. The window is
fp32 storage shaped like each param's local shard (accumkernels.optim.fsdp2.intake), so it costs
about 4 B/param / world per rank and never an unsharded copy; the fp32 shards are the master
weights. FSDP2 reduces (reduce-scatter, HSDP all-reduce, its ``set_requires_gradient_sync``
cadence) and averages over the data-parallel ranks as natively; ``reduction="sum"`` is then
native FSDP2's result, ``"mean"`` divides it by the micro-batches, and ``"weighted"`` makes FSDP2
sum (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``) and
divides by the weight total of all ranks. Clipping, the non-finite check and the window
bookkeeping are agreed over the whole mesh.

``AccumulatingOptimizer(...)`` takes this layout itself (optim.parts.layout_for) when the inner
optimizer holds DTensor params; ``model=`` (the ``fully_shard`` root) is required.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from accumkernels._util import LOW_PRECISION
from accumkernels.optim.sync.reducer import WindowTotals, check_phase, check_weights, weight_counts
from accumkernels.optim.fsdp2 import checkpoint as fsdp2_checkpoint
from accumkernels.optim.fsdp2.intake import ShardedIntake, ShardedWindow
from accumkernels.optim.fsdp2.recipe import RECIPE, dtensor_type, tensor_parallel_error
from accumkernels.optim.nonfinite import sum_of_squares
from accumkernels.optim.sync.local import LocalSync
from accumkernels._torch_private import fsdp2_group_mesh, fsdp2_offload_unsafe

__all__ = ["MeshSync", "ShardedLayout"]

_FORWARD = "ran the forward of another micro-batch"


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


def check_recipe(params: list[torch.Tensor], model: object, kwargs: dict) -> tuple:
    """Refuse (ValueError) what cannot work, before any state; return (modules, groups, mesh)."""
    dtensor = dtensor_type()
    if not isinstance(model, torch.nn.Module):
        raise tensor_parallel_error(
            "the params are DTensors (FSDP2's fully_shard, or tensor parallelism's "
            "parallelize_module) and no model= was given. FSDP2, alone or with tensor "
            "parallelism, needs model=<the fully_shard root module> so the wrapper can follow "
            "its backward")
    modules, groups, owned = _fsdp_groups(model, params)
    if not modules:
        raise tensor_parallel_error(
            f"the params are DTensors but model ({type(model).__name__}) has no fully_shard "
            "module: tensor parallelism without FSDP2")
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
    meshes = []
    for i, p in enumerate(params):
        if not isinstance(p, dtensor) or i not in owned:
            raise tensor_parallel_error(
                f"param {i} (shape {tuple(p.shape)}) is "
                f"{'not a DTensor' if not isinstance(p, dtensor) else 'a DTensor'} outside "
                "every fully_shard module of model; every trainable param of the optimizer must "
                "be sharded by fully_shard")
        if p.dtype in LOW_PRECISION:
            raise ValueError(
                f"AccumulatingOptimizer (FSDP2): param {i} is a {p.dtype} shard; FSDP2 rounds "
                "each reduced micro-batch gradient to the param dtype before any hook, so no "
                f"window could be exact. Keep the sharded params fp32: {RECIPE}")
        if p.device.type != p.device_mesh.device_type and p.to_local().is_pinned() \
                and fsdp2_offload_unsafe():
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


def _dp_dims(modules: list, mesh) -> int:
    """How many leading dims of the params' mesh are FSDP2's data-parallel ones (the rest are
    tensor/expert parallel: FSDP2 + TP puts them after the DP dims). FSDP2 keeps its DP mesh
    on each module's param group (private; without it every dim counts as data parallel)."""
    for module in modules:
        try:
            dp_mesh = fsdp2_group_mesh(module)
        except AttributeError:
            continue
        return dp_mesh.ndim if dp_mesh is not None else mesh.ndim
    return mesh.ndim


class MeshSync(LocalSync):
    """The sync protocol (accumkernels.optim.sync.local) under FSDP2: FSDP2 reduces the gradients;
    this sums the window's bookkeeping (and non-finite flags) over every rank of the mesh.

    ``reduction="weighted"``: ``add_weight`` reports the weight of the micro-batch this rank
    computed; the ranks of one tensor-parallel group compute the same one, so only the first
    of them counts it (the weights are summed over the data-parallel dims only). Once the
    window is complete (N given) and every micro-batch's weight is in, after the N-th backward
    or the ``add_weight`` that completes them, the mesh agrees on the total at once and the
    window is normalised: ``p.grad`` then shows the final sum / total weight, so a user's clip
    before ``step()`` measures what the step uses."""

    active = True
    joins_stage_norm = False  # pipelining's clip_across_stages: flat windows only

    def __init__(self, mesh, averaged: bool, dp_dims: int | None = None, weighted: bool = False):
        super().__init__(independent_ranks=False)
        self.mesh = mesh
        self.world = mesh.size()
        self.averaged = averaged  # FSDP2 averaged the gradients over the mesh (not summed)
        self.timeout_s = 300.0
        self.window = self.params = None
        self.weighted = weighted
        dp_dims = mesh.ndim if dp_dims is None else dp_dims
        coordinate = mesh.get_coordinate() or [0] * mesh.ndim
        # a tensor-parallel peer (not the first of its TP group) reports no weight of its own
        self.tp_peer = any(c != 0 for c in coordinate[dp_dims:])
        self.tp_size = self.world // math.prod(mesh.size(d) for d in range(dp_dims))
        self._awaiting = False  # the agreement after the N-th backward found weights missing

    def _weight(self) -> float:
        return 0.0 if self.tp_peer else self.window.local_weight()

    def _agree_weight(self) -> None:
        """The mesh agrees on the window's bookkeeping (the step's all-reduce: a rank that
        skipped an ``add_weight`` meets the others' agreement wherever it is, and every rank
        raises); with every weight in, the window is normalised by the total (what ``p.grad``
        shows), else the ``add_weight`` that completes them agrees again."""
        device = next(iter(self.window.storage.buffers), torch.device("cpu"))  # (NCCL: GPU)
        values = self._bookkeeping(torch.zeros((), device=device))
        self._awaiting = values[-3] > 0  # every rank misses the same number of weights
        if not self._awaiting and values[3] > 0:
            self.window.normalise(values[3])

    def end_backward(self) -> bool:
        """A backward of a complete window (every rank runs it): agree, normalise if every
        weight is in."""
        if self.weighted and self.window.complete:
            self._agree_weight()
            return not self._awaiting
        return False

    def weight_added(self) -> None:
        """The weight that completes a complete window's (reported after its backward); a
        weight beyond them is agreed at the step."""
        if self._awaiting and not self.window.weights_pending():
            self._agree_weight()

    def reset(self) -> None:
        self._awaiting, self.refused_weight = False, None
        super().reset()

    def rebind(self, window, params: list[torch.Tensor]) -> None:
        self.window, self.params = window, params

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

    def _bookkeeping(self, found_inf: torch.Tensor) -> list[float]:
        """The window's counts, weight, non-finite flag, held params and weight counts summed
        over the mesh; the same checks raise on every rank."""
        w = self.window
        micro_steps = w.micro_steps
        head = torch.tensor([micro_steps, micro_steps**2, w.kept, self._weight()],
                            dtype=torch.float64)
        weights = self.weight_state()
        info = torch.cat([head.to(found_inf.device), found_inf.double().reshape(1),
                          torch.tensor(w.held(self.params), dtype=torch.float64)
                          .to(found_inf.device), weight_counts(*weights).to(found_inf.device),
                          torch.ones(1, dtype=torch.float64, device=found_inf.device)])
        values = self.all_reduce(info, "window bookkeeping").tolist()
        check_phase(values.pop(), self.world, dist.get_rank(), True, _FORWARD)
        if values[1] * self.world != values[0] ** 2:  # Cauchy-Schwarz: every rank ran m
            raise RuntimeError(
                f"AccumulatingOptimizer (FSDP2): the ranks disagree on the window: this rank ran "
                f"{micro_steps} micro-batches, the {self.world} ranks {values[0]:g} in all")
        check_weights(values[-3:], self.world, dist.get_rank(), *weights)
        return values

    def forward_begins(self) -> None:
        """``accumulation_steps=None``: before a forward's first FSDP2 collective (its
        all-gather), the mesh meets in an all-reduce shaped like the step's bookkeeping, marked
        "not stepping". Every step() ends a window there, so a rank that calls step() while
        the others run on meets them here (not in FSDP2's all-gather, which would wait
        forever), and every rank raises alike (accumkernels.optim.sync.reducer.check_phase)."""
        if self.window is None:
            return
        device = next(iter(self.window.storage.buffers), torch.device("cpu"))
        # the bookkeeping's length: head (4), found_inf, held params, weight counts (3), phase
        info = torch.zeros(9 + len(self.params), dtype=torch.float64, device=device)
        stepping = self.all_reduce(info, "forward")[-1].item()
        check_phase(stepping, self.world, dist.get_rank(), False, _FORWARD)

    def finish(self, found_inf: torch.Tensor) -> WindowTotals:
        values = self._bookkeeping(found_inf)
        totals = WindowTotals(values, self.world, len(self.params))
        totals.averaged = self.averaged
        return totals

    def agree_for_checkpoint(self, found_inf: torch.Tensor,
                             weight: float) -> tuple[torch.Tensor, float]:
        """The OR of every rank's non-finite flag and the world's weight total, scaled so that
        1/world of it is each data-parallel rank's share (the checkpoint stores that share on
        every rank; tensor-parallel peers count no weight of their own)."""
        weight = 0.0 if self.tp_peer else weight
        values = torch.cat([found_inf.double().reshape(1),
                            torch.tensor([weight], dtype=torch.float64).to(found_inf.device)])
        values = self.all_reduce(values, "checkpoint bookkeeping").tolist()
        return torch.full_like(found_inf, float(values[0] > 0)), values[1] * self.tp_size

    def rank_local_window(self) -> None:
        return None  # the checkpoint saves the window in its agreed, sharded form

    def check_world(self) -> None:
        pass

    def ddp_possible(self) -> bool:
        return False


def mesh_norm(sync: MeshSync, shown: list[torch.Tensor],
              outside: list[torch.Tensor]) -> torch.Tensor:
    """The global 2-norm of the window (and of the native ``.grad`` of params outside it),
    computed as ``clip_grad_norm_`` does on DTensors, so the same on every rank. Where it is
    not finite, a float64 sum of squares of the local shards summed over the mesh tells an
    fp32 overflow (finite values: that norm) from a non-finite value on any rank (NaN)."""
    if not shown and not outside:
        return torch.zeros(())
    norm = torch.nn.utils.get_total_norm(shown + outside, 2.0)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if bool(torch.isfinite(norm)):
        return norm
    sumsq = sum_of_squares(shown + outside, norm.device)
    bad = ~torch.isfinite(sumsq)
    values = torch.stack([torch.where(bad, torch.zeros_like(sumsq), sumsq), bad.double()])
    values = sync.all_reduce(values, "non-finite check")
    return values[0].sqrt() if float(values[1]) == 0 else torch.full_like(sumsq, float("nan"))


class ShardedLayout:
    """The FSDP2 layout policy (see accumkernels.optim.parts): the window shaped like each
    param's local shard, FSDP2's hooks as intake, the mesh as sync, the DTensor norm."""

    can_fold = False  # the window's factors stay explicit passes over the DTensor shards
    # "mean" with N given is normalised only at the step here: 1/N stays fused into every add,
    # so p.grad shows the final mean once the N-th backward is in (window.py)
    fuses_inexact_mean = True
    measure = staticmethod(mesh_norm)
    checkpoint = fsdp2_checkpoint

    def __init__(self, params: list[torch.Tensor], model, kwargs: dict):
        self.model = model
        self.modules, self.groups, self.mesh = check_recipe(params, model, kwargs)

    def check(self, params: list[torch.Tensor]) -> None:
        pass  # check_recipe ran when the layout was picked

    def storage(self, params: list[torch.Tensor], config) -> ShardedWindow:
        self.modules, self.groups, self.mesh = check_recipe(params, self.model, {})
        return ShardedWindow(params)

    def show(self, params: list[torch.Tensor], storage: ShardedWindow) -> None:
        for p, shown in zip(params, storage.shown):
            p.grad = None
            p.main_grad = shown

    def intake(self, parts, storage: ShardedWindow, events, outside) -> ShardedIntake:
        return ShardedIntake(parts, storage, events, self.groups, self.modules, root=self.model)

    def sync(self, config, process_group, ddp, window, params) -> MeshSync:
        weighted = config.weighted
        if weighted:  # the wrapper owns the normalisation: FSDP2 sums over ranks
            for module in self.modules:
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        sync = MeshSync(self.mesh, averaged=not weighted, weighted=weighted,
                        dp_dims=_dp_dims(self.modules, self.mesh))
        sync.rebind(window, params)
        return sync
