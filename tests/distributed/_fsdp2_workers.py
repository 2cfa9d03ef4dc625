"""Rank processes for test_fsdp2.py: FSDP2 (``fully_shard``) on 2 or 4 gloo ranks.

``run_ranks(tmp_path, world, scenarios)`` spawns one process per rank; every rank runs the
listed scenarios in turn (one launch, several scenarios: CI time) and writes one result file.
Ranks meet through a FileStore in ``tmp_path``; each waits at a monitored barrier before
``destroy_process_group`` and leaves with ``os._exit``; the parent kills any rank still alive
after the deadline.

Each scenario trains the same model twice from the same seed on the same data: natively
(FSDP2 accumulating into ``.grad``) and with AccumulatingOptimizer, and returns both runs'
local gradient shards after every micro-batch, clip norms and final params.
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from _spawn import run_scenario, spawn_ranks

ACCUM = 3  # micro-batches per window
WINDOWS = 3
LR = 1e-2
CLIP = 0.05  # below every window's norm: clipping always acts
MICRO = 4  # samples per micro-batch and rank


class Net(torch.nn.Module):
    """Two fully_shard layers, an ``extra`` one (own FSDP group) and a ``gate`` param (root
    group) used only in some micro-batches; the head has 3 rows (an empty shard on 4 ranks)."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 40)
        self.extra = torch.nn.Linear(40, 40)
        self.l2 = torch.nn.Linear(40, 24)
        self.head = torch.nn.Linear(24, 3)
        self.gate = torch.nn.Parameter(torch.randn(24))

    def forward(self, x, use_extra: bool):
        h = torch.tanh(self.l1(x))
        if use_extra:
            h = h + torch.tanh(self.extra(h))
        h = torch.tanh(self.l2(h))
        if use_extra:
            h = h * self.gate
        return self.head(h)


def build(mesh_shape: tuple[int, ...], *, dtype=torch.float32):
    """Net under fully_shard (bf16 compute, fp32 reduce), the same init on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Net().to(dtype)
    names = ("rep", "shard") if len(mesh_shape) == 2 else ("shard",)
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=names)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.l1, model.extra, model.l2):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


class TPNet(torch.nn.Module):
    """Every param tensor-parallel (torchtitan's plan: colwise, rowwise, a colwise head that
    gathers its output), so FSDP2 puts all of them on one (dp, tp) mesh."""

    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(16, 40)
        self.l2 = torch.nn.Linear(40, 24)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x, use_extra: bool = True):
        return self.head(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


def build_tp(mesh_shape: tuple[int, int]):
    """TPNet: parallelize_module over the "tp" dim, then fully_shard over "dp" (bf16 compute,
    fp32 reduce), the same init on every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = TPNet()
    mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel(),
                                           "head": ColwiseParallel(output_layouts=Replicate())})
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model.l1, model.l2):
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    return model


def dp_rank_and_size(model) -> tuple[int, int]:
    """This rank's data-parallel index and the number of replicas (TP ranks share data)."""
    mesh = next(model.parameters()).device_mesh
    if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return mesh.get_local_rank("dp"), mesh.size(0)
    return dist.get_rank(), dist.get_world_size()


def micro_batch(rank: int, window: int, i: int):
    g = torch.Generator().manual_seed(1000 * rank + 10 * window + i)
    return torch.randn(MICRO, 16, generator=g), torch.randn(MICRO, 3, generator=g)


def make_inner(model, kind: str):
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def weight(rank: int, i: int) -> float:
    """The weight (sample count stand-in) rank ``rank`` reports for micro-batch ``i``."""
    return float(MICRO * (1 + rank + i))


def local_grads(model) -> list:
    return [None if p.grad is None else p.grad.to_local().detach().clone()
            for p in model.parameters()]


