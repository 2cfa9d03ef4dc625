"""Params whose memory is not row-major train as natively (DESIGN.md, "Any param layout").

Three layouts, each run natively and wrapped on the same init and fresh data:

* ``channels_last``: a conv net after ``model.to(memory_format=torch.channels_last)``;
* ``transposed``: a Linear whose weight is ``nn.Parameter(w.t())`` (strides (1, out));
* ``retransposed``: a square Linear weight flipped with ``p.data = p.data.t()`` after every
  window (its layout alternates between row-major and column-major).

fp32 (momentum SGD, and torch's fused AdamW): params, every ``p.grad`` between backwards (an
fp32 view with the param's strides) and the losses equal native, bit for bit with
``reduction="sum"``, within 1e-6 with ``"mean"`` and clipping (the wrapper's norm adds in
another order). bf16 with fp32 masters and fused AdamW: bit for bit a loop that keeps fp32
masters by hand (fp32 sums of the bf16 gradients, torch's fused AdamW on the masters, cast
back), and closer to the fp32 run than native bf16. Each also with
``accumulate_in_backward=False`` and with a checkpoint taken mid-window and loaded into a fresh
wrapper. On 9a2fd23 every one of them raised ``accumulate_: src[k] is not contiguous``.
"""

from __future__ import annotations

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accumkernels import AccumulatingOptimizer

N = 3  # micro-batches per window
WINDOWS = 3
CLIP = 0.05
VARIANTS = ["sum", "not_in_backward", "checkpoint", "clip_mean"]


def _model(layout: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    if layout == "channels_last":
        m = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 3, bias=False),
                          nn.Flatten(), nn.Linear(4 * 3 * 3, 5))
        return m.to(dtype).to(memory_format=torch.channels_last)
    m = nn.Sequential(nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 5))
    if layout == "transposed":
        m[0].weight = nn.Parameter(torch.randn(7, 6).t() * 0.3)  # strides (1, 6)
    return m.to(dtype)


def _batches(layout: str, n: int) -> list:
    shape = (4, 3, 7, 7) if layout == "channels_last" else (4, 7)
    return [(torch.randn(shape), torch.randn(4, 5)) for _ in range(n)]


def _input(layout: str, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    x = x.to(dtype)
    return x.contiguous(memory_format=torch.channels_last) if layout == "channels_last" else x


def _inner(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.01, fused=True)


def _between_windows(layout: str, model: nn.Module) -> None:
    if layout == "retransposed":
        w = model[2].weight
        w.data = w.data.t()


def _wrap(model, kind, variant, **extra) -> AccumulatingOptimizer:
    return AccumulatingOptimizer(
        _inner(kind, model.parameters()), accumulation_steps=N,
        reduction="mean" if variant == "clip_mean" else "sum",
        max_grad_norm=CLIP if variant == "clip_mean" else None,
        accumulate_in_backward=variant != "not_in_backward", **extra)


def _native_loop(layout, kind, variant, batches, dtype=torch.float32):
    model = _model(layout, dtype)
    opt = _inner(kind, model.parameters())
    losses, grads = [], []
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(_input(layout, x, dtype)).float(), y)
        losses.append(loss.item())
        (loss / N if variant == "clip_mean" else loss).backward()
        grads.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        if (i + 1) % N == 0:
            if variant == "clip_mean":
                torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
            _between_windows(layout, model)
    return model, losses, grads


def _wrapped_loop(layout, kind, variant, batches, dtype=torch.float32, check=None):
    model = _model(layout, dtype)
    opt = _wrap(model, kind, variant)
    losses = []
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(_input(layout, x, dtype)).float(), y)
        losses.append(loss.item())
        loss.backward()
        if variant == "checkpoint" and i % N == 1:  # mid-window: a fresh wrapper resumes
            saved = copy.deepcopy(opt.state_dict())
            del opt
            gc.collect()
            opt = _wrap(model, kind, variant)
            opt.load_state_dict(saved)
        if check is not None:
            check(i, model, opt)
        opt.step()
        if (i + 1) % N == 0:
            opt.zero_grad()
            _between_windows(layout, model)
    return model, losses


