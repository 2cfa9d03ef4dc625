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


# -- a closure optimizer (LBFGS) gets every option with its usual meaning -----------------------

def _lbfgs(ps):
    return torch.optim.LBFGS(ps, lr=0.5, max_iter=4, max_eval=6, history_size=5)


def _closure_native(model, params, data, clip=None):
    """The native closure over hand-kept fp32 masters ``params`` of the bf16 ``model``: the model
    is put at their point, one backward per micro-batch, the masters' ``.grad`` the fp32 sum."""
    model_params = list(model.parameters())

    def closure():
        with torch.no_grad():
            for p, m in zip(model_params, params):
                if p is not m:
                    p.copy_(m)
        for m in params:
            m.grad = None
        total = 0.0
        for x, y in data:  # each micro-batch's gradient summed in fp32
            model.zero_grad()
            loss = mse(model, x, y)
            loss.backward()
            total += float(loss.detach())
            for p, m in zip(model_params, params):
                m.grad = p.grad.float() if m.grad is None else m.grad + p.grad.float()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(params, clip)
        return total
    return closure


def _closure_wrapped(model, data, clip=None):
    def closure():
        total = 0.0
        for x, y in data:
            loss = mse(model, x, y)
            loss.backward()
            total += float(loss.detach())
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        return total
    return closure


def _lbfgs_bf16():
    """A bf16 model under a wrapped LBFGS, its twin with hand-kept fp32 masters under a native
    LBFGS, and two bf16 micro-batches: (model, ref, data, masters, native, opt)."""
    model = make_model(torch.bfloat16)
    ref = copy.deepcopy(model)
    data = [(x.bfloat16(), y.bfloat16()) for x, y in batches(2, 6)]
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ref.parameters()]
    return model, ref, data, masters, _lbfgs(masters), AccumulatingOptimizer(
        _lbfgs(model.parameters()))


def test_lbfgs_bf16_masters_move_the_model():
    """LBFGS on a bf16 model with master weights (the default) steps the fp32 masters, each
    closure evaluation at their current point, as hand-kept fp32 masters stepped by LBFGS do
    (the model never moved: LBFGS keeps its own list of params)."""
    model, ref, data, masters, native, opt = _lbfgs_bf16()
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(3):
        theirs = native.step(_closure_native(ref, masters, data))
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
        mine = opt.step(_closure_wrapped(model, data))
        assert mine == theirs
    for m, q in zip(masters, opt.master_params):
        torch.testing.assert_close(q, m, rtol=0, atol=1e-6)
    _assert_same(model, ref, atol=0)
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


@pytest.mark.parametrize("write", ["mul_", "copy_", "data"])
def test_lbfgs_bf16_weights_written_between_steps_are_taken_in(write):
    """A bf16 model under LBFGS with master weights: weights the user writes between two steps
    are taken into the masters before the next step's closure runs (the closure evaluates, and
    LBFGS steps from, the written point), as hand-kept fp32 masters reset from the written
    bf16 weights do natively. A slip that takes them in only after the closure evaluates the
    loss at the old point: the losses differ at once."""
    model, ref, data, masters, native, opt = _lbfgs_bf16()
    scale = torch.rand(()).item() * 0.5 + 0.25  # a fresh write each run

    def write_into(m):
        with torch.no_grad():
            w = next(m.parameters())
            if write == "mul_":
                w.mul_(scale)
            elif write == "copy_":
                w.copy_(torch.randn_like(w) * scale)
            else:
                w.data = (w.data * scale).contiguous()

    for step in range(3):
        if step:  # the user writes the bf16 weights between two steps; the masters take them
            write_into(model)
            with torch.no_grad():  # only the written weight's master takes the bf16 value
                next(ref.parameters()).copy_(next(model.parameters()))
                masters[0].copy_(next(ref.parameters()).float())
        theirs = native.step(_closure_native(ref, masters, data))
        with torch.no_grad():
            for p, m in zip(ref.parameters(), masters):
                p.copy_(m)
        mine = opt.step(_closure_wrapped(model, data))
        assert mine == theirs, f"step {step}: the closure ran at another point"
    for m, q in zip(masters, opt.master_params):
        torch.testing.assert_close(q, m, rtol=0, atol=1e-6)
    _assert_same(model, ref, atol=0)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_lbfgs_max_grad_norm_clips_each_evaluation(reduction):
    """``max_grad_norm`` with a closure optimizer clips each evaluation's (normalised) gradient,
    as a closure that calls ``clip_grad_norm_`` does natively; ``last_grad_norm`` reports it."""
    model = make_model()
    ref = copy.deepcopy(model)
    data = batches(2, 6)
    native = _lbfgs(ref.parameters())
    opt = AccumulatingOptimizer(_lbfgs(model.parameters()), max_grad_norm=0.05,
                                reduction=reduction)
    scale = 0.5 if reduction == "mean" else 1.0
    ref_data = [(x, y) for x, y in data]
    for _ in range(2):
        def closure(ref=ref):
            native.zero_grad()
            total = 0.0
            for x, y in ref_data:
                loss = mse(ref, x, y) * scale
                loss.backward()
                total += float(loss.detach()) / scale
            norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
            closure.norm = norm
            return total
        native.step(closure)
        opt.step(_closure_wrapped(model, data))
        assert opt.last_grad_norm is not None
        torch.testing.assert_close(opt.last_grad_norm, closure.norm, rtol=1e-6, atol=0)
    _assert_same(model, ref, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["skip_step", "raise", "skip_microbatch"])