def train(mesh_shape, *, wrap: bool, inner: str = "adamw", nosync: str = "", clip: str = "user",
          reduction: str = "sum", weights: bool = False, unused: bool = True,
          wire: bool = False, outside_clear: bool = False, tp: bool = False,
          weight_first: bool = False, empty: bool = False) -> dict:
    """Three windows of ACCUM micro-batches; ``nosync``: "" (sync every micro-batch), "grad"
    (set_requires_gradient_sync) or "allreduce" (HSDP set_requires_all_reduce); ``clip``:
    "user" (clip_grad_norm_ before step) or "wrapper" (max_grad_norm); ``unused``: ``extra``
    and ``gate`` sit out every other micro-batch (FSDP2's HSDP partial reduce cannot take that:
    its running sum changes size); ``wire``: the opt-in bf16-wire reduce-scatter;
    ``outside_clear``: ``model.zero_grad()`` after each window's first micro-batch (natively that
    drops it; the wrapper, with ``accumulation_steps=None``, must too); ``tp``: TPNet on a
    (dp, tp) mesh; ``weight_first``: ``add_weight`` before each backward (else after);
    ``empty``: rank 1's second micro-batch of each window has no tokens (weight 0, loss 0).
    Weighted: the native loop divides by the weight total right after the last backward, so
    the gradients of that micro-batch compare with the wrapper's final ones."""
    from accumkernels import AccumulatingOptimizer

    model = build_tp(mesh_shape) if tp else build(mesh_shape)
    rank, replicas = dp_rank_and_size(model)
    opt = make_inner(model, inner)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=None if outside_clear else ACCUM,
                                    model=model,
                                    reduction=reduction,
                                    max_grad_norm=CLIP if clip == "wrapper" else None)
        if wire:
            from accumkernels.optim.fsdp2.wire import enable_bf16_reduce_scatter
            comm = enable_bf16_reduce_scatter(model)
    elif weights:  # native weighted: FSDP2 sums over ranks, the loop divides by the total
        for module in model.modules():  # (the setters do not recurse)
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    def weight_of(r: int, k: int) -> float:
        return 0.0 if empty and r == 1 and k == 1 else weight(r, k)

    grads, norms = [], []
    for w in range(WINDOWS):
        for i in range(ACCUM):
            last = i == ACCUM - 1
            if nosync == "grad":
                model.set_requires_gradient_sync(last)
            elif nosync == "allreduce":
                model.set_requires_all_reduce(last)
            x, y = micro_batch(rank, w, i)
            if wrap and weights and weight_first:
                opt.add_weight(weight_of(rank, i))
            pred = model(x, use_extra=not unused or (w + i) % 2 == 0).float()
            loss = torch.nn.functional.mse_loss(pred, y,
                                                reduction="sum" if weights else "mean")
            (loss * 0 if weights and not weight_of(rank, i) else loss).backward()
            if wrap and weights and not weight_first:
                opt.add_weight(weight_of(rank, i))
            if outside_clear and i == 0:
                model.zero_grad()
            if not wrap and weights and last:  # natively: divide by the replicas' weights
                total = sum(weight_of(r, k) for r in range(replicas) for k in range(ACCUM))
                torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                                    1.0 / total)
            grads.append(local_grads(model))
        if not wrap and reduction == "mean":  # what the wrapper's reduction means, natively
            torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None],
                                1.0 / ACCUM)
        if clip == "user":
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).full_tensor())
        opt.step()
        if clip == "wrapper":
            norms.append(opt.last_grad_norm.clone())
        opt.zero_grad()
    out = {"grads": grads, "norms": norms,
           "params": [p.detach().full_tensor().clone() for p in model.parameters()],
           "local_params": [p.detach().to_local().clone() for p in model.parameters()]}
    if wrap and wire:
        out["wire"] = {"bytes": comm.bytes_sent, "fallbacks": comm.fp32_fallbacks}
    if wrap:
        out["window_bytes"] = sum(b.untyped_storage().nbytes()
                                  for b in opt._parts.window.storage.buffers.values())
        out["live_bytes"] = live_bytes()
        opt.remove_hooks()
    else:
        out["live_bytes"] = live_bytes()
    return out


def live_bytes() -> int:
    """Bytes of every distinct tensor storage reachable by the garbage collector."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if type(obj) in (torch.Tensor, torch.nn.Parameter) or isinstance(obj, DTensor):
                t = obj.to_local() if hasattr(obj, "to_local") else obj
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        except (RuntimeError, AttributeError):
            continue
    return sum(seen.values())


def scenario_pair(world: int, **kwargs) -> dict:
    """Native and wrapped runs of one configuration on this rank."""
    mesh = (2, 2) if kwargs.pop("hsdp", False) or kwargs.get("tp") else (world,)
    native_kwargs = {k: v for k, v in kwargs.items() if k != "clip"}
    return {"native": train(mesh, wrap=False, **native_kwargs),
            "ours": train(mesh, wrap=True, **kwargs)}


# -- process management -------------------------------------------------------------------------
def _run_all(world: int, scenarios: dict) -> dict:
    results = {}
    for name, kwargs in scenarios.items():
        kwargs = dict(kwargs)
        fn = kwargs.pop("fn", scenario_pair)
        results[name] = fn(world, **kwargs)
    return results


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    world, scenarios = kwargs["world"], kwargs["scenarios"]
    run_scenario(rank, out_dir, world, lambda: _run_all(world, scenarios))


def run_ranks(tmp_path, world: int, scenarios: dict, timeout: float = 150.0) -> list[dict]:
    """Run ``scenarios`` (name -> kwargs) on ``world`` spawned ranks; return each rank's
    results (name -> scenario result). Every process is gone when this returns."""
    return spawn_ranks(_rank_main, str(tmp_path), "fsdp2", {"world": world,
                                                             "scenarios": scenarios},
                       world, timeout)
