"""The step steps what is in the window (DESIGN: "The step steps what is in the window").

Finiteness, the clip norm and the normalisation are decided from the window as it is at
``step()``, after every write the contract allows, never from a picture of it (a kernel flag,
per-param norm slots, a version counter). Native PyTorch is the judge: the same loop, the same
writes to ``p.grad`` (through ``.data``, numpy, the storage, in place, assigned), then
``clip_grad_norm_`` and the inner optimizer.

Tolerance: the wrapper measures the norm with ``get_total_norm`` on the window's views, as
``clip_grad_norm_`` does on the native ``.grad``, and multiplies by the same clip coefficient: with
a non-fused inner optimizer on an fp32 model the runs are bit-identical. Only where fp32 overflows
(test_norm_of_huge_gradients_is_taken_after_normalisation) is the norm taken in float64 (native's
fp32 norm of the divided gradients is then within 1e-6 of it), and a fused inner optimizer divides
by 1/coef where native multiplies by coef (a few ulps): rtol 1e-5 there. The bugs these tests catch
are 1e-3 (a stale norm) to 10x (a norm from before a write)."""

from __future__ import annotations

import copy

import pytest
import torch

from accumkernels import AccumulatingOptimizer

LR = 0.1


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()).item())


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4),
                               torch.nn.Linear(4, 3))


