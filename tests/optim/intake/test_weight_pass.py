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


# -- the block's edges (issue 37): nesting, an exception caught, a backward inside, the window
# already moved with accumulate_in_backward=False. Native: every gradient is summed in .grad.
def add_grads(params, grads) -> None:
    """What a weight pass does with its gradients (``stage_backward_weight``): add to .grad."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g
        else:
            p.grad += g


def weight_grads(model, x, params=None, scale=1.0) -> None:
    """A gradient computed with ``torch.autograd.grad`` and added to ``.grad`` by hand."""
    params = list(model.parameters()) if params is None else params
    loss = model(x).pow(2).sum() * scale
    add_grads(params, torch.autograd.grad(loss, params))


def full_backward(model, x, scale=1.0) -> None:
    (model(x).pow(2).sum() * scale).backward()


def pair(seed, **kwargs):
    ours, native = make(seed), make(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), **kwargs)
    return ours, native, opt, torch.optim.SGD(native.parameters(), lr=0.1)


def _close(a, b, what: str) -> None:
    """fp32 sums of the same terms in another order: 1e-6 of the tensor's largest value (the
    bugs these tests catch are off by 1e-2 and more)."""
    err = (a.double() - b.double()).abs().max().item()
    assert err <= 1e-6 * b.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


def assert_same(ours, native, what: str) -> None:
    for i, (a, b) in enumerate(zip(ours.parameters(), native.parameters())):
        _close(a.detach(), b.detach(), f"{what}, param {i}")


def assert_same_grads(ours, native, what: str) -> None:
    for i, (a, b) in enumerate(zip(ours.parameters(), native.parameters())):
        assert (a.grad is None) == (b.grad is None), f"{what}, param {i}"
        if a.grad is not None:
            _close(a.grad, b.grad, f"{what}, param {i}")


def _xs(seed, n):
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(5, 4, generator=g) for _ in range(n)]


@pytest.mark.parametrize("outer_first", [True, False], ids=["outer_writes_first", "nested_first"])
def test_nested_weight_pass_is_part_of_the_outer_one(outer_first):
    """A nested block (the outer one already wrote .grad, or not yet) adds to the window; both
    blocks together are one micro-batch."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, native, opt, nopt = pair(seed, accumulation_steps=3)
    xs = _xs(seed, 4)
    for model in (ours, native):
        full_backward(model, xs[0])
    with opt.weight_pass():
        if outer_first:
            weight_grads(ours, xs[1])
        with opt.weight_pass():
            weight_grads(ours, xs[2])
        if not outer_first:
            weight_grads(ours, xs[1])
    weight_grads(native, xs[1])
    weight_grads(native, xs[2])
    assert opt.micro_steps == 2
    assert_same_grads(ours, native, "after the nested block")
    for model in (ours, native):
        full_backward(model, xs[3])
    opt.step()
    nopt.step()
    assert_same(ours, native, "after the step")


def test_exception_inside_the_block_leaves_window_and_partial():
    """The user catches an exception raised inside the block: .grad shows the window plus what
    was written (natively: summed in .grad), and the next step uses that."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, native, opt, nopt = pair(seed, accumulation_steps=3)
    xs = _xs(seed, 3)
    first = list(ours[0].parameters())
    for model in (ours, native):
        full_backward(model, xs[0])
    try:
        with opt.weight_pass():
            weight_grads(ours, xs[1], first)
            raise RuntimeError("a failure in the middle of the weight pass")
    except RuntimeError:
        pass
    weight_grads(native, xs[1], list(native[0].parameters()))
    assert_same_grads(ours, native, "after the exception")
    for model in (ours, native):
        full_backward(model, xs[2])
    assert opt.micro_steps == 3
    opt.step()
    nopt.step()
    assert_same(ours, native, "after the step")


@pytest.mark.parametrize("assigned_first", [False, True], ids=["backward_first",
                                                             "assigned_first"])
def test_backward_and_assigned_gradient_in_one_block_are_one_microbatch(assigned_first):
    """reduction='mean', N=2: a block with a backward and a gradient added by hand is one
    micro-batch, as the docstring says (natively both are summed in .grad)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    ours, native, opt, nopt = pair(seed, accumulation_steps=2, reduction="mean")
    xs = _xs(seed, 3)
    full_backward(ours, xs[2])  # a window to add to
    full_backward(native, xs[2])
    opt.flush()  # a short window of one: mean = sum
    nopt.step()
    opt.zero_grad()
    nopt.zero_grad()
    with opt.weight_pass():
        if assigned_first:
            weight_grads(ours, xs[1], list(ours[2].parameters()))
        full_backward(ours, xs[0])
        if not assigned_first:
            weight_grads(ours, xs[1], list(ours[2].parameters()))
    full_backward(native, xs[0])
    weight_grads(native, xs[1], list(native[2].parameters()))
    assert opt.micro_steps == 1
    for model in (ours, native):
        full_backward(model, xs[2])
    assert opt.micro_steps == 2
    for p in native.parameters():
        p.grad.div_(2)
    opt.step()
    nopt.step()
    assert_same_grads(ours, native, "the stepped window")
    assert_same(ours, native, "after the step")


@pytest.mark.parametrize("moved_by", ["accumulate", "nth_backward"])
@pytest.mark.parametrize("kwargs", [{"reduction": "mean"}, {"loss_scale": 1024.0}],
                         ids=["mean", "loss_scale"])
def test_weight_pass_after_the_window_moved_unmoved_mode(kwargs, moved_by):
    """accumulate_in_backward=False, N=2: a weight pass after the window was moved (by
    ``accumulate()``, or by the N-th backward: the pass is then a micro-batch past N) whose
    gradients were computed before the block is scaled and normalised like a backward's, never
    added raw to the normalised window."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    n = 2
    ours, native, opt, nopt = pair(seed, accumulation_steps=n, accumulate_in_backward=False,
                                   **kwargs)
    scale = opt.loss_scale
    for w in range(2):
        xs = _xs(seed + w, n + 1)
        backwards = 1 if moved_by == "accumulate" else n
        for x in xs[:backwards]:
            full_backward(ours, x, scale)
            full_backward(native, x)
        if moved_by == "accumulate":
            opt.accumulate()
        params = list(ours.parameters())
        grads = torch.autograd.grad(ours(xs[n]).pow(2).sum() * scale, params)
        with opt.weight_pass():
            add_grads(params, grads)
        weight_grads(native, xs[n])
        k = opt.micro_steps
        assert k == backwards + 1
        opt.accumulate()
        if kwargs.get("reduction") == "mean":
            for p in native.parameters():
                p.grad.div_(k)
        assert_same_grads(ours, native, f"window {w} before step")
        opt.step()
        nopt.step()
        opt.zero_grad()
        nopt.zero_grad()
        assert_same(ours, native, f"window {w} after the step")
