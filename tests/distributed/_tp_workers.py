"""Rank processes for test_tensor_parallel.py (on _fsdp2_workers.py's launcher): tensor
parallelism without FSDP2 (refused, by name) and ``reduction="weighted"`` on the meshes of
FSDP2 + TP and HSDP (_fsdp2_workers.train runs them natively and wrapped)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from _fsdp2_workers import TPNet, make_inner


class _NativeRefusal(Exception):
    """Native PyTorch itself refused the setup (the user never reaches the wrapper)."""


def tp_alone(world: int, even: bool = False):
    """TPNet under parallelize_module on a 1-D mesh of every rank (no fully_shard); ``even``:
    a 4-row head (DDP cannot flatten unevenly sharded params)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    torch.manual_seed(0)
    model = TPNet()
    if even:
        model.head = torch.nn.Linear(24, 4)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, {"l1": ColwiseParallel(), "l2": RowwiseParallel(),
                                     "head": ColwiseParallel(output_layouts=Replicate())})
    return model


def scenario_tp_refusals(world: int) -> dict:
    """Every way a user builds the wrapper over a TP-alone (or TP + DDP) model: a ValueError
    (message per case) and no hook left on any param; the native model still trains."""
    from accumkernels import AccumulatingOptimizer

    def ddp_model(m):
        from torch.nn.parallel import DistributedDataParallel as DDP
        try:
            return DDP(m)
        except Exception as exc:  # noqa: BLE001 - this torch's DDP cannot wrap DTensor params
            raise _NativeRefusal(f"{type(exc).__name__}: {exc}") from None

    cases = {
        "model": lambda m, o: AccumulatingOptimizer(o, model=m, accumulation_steps=2),
        "no_model": lambda m, o: AccumulatingOptimizer(o, accumulation_steps=2),
        "process_group": lambda m, o: AccumulatingOptimizer(o, model=m,
                                                            process_group=dist.group.WORLD),
        "independent_ranks": lambda m, o: AccumulatingOptimizer(o, independent_ranks=True),
        "ddp": lambda m, o: AccumulatingOptimizer(o, model=ddp_model(m)),
    }
    out = {}
    for name, make in cases.items():
        model = tp_alone(world, even=name == "ddp")
        opt = make_inner(model, "adamw")
        try:
            make(model, opt)
            out[name] = None
        except _NativeRefusal as exc:
            out[name] = f"native: {exc}"
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            out[name] = f"{type(exc).__name__}: {exc}"
        out[name + "_hooks"] = sum(len(p._post_accumulate_grad_hooks or {}) + len(
            p._backward_hooks or {}) for p in model.parameters())
        before = [p.detach().full_tensor().clone() for p in model.parameters()]
        model(torch.randn(4, 16)).pow(2).sum().backward()
        opt.step()  # (the inner optimizer, natively)
        out[name + "_trains"] = any(not torch.equal(a, p.detach().full_tensor())
                                    for a, p in zip(before, model.parameters()))
    return out


def scenario_tp_resume(world: int) -> dict:
    """FSDP2 + TP (dp 2 x tp 2), a window of 2: ``state_dict()`` after its first backward,
    deep-copied and loaded into a fresh wrapper over a freshly built model (same init), the
    window finished and stepped. Returns, per (reduction, inner optimizer), this rank's local
    param shards of the uninterrupted run, of the run that saved and went on, and of the
    resumed one."""
    import copy

    from accumkernels import AccumulatingOptimizer
    from _fsdp2_workers import build_tp, dp_rank_and_size, micro_batch, weight

    def make(reduction: str, inner: str):
        model = build_tp((2, 2))
        opt = (torch.optim.AdamW(model.parameters(), lr=0.01) if inner == "adamw"
               else torch.optim.SGD(model.parameters(), lr=0.01))
        return model, AccumulatingOptimizer(opt, model=model, accumulation_steps=2,
                                            reduction=reduction)

    def backward(model, opt, reduction: str, i: int) -> None:
        rank, _ = dp_rank_and_size(model)
        x, y = micro_batch(rank, 0, i)
        torch.nn.functional.mse_loss(model(x).float(), y, reduction="sum").backward()
        if reduction == "weighted":
            opt.add_weight(weight(rank, i))

    def local(model) -> list:
        return [p.detach().to_local().clone() for p in model.parameters()]

    out = {}
    for reduction, inner in (("sum", "adamw"), ("weighted", "adamw"), ("weighted", "sgd")):
        runs = {}
        for run in ("straight", "saved", "resumed"):
            model, opt = make(reduction, inner)
            backward(model, opt, reduction, 0)
            if run != "straight":
                sd = copy.deepcopy(opt.state_dict())
            if run == "resumed":
                opt.remove_hooks()
                model, opt = make(reduction, inner)
                opt.load_state_dict(sd)
            backward(model, opt, reduction, 1)
            opt.step()
            runs[run] = local(model)
            opt.remove_hooks()
        out[f"{reduction}_{inner}"] = runs
    return out