def _assert_grads(i, model, native_grads, exact):
    for (name, p), want in zip(model.named_parameters(), native_grads[i]):
        g = p.grad
        assert g is not None and g.dtype == torch.float32, f"micro-batch {i}, {name}"
        assert g.stride() == p.stride(), \
            f"micro-batch {i}, {name}: p.grad strides {g.stride()} vs the param's {p.stride()}"
        assert g.data_ptr() == p.main_grad.data_ptr(), f"{name}: p.grad is not the window"
        if exact:
            assert torch.equal(g, want), f"micro-batch {i}, {name}: p.grad differs from native"
        else:
            torch.testing.assert_close(g, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["channels_last", "transposed", "retransposed"])
@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_fp32_trains_as_natively(layout, kind, variant):
    batches = _batches(layout, N * WINDOWS)
    native, native_losses, native_grads = _native_loop(layout, kind, variant, batches)
    exact = variant != "clip_mean"

    def check(i, model, opt):
        # not_in_backward: the window waits in .grad; clip_mean: mid-window p.grad shows the
        # running sum (N = 3: no exact 1/N to fuse), the mean once the N-th backward is in
        if variant not in ("not_in_backward", "clip_mean") or (i + 1) % N == 0:
            _assert_grads(i, model, native_grads, exact)

    ours, losses = _wrapped_loop(layout, kind, variant, batches, check=check)
    assert losses == native_losses if exact else \
        torch.allclose(torch.tensor(losses), torch.tensor(native_losses), rtol=1e-6)
    moved = False
    for (name, p), q in zip(ours.named_parameters(), native.parameters()):
        assert p.stride() == q.stride(), name
        if exact:
            assert torch.equal(p, q), f"{name}: differs from native by {(p - q).abs().max()}"
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        moved = moved or not torch.equal(p, _model(layout, torch.float32).state_dict()[name])
    assert moved


def _hand_kept_masters(layout, batches, variant):
    """bf16 model, fp32 masters kept by hand: fp32 sums of the bf16 gradients, torch's fused
    AdamW on the masters, the masters cast back (what the wrapper promises, bit for bit)."""
    model = _model(layout, torch.bfloat16)
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float()) for p in params]  # .float() keeps the layout
    opt = _inner("adamw_fused", masters)
    for i, (x, y) in enumerate(batches):
        loss = F.mse_loss(model(_input(layout, x, torch.bfloat16)).float(), y)
        (loss / N if variant == "clip_mean" else loss).backward()
        for p, m in zip(params, masters):
            g = torch.empty_like(m).copy_(p.grad)
            m.grad = g if m.grad is None else m.grad.add_(g)
            p.grad = None
        if (i + 1) % N == 0:
            if variant == "clip_mean":
                torch.nn.utils.clip_grad_norm_(masters, CLIP)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
            _between_windows(layout, model)
            for p, m in zip(params, masters):  # the masters follow a re-striding in place
                if m.stride() != p.stride():
                    m.data = m.data.as_strided(p.shape, p.stride())
    return model


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", ["channels_last", "transposed", "retransposed"])
def test_bf16_masters_fused_adamw_as_hand_kept_masters(layout, variant):
    batches = _batches(layout, N * WINDOWS)
    hand = _hand_kept_masters(layout, batches, variant)
    ours, _ = _wrapped_loop(layout, "adamw_fused", variant, batches, torch.bfloat16)
    fp32, _, _ = _native_loop(layout, "adamw_fused", variant, batches)
    native_bf16, _, _ = _native_loop(layout, "adamw_fused", variant, batches, torch.bfloat16)
    err_ours = err_native = 0.0
    for (name, p), q, r, s in zip(ours.named_parameters(), hand.parameters(), fp32.parameters(),
                                  native_bf16.parameters()):
        assert p.stride() == q.stride(), name
        if variant == "clip_mean":  # the clip norm: summed in another order
            torch.testing.assert_close(p, q, rtol=2e-2, atol=1e-3)  # (one bf16 ulp)
        else:
            assert torch.equal(p, q), f"{name}: differs from hand-kept masters by " \
                                      f"{(p.float() - q.float()).abs().max()}"
        err_ours += (p.float() - r).abs().sum().item()
        err_native += (s.float() - r).abs().sum().item()
    assert err_ours < err_native, (err_ours, err_native)


