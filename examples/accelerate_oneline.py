"""HF Accelerate, one line: ``AccumulatingAccelerator`` instead of ``Accelerator``.

The loop is Accelerate's own gradient-accumulation recipe, unchanged. ``prepare`` wraps the
optimizer in ``AccumulatingOptimizer`` (the fp32 window; the prepared optimizer steps it only
on sync micro-batches) and, under ``accelerate launch`` with several processes, registers
``accumkernels.ddp_comm_hook`` on the DDP module it builds. A window the wrapper drops
(non-finite) is a skipped step for Accelerate: the prepared scheduler does not advance.
Options for the wrapper: ``AccumulatingAccelerator(..., accumkernels={"max_grad_norm": 1.0})``.

Run: ``python examples/accelerate_oneline.py`` (or ``accelerate launch --num_processes 2 ...``)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from accumkernels.integrations.accelerate import AccumulatingAccelerator


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="windows per epoch")
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    accelerator = AccumulatingAccelerator(gradient_accumulation_steps=4, cpu=True)  # the line
    torch.manual_seed(0)
    n = (args.steps * 4 + 2) * 16  # each epoch ends with a short window of 2 micro-batches
    centers = torch.randn(8, 20) * 2
    labels = torch.randint(0, 8, (n,))
    inputs = centers[labels] + torch.randn(n, 20)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels),
                                         batch_size=16, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, (args.steps + 1) * 2)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    for _ in range(args.epochs):
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(nn.functional.cross_entropy(model(x), y))
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()

    with torch.no_grad():
        final = nn.functional.cross_entropy(accelerator.unwrap_model(model)(inputs), labels)
    print(f"optimizer: {type(optimizer.optimizer).__name__}")
    print(f"final loss {final.item():.4f}")
    return final.item()


if __name__ == "__main__":
    main()
