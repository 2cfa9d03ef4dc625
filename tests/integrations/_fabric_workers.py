"""The Lightning Fabric loop of test_fabric.py, written once and run natively, with the recipe
(``AccumulatingOptimizer`` given to ``fabric.setup``, by name or by hand) and with the one line
(``accumkernels.integrations.fabric.setup``), on 1 process (called in the test process) or on 2
gloo ranks (``run_fabric_ranks``: the process group exists already, so Fabric uses it).

The loop is Fabric's documented accumulation loop: ``fabric.no_backward_sync`` around the
backwards that accumulate, the loss divided by ``ACCUM``, ``fabric.clip_gradients`` then
``optimizer.step()``, a LambdaLR stepped per window and ``optimizer.zero_grad()`` at each
window's end; windows of 4, 4 and a short one of 2 per epoch, two epochs. A run may save a
checkpoint with ``fabric.save`` after a given micro-batch and stop, and another resume from it
with ``fabric.load``.
"""

from __future__ import annotations

import os

import torch
from _integrations_common import (
    ACCUM,
    CLIP,
    EPOCHS,
    LR,
    MICRO,
    PER_EPOCH,
    WORLD,
    oneline_decay,
    oneline_gpt2,
    snapshot,
    token_samples,
)
from _spawn import run_scenario, spawn_ranks

MODES = ("native", "recipe", "by_name", "oneline")


def _optimizer(model: torch.nn.Module, mode: str, lr: float) -> torch.optim.Optimizer:
    if mode == "by_name":
        import accumkernels.optimizers

        return accumkernels.optimizers.AdamW(model.parameters(), lr=lr)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    if mode == "recipe":
        from accumkernels import AccumulatingOptimizer

        return AccumulatingOptimizer(opt, accumulation_steps=None, reduction="sum")
    return opt  # native, or wrapped by the one line


def train_fabric(world: int, mode: str, dtype=torch.float32, *, lr: float = LR,
                 stop_after: int | None = None, save: str | None = None,
                 resume: str | None = None) -> dict:
    """The loop; ``stop_after=k``: ``fabric.save(save, ...)`` after micro-batch k (counted over
    the whole run) and stop; ``resume``: ``fabric.load`` it and go on from there."""
    from lightning.fabric import Fabric

    from accumkernels.integrations.fabric import setup

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto")
    fabric.launch()
    model = oneline_gpt2(dtype)
    opt = _optimizer(model, mode, lr)
    if mode == "oneline" or world > 1 and mode != "native":
        model, opt = setup(fabric, model, opt)
    else:
        model, opt = fabric.setup(model, opt)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt.optimizer, oneline_decay)
    rank = fabric.global_rank
    samples = token_samples(world)
    mine = samples[rank * PER_EPOCH * MICRO:(rank + 1) * PER_EPOCH * MICRO]
    batches = [torch.utils.data.default_collate(mine[i:i + MICRO])
               for i in range(0, len(mine), MICRO)]
    state = {"model": model, "optimizer": opt, "scheduler": scheduler, "micro": 0}
    if resume is not None:
        fabric.load(resume, state)
    norms: list[float] = []
    micro = 0
    for _ in range(EPOCHS):
        for i, batch in enumerate(batches):
            micro += 1
            if micro <= state["micro"]:
                continue  # done before the checkpoint
            boundary = (i + 1) % ACCUM == 0 or i + 1 == len(batches)
            with fabric.no_backward_sync(model, enabled=not boundary):
                fabric.backward(model(**batch).loss / ACCUM)
            if boundary:
                norms.append(float(fabric.clip_gradients(model, opt, max_norm=CLIP)))
                opt.step()
                scheduler.step()
                opt.zero_grad()
            if micro == stop_after:
                state["micro"] = micro
                fabric.save(save, state)
                fabric.barrier()
                return {"norms": norms, "params": snapshot(model.module)}
    fabric.barrier()
    from accumkernels import AccumulatingOptimizer

    return {"params": snapshot(model.module), "norms": norms, "lr": scheduler.get_last_lr()[0],
            "wrapped": isinstance(opt, AccumulatingOptimizer),
            "optimizer": f"{type(opt.optimizer).__module__}.{type(opt.optimizer).__qualname__}"}


def load_refused(world: int, path: str) -> str | None:
    """``fabric.load`` of a checkpoint saved mid-window (rank 0's window only): the error each
    rank gets, or None where it loads."""
    from lightning.fabric import Fabric

    from accumkernels.integrations.fabric import setup

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    model = oneline_gpt2()
    model, opt = setup(fabric, model, torch.optim.AdamW(model.parameters()))
    try:
        fabric.load(path, {"model": model, "optimizer": opt})  # ends with a barrier
    except ValueError as exc:
        fabric.barrier()  # the one the load did not reach
        return str(exc)
    return None


def without_hook(world: int) -> str | None:
    """The recipe by hand under DDP without the comm hook (plain ``fabric.setup``): what one
    window's step raises, or None if it steps."""
    from lightning.fabric import Fabric

    import accumkernels.optimizers

    fabric = Fabric(accelerator="cpu", devices=world, strategy="ddp")
    fabric.launch()
    model = oneline_gpt2()
    model, opt = fabric.setup(model, accumkernels.optimizers.AdamW(model.parameters()))
    batch = torch.utils.data.default_collate(token_samples(world)[:MICRO])
    try:
        fabric.backward(model(**batch).loss)
        opt.step()
    except (RuntimeError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        fabric.barrier()
    return None


def scenario_fabric(work: str, world: int, bf16: bool = False) -> dict:
    """Every mode, the resumed runs (at a window's end, after micro-batch 8; in the middle of a
    window, after micro-batch 6), and on several ranks a mid-window checkpoint loaded back."""
    res = {mode: train_fabric(world, mode) for mode in MODES}
    for mode in ("native", "oneline"):
        ckpt = os.path.join(work, f"{mode}_boundary.ckpt")
        train_fabric(world, mode, stop_after=8, save=ckpt)
        res[f"{mode}_resumed"] = train_fabric(world, mode, resume=ckpt)
    ckpt = os.path.join(work, "mid_window.ckpt")
    train_fabric(world, "oneline", stop_after=6, save=ckpt)
    if world == 1:
        res["mid_window_resumed"] = train_fabric(world, "oneline", resume=ckpt)
    else:
        res["mid_window_refused"] = load_refused(world, ckpt)
        res["without_hook"] = without_hook(world)
    if bf16:
        from _integrations_workers import BF16_LR

        for mode, dtype in (("oneline", torch.bfloat16), ("native", torch.bfloat16),
                            ("native", torch.float64)):
            key = f"{'bf16' if dtype is torch.bfloat16 else 'f64'}_{mode}"
            res[key] = train_fabric(world, mode, dtype, lr=BF16_LR)
    return res


def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    run_scenario(rank, out_dir, WORLD, lambda: scenario_fabric(
        os.path.join(out_dir, "work"), WORLD, **kwargs))


def run_fabric_ranks(tmp_path, timeout: float = 300.0, **kwargs) -> list[dict]:
    os.makedirs(os.path.join(str(tmp_path), "work"), exist_ok=True)
    return spawn_ranks(_rank_main, str(tmp_path), "fabric", kwargs, WORLD, timeout)
