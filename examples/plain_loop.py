"""Plain PyTorch loop: a bf16 model, fp32 gradient accumulation and fp32 master weights.

Shows the idiomatic AccumulatingOptimizer loop:

* the model is bf16; the wrapper keeps an fp32 master copy of every param for the optimizer
  (``master_weights="auto"``) and accumulates every micro-batch's gradient in fp32, so nothing
  is lost to bf16 rounding however many micro-batches a window has;
* micro-batches hold different numbers of items (ragged sequences). With
  ``reduction="weighted"`` each micro-batch's loss is a *sum* over its items and
  ``opt.add_weight(n_items)`` reports how many there were: every step uses exactly the mean
  gradient over all items of the window (``--reduction mean`` averages per-micro-batch means
  instead, the usual ``loss / N`` behaviour, which weights items unequally);
* ``step()`` and ``zero_grad()`` are called every micro-batch; the wrapper steps when the window
  of ``--accum`` micro-batches is full, and ``flush()`` takes the short last window of an epoch.

Run: ``python examples/plain_loop.py --steps 20``
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from accumkernels import AccumulatingOptimizer


def make_data(n_micro_batches: int, dim: int, generator: torch.Generator):
    """Ragged micro-batches of a noisy linear regression task (1 to 16 rows each)."""
    true_w = torch.randn(dim, 1, generator=generator)
    batches = []
    for _ in range(n_micro_batches):
        rows = int(torch.randint(1, 17, (1,), generator=generator))
        x = torch.randn(rows, dim, generator=generator)
        y = torch.tanh(x @ true_w) + 0.01 * torch.randn(rows, 1, generator=generator)
        batches.append((x, y))
    return batches


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (windows)")
    parser.add_argument("--accum", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--reduction", choices=["weighted", "mean"], default="weighted")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    dim = 32
    model = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, 1)).to(torch.bfloat16)
    # One extra short window at the end (accum // 2 micro-batches) to show flush().
    n_micro = args.steps * args.accum + args.accum // 2
    data = make_data(n_micro, dim, torch.Generator().manual_seed(1))

    opt = AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=args.lr),
        accumulation_steps=args.accum,
        reduction=args.reduction,
        max_grad_norm=1.0,  # fused global-norm clipping of the fp32 window
    )
    assert opt.master_weights  # "auto" picked fp32 master weights for the bf16 params
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps + 1)

    window_loss, window_items, steps = 0.0, 0, 0
    for x, y in data:
        pred = model(x.to(torch.bfloat16)).float()
        if args.reduction == "weighted":
            loss = ((pred - y) ** 2).sum()  # a sum over the items ...
            opt.add_weight(len(x))          # ... and how many there were
        else:
            loss = ((pred - y) ** 2).mean()
        loss.backward()  # the gradient goes straight into the fp32 window
        window_loss += ((pred - y) ** 2).sum().item()
        window_items += len(x)

        stepping = opt.sync_step  # True right after the window's last backward
        opt.step()  # a no-op until the window is full
        opt.zero_grad()  # clears .grad only, never the window
        if stepping:
            scheduler.step()
            steps += 1
            print(f"step {steps:3d}  loss {window_loss / window_items:.4f}  "
                  f"grad_norm {opt.last_grad_norm.item():.3f}")
            window_loss, window_items = 0.0, 0

    if opt.micro_steps:  # the short last window: step on what there is
        opt.flush()
        print(f"flushed a short window; loss {window_loss / window_items:.4f}")

    with torch.no_grad():
        x = torch.cat([x for x, _ in data])
        y = torch.cat([y for _, y in data])
        final = ((model(x.to(torch.bfloat16)).float() - y) ** 2).mean().item()
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
