"""FSDP2 (``fully_shard``) with AccumulatingOptimizer: an fp32 window per local shard.

    python examples/fsdp2.py --world-size 2 --steps 3 [--bf16-wire] [--no-sync]
    torchrun --nproc-per-node 8 examples/fsdp2.py --steps 100

Run directly it spawns its ranks on CPU (gloo, a FileStore in a temporary directory); under
``torchrun`` each process is one rank (NCCL on GPUs). What differs from a native FSDP2 loop:

* the recipe is torchtitan's: fp32 params, ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
  reduce_dtype=torch.float32)``; the optimizer is wrapped with ``model=`` the fully_shard
  root. The window is fp32 storage shaped like each param's local shard (4 B/param / world,
  the fp32 shards are the master weights); ``p.grad`` between backwards is that window as a
  DTensor, so ``clip_grad_norm_`` and ``step()`` are native FSDP2's;
* ``--bf16-wire``: the opt-in reduce-scatter that sends bf16 (half the bytes of fp32) and sums
  in fp32, exact (``accumkernels.optim.fsdp2_wire``);
* ``--no-sync``: FSDP2's ``set_requires_gradient_sync(False)`` for the first N-1 micro-batches
  (one reduce-scatter per window, but FSDP2 then keeps an unsharded fp32 sum per rank);
* a checkpoint through ``torch.distributed.checkpoint`` in the middle of the last window,
  resumed into a fresh model and wrapper (``--checkpoint DIR`` keeps it).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import accumkernels
from accumkernels.optim.fsdp2_wire import enable_bf16_reduce_scatter

ACCUM = 4


def build(device: str, world_size: int, bf16_wire: bool):
    torch.manual_seed(0)  # the same init on every rank
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 1))
    mesh = init_device_mesh(device, (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model.to(device), mesh=mesh, mp_policy=policy)
    comm = enable_bf16_reduce_scatter(model) if bf16_wire else None
    opt = accumkernels.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                             accumulation_steps=ACCUM, model=model)
    return model, opt, comm


def micro_batches(model, opt, data, device: str, no_sync: bool, count: int):
    loss = None
    for i in range(count):
        if no_sync:
            model.set_requires_gradient_sync(opt.micro_steps == ACCUM - 1)
        x = torch.randn(8, 16, generator=data).to(device)
        loss = (model(x).float() - x.sum(dim=1, keepdim=True)).square().mean()
        loss.backward()  # FSDP2 reduce-scatters; the wrapper moves the shard into the window
        if opt.micro_steps == ACCUM:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # the window, sharded
            opt.step()
            opt.zero_grad()
    return loss


def train(rank: int, world_size: int, args: argparse.Namespace, device: str) -> None:
    model, opt, comm = build(device, world_size, args.bf16_wire)
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    micro_batches(model, opt, data, device, args.no_sync, ACCUM * args.steps + 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}  # mid-window
    dcp.save(state, checkpoint_id=args.checkpoint)
    model, opt, comm2 = build(device, world_size, args.bf16_wire)  # resume into fresh objects
    state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=args.checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loss = micro_batches(model, opt, data, device, args.no_sync, ACCUM - 2)
    checksum = torch.stack([p.detach().full_tensor().sum() for p in model.parameters()]).sum()
    gathered = [torch.zeros((), device=device) for _ in range(world_size)]
    dist.all_gather(gathered, checksum)
    assert all(torch.equal(g, gathered[0]) for g in gathered), "ranks diverged"
    window = sum(p.main_grad.to_local().numel() * 4 for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        wire = "" if comm is None else (f", bf16 wire {comm.bytes_sent + comm2.bytes_sent} B "
                                        f"sent by rank 0 ({comm.fp32_fallbacks} fp32 fallbacks)")
        print(f"final loss {loss.item():.4f}; window {window} B on rank 0 for {numel} params "
              f"({window / numel:.2f} B/param on {world_size} ranks){wire}")


def _spawned(rank: int, world_size: int, args: argparse.Namespace, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size)
    try:
        train(rank, world_size, args, "cpu")
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
    parser.add_argument("--bf16-wire", action="store_true")
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
        if args.checkpoint is None:  # every rank needs the same directory
            args.checkpoint = os.path.join(tempfile.gettempdir(), "accumkernels_fsdp2_ckpt")
        try:
            train(dist.get_rank(), dist.get_world_size(), args, "cuda" if cuda else "cpu")
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            args.checkpoint = os.path.join(tmp, "ckpt")
        mp.spawn(_spawned, args=(args.world_size, args, os.path.join(tmp, "store")),
                 nprocs=args.world_size, join=True)


if __name__ == "__main__":
    main()