def test_lbfgs_nonfinite_gradient_changes_nothing(policy, dtype):
    """A closure whose gradient is NaN (at the first or a later evaluation) writes nothing: the
    weights, masters and LBFGS's state stay as before the step; ``skip_step`` counts it,
    ``raise`` raises FloatingPointError naming the param."""
    model = make_model(dtype)
    opt = AccumulatingOptimizer(_lbfgs(model.parameters()), nonfinite=policy)
    data = [(x.to(dtype), y.to(dtype)) for x, y in batches(2, 6)]
    opt.step(_closure_wrapped(model, data))  # a good step: LBFGS has a history
    for bad_at in (1, 3):
        calls = [0]
        good = _closure_wrapped(model, data)

        def closure(good=good, calls=calls, bad_at=bad_at):
            calls[0] += 1
            if calls[0] != bad_at:
                return good()
            loss = mse(model, *data[0]) * float("nan")  # one micro-batch, NaN gradients
            loss.backward()
            return float(loss.detach())
        before = [p.detach().clone() for p in model.parameters()]
        masters = [m.detach().clone() for m in opt.master_params]
        state = copy.deepcopy(opt.optimizer.state_dict())
        if policy == "raise":
            with pytest.raises(FloatingPointError, match="parameter 0|weight"):
                opt.step(closure)
        else:
            opt.step(closure)
        assert calls[0] >= bad_at
        for p, b in zip(model.parameters(), before):
            assert torch.equal(p, b)
        for m, b in zip(opt.master_params, masters):
            assert torch.equal(m, b)
        after = opt.optimizer.state_dict()["state"][0]
        for k, v in state["state"][0].items():
            if torch.is_tensor(v):
                assert torch.equal(after[k], v), k
            elif isinstance(v, list):
                assert len(after[k]) == len(v), k
            else:
                assert after[k] == v, k
        if policy != "raise":
            opt.zero_grad()
    if policy == "skip_step":
        assert opt.skipped_steps == 2
    if policy == "skip_microbatch":
        assert opt.skipped_steps == 2 and opt.skipped_microbatches == 2


# -- add_param_group -----------------------------------------------------------------------------

def _two_groups(model, build=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)):
    """An optimizer over the first layers; the last layer is added later."""
    return build([p for layer in list(model)[:-1] for p in layer.parameters()])


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_add_param_group_mid_window_keeps_gradients(in_backward):
    """``add_param_group`` between two backwards of a window keeps what the first one gave
    (the window's params and the new ones' own ``.grad``), as natively."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = _two_groups(ref)
    opt = AccumulatingOptimizer(_two_groups(model), accumulation_steps=2,
                                accumulate_in_backward=in_backward)
    data = batches(4, 5)
    for k, (x, y) in enumerate(data):
        mse(ref, x, y).backward()
        mse(model, x, y).backward()
        if k == 0:
            native.add_param_group({"params": list(ref[-1].parameters()), "lr": 0.05})
            opt.add_param_group({"params": list(model[-1].parameters()), "lr": 0.05})
        if k % 2:
            native.step()
            native.zero_grad()
        opt.step()
        opt.zero_grad()
    _assert_same(model, ref)


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_add_param_group_after_assigned_grad(in_backward):
    """A ``.grad`` assigned without a backward is the param's gradient: ``add_param_group``
    keeps it and the next ``step()`` steps with it, as natively."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = _two_groups(ref)
    opt = AccumulatingOptimizer(_two_groups(model), accumulate_in_backward=in_backward)
    for p, q in zip(model.parameters(), ref.parameters()):
        q.grad = torch.randn_like(q)
        p.grad = q.grad.clone()
    native.add_param_group({"params": list(ref[-1].parameters())})
    opt.add_param_group({"params": list(model[-1].parameters())})
    native.step()
    opt.step()
    _assert_same(model, ref)
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(),
                                                      make_model().parameters()))


