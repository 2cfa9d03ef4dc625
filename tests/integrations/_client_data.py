"""Data the real training entry points of test_clients.py read, made here (no downloads): a
litgpt ``DataModule`` of fixed random token sequences, importable by class path from a
``litgpt pretrain`` config."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from litgpt.data import DataModule


@dataclass
class RandomTokens(DataModule):
    """``samples`` random sequences of ``max_seq_length + 1`` tokens below ``vocab_size``
    (seeded), in order; validation reads the first few."""

    vocab_size: int = 64
    samples: int = 64
    seed: int = 1
    batch_size: int = field(default=1, init=False, repr=False)
    max_seq_length: int = field(default=16, init=False, repr=False)

    def __post_init__(self):
        super().__init__()

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length: int | None = None,
                **kwargs) -> None:
        self.batch_size = batch_size
        self.max_seq_length = max_seq_length or self.max_seq_length

    def _data(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, self.vocab_size, (self.samples, self.max_seq_length + 1),
                             generator=g)

    def train_dataloader(self):
        return torch.utils.data.DataLoader(self._data(), batch_size=self.batch_size,
                                           shuffle=False)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self._data()[:4], batch_size=self.batch_size,
                                           shuffle=False)
