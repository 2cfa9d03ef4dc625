"""The LightningModule that test_optimizers_by_name.py hands to LightningCLI: importable by name
(the CLI's parser resolves it), without ``configure_optimizers`` (the CLI's ``--optimizer``
builds the optimizer)."""

from __future__ import annotations

import lightning as L
import torch


class TinyRegression(L.LightningModule):
    """A two-layer regression on 16 fixed random samples, micro-batches of 2."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                       torch.nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(16, 8, generator=g)
        data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
        return torch.utils.data.DataLoader(data, batch_size=2)
