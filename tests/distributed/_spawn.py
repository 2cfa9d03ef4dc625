"""Spawned gloo ranks for the multi-process tests: start, collect each rank's result file with a
deadline, tear down. Shared by _ddp_workers.py, test_ddp_checkpoint.py, test_ddp_unused.py and
tests/integrations/_integrations_common.py."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
import traceback
from collections.abc import Callable

import torch
import torch.distributed as dist


def run_scenario(rank: int, out_dir: str, world: int, scenario: Callable[[], object]) -> None:
    """One rank: a gloo group from a FileStore in ``out_dir`` (no port to race for), the
    scenario, its result written before teardown, a barrier, then ``os._exit`` (gloo's threads
    can abort in C++ static destructors at a normal exit)."""
    result: dict = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
        result["result"] = scenario()
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file
    try:
        if dist.is_initialized():
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            dist.destroy_process_group()
    finally:
        os._exit(0)


def spawn_ranks(target: Callable, out_dir: str, scenario: str, kwargs: dict, world: int,
                timeout: float) -> list:
    """Run ``target(rank, out_dir, scenario, kwargs)`` on ``world`` spawned ranks; return each
    rank's result.

    Raises AssertionError with the rank's traceback if a rank failed, TimeoutError if a rank
    wrote no result within ``timeout`` seconds. Every process is gone when this returns.
    """
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(rank, out_dir, scenario, kwargs))
             for rank in range(world)]
    paths = [os.path.join(out_dir, f"rank{rank}.pt") for rank in range(world)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(path) for path in paths):
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and not os.path.exists(paths[r])]
            if dead:
                raise AssertionError(f"{scenario}: rank {dead[0]} died (exit code "
                                     f"{procs[dead[0]].exitcode}) without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scenario}: no result from every rank within {timeout:g} s")
            time.sleep(0.05)
        for p in procs:  # results are in; teardown gets a grace period, then is cut short
            p.join(max(1.0, deadline + 30 - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = [torch.load(path, weights_only=False) for path in paths]
    for rank, r in enumerate(results):
        if r["error"] is not None:
            raise AssertionError(f"{scenario}: rank {rank} failed: {r['error']}\n{r['traceback']}")
    return [r["result"] for r in results]
