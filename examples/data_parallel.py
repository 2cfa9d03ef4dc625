"""Data parallel without DDP: each rank accumulates its micro-batches in fp32, and the wrapper
all-reduces the fp32 window once per optimizer step (overlapped with the last backward).

    python examples/data_parallel.py --world-size 2 --steps 3

Spawns the ranks itself (gloo, CPU; the ranks meet through a file store in a temporary
directory, so no port is picked). Under torchrun, call train() per process.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import accumkernels

MICRO_BATCHES_PER_RANK = 2


def train(rank: int, world_size: int, store: str, steps: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    try:
        _train(rank, world_size, steps)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort in C++ static destructors at a normal interpreter exit
    # ("terminate called without an active exception"): this spawned rank leaves without them
    sys.stdout.flush()
    os._exit(0)


def _train(rank: int, world_size: int, steps: int) -> None:
    torch.manual_seed(rank)  # different inits: the wrapper broadcasts rank 0's parameters
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    opt = accumkernels.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2),
        accumulation_steps=MICRO_BATCHES_PER_RANK,
        reduction="mean",  # mean over all micro-batches of all ranks
        process_group=dist.group.WORLD,
    )
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own shard
    for step in range(steps):
        for _ in range(MICRO_BATCHES_PER_RANK):
            x = torch.randn(8, 16, generator=data)
            loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
            loss.backward()  # gradients go to the fp32 window; only the last one communicates
            opt.step()  # a no-op until the window is complete
            opt.zero_grad()
    checksum = torch.stack([p.detach().sum() for p in model.parameters()]).sum()
    gathered = [torch.zeros(()) for _ in range(world_size)]
    dist.all_gather(gathered, checksum)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
    if rank == 0:
        print(f"final loss {loss.item():.4f} (params identical on {world_size} ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(train, args=(args.world_size, f"{tmp}/store", args.steps),
                           nprocs=args.world_size, start_method="spawn")


if __name__ == "__main__":
    main()
