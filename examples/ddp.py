"""DistributedDataParallel with AccumulatingOptimizer: DDP's own ``no_sync`` loop, fp32 window.

    python examples/ddp.py --world-size 2 --steps 3

Spawns the ranks itself (gloo, CPU). Under ``torchrun`` the body of ``train()`` is the usual
per-process script. Two things differ from a native DDP loop:

* the optimizer is wrapped with ``model=ddp``, which registers ``accumkernels.ddp_comm_hook`` on
  the DDP module: on DDP's sync backward it averages the fp32 window across ranks instead of
  DDP's bf16/fp32 micro-batch bucket (when DDP is built after the wrapper, e.g. by Accelerate
  or the HF Trainer, register the hook yourself: ``ddp.register_comm_hook(None,
  accumkernels.ddp_comm_hook)``);
* nothing else: ``no_sync`` for the first N-1 micro-batches, clipping on the sync step and
  ``step()`` are native DDP's. Every rank ends with the same parameters, equal to native DDP.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import accumkernels

ACCUM = 4


def train(rank: int, world_size: int, store: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    try:
        torch.manual_seed(0)  # the same init on every rank, as DDP expects
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                    torch.nn.Linear(32, 1))
        ddp = DDP(model)
        opt = accumkernels.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                                 model=ddp)
        data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own shard
        for _ in range(steps):
            for i in range(ACCUM):
                x = torch.randn(8, 16, generator=data)
                sync = i == ACCUM - 1
                with contextlib.nullcontext() if sync else ddp.no_sync():
                    loss = (ddp(x) - x.sum(dim=1, keepdim=True)).square().mean() / ACCUM
                    loss.backward()  # fp32 window; only the sync backward communicates
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the averaged fp32 window
            opt.step()
            opt.zero_grad()
        checksum = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
        gathered = [torch.zeros(()) for _ in range(world_size)]
        dist.all_gather(gathered, checksum)
        assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
        if rank == 0:
            print(f"final loss {loss.item() * ACCUM:.4f} (params identical on {world_size} ranks)")
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort in C++ static destructors at a normal interpreter exit
    # ("terminate called without an active exception"): this spawned rank leaves without them
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(train, args=(args.world_size, f"{tmp}/store", args.steps),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
