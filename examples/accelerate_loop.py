"""HF Accelerate: the standard ``accelerator.accumulate()`` loop with AccumulatingOptimizer.

The only change to Accelerate's gradient-accumulation recipe is wrapping the optimizer:

* ``accumulation_steps=None``: ``step()``/``zero_grad()`` stay where they are (every
  micro-batch), and the prepared optimizer forwards them only on sync micro-batches, so every
  ``step()`` the wrapper receives ends a window;
* ``reduction="sum"``, because ``accelerator.backward`` already divides the loss by N.

``p.grad`` is the running fp32 window after every backward, so ``accelerator.clip_grad_norm_``
on the sync micro-batch sees the window. A dataloader whose length is not a multiple of N ends
each epoch with a short window: Accelerate steps it, and so the wrapper steps it like native.

Run: ``python examples/accelerate_loop.py --steps 20``
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from accumkernels import AccumulatingOptimizer


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="full windows per epoch")
    parser.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)

    accelerator = Accelerator(gradient_accumulation_steps=args.accum, cpu=True)
    torch.manual_seed(0)
    # A small classifier on synthetic data: 8 Gaussian clusters in 20 dimensions.
    # Half a window more than --steps windows: each epoch ends with a short window.
    n = (args.steps * args.accum + args.accum // 2) * args.micro_batch
    centers = torch.randn(8, 20) * 2
    labels = torch.randint(0, 8, (n,))
    inputs = centers[labels] + torch.randn(n, 20)
    dataset = torch.utils.data.TensorDataset(inputs, labels)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.micro_batch, shuffle=True)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 8))

    optimizer = AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=3e-3),
        accumulation_steps=None,  # the prepared optimizer steps only at window ends
        reduction="sum",          # accelerator.backward divides by N already
    )
    total_steps = (args.steps + 1) * args.epochs
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_steps)
    model, optimizer, dataloader, scheduler = accelerator.prepare(
        model, optimizer, dataloader, scheduler)

    for epoch in range(args.epochs):
        total, count = 0.0, 0
        for x, y in dataloader:
            with accelerator.accumulate(model):
                loss = nn.functional.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:  # the window is in p.grad here
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            total += loss.item() * len(y)
            count += len(y)
        print(f"epoch {epoch}  loss {total / count:.4f}  optimizer steps so far "
              f"{scheduler.scheduler.last_epoch}")

    with torch.no_grad():
        final = nn.functional.cross_entropy(model(inputs), labels).item()
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
