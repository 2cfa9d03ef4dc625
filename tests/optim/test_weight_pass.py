"""Weight passes (``AccumulatingOptimizer.weight_pass()``): gradients computed with
``torch.autograd.grad`` and assigned or added to ``.grad`` by hand, as the split backward of
``torch.distributed.pipelining``'s zero-bubble schedules does (``stage_backward_input`` then
``stage_backward_weight``), are one micro-batch each: accumulated in fp32, scaled, counted and
checked like a full backward's. Judge: native PyTorch running the same split backward (fp32,
bit-identical: the same fp32 sums in the same order), in one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accumkernels import AccumulatingOptimizer

pipelining = pytest.importorskip("torch.distributed.pipelining._backward")

N = 4


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def split_backward(model, x, scale=1.0, wrapper=None) -> None:
    """The input pass, then the weight pass (inside ``wrapper.weight_pass()`` if given)."""
    x = x.detach().requires_grad_()
    loss = model(x).pow(2).sum() * scale
    _, groups = pipelining.stage_backward_input([loss], None, [x], model.parameters())
    if wrapper is None:
        pipelining.stage_backward_weight(model.parameters(), groups)
    else:
        with wrapper.weight_pass():
            pipelining.stage_backward_weight(model.parameters(), groups)


@pytest.mark.parametrize("kwargs", [
    {"accumulation_steps": N}, {"accumulation_steps": None},
    {"accumulation_steps": N, "reduction": "mean"}, {"accumulation_steps": N, "loss_scale": 1024.0},
], ids=["N", "None", "mean", "loss_scale"])
def test_each_weight_pass_is_one_microbatch(kwargs):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, native = make(seed), make(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), **kwargs)
    nopt = torch.optim.SGD(native.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):  # two windows
        xs = [torch.randn(5, 4, generator=g) for _ in range(N)]
        for x in xs:
            split_backward(ours, x, opt.loss_scale, wrapper=opt)
            split_backward(native, x)
            if kwargs["accumulation_steps"] is not None:
                opt.step()  # a no-op until N micro-batches are in
        assert opt.micro_steps == N or kwargs["accumulation_steps"] is not None
        if kwargs["accumulation_steps"] is None:
            opt.step()  # N=None: every step() ends the window
        assert opt.skipped_steps == 0
        if kwargs.get("reduction") == "mean":
            for p in native.parameters():
                p.grad.div_(N)
        nopt.step()
        nopt.zero_grad()
        opt.zero_grad()
        for a, b in zip(ours.parameters(), native.parameters()):
            assert torch.equal(a, b), (a - b).abs().max()


def test_weight_pass_counts_and_drops_a_nan_microbatch():
    """skip_microbatch: a NaN weight pass is dropped, the window of the others survives."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, native = make(seed), make(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), accumulation_steps=N,
                                nonfinite="skip_microbatch")
    nopt = torch.optim.SGD(native.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(5, 4, generator=g) for _ in range(N)]
    for k, x in enumerate(xs):
        split_backward(ours, x, float("nan") if k == 1 else 1.0, wrapper=opt)
        if k != 1:
            split_backward(native, x)
    assert opt.micro_steps == N and opt.skipped_microbatches == 1
    opt.step()
    nopt.step()
    for a, b in zip(ours.parameters(), native.parameters()):
        assert torch.equal(a, b)


def test_without_the_weight_pass_the_window_never_fills():
    """The failure the weight pass fixes: AccumulateGrad never runs, nothing is counted."""
    model = make(0)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N)
    for _ in range(N):
        split_backward(model, torch.randn(5, 4))
    assert opt.micro_steps == 0
