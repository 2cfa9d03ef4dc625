"""LightningCLI on 2 gloo ranks (``--trainer.strategy=ddp``) for test_optimizers_by_name.py:
the optimizer named on the command line, natively and by name (with the ``FP32Accumulation``
callback named there too, which registers the DDP comm hook and keeps an optimizer that is
already an ``AccumulatingOptimizer``), and by name without the callback."""

from __future__ import annotations

import os

import torch
from _integrations_common import WORLD
from _spawn import run_scenario, spawn_ranks

CALLBACK = "accumkernels.integrations.lightning.FP32Accumulation"


def cli_fit(work: str, optimizer: str, callback: bool) -> dict:
    from _lightning_cli_module import TinyRegression
    from lightning.pytorch.cli import LightningCLI

    args = ["--seed_everything=0", "--trainer.accelerator=cpu", f"--trainer.devices={WORLD}",
            "--trainer.strategy=ddp", "--trainer.max_epochs=2",
            "--trainer.accumulate_grad_batches=3", "--trainer.gradient_clip_val=0.05",
            "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
            f"--trainer.default_root_dir={work}", f"--optimizer={optimizer}",
            "--optimizer.lr=0.01"]
    if callback:
        args.append(f"--trainer.callbacks+={CALLBACK}")
    cli = LightningCLI(TinyRegression, args=args, run=False, save_config_callback=None)
    try:
        cli.trainer.fit(cli.model)
    except RuntimeError as exc:
        return {"error": str(exc)}
    opt = cli.trainer.optimizers[0]
    return {"params": [p.detach().clone() for p in cli.model.parameters()],
            "optimizer": f"{type(opt).__module__}.{type(opt).__qualname__}"}


def scenario_cli(work: str) -> dict:
    res = {"native": cli_fit(work, "torch.optim.AdamW", False),
           "by_name": cli_fit(work, "accumkernels.optimizers.AdamW", True)}
    res["no_callback"] = cli_fit(work, "accumkernels.optimizers.AdamW", False)
    torch.distributed.barrier()
    return res


def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, WORLD, lambda: scenario_cli(os.path.join(out_dir, "work")))


def run_cli_ranks(tmp_path, timeout: float = 200.0) -> list[dict]:
    os.makedirs(os.path.join(str(tmp_path), "work"), exist_ok=True)
    return spawn_ranks(_rank_main, str(tmp_path), "lightning_cli", {}, WORLD, timeout)
