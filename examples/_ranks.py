"""What the multi-process examples share: starting the ranks, checking that replicas agree,
leaving cleanly. Each example's ``train(rank, world_size, device, ...)`` is the usual
per-process body; this file only runs it.

* under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set): on this process, NCCL on a GPU (or the
  ``backend`` an example asks for), one device per local rank;
* otherwise: ``world_size`` spawned CPU ranks over gloo, meeting through a file store in a
  temporary directory (no port to pick).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launch(train, world_size: int, *args, backend: str | None = None) -> None:
    """Run ``train(rank, world_size, device, *args)`` on every rank (see the module docstring)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # under torchrun
        cuda = torch.cuda.is_available() and backend in (None, "nccl")
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"))
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        try:
            train(dist.get_rank(), dist.get_world_size(), device, *args)
            dist.barrier()
        finally:
            dist.destroy_process_group()
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_spawned, args=(train, world_size, os.path.join(tmp, "store"), args),
                           nprocs=world_size, start_method="spawn")


def _spawned(rank: int, train, world_size: int, store: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world_size)
    try:
        train(rank, world_size, torch.device("cpu"), *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # gloo's threads can abort in C++ static destructors at a normal interpreter exit
    # ("terminate called without an active exception"): this spawned rank leaves without them
    sys.stdout.flush()
    os._exit(0)


def assert_replicas_agree(tensors, group=None, what: str = "ranks") -> None:
    """Every rank of ``group`` holds the same values in ``tensors`` (a checksum, gathered)."""
    tensors = list(tensors)
    checksum = torch.stack([t.detach().double().sum() for t in tensors]).sum().reshape(1)
    gathered = [torch.zeros_like(checksum) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, checksum, group=group)
    assert all(torch.equal(g, gathered[0]) for g in gathered), f"{what} diverged"
