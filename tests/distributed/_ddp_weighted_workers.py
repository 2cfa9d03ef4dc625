"""Rank processes for test_ddp_weighted.py: ``reduction="weighted"`` under DistributedDataParallel
on 2 gloo ranks (_spawn.py: a FileStore, a deadline, the result before teardown).

Each run trains the same MLP twice from the same seed on the same data: natively (a summed loss,
DDP averaging over the ranks, the loop multiplying ``.grad`` by world / total weight after the
sync backward, then ``clip_grad_norm_``) and wrapped (``add_weight`` before or after each
backward, the user's ``clip_grad_norm_`` before ``step()``). Returned: ``p.grad`` right after each
window's last micro-batch (and its weight), the clip norms and the params.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from _ddp_workers import mlp
from _spawn import run_scenario, spawn_ranks

ACCUM = 3
WINDOWS = 3
CLIP = 1e-3  # below every window's norm: the clip acts
MICRO = 5


def data(rank: int, w: int, i: int):
    g = torch.Generator().manual_seed(100 * rank + 10 * w + i)
    n = 2 + (rank + w + i) % MICRO  # micro-batches of different sizes: the weights matter
    return torch.randn(n, 16, generator=g), torch.randn(n, 4, generator=g)


def tokens(rank: int, w: int, i: int, empty: bool) -> int:
    """The micro-batch's weight; ``empty``: rank 1's second micro-batch of every window is
    fully masked (no tokens: weight 0, a loss of 0)."""
    return 0 if empty and rank == 1 and i == 1 else data(rank, w, i)[0].shape[0]


def train(*, wrap: bool, weight_first: bool = False, nosync: bool = True,
          accumulation_steps: int | None = ACCUM, group: bool = False,
          empty: bool = False) -> dict:
    """``group``: no DDP; the wrapper's ``process_group`` (natively: the loop all-reduces the
    summed ``.grad`` and divides by the ranks' total weight); ``empty``: see :func:`tokens`."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = mlp() if group else DDP(mlp())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    if wrap:
        reduce = {"process_group": dist.group.WORLD} if group else {"model": ddp}
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps,
                                    reduction="weighted", **reduce)
    nosync = nosync and not group
    grads, norms = [], []
    for w in range(WINDOWS):
        for i in range(ACCUM):
            x, y = data(rank, w, i)
            last = i == ACCUM - 1
            n = tokens(rank, w, i, empty)
            if wrap and weight_first:
                opt.add_weight(float(n))
            ctx = ddp.no_sync() if nosync and not last else contextlib.nullcontext()
            with ctx:
                loss = torch.nn.functional.mse_loss(ddp(x), y, reduction="sum")
                (loss if n else loss * 0).backward()
            if wrap and not weight_first:
                opt.add_weight(float(n))
        if not wrap:  # DDP averaged sum(g) over the ranks: times world / the ranks' total
            total = torch.tensor([float(sum(tokens(rank, w, i, empty) for i in range(ACCUM)))],
                                 dtype=torch.float64)
            dist.all_reduce(total)
            for p in ddp.parameters():
                if group:  # (the wrapper's process_group sums the window over the ranks)
                    dist.all_reduce(p.grad)
                p.grad.mul_((1.0 if group else world) / total.item())
        grads.append([p.grad.detach().clone() for p in ddp.parameters()])
        norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP))
        opt.step()
        opt.zero_grad()
    return {"grads": grads, "norms": norms,
            "params": [p.detach().clone() for p in ddp.parameters()]}


FAULTS = {  # rank 1's add_weight for micro-batch 1 of window 0: skipped, or a bad value
    "skip_after": ("skip", False), "skip_before": ("skip", True),
    "negative": (-1.0, False), "nan": (float("nan"), True),
}