def batches(seed: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


def backward(model, x, scale: float = 1.0, use_last: bool = True) -> None:
    h = model[2](model[1](model[0](x)))
    (model[3](h) if use_last else h).pow(2).sum().mul(scale).backward()


def assert_params(a: torch.nn.Module, b: torch.nn.Module, rtol: float = 0.0) -> None:
    """Bit-identical (rtol 0), or within ``rtol``."""
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if rtol == 0.0:
            assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"
        else:
            torch.testing.assert_close(p, q, rtol=rtol, atol=0, msg=lambda m: f"{name}: {m}")


def alias(t: torch.Tensor) -> torch.Tensor:
    """A new tensor over ``t``'s storage (``Tensor.set_``): writes through it reach ``t`` without
    bumping ``t``'s version counter, like a numpy view or a ``.data`` write."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                              t.stride())


# -- 1. non-finite values written into the visible window ------------------------------------------

def _grad(model):
    return model[0].weight.grad


NONFINITE_WRITES = {
    "item": lambda model, bad: _grad(model).__setitem__((0, 0), float("inf") if bad else 0.5),
    "mul_overflow": lambda model, bad: _grad(model).mul_(1e39 if bad else 2.0),
    "main_grad_nan": lambda model, bad: model[2].weight.main_grad.__setitem__(
        (1, 2), float("nan") if bad else 0.25),
    "data": lambda model, bad: _grad(model).data.__setitem__((0, 1), float("nan") if bad else 1.0),
    "numpy": lambda model, bad: _grad(model).numpy().__setitem__((2, 3),
                                                                 float("inf") if bad else 3.0),
    "storage": lambda model, bad: alias(_grad(model)).fill_(float("nan") if bad else 0.5),
}


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize("policy", ["skip_step", "raise"])
@pytest.mark.parametrize("write", sorted(NONFINITE_WRITES))
def test_nonfinite_written_into_the_window_ends_in_the_policy(write, policy, clip):
    """A non-finite value written after the last backward is seen by the step; the same finite
    write steps exactly as native does with that write."""
    seed = fresh_seed()
    xs = batches(seed, 2)
    for bad in (False, True):
        model, native_model = make_model(seed), make_model(seed)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                    nonfinite=policy, max_grad_norm=clip)
        native = torch.optim.SGD(native_model.parameters(), lr=LR)
        before = [p.detach().clone() for p in model.parameters()]
        for x in xs:
            backward(model, x)
            backward(native_model, x)
        NONFINITE_WRITES[write](model, bad)
        if not bad:
            if write == "main_grad_nan":
                native_model[2].weight.grad[1, 2] = 0.25
            else:
                NONFINITE_WRITES[write](native_model, bad)
        if not bad:
            opt.step()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(native_model.parameters(), clip)
            native.step()
            assert opt.skipped_steps == 0
            assert_params(model, native_model)
        elif policy == "raise":
            with pytest.raises(FloatingPointError, match=r"0\.weight|2\.weight|parameter"):
                opt.step()
        else:
            opt.step()
            assert opt.skipped_steps == 1
            for p, b in zip(model.parameters(), before):
                assert torch.equal(p, b), "a non-finite window was stepped"


def test_user_fixes_a_nonfinite_gradient_as_native():
    """A NaN backward the user repairs in place (``nan_to_num_``) before the step: native
    steps on the repaired gradients, and so does the wrapper (the window decides, not the
    kernels' flag)."""
    seed = fresh_seed()
    model, native_model = make_model(seed), make_model(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    native = torch.optim.SGD(native_model.parameters(), lr=LR)
    for m in (model, native_model):
        backward(m, batches(seed, 1)[0])
        backward(m, batches(seed, 1)[0], scale=float("nan"))
        for p in m.parameters():
            p.grad.nan_to_num_(0.5)
    opt.step()
    native.step()
    assert opt.skipped_steps == 0
    assert_params(model, native_model)


# -- 2. and 3. the clip norm after every write route -----------------------------------------------

def _resume(model, opt, state):
    """Save mid-window and resume into a fresh wrapper over the same model (as a restart)."""
    sd = opt.state_dict()
    with pytest.warns(UserWarning, match="takes over"):  # the old wrapper is still alive
        fresh = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                      max_grad_norm=opt.max_grad_norm, **state)
    fresh.load_state_dict(sd)
    return model, fresh


def _deepcopy(model, opt, state):
    """deepcopy of model and optimizer together mid-window; training goes on with the copies."""
    both = copy.deepcopy({"model": model, "opt": opt})
    opt.remove_hooks()
    return both["model"], both["opt"]


def _same(call):
    """A route that calls ``call(model, opt)`` and keeps both."""
    def route(model, opt, state):
        call(model, opt)
        return model, opt
    return route


# Each route: (what the wrapper run does, what the native run does) between micro-batches 2 and
# 3 of a 3-micro-batch window, or None for "the same call on the native model".
ROUTES = {
    "resume_mid_window": (_resume, lambda m: None),
    "deepcopy_mid_window": (_deepcopy, lambda m: None),
    "zero_grad_keep_zeros": (_same(lambda m, o: o.zero_grad(set_to_none=False)),
                             lambda m: m.zero_grad(set_to_none=False)),
    "model_zero_grad_keep_zeros": (_same(lambda m, o: m.zero_grad(set_to_none=False)),
                                   lambda m: m.zero_grad(set_to_none=False)),
    "assigned_grad": (_same(lambda m, o: setattr(m[2].bias, "grad", torch.ones(4) * 5)),
                      lambda m: setattr(m[2].bias, "grad", torch.ones(4) * 5)),
    "accumulate_call": (_same(lambda m, o: o.accumulate()), lambda m: None),
    "grad_data_mul": (_same(lambda m, o: m[3].weight.grad.data.mul_(0.1)),
                      lambda m: m[3].weight.grad.data.mul_(0.1)),
    "grad_data_clamp": (_same(lambda m, o: [p.grad.data.clamp_(-0.05, 0.05)
                                            for p in m.parameters()]),
                        lambda m: [p.grad.data.clamp_(-0.05, 0.05) for p in m.parameters()]),
    "main_grad_data": (_same(lambda m, o: m[3].weight.main_grad.data.mul_(7.0)),
                       lambda m: m[3].weight.grad.mul_(7.0)),
    "numpy_view": (_same(lambda m, o: m[3].bias.grad.numpy().__imul__(9.0)),
                   lambda m: m[3].bias.grad.mul_(9.0)),
    "storage_alias": (_same(lambda m, o: alias(m[3].weight.grad).mul_(0.01)),
                      lambda m: m[3].weight.grad.mul_(0.01)),
    "in_place_mul": (_same(lambda m, o: m[0].weight.grad.mul_(3.0)),
                     lambda m: m[0].weight.grad.mul_(3.0)),
}


@pytest.mark.parametrize("max_norm", [1.0, 0.01])
@pytest.mark.parametrize("route", sorted(ROUTES))
def test_clip_norm_sees_every_write(route, max_norm):
    """Two micro-batches, a write through ``route``, a third micro-batch that does not touch the
    last layer, the step: the clip norm and parameters equal native ``clip_grad_norm_`` + SGD on
    the same gradients (``accumulate_in_backward=False`` for the ``accumulate()`` route)."""
    seed = fresh_seed()
    xs = batches(seed, 9)
    state = {"accumulate_in_backward": False} if route == "accumulate_call" else {}
    model, native_model = make_model(seed), make_model(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR),
                                max_grad_norm=max_norm, **state)
    native = torch.optim.SGD(native_model.parameters(), lr=LR)
    ours, theirs = ROUTES[route]
    for window in range(3):
        for k in range(2):
            backward(model, xs[3 * window + k])
            backward(native_model, xs[3 * window + k])
        if window == 1:
            model, opt = ours(model, opt, state)
            theirs(native_model)
        backward(model, xs[3 * window + 2], use_last=False)
        backward(native_model, xs[3 * window + 2], use_last=False)
        opt.step()
        native_norm = torch.nn.utils.clip_grad_norm_(native_model.parameters(), max_norm)
        native.step()
        assert torch.equal(opt.last_grad_norm, native_norm), (opt.last_grad_norm, native_norm)
        opt.zero_grad()
        native.zero_grad()
        assert_params(model, native_model)


# -- 4. the norm of the normalised window never overflows where it does not ----------------------

def huge_scale(seed: int, xs, divisor: float) -> float:
    """The loss scale that puts the normalised window's norm at 1e19 (gradients are linear in
    it): its squares (1e38) fit fp32, those of the raw sum (4x or 16x larger norm) do not."""
    probe = make_model(seed)
    for x in xs:
        backward(probe, x)
    norm = torch.linalg.vector_norm(torch.stack([p.grad.double().norm()
                                                 for p in probe.parameters()])) / divisor
    return 1e19 / float(norm)


@pytest.mark.parametrize("reduction", ["mean", "weighted"])
def test_norm_of_huge_gradients_is_taken_after_normalisation(reduction):
    """Gradients near 1e19 summed over 4 micro-batches: the squares of the raw sum overflow
    fp32, the normalised window's norm does not. Native clips sum(g)/k (or /sum(w)) and steps;
    so must the wrapper (``accumulation_steps=None``: k is learned at the step)."""
    seed = fresh_seed()
    xs = batches(seed, 4)
    weights = [3.0, 5.0, 2.0, 6.0]
    model, native_model = make_model(seed), make_model(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR), max_grad_norm=1.0,
                                reduction=reduction)
    native = torch.optim.SGD(native_model.parameters(), lr=LR)
    divisor = len(xs) if reduction == "mean" else sum(weights)
    scale = huge_scale(seed, xs, divisor)
    for x, w in zip(xs, weights):
        backward(model, x, scale=scale)
        backward(native_model, x, scale=scale)
        if reduction == "weighted":
            opt.add_weight(w)
    for p in native_model.parameters():
        p.grad.div_(divisor)
    native_norm = torch.nn.utils.clip_grad_norm_(native_model.parameters(), 1.0)
    assert torch.isfinite(native_norm) and native_norm > 1e18
    native.step()
    opt.step()
    assert opt.skipped_steps == 0
    torch.testing.assert_close(opt.last_grad_norm.double(), native_norm.double(), rtol=2e-6,
                               atol=0)
    assert_params(model, native_model, rtol=1e-5)
    moved = any(not torch.equal(p, q) for p, q in zip(model.parameters(),
                                                      make_model(seed).parameters()))
    assert moved, "the params did not move"


def test_fused_fold_norm_of_huge_gradients():
    """The same with a fused inner optimizer (the normalisation folded into its grad_scale)."""
    seed = fresh_seed()
    xs = batches(seed, 4)
    model, native_model = make_model(seed), make_model(seed)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR, fused=True),
                                max_grad_norm=1.0, reduction="mean")
    native = torch.optim.SGD(native_model.parameters(), lr=LR, fused=True)
    scale = huge_scale(seed, xs, len(xs))
    for x in xs:
        backward(model, x, scale=scale)
        backward(native_model, x, scale=scale)
    for p in native_model.parameters():
        p.grad.div_(len(xs))
    native_norm = torch.nn.utils.clip_grad_norm_(native_model.parameters(), 1.0)
    native.step()
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm.double(), native_norm.double(), rtol=2e-6,
                               atol=0)
    assert_params(model, native_model, rtol=1e-5)