def test_add_param_group_after_step_and_zero_grad_keep():
    """``step(); zero_grad(set_to_none=False); add_param_group(...)`` is a boundary (the window
    is zeros): accepted, and the zero gradients still step the params, as natively."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = _two_groups(ref, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    opt = AccumulatingOptimizer(_two_groups(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2)))
    for k, (x, y) in enumerate(batches(3, 5)):
        for m, o in ((ref, native), (model, opt)):
            mse(m, x, y).backward()
            o.step()
            o.zero_grad(set_to_none=False)
            if k == 0:
                o.add_param_group({"params": list(m[-1].parameters())})
    _assert_same(model, ref)


def test_add_param_group_keeps_last_grad_norm():
    """``last_grad_norm`` (the last real step's norm) survives ``add_param_group``."""
    model = make_model()
    opt = AccumulatingOptimizer(_two_groups(model), max_grad_norm=1.0)
    (x, y), = batches(1, 5)
    mse(model, x, y).backward()
    opt.step()
    norm = opt.last_grad_norm
    assert norm is not None
    opt.zero_grad()
    opt.add_param_group({"params": list(model[-1].parameters())})
    assert opt.last_grad_norm is not None and torch.equal(opt.last_grad_norm, norm)


# -- accumulate_in_backward=False: reset_window() and outside clears -----------------------------

def test_reset_window_drops_unmoved_backwards():
    """``reset_window()`` discards the backwards not yet moved and their count: with N=2 and
    ``mean`` the next two backwards make the window, as a native loop that restarts there."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                accumulation_steps=2, reduction="mean",
                                accumulate_in_backward=False)
    data = batches(3, 5)
    mse(model, *data[0]).backward()
    opt.reset_window()
    assert opt.micro_steps == 0
    for x, y in data[1:]:
        mse(model, x, y).backward()
        opt.step()
        (mse(ref, x, y) / 2).backward()
    native.step()
    _assert_same(model, ref)


def _clear(clear: str, opt, model) -> None:
    """The loop's clear: ``opt.zero_grad()``, ``model.zero_grad()`` or ``p.grad = None``."""
    if clear == "opt":
        opt.zero_grad()
    elif clear == "model":
        model.zero_grad()
    else:
        for p in model.parameters():
            p.grad = None


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("clear", ["opt", "model", "param"])
def test_outside_clear_mid_window_means_zero_grad(clear, reduction):
    """With ``accumulate_in_backward=False`` and N given, ``model.zero_grad()`` (or
    ``p.grad = None``) between the backwards of a window still filling means ``opt.zero_grad()``
    (README): the window keeps the earlier backwards, as the native loop without a clear."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                accumulation_steps=3, reduction=reduction,
                                accumulate_in_backward=False)
    scale = 1 / 3 if reduction == "mean" else 1.0
    for window in range(2):
        for x, y in batches(3, 5):
            mse(model, x, y).backward()
            if opt.sync_step:  # (a step() mid-window would move .grad into the window)
                opt.step()
            _clear(clear, opt, model)
            (mse(ref, x, y) * scale).backward()
        native.step()
        native.zero_grad()
    _assert_same(model, ref)


@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("clear", ["opt", "model", "param"])
def test_clear_between_backwards_restarts_the_window_without_n(clear, reduction, in_backward):
    """N None: a clear between two backwards (``opt.zero_grad()``, ``model.zero_grad()``,
    ``p.grad = None``) starts a new window, as natively (``.grad`` holds only what came after
    it); ``mean`` divides by the micro-batches after the clear (here 1, then 2), not by every
    backward since the last step. Judge: the native loop, the mean taken by hand."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                reduction=reduction, accumulate_in_backward=in_backward)

    for after_clear in (1, 2):  # one backward thrown away, then 1 (2) backwards kept
        data = batches(1 + after_clear, 5)
        scale = 1 / after_clear if reduction == "mean" else 1.0
        for i, (x, y) in enumerate(data):
            mse(model, x, y).backward()
            (mse(ref, x, y) * scale).backward()
            if i == 0:
                _clear(clear, opt, model)
                _clear(clear, native, ref)
        opt.step()
        native.step()
        _assert_same(model, ref, atol=0, what=f"{after_clear} after the clear: ")
        opt.zero_grad()
        native.zero_grad()


@pytest.mark.parametrize("clear", ["model", "param"])
def test_outside_clear_after_a_mixed_weight_pass_keeps_it(clear):
    """``accumulate_in_backward=False``, N given: a weight pass whose block runs a backward for
    some params and assigns the others' gradients, then ``model.zero_grad()`` (or
    ``p.grad = None``) before the window is full: the clear means ``opt.zero_grad()``, so the
    whole block's gradients stay in the window, the assigned ones too (the backward inside the
    block had counted the micro-batch, and only its own gradients were noted). Judge: the
    native loop without the clear."""
    model = make_model()
    ref = copy.deepcopy(model)
    native = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                accumulation_steps=3, accumulate_in_backward=False)
    params, rparams = list(model.parameters()), list(ref.parameters())
    half = len(params) // 2
    for x, y in batches(3, 5):
        loss = mse(model, x, y)
        with opt.weight_pass():
            loss.backward(inputs=params[:half], retain_graph=True)
            for p, g in zip(params[half:], torch.autograd.grad(loss, params[half:])):
                p.grad = g if p.grad is None else p.grad + g
        if clear == "model":
            model.zero_grad()
        else:
            for p in params:
                p.grad = None
        mse(ref, x, y).backward()
    opt.step()
    native.step()
    _assert_same(model, ref, atol=0)
    assert opt.micro_steps == 0 and all(p.grad is not None for p in params)


