"""PyTorch Lightning: return AccumulatingOptimizer from ``configure_optimizers``.

Lightning keeps doing the accumulation bookkeeping (``accumulate_grad_batches``), the loss
scaling, gradient clipping (``gradient_clip_val``) and the LR schedule; the wrapper only makes
the accumulation exact and fused:

* ``accumulation_steps=None``: Lightning calls ``step(closure)`` only on the last micro-batch
  of each window; the closure's backward completes the window, and ``p.grad`` is the running
  fp32 window after every backward, so ``on_before_optimizer_step`` and Lightning's clipping
  see it; the step after the closure ends the window;
* ``reduction="sum"``: Lightning already divides the loss by ``accumulate_grad_batches``.

A short window at the end of an epoch is stepped like native (Lightning steps it). For bf16 models with master weights, ``gradient_clip_val`` clips the fp32 window too:
Lightning clips the optimizer's params, the fp32 masters, whose ``.grad`` is the window.

Run: ``python examples/lightning_module.py --steps 10``
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn

from accumkernels import AccumulatingOptimizer


class SpiralClassifier(L.LightningModule):
    def __init__(self, accumulation_steps: int, total_steps: int, lr: float = 1e-2):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                                 nn.Linear(64, 3))
        self.accumulation_steps = accumulation_steps
        self.total_steps = total_steps
        self.lr = lr
        self.grad_norms: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)

    def on_before_optimizer_step(self, optimizer):
        # Runs once per window, before Lightning clips: p.grad holds the accumulated window.
        norm = torch.linalg.vector_norm(
            torch.stack([p.grad.norm() for p in self.parameters() if p.grad is not None]))
        self.grad_norms.append(norm.item())

    def configure_optimizers(self):
        optimizer = AccumulatingOptimizer(
            torch.optim.AdamW(self.parameters(), lr=self.lr),
            accumulation_steps=None,  # Lightning steps only at window ends
            reduction="sum",  # Lightning divides the loss by accumulate_grad_batches already
        )
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.total_steps)
        return {"optimizer": optimizer,
                "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def spiral(n: int, generator: torch.Generator) -> torch.utils.data.TensorDataset:
    """Three interleaved spiral arms in 2-D."""
    labels = torch.randint(0, 3, (n,), generator=generator)
    r = torch.rand(n, generator=generator)
    theta = 4 * r + labels * 2 * math.pi / 3 + 0.2 * torch.randn(n, generator=generator)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    return torch.utils.data.TensorDataset(x, labels)


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per epoch")
    parser.add_argument("--accum", type=int, default=4, help="accumulate_grad_batches")
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=10)
    args = parser.parse_args(argv)

    L.seed_everything(0, verbose=False)
    dataset = spiral(args.steps * args.accum * args.micro_batch, torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch, shuffle=True)
    module = SpiralClassifier(args.accum, total_steps=args.steps * args.epochs)
    trainer = L.Trainer(
        accumulate_grad_batches=args.accum, gradient_clip_val=1.0, max_epochs=args.epochs,
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(module, loader)

    print(f"{len(module.grad_norms)} optimizer steps; window grad norms "
          f"{module.grad_norms[0]:.3f} -> {module.grad_norms[-1]:.3f}")
    x, y = dataset.tensors
    with torch.no_grad():
        final = nn.functional.cross_entropy(module.net(x), y).item()
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
