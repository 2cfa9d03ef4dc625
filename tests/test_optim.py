"""AccumulatingOptimizer, core semantics: reductions, flush, precision, master weights, window.

References are independent of the code under test: stock torch optimizers on plain models,
float64 sums of the per-micro-batch gradients captured with tensor hooks, or closed forms.
"""

from __future__ import annotations

import copy
import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accumkernels import AccumulatingOptimizer

D_IN, D_OUT = 12, 5
# ~0.001 MB = 262 fp32 elements: the test models below span several buckets (partial buckets,
# buckets holding one param larger than the bucket size, buckets shared by several params).
SMALL_BUCKET = 0.001


def make_model(dtype=torch.float32, widths=(D_IN, 24, 16, D_OUT)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def batches(n, m, dtype=torch.float32):
    return [(torch.randn(m, D_IN, dtype=dtype), torch.randn(m, D_OUT, dtype=dtype))
            for _ in range(n)]


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def capture_grads(model):
    """Record every gradient autograd hands to each param (before any accumulation)."""
    caps = {name: [] for name, _ in model.named_parameters()}
    handles = [p.register_hook(lambda g, name=name: caps[name].append(g.detach().clone()))
               for name, p in model.named_parameters()]
    return caps, handles


def rel_err(a, ref):
    """Norm-wise relative error of a (any dtype) against a float64 reference."""
    return ((a.double() - ref).norm() / ref.norm()).item()


def total_rel_err(tensors, refs):
    num = sum(((a.double() - r) ** 2).sum() for a, r in zip(tensors, refs))
    den = sum((r ** 2).sum() for r in refs)
    return math.sqrt(num / den)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


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


def test_master_weights_keep_sub_ulp_updates():
    lr = 2.0 ** -10
    w0 = torch.randn(64).to(torch.bfloat16)
    away = torch.sign(w0.float())
    ulp = (torch.nextafter(w0, w0 * 2) - w0).float().abs()  # bf16 spacing away from zero
    c = (-away * 0.3 * ulp / lr).to(torch.bfloat16)  # SGD moves each weight 0.3 ulp outwards

    def run(wrap, steps):
        w = nn.Parameter(w0.clone())
        inner = torch.optim.SGD([w], lr=lr)
        opt = AccumulatingOptimizer(inner) if wrap else inner
        values = []
        for _ in range(steps):
            (w * c).sum().backward()  # the gradient is c, exactly
            opt.step()
            opt.zero_grad()
            values.append(w.detach().clone())
        return values, inner

    values, inner = run(True, 2)
    assert all(p.dtype == torch.float32 for g in inner.param_groups for p in g["params"])
    assert torch.equal(values[0], w0)  # 0.3 ulp: below half an ulp, the bf16 param is unchanged
    assert torch.equal(values[1], (w0.float() + away * ulp).to(torch.bfloat16))  # 0.6 ulp: +1 ulp
    plain, _ = run(False, 6)
    assert all(torch.equal(v, w0) for v in plain)  # plain bf16 SGD never moves


def test_master_weights_false_steps_the_bf16_params_with_bf16_grads():
    N, lr = 3, 0.25
    model = make_model(torch.bfloat16)
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, master_weights=False,
                                bucket_size_mb=SMALL_BUCKET)
    assert [id(p) for p in inner.param_groups[0]["params"]] == [id(p) for p in model.parameters()]
    start = params_of(model)
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4, torch.bfloat16):
        mse(model, x, y).backward()
    for h in handles:
        h.remove()
    opt.step()
    for (name, p), s in zip(model.named_parameters(), start):
        assert p.dtype == torch.bfloat16
        g = sum(g.double() for g in caps[name]).to(torch.bfloat16)  # the window, in bf16
        expected = (s.double() - lr * g.double()).to(torch.bfloat16)
        # The fp32 window sum may round to a neighbouring bf16 grad, and the bf16 SGD update
        # rounds once more: within one bf16 ulp of the expected value (<= 2^-7 relative).
        torch.testing.assert_close(p.double(), expected.double(), rtol=2.0 ** -7, atol=1e-6)
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


# -- the window ---------------------------------------------------------------------------------

def run_loop(model, opt, data, zero_grad=None, per_microbatch_step=False, in_backward=True):
    for x, y in data:
        mse(model, x, y).backward()
        if not in_backward:
            opt.accumulate()
        if per_microbatch_step:
            opt.step()
        if opt.sync_step and not per_microbatch_step:
            opt.step()
        if zero_grad is not None:  # mid-window with N: the window survives
            opt.zero_grad(set_to_none=zero_grad)


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_keeps_the_window(set_to_none, in_backward):
    N = 3
    model = make_model()
    twin = copy.deepcopy(model)
    kw = {"accumulation_steps": N, "reduction": "mean", "accumulate_in_backward": in_backward,
          "bucket_size_mb": SMALL_BUCKET}
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **kw)
    twin_opt = AccumulatingOptimizer(torch.optim.AdamW(twin.parameters(), lr=1e-2), **kw)
    start = params_of(model)
    data = batches(2 * N, 4)
    run_loop(model, opt, data, zero_grad=set_to_none, in_backward=in_backward)
    run_loop(twin, twin_opt, data, in_backward=in_backward)
    for p, q, s in zip(model.parameters(), twin.parameters(), start):
        assert not torch.equal(p, s)
        assert torch.equal(p, q)  # same arithmetic: bitwise equal


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulate_in_backward_false_grad_visibility(dtype):
    """accumulate_in_backward=False: after a backward p.grad holds the gradients of the backwards
    since the last accumulate(), in the param dtype, exactly as autograd left them (what native
    .grad holds over those backwards); accumulate() moves them and p.grad is the fp32 window
    view; the N-th backward moves them by itself."""
    N = 4
    model = make_model(dtype)
    twin = copy.deepcopy(model)  # native autograd, zeroed where the wrapper moves its grads
    moved = [0.0] * len(list(model.parameters()))
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=N,
                                accumulate_in_backward=False, bucket_size_mb=SMALL_BUCKET)
    for k, (x, y) in enumerate(batches(N, 4, dtype)):
        mse(model, x, y).backward()
        mse(twin, x, y).backward()
        if k < N - 1:  # not moved yet: bit-equal to native's .grad over the same backwards
            for p, q in zip(model.parameters(), twin.parameters()):
                assert p.grad.dtype == dtype and torch.equal(p.grad, q.grad)
        if k == 1:
            opt.accumulate()
        if k in (1, N - 1):  # moved: autograd's sum of backwards 0-1, then 2-3 (param dtype)
            moved = [q.grad.double() + m for q, m in zip(twin.parameters(), moved)]
            twin.zero_grad()
            assert opt.micro_steps == k + 1
            for (name, p), ref in zip(model.named_parameters(), moved):  # the fp32 window view
                assert p.grad.dtype == torch.float32
                assert p.grad.data_ptr() == p.main_grad.data_ptr()
                # 2 terms summed in fp32 (bf16 terms are exact in fp32): relative ~6e-8.
                assert rel_err(p.grad, ref) < 1e-6, name
