"""Master weights (DESIGN: "master_weights"): a bf16/fp16 model is stepped through fp32 master
copies, which keep updates below half a bf16 ulp; ``master_weights=False`` steps the bf16 params
with bf16 gradients; weights changed in place outside the optimizer (``load_state_dict``,
``p.data.clamp_()``) are never reverted by stale masters. The re-sync's own passes against
torch: test_masters_resync.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _native_common import mlp, mlp_batches, random_seed
from _optim_common import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
)
from torch import nn

from accumkernels import AccumulatingOptimizer

LR = 0.1


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
        return values, (inner, opt, w)

    values, (inner, opt, w) = run(True, 2)
    # the inner optimizer's groups (and state) hold the model param, as checkpoint tools need;
    # it steps the fp32 master, and its state of that param is fp32
    assert [p for g in inner.param_groups for p in g["params"]] == [w]
    assert [m.dtype for m in opt.master_params] == [torch.float32]
    assert all(v.dtype == torch.float32 for v in inner.state[w].values()
               if torch.is_tensor(v) and v.is_floating_point() and v.dim())
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


# -- weights changed outside the optimizer ---------------------------------------------------------


@pytest.mark.parametrize("change", ["load_state_dict", "clamp"])
def test_bf16_weights_changed_outside_the_optimizer_are_never_reverted(change):
    """bf16 model, master weights (fp32 copies the inner SGD steps). After wrapping, the model's
    weights are changed in place behind the optimizer's back: model.load_state_dict(other) before
    the first window, or p.data.clamp_(-0.05, 0.05) after a first step. Exactly two outcomes are
    accepted for the next window + step():

    * the step starts from the changed weights (masters re-synced):
      p == bf16(w_changed - lr * sum g), g the bf16 micro-batch gradients (float64 sum);
      tolerance |p - expected| <= 2**-6 * max(|expected|, |w_changed|): the fp32 master of an
      unchanged element may sit up to half a bf16 ulp (2**-8 relative) from its bf16 copy, and
      both results round once to bf16 (another 2**-8 each);
    * a clear error (RuntimeError or ValueError mentioning the master weights) raised before
      anything is overwritten: the params still hold the changed weights.

    Silently stepping from the stale masters (the wrapper before commit 1a87787)
    reverts the change: the test checks that this outcome is far outside the tolerance for most
    elements."""
    lr, clamp = LR, 0.05
    model = mlp(torch.bfloat16, seed=random_seed())
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=2,
                                bucket_size_mb=SMALL_BUCKET)
    assert opt.master_weights

    def window():
        caps, handles = capture_grads(model)
        for batch in mlp_batches(2, dtype=torch.bfloat16):
            mse(model, *batch).backward()
        for h in handles:
            h.remove()
        return {name: sum(g.double() for g in gs) for name, gs in caps.items()}

    if change == "clamp":
        window()
        opt.step()
        opt.zero_grad()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    if change == "clamp":
        for p in model.parameters():
            p.data.clamp_(-clamp, clamp)
    else:
        model.load_state_dict(mlp(torch.bfloat16, seed=random_seed()).state_dict())
    changed = {name: p.detach().clone() for name, p in model.named_parameters()}
    try:
        sums = window()
        opt.step()
    except (RuntimeError, ValueError) as e:
        assert "master" in str(e).lower(), f"unclear error: {e}"
        for name, p in model.named_parameters():
            assert torch.equal(p, changed[name]), f"{name} was overwritten before the error"
        return
    far = total = 0
    for name, p in model.named_parameters():
        w = changed[name].double()
        expected = w - lr * sums[name]
        tol = 2.0 ** -6 * torch.maximum(expected.abs(), w.abs())
        err = (p.double() - expected).abs()
        assert (err <= tol).all(), \
            f"{name}: not stepped from the changed weights (max excess {(err - tol).max():.3g})"
        reverted = before[name].double() - lr * sums[name]  # what stale masters would give
        far += int(((reverted - expected).abs() > 4 * tol).sum())
        total += p.numel()
    assert far > total // 2, "test too weak: stale masters would pass"


@pytest.mark.parametrize("name", ["NAdam", "Adafactor", "AdamW"])
def test_a_state_loaded_into_the_inner_optimizer_after_wrapping_stays_fp32(name):
    """``opt.optimizer.load_state_dict(sd)`` after wrapping a bf16 model: torch casts the loaded
    state to the inner's group params (the model's bf16 ones), which rounded the fp32 moments
    and left scalars and factored state (NAdam's ``mu_product``, Adafactor's row/column
    variances) in bf16, so the fp32 master step refused them or stepped rounded moments. The
    judge: the same optimizer over hand-kept fp32 masters (started from the model's weights)
    that loads the same state dict; the wrapper's masters and state equal it bit for bit."""
    kw = {"foreach": True} if name != "Adafactor" else {}
    torch.manual_seed(int(torch.randint(0, 10_000, ())))
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).bfloat16()
    data = [(torch.randn(4, 6).bfloat16(), torch.randn(4, 3).bfloat16()) for _ in range(3)]

    def native_on(params):
        return getattr(torch.optim, name)(params, lr=0.01, **kw)

    # a first native run over fp32 masters gives the state dict to load (fp32 moments)
    donor = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    donor_opt = native_on(donor)
    for p in donor:
        p.grad = torch.randn_like(p)
    donor_opt.step()
    sd = donor_opt.state_dict()

    masters = [nn.Parameter(p.detach().float().clone()) for p in model.parameters()]
    native = native_on(masters)
    native.load_state_dict(copy.deepcopy(sd))  # (torch's load keeps 'step' tensors shared)
    opt = AccumulatingOptimizer(native_on(model.parameters()))
    opt.optimizer.load_state_dict(copy.deepcopy(sd))
    ref = [p.detach().clone() for p in model.parameters()]
    for x, y in data:
        loss = torch.nn.functional.mse_loss(model(x).float(), y.float())
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():  # the native side: the same bf16 forward at the masters' point
            for q, m in zip(ref, masters):
                q.copy_(m)
        ref_model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).bfloat16()
        with torch.no_grad():
            for q, r in zip(ref_model.parameters(), ref):
                q.copy_(r)
        torch.nn.functional.mse_loss(ref_model(x).float(), y.float()).backward()
        for m, q in zip(masters, ref_model.parameters()):
            m.grad = q.grad.float()
        native.step()
        native.zero_grad()
    for m, q in zip(masters, opt.master_params):
        assert torch.equal(m, q)
    for p in opt.optimizer.state.values():
        for k, v in p.items():
            if torch.is_tensor(v) and v.is_floating_point() and k != "step":
                assert v.dtype == torch.float32, k
