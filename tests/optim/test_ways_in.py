"""Every way in means what it means natively (DESIGN: "Every way in means what it means natively"):
a closure optimizer (LBFGS) with the wrapper's options, the inner optimizer's own step hooks
writing the params, params frozen between forward and backward, ``add_param_group`` mid-window
and after an assigned ``.grad``, ``reset_window()`` and outside clears with
``accumulate_in_backward=False``, and a loop that never clears ``.grad``.

The judge is the same loop run natively (fp32: bit for bit or within 1e-6), or, for bf16 models
with master weights, hand-kept fp32 masters stepped by the same optimizer class (as
tests/conformance/_matrix_oracle.py does). Data are fresh random draws (conftest seeds each test).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _optim_common import D_IN, D_OUT, batches, make_model, mse

from accumkernels import AccumulatingOptimizer


def _assert_same(model, ref, atol=1e-6, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), f"{what}{name} is not finite"
        torch.testing.assert_close(p.detach().float(), q.detach().float(), rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


# -- params frozen between forward and backward --------------------------------------------------

def _gan(wrap: bool, gen, disc, data):
    """A GAN: D's loss on real and detached fake samples; G's loss through D, D frozen after
    the forward and unfrozen after the backward. N=2 micro-batches per step for both."""
    opt_g = torch.optim.AdamW(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.AdamW(disc.parameters(), lr=1e-2)
    if wrap:
        opt_g = AccumulatingOptimizer(opt_g, accumulation_steps=2)
        opt_d = AccumulatingOptimizer(opt_d, accumulation_steps=2)
    bce = F.binary_cross_entropy_with_logits
    for window in data:
        for k, (real, z) in enumerate(window):
            fake = gen(z)
            d_real, d_fake = disc(real), disc(fake.detach())
            (bce(d_real, torch.ones_like(d_real)) + bce(d_fake, torch.zeros_like(d_fake))
             ).backward()
            if wrap or k == 1:
                opt_d.step()  # wrapped, Accelerate-style: a no-op until D's 2nd micro-batch
                opt_d.zero_grad()
            out = disc(fake)
            for p in disc.parameters():
                p.requires_grad_(False)  # D frozen for G's update, after the forward
            bce(out, torch.ones_like(out)).backward()
            for p in disc.parameters():
                p.requires_grad_(True)
            if wrap:
                opt_g.step()
        if not wrap:
            opt_g.step()
        opt_g.zero_grad()
    return opt_g, opt_d


def test_param_frozen_after_forward_is_no_microbatch():
    """A backward that gives none of the wrapper's params a gradient (they were frozen between
    forward and backward) is no micro-batch: D steps on its own 2 micro-batches, as natively."""
    gen = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    disc = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    data = [[(torch.randn(6, 4), torch.randn(6, 3)) for _ in range(2)] for _ in range(4)]
    ref_g, ref_d = copy.deepcopy(gen), copy.deepcopy(disc)
    _gan(False, ref_g, ref_d, data)
    _, opt_d = _gan(True, gen, disc, data)
    _assert_same(disc, ref_d, what="D ")
    _assert_same(gen, ref_g, what="G ")
    assert opt_d.micro_steps == 0


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_frozen_backward_leaves_count_and_grad(in_backward):
    """The frozen params' ``.grad`` stays None and ``micro_steps`` stays 0 (native: autograd
    stores nothing for a param that no longer requires a gradient)."""
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                accumulation_steps=2, accumulate_in_backward=in_backward)
    (x, y), = batches(1, 4)
    loss = mse(model, x, y)
    for p in model.parameters():
        p.requires_grad_(False)
    x2 = torch.randn(4, D_IN, requires_grad=True)  # the backward still runs (through x2)
    (loss + model(x2).sum() * 0 + x2.sum()).backward()
    assert opt.micro_steps == 0
    assert all(p.grad is None for p in model.parameters())


# -- bf16 with master weights: hand-kept fp32 masters are the judge ------------------------------

def _masters_oracle(model, build, data, hooks=()):
    """Native master-weight training of the bf16 ``model``: fp32 masters stepped by ``build``'s
    optimizer (with ``hooks`` registered on it), the window summed in fp32, weights cast back."""
    params = list(model.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = build(masters)
    for pre, post in hooks:
        opt.register_step_pre_hook(pre)
        opt.register_step_post_hook(post)
    for window in data:
        acc = [torch.zeros_like(m) for m in masters]
        for x, y in window:
            model.zero_grad()
            mse(model, x.bfloat16(), y.bfloat16()).backward()
            for a, p in zip(acc, params):
                a.add_(p.grad.float())
        for m, a in zip(masters, acc):
            m.grad = a
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return masters


def _halve(opt, *_):
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                p.mul_(0.5)


def _clamp(opt, *_):
    with torch.no_grad():
        for group in opt.param_groups:
            for p in group["params"]:
                p.clamp_(-0.2, 0.2)


_HOOKED = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
}


@pytest.mark.parametrize("inner", list(_HOOKED))
def test_inner_step_hooks_that_write_params_stand(inner):
    """Step hooks registered on the inner optimizer before wrapping see the params it steps (the
    fp32 masters of a bf16 model) and their writes stand: a projection before the step and a
    clamp after it, as on hand-kept masters (they were undone by the fused master step)."""
    model = make_model(torch.bfloat16)
    ref = copy.deepcopy(model)
    data = [[(x.bfloat16(), y.bfloat16()) for x, y in batches(2, 4)] for _ in range(3)]
    masters = _masters_oracle(ref, _HOOKED[inner], data, hooks=[(_halve, _clamp)])
    base = _HOOKED[inner](model.parameters())
    base.register_step_pre_hook(_halve)
    base.register_step_post_hook(_clamp)
    opt = AccumulatingOptimizer(base, accumulation_steps=2)
    for window in data:
        for x, y in window:
            mse(model, x, y).backward()
            opt.step()
            opt.zero_grad()
    for m, q in zip(masters, opt.master_params):
        torch.testing.assert_close(q, m, rtol=0, atol=1e-6)
    _assert_same(model, ref, atol=0)