def faulty(fault: str, group: bool) -> dict:
    """One window under DDP (``group``: ``process_group``) in which rank 1 skips one
    ``add_weight`` or reports a bad weight: what each rank raises, and where."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    rank = dist.get_rank()
    bad, weight_first = FAULTS[fault]
    ddp = mlp() if group else DDP(mlp())
    reduce = {"process_group": dist.group.WORLD} if group else {"model": ddp}
    opt = AccumulatingOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1),
                                accumulation_steps=ACCUM, reduction="weighted", **reduce)
    opt.collective_timeout = 20.0  # a hang fails the test fast, never passes it
    where = "step"
    try:
        for i in range(ACCUM):
            x, y = data(rank, 0, i)
            weight = bad if rank == 1 and i == 1 else float(x.shape[0])
            where = f"add_weight {i}"
            if weight_first and weight != "skip":
                opt.add_weight(weight)
            where = f"backward {i}"
            ctx = ddp.no_sync() if i < ACCUM - 1 and not group else contextlib.nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(ddp(x), y, reduction="sum").backward()
            where = f"add_weight {i}"
            if not weight_first and weight != "skip":
                opt.add_weight(weight)
        where = "clip"
        norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP).item()
        where = "step"
        opt.step()
        return {"error": None, "norm": norm}
    except Exception as exc:  # noqa: BLE001 - the test reads the type, message and place
        return {"error": f"{type(exc).__name__}: {exc}", "where": where}


EXTRA_STEP = {  # name: (DDP options or None for process_group, reduction, add_weight first)
    # DDP's buckets (one per param; DDP's first bucket holds <= 1 MiB) and the wrapper's (one
    # of 1.5 MB) differ: the collectives the ranks meet in first differ in size
    "ddp_small_buckets": ({"bucket_cap_mb": 1e-4}, "sum", False),
    "ddp_weighted_before": ({}, "weighted", True),
    "group_weighted_after": (None, "weighted", False),
}


def extra_step(name: str) -> dict:
    """``accumulation_steps=None``, 2 windows of ACCUM micro-batches (DDP: no_sync but on the
    last): rank 1 calls ``step()`` after window 1's micro-batch 1 as well (after DDP rebuilt
    its buckets: its first backward has one bucket of every param). What each rank raises,
    and where."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    rank = dist.get_rank()
    options, reduction, weight_first = EXTRA_STEP[name]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 600), torch.nn.Tanh(),
                                torch.nn.Linear(600, 600), torch.nn.Tanh(),
                                torch.nn.Linear(600, 4))
    ddp = model if options is None else DDP(model, **options)
    reduce = {"process_group": dist.group.WORLD} if options is None else {"model": ddp}
    opt = AccumulatingOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1),
                                accumulation_steps=None, reduction=reduction, **reduce)
    opt.collective_timeout = 20.0  # a hang fails the test fast, never passes it
    where = "start"
    try:
        for w in range(2):
            for i in range(ACCUM):
                x, y = data(rank, w, i)
                if reduction == "weighted" and weight_first:
                    opt.add_weight(float(x.shape[0]))
                where = f"backward {w}.{i}"
                ctx = ddp.no_sync() if i < ACCUM - 1 and options is not None \
                    else contextlib.nullcontext()
                with ctx:
                    torch.nn.functional.mse_loss(ddp(x), y, reduction="sum").backward()
                if reduction == "weighted" and not weight_first:
                    opt.add_weight(float(x.shape[0]))
                if rank == 1 and (w, i) == (1, 1):
                    where = f"step {w}.{i}"
                    opt.step()
            where = f"step {w}"
            opt.step()
            opt.zero_grad()
        return {"error": None, "params": [p.detach().clone() for p in ddp.parameters()]}
    except Exception as exc:  # noqa: BLE001 - the test reads the type, message and place
        return {"error": f"{type(exc).__name__}: {exc}", "where": where}


def step_scenarios() -> dict:
    out = {}
    for name in EXTRA_STEP:
        out[name] = extra_step(name)
        dist.barrier()
    return out


def fault_scenarios() -> dict:
    out = {}
    for group in (False, True):
        for fault in FAULTS:
            out[("group_" if group else "") + fault] = faulty(fault, group)
            dist.barrier()
    return out


def scenarios() -> dict:
    out = {"native": train(wrap=False), "native_sync_each": train(wrap=False, nosync=False),
           "native_group": train(wrap=False, group=True),
           "native_empty": train(wrap=False, empty=True),
           "native_group_empty": train(wrap=False, group=True, empty=True)}
    for name, kw in {"after": {}, "before": {"weight_first": True},
                     "after_sync_each": {"nosync": False},
                     "after_none": {"accumulation_steps": None},
                     "group_after": {"group": True},
                     "group_before": {"group": True, "weight_first": True},
                     "empty_after": {"empty": True},
                     "empty_before": {"empty": True, "weight_first": True},
                     "group_empty_after": {"group": True, "empty": True}}.items():
        out[name] = train(wrap=True, **kw)
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, 2, {"faults": fault_scenarios,
                                    "steps": step_scenarios}.get(name, scenarios))


def run_ranks(tmp_path, timeout: float = 150.0, name: str = "ddp_weighted") -> list[dict]:
    return spawn_ranks(_rank_main, str(tmp_path), name, {}, 2, timeout)
