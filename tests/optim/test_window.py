"""The window and its cadence (DESIGN: "Window", "step(closure=None)", "reduction"): every
backward is one micro-batch; ``"mean"``, ``"sum"`` and ``"weighted"`` against one large batch, a
native loop or float64 sums; ``accumulation_steps=N`` with ``step()`` at the boundary
(Trainer-style) or every micro-batch (Accelerate-style), and ``None``; ``flush()`` of a short
window, ``reset_window()``, a closure as a micro-batch, a backward past a complete window; the
window summed in fp32 over 48 bf16 micro-batches.

References are independent of the code under test: stock torch optimizers on plain models,
float64 sums of the per-micro-batch gradients captured with tensor hooks, or closed forms.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _optim_common import (
    D_IN,
    D_OUT,
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    run_loop,
    total_rel_err,
)

from accumkernels import AccumulatingOptimizer

# -- reductions -----------------------------------------------------------------------------

@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_mean_equals_one_large_batch(in_backward):
    N, m = 4, 3
    model = make_model()
    ref = copy.deepcopy(model)
    # eps=1e-4: Adam's update g/(|g|+eps) has slope <= 1/eps, so an fp32 rounding difference
    # delta ~1e-8 between the two gradient computations (one matmul over 12 rows vs four over
    # 3) moves a param by <= lr*delta/eps ~ 1e-7 per step, even for a gradient element that
    # cancels to ~0 (with eps=1e-8 such an element could flip sign and move by 2*lr).
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4),
                                accumulation_steps=N, reduction="mean",
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    start = params_of(model)
    for _ in range(3):
        data = batches(N, m)
        for x, y in data:
            mse(model, x, y).backward()
            if not in_backward:
                opt.accumulate()
        assert opt.sync_step and opt.micro_steps == N
        opt.step()
        assert opt.micro_steps == 0
        opt.zero_grad()  # (as the native loop clears)
        x = torch.cat([x for x, _ in data])
        y = torch.cat([y for _, y in data])
        ref_opt.zero_grad()
        mse(ref, x, y).backward()
        ref_opt.step()
    for p, q, s in zip(model.parameters(), ref.parameters(), start):
        assert not torch.equal(p, s)
        torch.testing.assert_close(p, q, rtol=0, atol=1e-5)


@pytest.mark.parametrize("in_backward,steps", [(True, 3), (False, None)],
                         ids=["hooks-N", "accumulate-None"])
def test_sum_is_a_drop_in_for_trainer_loop(in_backward, steps):
    """loss/N, clip_grad_norm_ on the model at the boundary, step: same params as native."""
    N, m, max_norm = 3, 4, 0.1
    model = make_model()
    ref = copy.deepcopy(model)
    # eps=1e-4 bounds the effect of fp32 rounding differences on Adam (see the mean test);
    # both sides accumulate in fp32, so gradients differ by a few fp32 ulps at most.
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4),
                                accumulation_steps=steps, accumulate_in_backward=in_backward,
                                bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, eps=1e-4)
    for _ in range(3):
        data = batches(N, m)
        for mod, o in ((model, opt), (ref, ref_opt)):
            for x, y in data:
                (mse(mod, x, y) / N).backward()
            norm = torch.nn.utils.clip_grad_norm_(mod.parameters(), max_norm)
            assert norm > max_norm  # clipping is active, so it must act on the real window
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_trainer_loop_without_hooks_steps_at_the_boundary():
    N = 3
    model = make_model()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=False, bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = batches(N, 4)
    for mod, o in ((model, opt), (ref, ref_opt)):
        for x, y in data:
            (mse(mod, x, y) / N).backward()  # "every backward() ... is one micro-batch"
        o.step()
    for p, q in zip(model.parameters(), ref.parameters()):  # fp32 sums of 3 grads, both sides
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_weighted_equals_full_batch_per_item_mean():
    sizes = (1, 7, 2, 13)
    model = make_model()
    model64 = copy.deepcopy(model).double()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                accumulation_steps=len(sizes), reduction="weighted",
                                bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    data = [(torch.randn(n, D_IN), torch.randn(n, D_OUT)) for n in sizes]
    caps, handles = capture_grads(model)

    def sum_loss(mod, x, y):  # a SUM over items (each item: mean over its outputs)
        return F.mse_loss(mod(x), y, reduction="none").mean(dim=1).sum()

    for i, (x, y) in enumerate(data):
        if i in (0, 2):
            opt.add_weight(sizes[i])  # before the backward
        sum_loss(model, x, y).backward()
        if i == 1:
            opt.add_weight(float(sizes[i]))  # after the backward
    for h in handles:
        h.remove()
    # Boundary reached; the last weight is still missing: p.grad shows sum(g) / (1+7+2).
    sums = {name: sum(g.double() for g in gs) for name, gs in caps.items()}
    names = [name for name, _ in model.named_parameters()]
    grads = [p.grad for p in model.parameters()]
    # fp32 accumulation of 4 fp32 gradients vs their float64 sum: relative error ~1e-7.
    assert total_rel_err(grads, [sums[n] / 10 for n in names]) < 1e-6
    opt.add_weight(torch.tensor(13.0))  # after the boundary, before step()
    assert total_rel_err([p.grad for p in model.parameters()], [sums[n] / 23 for n in names]) < 1e-6

    # ... which is the full-batch per-item mean gradient (float64 model on all 23 items); the
    # fp32 forward/backward vs float64 differs by fp32 rounding through 3 small layers (~1e-6).
    x = torch.cat([x for x, _ in data]).double()
    y = torch.cat([y for _, y in data]).double()
    F.mse_loss(model64(x), y).backward()
    full = [p.grad for p in model64.parameters()]
    assert total_rel_err([p.grad for p in model.parameters()], full) < 1e-5
    opt.step()
    for p, s, g in zip(model.parameters(), start, full):
        # SGD: p = s - 0.1*g; fp32 update of O(1) params: atol a few fp32 ulps + 0.1*1e-5*|g|.
        torch.testing.assert_close(p.double(), s.double() - 0.1 * g, rtol=0, atol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_flush_short_window(reduction):
    N, k, lr = 4, 3, 0.1
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                accumulation_steps=N, reduction=reduction,
                                bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    caps, handles = capture_grads(model)
    for x, y in batches(k, 5):
        mse(model, x, y).backward()
        opt.step()  # not the boundary: a no-op
    for h in handles:
        h.remove()
    assert not opt.sync_step and opt.micro_steps == k
    for p, s in zip(model.parameters(), start):
        assert torch.equal(p, s)
    opt.flush()
    assert opt.micro_steps == 0
    divisor = k if reduction == "mean" else 1
    for (name, p), s in zip(model.named_parameters(), start):
        expected = s.double() - lr * sum(g.double() for g in caps[name]) / divisor
        # fp32 sum of 3 grads (rel 1e-7) times lr, plus rounding of the fp32 update: < 1e-6.
        torch.testing.assert_close(p.double(), expected, rtol=0, atol=1e-6)
    opt.flush()  # empty window: nothing to do
    for (name, p), s in zip(model.named_parameters(), start):
        assert not torch.equal(p, s)


def test_flush_with_master_weights():
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=4)
    start = params_of(model)
    for x, y in batches(2, 4, torch.bfloat16):
        mse(model, x, y).backward()
    opt.flush()
    assert opt.micro_steps == 0
    assert all(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


# -- precision --------------------------------------------------------------------------------

def test_bf16_48_microbatches_accumulate_in_fp32():
    N = 48
    model = make_model(torch.bfloat16, widths=(D_IN, 48, 32, D_OUT))
    native = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                bucket_size_mb=SMALL_BUCKET)
    caps, handles = capture_grads(model)
    data = batches(N, 4, torch.bfloat16)
    for x, y in data:
        mse(model, x, y).backward()
        mse(native, x, y).backward()  # stock AccumulateGrad: p.grad += g in bf16
    for h in handles:
        h.remove()
    assert opt.sync_step and opt.micro_steps == N
    names = [n for n, _ in model.named_parameters()]
    ref = [sum(g.double() for g in caps[n]) for n in names]  # float64 sum of the bf16 grads
    assert all(len(caps[n]) == N for n in names)
    grads = [p.grad for p in model.parameters()]
    assert all(g.dtype == torch.float32 for g in grads)
    # Norm over all params. fp32 sum of 48 terms: error ~sqrt(48)*2^-24 relative ~ 4e-7.
    err = total_rel_err(grads, ref)
    assert err < 2e-6
    assert total_rel_err([p.main_grad for p in model.parameters()], ref) < 2e-6
    err_native = total_rel_err([p.grad for p in native.parameters()], ref)
    print(f"\nrelative error (norm over all params) of the accumulated gradient, 48 bf16 "
          f"micro-batches: accumkernels fp32 {err:.2e}, native bf16 {err_native:.2e}")
    assert err_native > 1e-4  # bf16 sums lose ~2^-9 per add: the comparison is meaningful


# -- the window ---------------------------------------------------------------------------------


def test_accelerate_style_step_every_microbatch():
    N = 3
    model = make_model()
    twin = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    twin_opt = AccumulatingOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-2),
                                     accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    data = batches(2 * N, 4)
    before = params_of(model)
    for i, (x, y) in enumerate(data):
        mse(model, x, y).backward()
        assert opt.micro_steps == i % N + 1
        assert opt.sync_step == ((i + 1) % N == 0)
        opt.step()
        opt.zero_grad()
        changed = [not torch.equal(p, b) for p, b in zip(model.parameters(), before)]
        assert all(changed) if (i + 1) % N == 0 else not any(changed)
        before = params_of(model)
    run_loop(twin, twin_opt, data)  # Trainer-style: step only at boundaries
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_reset_window_discards_accumulated_gradients():
    N = 2
    model = make_model()
    twin = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                bucket_size_mb=SMALL_BUCKET)
    twin_opt = AccumulatingOptimizer(torch.optim.SGD(twin.parameters(), lr=0.1),
                                     accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    x, y = batches(1, 4)[0]
    mse(model, x, y).backward()
    opt.reset_window()
    assert opt.micro_steps == 0
    data = batches(N, 4)
    run_loop(model, opt, data)
    run_loop(twin, twin_opt, data)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_step_closure_counts_as_a_microbatch(in_backward):
    N = 2
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    calls = []

    def closure():
        x, y = batches(1, 4)[0]
        loss = mse(model, x, y)
        loss.backward()
        calls.append(loss)
        return loss

    out = opt.step(closure)
    assert out is calls[0] and opt.micro_steps == 1
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    out = opt.step(closure)
    assert out is calls[1] and len(calls) == 2
    assert opt.micro_steps == 0
    assert all(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_backward_after_complete_window_keeps_accumulating_like_native(in_backward):
    """No step() after N micro-batches: like native PyTorch, the next backward adds on."""
    N = 2
    model = make_model()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in batches(N + 1, 4):
        for mod, o in ((model, opt), (ref, ref_opt)):
            mse(mod, x, y).backward()
        opt.accumulate()
    assert opt.micro_steps == N + 1 and opt.sync_step
    for p, q in zip(model.parameters(), ref.parameters()):  # 3 fp32 terms: rounding ~1e-7
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    opt.step()
    ref_opt.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("n", [3, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mean_keeps_a_sum_that_cancels_exactly(n, dtype):
    """``reduction="mean"`` with N given: micro-batches whose gradients cancel exactly (a loss,
    then its negative) leave exactly 0, as native's ``sum / N`` does, whatever N (a 1/N fused
    into each add rounds every term for N not a power of two and would leave that rounding);
    Rprop, which steps by the sign alone, then moves exactly the params native moves."""
    torch.manual_seed(1234 + n)
    lin = torch.nn.Linear(D_IN, D_OUT).to(dtype)
    ref = copy.deepcopy(lin)
    opt = AccumulatingOptimizer(torch.optim.Rprop(lin.parameters(), foreach=False),
                                accumulation_steps=n, reduction="mean")
    masters = {id(p): p.detach().float().clone().requires_grad_() for p in ref.parameters()}
    x = torch.randn(4, D_IN, dtype=dtype)
    pairs = (n - 1) // 2  # (a loss, then its negative) x pairs; then the bias alone
    for k in range(n):
        for m in (lin, ref):
            if k < 2 * pairs:
                loss = m(x).float().pow(2).sum() * (1 if k % 2 == 0 else -1)
            else:  # the weight gets no gradient: its sum over the window is exactly 0
                loss = m.bias.float().sum()
            loss.backward()
    assert opt.sync_step
    sums = {name: q.grad.float() for name, q in ref.named_parameters()}
    assert torch.count_nonzero(sums["weight"]) == 0  # (native: the weight's gradients cancel)
    assert torch.count_nonzero(lin.weight.grad) == 0, "the wrapper's mean left a rounding"
    opt.step()
    for name, q in ref.named_parameters():  # native: the fp32 sum / N on fp32 copies
        master = masters[id(q)]
        master.grad = sums[name] / n
    torch.optim.Rprop(list(masters.values()), foreach=False).step()
    for (name, p), q in zip(lin.named_parameters(), ref.parameters()):
        want = masters[id(q)].detach().to(dtype)
        assert torch.equal(p.detach(), want), name