def test_layout_change_mid_window_keeps_the_window():
    """``p.data = p.data.t()`` inside a window: ``p.grad`` keeps every element's value, in the
    param's new layout (natively, ``.grad`` keeps its old strides and autograd adds into it by
    element)."""
    layout = "retransposed"
    batches = _batches(layout, 2)
    native = _model(layout, torch.float32)
    ours = _model(layout, torch.float32)
    opt = _wrap(ours, "sgd", "sum")
    for model in (native, ours):
        F.mse_loss(model(batches[0][0]), batches[0][1]).backward()
        _between_windows(layout, model)
        F.mse_loss(model(batches[1][0]), batches[1][1]).backward()
    w, v = ours[2].weight, native[2].weight
    assert w.grad.stride() == w.stride() and torch.equal(w.grad, v.grad)
    assert opt.micro_steps == 2


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_channels_last_after_wrapping_and_dtype_round_trip(kind, dtype):
    """``model.to(memory_format=torch.channels_last)`` after the wrapper was built (the views
    and masters follow), then ``model.double().float()`` mid-window (it swaps every ``.grad``'s
    data, views included): the same params as the wrapper on a model converted before, and,
    in fp32, as native."""
    batches = _batches("channels_last", 2 * N)
    runs = []
    for when in ("before", "after", "native"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 3, bias=False),
                              nn.Flatten(), nn.Linear(4 * 3 * 3, 5)).to(dtype)
        if when == "before":
            model.to(memory_format=torch.channels_last)
        opt = _inner(kind, model.parameters())
        if when != "native":
            opt = AccumulatingOptimizer(opt, accumulation_steps=N)
        model.to(memory_format=torch.channels_last)
        for i, (x, y) in enumerate(batches):
            F.mse_loss(model(_input("channels_last", x, dtype)).float(), y).backward()
            if i == 1 and dtype == torch.float32:
                model.double().float()
            if when != "native" or (i + 1) % N == 0:
                opt.step()
            if (i + 1) % N == 0:
                opt.zero_grad()
        for p in model.parameters():
            assert p.stride() == (p.grad.stride() if p.grad is not None else p.stride())
        runs.append([p.detach().clone() for p in model.parameters()])
    for a, b, c in zip(*runs):
        assert a.stride() == b.stride() and torch.equal(a, b)
        if dtype == torch.float32:
            assert torch.equal(a, c)


def test_bf16_masters_relayout_into_new_memory_after_a_step():
    """``model.to(memory_format=torch.channels_last)`` on a bf16 conv net after a real step moves
    each conv weight into new memory: its fp32 master (which holds bits the bf16 weight lacks)
    takes the new layout keeping its values element by element, and the next window steps as
    hand-kept fp32 masters do (fused AdamW on the masters, fp32 sums, cast back)."""
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = nn.Sequential(nn.Conv2d(3, 6, 3), nn.Tanh(), nn.Conv2d(6, 4, 3, bias=False),
                          nn.Flatten(), nn.Linear(4 * 3 * 3, 5)).bfloat16()
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    masters = [nn.Parameter(p.detach().float().clone()) for p in params]
    native = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                accumulation_steps=2)
    data = [(torch.randn(2, 3, 7, 7).bfloat16(), torch.randn(2, 5)) for _ in range(4)]
    for k in range(2):
        if k == 1:
            before = [m.detach().clone() for m in opt.master_params]
            assert any(not torch.equal(m, p.float()) for m, p in zip(before, model.parameters()))
            places = [p.data_ptr() for p in model.parameters()]
            model.to(memory_format=torch.channels_last)
            ref.to(memory_format=torch.channels_last)
            for m in masters:  # the hand-kept masters take it too (torch's fused step pairs
                if m.dim() == 4:  # them with their state by memory position, as the wrapper's)
                    m.data = m.data.contiguous(memory_format=torch.channels_last)
            assert places[0] != model[0].weight.data_ptr()  # new memory
        acc = [torch.zeros_like(m) for m in masters]
        for x, y in data[2 * k:2 * k + 2]:
            F.mse_loss(model(x).float(), y).backward()
            opt.step()
            if k == 1 and x is data[2][0]:
                for m, b in zip(opt.master_params, before):
                    assert torch.equal(m, b)  # the same values, element by element
                assert opt.master_params[0].is_contiguous(memory_format=torch.channels_last)
            ref.zero_grad()
            F.mse_loss(ref(x).float(), y).backward()
            for a, p in zip(acc, params):
                a.add_(p.grad.float())
        opt.zero_grad()
        for m, a in zip(masters, acc):
            m.grad = a
        native.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    for m, q in zip(masters, opt.master_params):
        assert torch.equal(q, m)
    for p, q in zip(model.parameters(), params):
        assert torch.equal(p, q)
