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


def train(*, wrap: bool, weight_first: bool = False, nosync: bool = True,
          accumulation_steps: int | None = ACCUM, group: bool = False) -> dict:
    """``group``: no DDP; the wrapper's ``process_group`` (natively: the loop all-reduces the
    summed ``.grad`` and divides by the ranks' total weight)."""
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
            if wrap and weight_first:
                opt.add_weight(float(x.shape[0]))
            ctx = ddp.no_sync() if nosync and not last else contextlib.nullcontext()
            with ctx:
                torch.nn.functional.mse_loss(ddp(x), y, reduction="sum").backward()
            if wrap and not weight_first:
                opt.add_weight(float(x.shape[0]))
        if not wrap:  # DDP averaged sum(g) over the ranks: times world / the ranks' total
            total = torch.tensor([float(sum(data(rank, w, i)[0].shape[0]
                                            for i in range(ACCUM)))], dtype=torch.float64)
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


def scenarios() -> dict:
    out = {"native": train(wrap=False), "native_sync_each": train(wrap=False, nosync=False),
           "native_group": train(wrap=False, group=True)}
    for name, kw in {"after": {}, "before": {"weight_first": True},
                     "after_sync_each": {"nosync": False},
                     "after_none": {"accumulation_steps": None},
                     "group_after": {"group": True},
                     "group_before": {"group": True, "weight_first": True}}.items():
        out[name] = train(wrap=True, **kw)
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, 2, scenarios)


def run_ranks(tmp_path, timeout: float = 150.0) -> list[dict]:
    return spawn_ranks(_rank_main, str(tmp_path), "ddp_weighted", {}, 2, timeout)
