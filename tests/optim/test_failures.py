"""A failure changes nothing, nothing piles up (DESIGN: "Robust to the user's own hands"): an
exception in the middle of a backward leaves a consistent window and ``reset_window()`` recovers
from it; a failing call (``step()``/``flush()`` of a weighted window without its weights, a bad
``add_weight``, a backward past a complete window) is refused with nothing changed and training
goes on like native; discarded wrappers leave no hooks behind; 3000 micro-steps grow neither
live tensors nor hooks. Overflow that must not reach the weights: test_nonfinite.py; refused
loads: test_checkpoint.py; refused constructions: test_config.py.

Every test pits the wrapper against an independent reference: a stock torch optimizer on a plain
copy of the model (native accumulation in ``.grad``), or a byte-level checksum of everything a
caller can observe, taken before a call that must fail and change nothing.
"""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    all_close,
    assert_params_close,
    batches,
    checksum,
    count_hooks,
    make_model,
    mse,
    params_of,
    wrap_sgd,
)
from torch import nn

# -- an exception in the middle of a backward ---------------------------------------------------

class _Boom(RuntimeError):
    pass


class _BombFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if ctx.owner.armed:
            raise _Boom("a module failed in the middle of the backward")
        return g, None


class Bomb(nn.Module):
    """Identity whose backward raises while armed: the layers above it have their gradients by
    then (some buckets complete, some not), the layers below never get theirs."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        return _BombFn.apply(x, self)


def bomb_model():
    return nn.Sequential(nn.Linear(12, 24), nn.Tanh(), Bomb(), nn.Linear(24, 16), nn.Tanh(),
                         nn.Linear(16, 5))


def _failing_backward(model, x, y):
    model[2].armed = True
    try:
        with pytest.raises(_Boom):
            mse(model, x, y).backward()
    finally:
        model[2].armed = False


@pytest.mark.parametrize("bucket_mb", [SMALL_BUCKET, 25], ids=["buckets", "one-bucket"])
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_exception_mid_backward_leaves_a_consistent_window(in_backward, bucket_mb):
    """Micro-batch 2 of a window raises in its backward; the user catches it and goes on. The
    window must hold the failed micro-batch fully out (= native without it) or exactly its
    partial gradients (= native, which keeps them in .grad); the next window is normal."""
    lr, fail = 0.1, 1
    template = bomb_model()
    window1, window2 = batches(3, 4), batches(2, 4)

    def run(model, opt, mode):
        for i, (x, y) in enumerate(window1):
            if i == fail:
                if mode != "without":
                    _failing_backward(model, x, y)
                continue
            mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        after1 = params_of(model)
        for x, y in window2:
            mse(model, x, y).backward()
        opt.step()
        opt.zero_grad()
        return after1

    refs = {}
    for mode in ("without", "partial"):
        ref = copy.deepcopy(template)
        refs[mode] = (run(ref, torch.optim.SGD(ref.parameters(), lr=lr), mode), ref)
    assert not all_close(refs["without"][0], refs["partial"][0])  # partial grads do exist

    model = copy.deepcopy(template)
    opt = wrap_sgd(model, lr=lr, accumulate_in_backward=in_backward, bucket_size_mb=bucket_mb)
    after1 = run(model, opt, "wrapper")
    matching = [mode for mode, (ref1, _) in refs.items() if all_close(after1, ref1)]
    assert matching, ("after a backward that raised, the window is neither without the failed "
                      "micro-batch nor with exactly its partial gradients")
    assert_params_close(model, refs[matching[0]][1], what="the window after the failure: ")


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_reset_window_after_a_failed_backward_resumes_training(in_backward):
    N, lr = 2, 0.1
    template = bomb_model()
    model, native = copy.deepcopy(template), copy.deepcopy(template)
    opt = wrap_sgd(model, lr=lr, accumulation_steps=N, accumulate_in_backward=in_backward)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    mse(model, *batches(1, 4)[0]).backward()
    opt.step()
    _failing_backward(model, *batches(1, 4)[0])
    opt.reset_window()
    assert opt.micro_steps == 0
    for w in range(3):
        data = batches(N, 4)
        before = params_of(model)
        for x, y in data:  # Accelerate style: step() after every micro-batch
            mse(model, x, y).backward()
            opt.step()
        opt.zero_grad()  # (as the native loop clears)
        for x, y in data:
            mse(native, x, y).backward()
        native_opt.step()
        native_opt.zero_grad()
        assert not all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), \
            f"window {w} after reset_window() did not step"
        assert_params_close(model, native, what=f"window {w}: ")


# -- nothing piles up ------------------------------------------------------------------------

def test_discarded_wrappers_leave_no_hooks_behind():
    """100 wrap-and-discard cycles on one model (``del opt; gc.collect()``, half of them discarded
    mid-window): the hooks do not pile up, the wrappers are freed, and a fresh wrapper trains
    like native."""
    N, lr = 2, 0.1
    gc.collect()
    gc.freeze()  # keeps the 100 full collections cheap: only objects made here are scanned
    try:
        template = make_model()
        model, native = copy.deepcopy(template), copy.deepcopy(template)
        opt = wrap_sgd(model, lr=lr, accumulation_steps=N)
        per_wrapper = count_hooks(model)
        del opt
        gc.collect()
        refs = []
        for i in range(100):
            opt = wrap_sgd(model, lr=lr, accumulation_steps=N)
            refs.append(weakref.ref(opt))
            hooks = count_hooks(model)
            assert hooks <= 2 * per_wrapper, f"cycle {i}: {hooks} hooks ({per_wrapper} per wrapper)"
            if i % 2:
                mse(model, *batches(1, 4)[0]).backward()
            del opt
            gc.collect()
        alive = sum(r() is not None for r in refs)
        assert alive == 0, f"{alive} discarded wrappers are still alive"
        model.zero_grad()
        opt = wrap_sgd(model, lr=lr, accumulation_steps=N)
        native_opt = torch.optim.SGD(native.parameters(), lr=lr)
        for w in range(2):
            data = batches(N, 4)
            for x, y in data:
                mse(model, x, y).backward()
                opt.step()
                mse(native, x, y).backward()
            opt.zero_grad()  # (as the native loop clears)
            native_opt.step()
            native_opt.zero_grad()
            assert_params_close(model, native, what=f"window {w}: ")
        assert count_hooks(model) == per_wrapper
    finally:
        gc.unfreeze()


# -- a failing call changes nothing -------------------------------------------------------------

def _weighted(n_backwards, steps, weights_before=()):
    model = make_model()
    native = copy.deepcopy(model)
    opt = wrap_sgd(model, accumulation_steps=steps, reduction="weighted")
    data = batches(n_backwards, 4)
    for i, (x, y) in enumerate(data):
        if i < len(weights_before):
            opt.add_weight(weights_before[i])
        mse(model, x, y).backward()
    return model, native, opt, data


def _native_weighted(native, data, weights, lr=0.1):
    total = sum(weights)
    for x, y in data:
        (mse(native, x, y) / total).backward()
    torch.optim.SGD(native.parameters(), lr=lr).step()


def _no_weights(call, steps, n=2):
    """step()/flush() of a 'weighted' window whose weights were not reported: ValueError; then
    the weights come and the step equals native sum(g) / sum(w)."""
    def scenario():
        model, native, opt, data = _weighted(n, steps)
        weights = [float(w) for w in torch.randint(1, 9, (n,))]

        def fail():
            getattr(opt, call)()

        def recover():
            for w in weights:
                opt.add_weight(w)
            getattr(opt, call)()
            _native_weighted(native, data, weights)
            assert_params_close(model, native)
        return model, opt, fail, (ValueError,), recover
    return scenario


def _bad_weight(weight, errors, reduction="weighted"):
    """add_weight() with a bad value: refused; then the window completes like native."""
    def scenario():
        model, native, opt, data = _weighted(1, 2, weights_before=[3.0])
        if reduction != "weighted":
            model = make_model()
            native = copy.deepcopy(model)
            opt = wrap_sgd(model, accumulation_steps=2, reduction=reduction)
            mse(model, *data[0]).backward()

        def fail():
            opt.add_weight(weight() if callable(weight) else weight)

        def recover():
            x, y = batches(1, 4)[0]
            if reduction == "weighted":
                opt.add_weight(5.0)
            mse(model, x, y).backward()
            opt.step()
            if reduction == "weighted":
                _native_weighted(native, data + [(x, y)], [3.0, 5.0])
            else:
                for xi, yi in data + [(x, y)]:
                    mse(native, xi, yi).backward()
                torch.optim.SGD(native.parameters(), lr=0.1).step()
            assert_params_close(model, native)
        return model, opt, fail, errors, recover
    return scenario


FAILING_CALLS = {
    "step-weighted-no-weights-at-N": _no_weights("step", steps=2),
    "step-weighted-no-weights-steps-None": _no_weights("step", steps=None),
    "flush-weighted-no-weights": _no_weights("flush", steps=3),
    "add_weight-negative": _bad_weight(-1.0, (ValueError,)),
    "add_weight-negative-tensor": _bad_weight(lambda: torch.tensor(-0.5), (ValueError,)),
    "add_weight-nan": _bad_weight(math.nan, (ValueError,)),
    "add_weight-inf": _bad_weight(math.inf, (ValueError,)),
    "add_weight-str": _bad_weight("4", (TypeError,)),
    "add_weight-bool": _bad_weight(True, (TypeError,)),
    "add_weight-2-element-tensor": _bad_weight(lambda: torch.tensor([1.0, 2.0]),
                                               (TypeError, ValueError, RuntimeError)),
    "add_weight-reduction-sum": _bad_weight(2.0, (ValueError,), reduction="sum"),
}


@pytest.mark.parametrize("case", list(FAILING_CALLS))
def test_failing_call_changes_nothing(case):
    model, opt, fail, errors, recover = FAILING_CALLS[case]()
    before = checksum(opt, model)
    with pytest.raises(errors):
        fail()
    assert checksum(opt, model) == before, "the failing call changed the wrapper's state"
    recover()


def test_backward_after_a_complete_window_is_refused_cleanly_or_joins_it():
    """A backward after the window of N micro-batches is complete, before step(): either it is
    refused (RuntimeError) and changes nothing, or it joins the window as native accumulation
    would. Then step() equals native over the micro-batches the window holds."""
    N, lr = 2, 0.1
    model = make_model()
    native = copy.deepcopy(model)
    opt = wrap_sgd(model, lr=lr, accumulation_steps=N)
    data = batches(N + 1, 4)
    for x, y in data[:N]:
        mse(model, x, y).backward()
    before = checksum(opt, model)
    try:
        mse(model, *data[N]).backward()
    except RuntimeError:
        assert checksum(opt, model) == before, "the refused backward changed the wrapper's state"
        window = data[:N]
    else:
        window = data
    opt.step()
    for x, y in window:
        mse(native, x, y).backward()
    torch.optim.SGD(native.parameters(), lr=lr).step()
    assert_params_close(model, native)


# -- soak ------------------------------------------------------------------------------------

def test_soak_3000_micro_steps_nothing_piles_up():
    """3000 micro-steps (Linear(8, 8), N=4, sum; Accelerate-style step()+zero_grad() every
    micro-step, a NaN micro-batch now and then, state_dict() now and then): live tensors and
    hooks do not grow between micro-step 500 and 3000, and the params track native."""
    N, lr, steps = 4, 0.05, 3000
    model = nn.Linear(8, 8)
    native = copy.deepcopy(model)
    opt = wrap_sgd(model, lr=lr, accumulation_steps=N)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)

    def live_tensors():
        gc.collect()
        return sum(1 for o in gc.get_objects() if torch.is_tensor(o))

    poisoned_window = False
    skipped = 0
    for i in range(steps):
        x = torch.randn(4, 8)
        bad = i % 97 == 13
        loss = (model(x) - x.flip(1)).square().mean()
        (loss * math.nan if bad else loss).backward()
        opt.step()
        opt.zero_grad()
        if not bad:
            (native(x) - x.flip(1)).square().mean().backward()
        poisoned_window |= bad
        if i % N == N - 1:
            if poisoned_window:
                skipped += 1
            else:
                native_opt.step()
            native_opt.zero_grad()
            poisoned_window = False
        if i % 100 == 50:
            opt.state_dict()
        if i == 499:
            tensors_500, hooks_500 = live_tensors(), count_hooks(model)
    tensors_end = live_tensors()
    assert tensors_end <= tensors_500 + 4, f"live tensors grew: {tensors_500} -> {tensors_end}"
    assert count_hooks(model) == hooks_500
    assert opt.skipped_steps == skipped > 0
    assert_params_close(model, native, atol=1e-5)
