"""HF Trainer: a bf16 GPT-2 trained with fp32 gradient accumulation and fp32 master weights.

Pass the wrapper (and a scheduler built on it) through ``Trainer(optimizers=(opt, scheduler))``;
nothing else in the Trainer setup changes:

* ``accumulation_steps=None``: Trainer calls ``step()`` only at window ends; ``p.grad`` is the
  running fp32 window after every backward, so Trainer's clip (``max_grad_norm``) and its
  ``grad_norm`` log see the window;
* ``reduction="sum"``: Trainer already normalises the loss over the whole window (by the
  window's token count, ``num_items_in_batch``, for causal LMs; by N otherwise);
* the model is bf16: without the wrapper, every micro-batch's gradient would be added into a
  bf16 ``.grad`` and AdamW would update bf16 weights; with it, the window is summed in fp32,
  ``p.grad`` shows it as fp32 (``grad_dtype=None`` on the bf16 params), and AdamW steps fp32 master weights that
  are copied back to the bf16 model.

A short window at the end of an epoch is stepped like native: Trainer calls ``step()`` for it.

A tiny GPT-2 built from a config and synthetic token sequences keep it offline and fast.

Run: ``python examples/hf_trainer.py --steps 10``
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainingArguments,
    get_linear_schedule_with_warmup,
)
from transformers.utils import logging

from accumkernels import AccumulatingOptimizer


class CountingDataset(torch.utils.data.Dataset):
    """Sequences counting up by 3 (mod vocab) from a random start: easy next-token prediction."""

    def __init__(self, n: int, seq: int, vocab: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, vocab, (n, 1), generator=g)
        self.ids = (starts + 3 * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--accum", type=int, default=4, help="gradient_accumulation_steps")
    parser.add_argument("--micro-batch", type=int, default=4)
    args = parser.parse_args(argv)
    logging.set_verbosity_error()

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    dataset = CountingDataset(args.steps * args.accum * args.micro_batch, seq=20, vocab=128)

    optimizer = AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01),
        accumulation_steps=None,  # Trainer steps only at window ends
        reduction="sum",          # Trainer normalises the loss over the window itself
    )
    scheduler = get_linear_schedule_with_warmup(optimizer, 2, args.steps)

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, report_to=[], use_cpu=True, save_strategy="no",
            per_device_train_batch_size=args.micro_batch, gradient_accumulation_steps=args.accum,
            max_grad_norm=1.0, max_steps=args.steps, logging_steps=max(1, args.steps // 5),
            dataloader_num_workers=0, disable_tqdm=True, seed=0,
        )
        trainer = Trainer(model=model, args=training_args, train_dataset=dataset,
                          optimizers=(optimizer, scheduler))
        trainer.train()

    assert next(model.parameters()).dtype == torch.bfloat16  # the model stayed bf16
    with torch.no_grad():
        batch = dataset.ids[:64]
        final = model(input_ids=batch, labels=batch).loss.item()
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
