"""DistributedDataParallel with AccumulatingOptimizer: DDP's own ``no_sync`` loop, fp32 window.

    python examples/ddp.py --world-size 2 --steps 3

Spawns the ranks itself (gloo, CPU), or runs under ``torchrun`` (examples/_ranks.py); the body
of ``train()`` is the usual per-process script. Two things differ from a native DDP loop:

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

import torch
from _ranks import assert_replicas_agree, launch
from torch.nn.parallel import DistributedDataParallel as DDP

import accumkernels

ACCUM = 4


def train(rank: int, world_size: int, device: torch.device, steps: int) -> None:
    torch.manual_seed(0)  # the same init on every rank, as DDP expects
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
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
    assert_replicas_agree(model.parameters())
    if rank == 0:
        print(f"final loss {loss.item() * ACCUM:.4f} (params identical on {world_size} ranks)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    launch(train, args.world_size, args.steps, backend="gloo")  # (a CPU model)


if __name__ == "__main__":
    main()
