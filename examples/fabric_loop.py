"""Lightning Fabric: the optimizer by name, Fabric's accumulation loop unchanged.

``accumkernels.optimizers.AdamW(params, lr=...)`` is ``AccumulatingOptimizer(torch.optim.AdamW(
params, lr=...))`` with the defaults a Fabric loop needs: ``accumulation_steps=None`` (the loop
calls ``step()`` only at a window's end) and ``reduction="sum"`` (the loop divides the loss by
N). ``accumkernels.integrations.fabric.setup`` is ``fabric.setup`` plus the DDP comm hook that
``strategy="ddp"`` needs (Fabric registers none); on one device it is just ``fabric.setup``.
``fabric.no_backward_sync``, ``fabric.clip_gradients`` (it clips the fp32 window) and
``fabric.save``/``fabric.load`` work as without the wrapper.

Run: ``python examples/fabric_loop.py``
"""

from __future__ import annotations

import argparse
import math

import lightning as L
import torch
from torch import nn

import accumkernels.optimizers
from accumkernels.integrations.fabric import setup


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--accumulation", type=int, default=4)
    args = parser.parse_args(argv)
    fabric = L.Fabric(accelerator="cpu", devices=1)
    fabric.launch()
    fabric.seed_everything(0)
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (2560,), generator=g)
    r = torch.rand(2560, generator=g)
    theta = 4 * r + labels * 2 * math.pi / 3 + 0.2 * torch.randn(2560, generator=g)
    x = torch.stack([r * torch.cos(theta), r * torch.sin(theta)], dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, labels),
                                         batch_size=64, shuffle=True)
    model = nn.Sequential(nn.Linear(2, 64), nn.Tanh(), nn.Linear(64, 3))
    optimizer = accumkernels.optimizers.AdamW(model.parameters(), lr=1e-2)  # by name
    model, optimizer = setup(fabric, model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    n = args.accumulation
    for _ in range(args.epochs):
        for i, (xb, yb) in enumerate(loader):
            boundary = (i + 1) % n == 0 or i + 1 == len(loader)
            with fabric.no_backward_sync(model, enabled=not boundary):
                loss = nn.functional.cross_entropy(model(xb), yb)
                fabric.backward(loss / n)
            if boundary:
                fabric.clip_gradients(model, optimizer, max_norm=1.0)
                optimizer.step()
                optimizer.zero_grad()
    with torch.no_grad():
        final = float(nn.functional.cross_entropy(model(x), labels))
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