# -- a loop that never clears .grad ---------------------------------------------------------------

@pytest.mark.parametrize("n", [None, 2])
@pytest.mark.parametrize("inner", ["sgd", "adamw-fused"])
def test_never_cleared_window_adds_to_the_last(inner, n):
    """``backward; step; backward; step`` without any clear: natively the second step uses
    g0 + g1 (``.grad`` was never cleared), and ``p.grad`` after the second backward shows it;
    the wrapper's window adds to the last one the same way. With ``mean``, clipping and a
    fused inner optimizer (its ``grad_scale``), as a native loop that divides the loss and
    calls ``clip_grad_norm_``."""
    build = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
             "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True)}[inner]
    model = make_model()
    ref = copy.deepcopy(model)
    native = build(ref.parameters())
    kwargs = {"reduction": "mean", "max_grad_norm": 0.5} if n else {}
    opt = AccumulatingOptimizer(build(model.parameters()), accumulation_steps=n, **kwargs)
    k = n or 1
    for window in range(3):
        for x, y in batches(k, 5):
            mse(model, x, y).backward()
            (mse(ref, x, y) / k).backward()
            if opt.sync_step:
                for p, q in zip(model.parameters(), ref.parameters()):
                    if n:  # (the wrapper normalises a complete window at its N-th backward)
                        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)
                opt.step()
        if n:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        native.step()
        _assert_same(model, ref, what=f"window {window}: ")
    if not n:
        (x, y), = batches(1, 5)
        mse(model, x, y).backward()
        mse(ref, x, y).backward()
        for p, q in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-6)


def test_never_cleared_bf16_fused_masters():
    """The same without clears on a bf16 model whose fused master step divides by its
    ``grad_scale`` (the mean's 1/N and the clip) without writing the window back: the next
    backward adds to the gradient the step used, as hand-kept fp32 masters' ``.grad`` that is
    never cleared (``p.grad``, fp32, after the next window's first backward)."""
    model = make_model(torch.bfloat16)
    ref = copy.deepcopy(model)
    params = list(ref.parameters())
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    native = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True),
                                accumulation_steps=2, reduction="mean", max_grad_norm=0.5)
    acc = [torch.zeros_like(m) for m in masters]
    data = [[(x.bfloat16(), y.bfloat16()) for x, y in batches(2, 5)] for _ in range(2)]
    for x, y in data[0]:
        mse(model, x, y).backward()
        opt.step()
        ref.zero_grad()
        mse(ref, x, y).backward()
        for a, p in zip(acc, params):
            a.add_(p.grad.float() / 2)
    for m, a in zip(masters, acc):
        m.grad = a
    torch.nn.utils.clip_grad_norm_(masters, 0.5)  # (in place: acc is the masters' .grad)
    native.step()
    with torch.no_grad():
        for p, m in zip(params, masters):
            p.copy_(m)
    for m, q in zip(masters, opt.master_params):  # (the fused clip divides by its grad_scale
        # where clip_grad_norm_ multiplies: an ulp of the gradient, ~1e-6 here)
        torch.testing.assert_close(q, m, rtol=0, atol=1e-5)
    with torch.no_grad():  # the same weights on both sides (a bf16 rounding apart at most)
        for p, q in zip(params, model.parameters()):
            p.copy_(q)
    x, y = data[1][0]
    mse(model, x, y).backward()
    ref.zero_grad()
    mse(ref, x, y).backward()
    for a, p, q in zip(acc, params, model.parameters()):
        torch.testing.assert_close(q.grad, a + p.grad.float() / 2, rtol=1e-5, atol=1e-7)
