"""HF Trainer, one line: ``AccumulatingTrainer`` instead of ``Trainer``.

Everything else is the stock Trainer script: the Trainer builds its AdamW (``learning_rate``,
weight-decay groups), accumulates ``gradient_accumulation_steps`` micro-batches, clips with
``max_grad_norm``, checkpoints and, under ``torchrun --nproc-per-node 2``, wraps the model in
DDP. ``AccumulatingTrainer`` wraps that optimizer in ``AccumulatingOptimizer`` (fp32 window,
fp32 master weights for this bf16 model) and registers ``accumkernels.ddp_comm_hook`` on the
Trainer's DDP module. Options for the wrapper: ``AccumulatingTrainer(...,
accumkernels={"nonfinite": "skip_step"})``.

Run: ``python examples/hf_trainer_oneline.py`` (or ``torchrun --nproc-per-node 2 ...``)
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.utils import logging

from accumkernels.integrations.transformers import AccumulatingTrainer


class CountingDataset(torch.utils.data.Dataset):
    """Sequences counting up by 3 (mod vocab) from a random start: easy next-token prediction."""

    def __init__(self, n: int, seq: int, vocab: int):
        g = torch.Generator().manual_seed(0)
        self.ids = (torch.randint(0, vocab, (n, 1), generator=g) + 3 * torch.arange(seq)) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps")
    args = parser.parse_args(argv)
    logging.set_verbosity_error()
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).to(torch.bfloat16)
    dataset = CountingDataset(args.steps * 4 * 4, seq=20, vocab=128)

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir, report_to=[], use_cpu=True, save_strategy="no",
            per_device_train_batch_size=4, gradient_accumulation_steps=4, learning_rate=1e-2,
            max_grad_norm=1.0, max_steps=args.steps, disable_tqdm=True, logging_strategy="no")
        trainer = AccumulatingTrainer(model=model, args=training_args, train_dataset=dataset)
        trainer.train()

    with torch.no_grad():
        final = model(input_ids=dataset.ids[:64], labels=dataset.ids[:64]).loss.item()
    print(f"optimizer: {type(trainer.optimizer.optimizer).__name__}")
    print(f"final loss {final:.4f}")
    return final


if __name__ == "__main__":
    main()
