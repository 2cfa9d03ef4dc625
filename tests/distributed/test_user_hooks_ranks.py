"""A user's post-accumulate-grad hook (registered before wrapping) on ranks: it sees and writes
the rank's running window, as it sees and writes native ``.grad`` (the rank's running sum), and
the ranks reduce what it wrote: under DDP (``no_sync`` but on the last micro-batch, with and
without ``find_unused_parameters``) and with ``process_group`` (buckets reduced as the last
micro-batch completes them, hooks on every param or on some). Native judge: DDP itself, or
plain ranks averaging ``.grad`` (fp32: within 1e-6). Single process: tests/optim/intake/test_user_hooks.py."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
from _spawn import run_scenario, spawn_ranks
from torch import nn

from accumkernels import AccumulatingOptimizer

N, WINDOWS = 3, 2


def _train(rank: int, world: int, layout: str, every: int, wrap: bool, base: nn.Module):
    model = copy.deepcopy(base)
    seen = []
    for k, p in enumerate(model.parameters()):
        if k % every == 0:
            def hook(p):
                seen.append(p.grad.detach().float().clone())
                p.grad.mul_(0.5)
            p.register_post_accumulate_grad_hook(hook)
    ddp = None
    if layout.startswith("ddp"):
        ddp = nn.parallel.DistributedDataParallel(model,
                                                  find_unused_parameters=layout == "ddp-unused")
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    kw = {"model": ddp} if ddp is not None else {"process_group": dist.group.WORLD}
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=0.0002, **kw) \
        if wrap else inner
    torch.manual_seed(1 + rank)
    for _ in range(WINDOWS):
        for i in range(N):
            x, y = torch.randn(4, 6), torch.randn(4, 3)
            if ddp is not None and i < N - 1:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
            else:
                nn.functional.mse_loss((ddp or model)(x), y).backward()
            if wrap:
                opt.step()
        if not wrap:
            if ddp is None:
                for p in model.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], seen


def _scenario(rank: int, world: int, layout: str, every: int):
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    return {"native": _train(rank, world, layout, every, False, base),
            "ours": _train(rank, world, layout, every, True, base)}


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, 2, lambda: _scenario(rank, 2, kwargs["layout"], kwargs["every"]))


@pytest.mark.parametrize("layout,every", [("process_group", 1), ("process_group", 2),
                                          ("ddp", 1), ("ddp-unused", 2)])
def test_post_accumulate_grad_hook_on_ranks(layout, every, tmp_path):
    ranks = spawn_ranks(_rank_main, str(tmp_path), f"user_hooks_{layout}_{every}",
                        {"layout": layout, "every": every}, 2, timeout=240)
    for rank, res in enumerate(ranks):
        (native, seen_native), (ours, seen_ours) = res["native"], res["ours"]
        assert len(seen_ours) == len(seen_native)
        for a, b in zip(seen_ours, seen_native):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6,
                                       msg=f"rank {rank}: p.grad seen by the user's hook")
        for a, b in zip(ours, native):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6, msg=f"rank {rank}: params")
