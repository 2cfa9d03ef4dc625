"""The ``params`` axis of the conformance matrix: one small model per param layout, and the data
of each micro-batch (seeded by case, window and index, so both sides of a case see the same).

Every model takes ``x`` of ``in_shape`` per sample and returns ``OUT`` values per sample; the MLPs
hold a square weight (``model.square``, what ``hands=data-transpose`` transposes).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

D_IN, D_HID, OUT, BATCH = 6, 5, 3, 4


class MLP(nn.Module):
    """a -> tanh -> square -> tanh -> c; options: the square layer used twice (tied), an extra
    layer used only in some micro-batches (unused), the square layer in bf16 (mixed), a weight
    built from a transposed view (transposed)."""

    in_shape = (D_IN,)

    def __init__(self, tied=False, unused=False, mixed=False, transposed=False):
        super().__init__()
        self.a = nn.Linear(D_IN, D_HID)
        self.b = nn.Linear(D_HID, D_HID)
        self.c = nn.Linear(D_HID, OUT)
        self.extra = nn.Linear(D_HID, D_HID) if unused else None
        self.tied, self.mixed = tied, mixed
        if transposed:  # a (D_HID, D_IN) weight whose memory is (D_IN, D_HID) row-major
            self.a.weight = nn.Parameter(self.a.weight.detach().t().contiguous().t())
        if mixed:
            self.b.to(torch.bfloat16)
        self.use_extra = True

    @property
    def square(self) -> nn.Parameter:
        return self.b.weight

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.mixed:
            h = self.b(h.bfloat16()).float()
        else:
            h = self.b(h)
        if self.tied:
            h = self.b(torch.tanh(h))
        if self.extra is not None and self.use_extra:
            h = h + self.extra(h)
        return self.c(torch.tanh(h))


class ConvNet(nn.Module):
    in_shape = (2, 4, 4)

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.conv2 = nn.Conv2d(3, 3, 3, padding=1)
        self.head = nn.Linear(3 * 16, OUT)
        self.use_extra = True

    def forward(self, x):
        h = torch.tanh(self.conv2(torch.tanh(self.conv(x))))
        return self.head(h.flatten(1))


def _channels_last():
    return ConvNet().to(memory_format=torch.channels_last)


def _frozen():
    m = MLP()
    m.a.bias.requires_grad_(False)
    return m


MODELS = {
    "contiguous": MLP,
    "channels_last": _channels_last,
    "transposed": lambda: MLP(transposed=True),
    "tied": lambda: MLP(tied=True),
    "frozen": _frozen,
    "unused": lambda: MLP(unused=True),
    "mixed": lambda: MLP(mixed=True),
}


def build(params: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """The model of layout ``params`` in ``dtype`` (not 'mixed'), seeded."""
    torch.manual_seed(seed)
    model = MODELS[params]()
    if params != "mixed" and dtype != torch.float32:
        model.to(dtype)
    return model


def same_start(model: nn.Module, params: str, dtype: torch.dtype, seed: int) -> nn.Module:
    """A fresh model of the same layout holding ``model``'s current weights."""
    fresh = build(params, dtype, seed)
    fresh.load_state_dict(model.state_dict())
    return match_layout(fresh, model)


def match_layout(fresh: nn.Module, like: nn.Module) -> nn.Module:
    """Give ``fresh``'s params the strides of ``like``'s (a user who rebuilds a model after
    ``p.data = p.data.t()`` re-applies it): a matmul's rounding depends on the layout."""
    with torch.no_grad():
        for p, q in zip(fresh.parameters(), like.parameters()):
            if p.stride() != q.stride():
                p.data = torch.empty_strided(q.shape, q.stride(), dtype=p.dtype).copy_(p)
    return fresh


def micro_batch(seed: int, w: int, i: int, in_shape, dtype) -> tuple:
    """(x, y, weight) of micro-batch i of window w."""
    g = torch.Generator().manual_seed(seed * 1000 + w * 10 + i)
    x = torch.randn(BATCH, *in_shape, generator=g)
    y = torch.randn(BATCH, OUT, generator=g)
    weight = float(torch.randint(1, 9, (1,), generator=g).item())
    in_dtype = torch.float32 if dtype is None else dtype
    return x.to(in_dtype), y, weight


def loss_fn(model: nn.Module, x, y, summed: bool) -> torch.Tensor:
    """MSE, mean over the micro-batch, or summed (reduction='weighted': the step divides)."""
    out = model(x).float()
    return F.mse_loss(out, y, reduction="sum" if summed else "mean")


def extra_used(w: int, i: int) -> bool:
    """The 'unused' layout's extra layer: never in window 0 (a param with no state at the
    first boundary), in window 1 but its micro-batch 1, never in window 2 (its view holds
    window 1's gradient unless the step zeroes what the window did not touch)."""
    return w == 1 and i != 1
