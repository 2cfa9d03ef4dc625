"""Lightning, one line: ``callbacks=[FP32Accumulation()]``.

The LightningModule returns a plain AdamW (and its scheduler) from ``configure_optimizers``;
the callback wraps it in ``AccumulatingOptimizer`` when the fit starts (before a checkpoint's
optimizer state is loaded) and, with ``strategy="ddp"`` on several devices, registers
``accumkernels.ddp_comm_hook`` on Lightning's DDP module (Lightning's own ``ddp_comm_hook``
setting is applied only on CUDA). Lightning keeps its accumulation, clipping and scheduling.
Options for the wrapper: ``FP32Accumulation(max_grad_norm=1.0, nonfinite="raise")``.

Run: ``python examples/lightning_oneline.py``
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn

from accumkernels.integrations.lightning import FP32Accumulation


class SpiralClassifier(L.LightningModule):
    def __init__(self, total_steps: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 3))
        self.total_steps = total_steps

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, self.total_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler,
                                                         "interval": "step"}}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args(argv)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (2560,), generator=g)
    r = torch.rand(2560, generator=g)
    theta = 4 * r + labels * 2 * math.pi / 3 + 0.2 * torch.randn(2560, generator=g)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels),
                                         batch_size=64, shuffle=True)
    module = SpiralClassifier(total_steps=10 * args.epochs)
    trainer = L.Trainer(
        accumulate_grad_batches=4, gradient_clip_val=1.0, max_epochs=args.epochs,
        callbacks=[FP32Accumulation()],  # the one line
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, loader)

    with torch.no_grad():
        final = nn.functional.cross_entropy(module.net(x), labels).item()
    print(f"optimizer: {type(trainer.optimizers[0]).__name__}")
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
