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
  in fp32, exact (``accumkernels.optim.fsdp2.wire``);
* ``--no-sync``: FSDP2's ``set_requires_gradient_sync(False)`` for the first N-1 micro-batches
  (one reduce-scatter per window, but FSDP2 then keeps an unsharded fp32 sum per rank);
* a checkpoint through ``torch.distributed.checkpoint`` in the middle of the last window,
  resumed into a fresh model and wrapper (``--checkpoint DIR`` keeps it).
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed.checkpoint as dcp
from _ranks import assert_replicas_agree, launch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import accumkernels
from accumkernels.optim.fsdp2.wire import enable_bf16_reduce_scatter

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


def train(rank: int, world_size: int, device: torch.device, args: argparse.Namespace) -> None:
    device = device.type
    model, opt, comm = build(device, world_size, args.bf16_wire)
    data = torch.Generator().manual_seed(100 + rank)  # each rank sees its own data
    micro_batches(model, opt, data, device, args.no_sync, ACCUM * args.steps + 2)
    state = {"model": model.state_dict(), "optim": opt.state_dict()}  # mid-window
    dcp.save(state, checkpoint_id=args.checkpoint)
    model, opt, comm2 = build(device, world_size, args.bf16_wire)  # resume into fresh objects
    with opt.window_template():  # a mid-window checkpoint: the template holds the windows
        state = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=args.checkpoint)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    loss = micro_batches(model, opt, data, device, args.no_sync, ACCUM - 2)
    assert_replicas_agree(p.full_tensor() for p in model.parameters())
    window = sum(p.main_grad.to_local().numel() * 4 for p in model.parameters())
    numel = sum(p.numel() for p in model.parameters())
    if rank == 0:
        wire = "" if comm is None else (f", bf16 wire {comm.bytes_sent + comm2.bytes_sent} B "
                                        f"sent by rank 0 ({comm.fp32_fallbacks} fp32 fallbacks)")
        print(f"final loss {loss.item():.4f}; window {window} B on rank 0 for {numel} params "
              f"({window / numel:.2f} B/param on {world_size} ranks){wire}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16-wire", action="store_true")
    parser.add_argument("--no-sync", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:  # under torchrun every rank needs the same directory
            torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
            args.checkpoint = os.path.join(tempfile.gettempdir() if torchrun else tmp,
                                           "accumkernels_fsdp2_ckpt")
        launch(train, args.world_size, args)


if __name__ == "__main__":
    main()
