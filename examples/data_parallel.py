"""Data parallel without DDP: each rank accumulates its micro-batches in fp32, and the wrapper
all-reduces the fp32 window once per optimizer step (overlapped with the last backward).

    python examples/data_parallel.py --world-size 2 --steps 3

Spawns the ranks itself (gloo, CPU; the ranks meet through a file store in a temporary
directory, so no port is picked), or runs under torchrun (examples/_ranks.py).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from _ranks import assert_replicas_agree, launch

import accumkernels

MICRO_BATCHES_PER_RANK = 2


def train(rank: int, world_size: int, device: torch.device, steps: int) -> None:
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
    assert_replicas_agree(model.parameters())
    if rank == 0:
        print(f"final loss {loss.item():.4f} (params identical on {world_size} ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    launch(train, args.world_size, args.steps, backend="gloo")  # (a CPU model)


if __name__ == "__main__":
    main()
