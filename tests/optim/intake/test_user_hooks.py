"""Hooks a user registers on the model's params and modules before wrapping mean what they mean
natively: a post-accumulate-grad hook sees ``p.grad`` as autograd's native ``.grad`` (the running
sum of the window) and what it writes there is what the step uses; module backward hooks change
the gradients before they reach the window. Judged against the same loop with a stock optimizer
(fp32: bit-identical)."""

from __future__ import annotations

import pytest
import torch
from _optim_common import SMALL_BUCKET, batches, make_model, mse

from accumkernels import AccumulatingOptimizer

N, WINDOWS = 3, 2


def _post_accumulate(model, mode: str, seen: list, every: int = 1) -> None:
    def hook(p, name):
        seen.append((name, p.grad.detach().float().clone()))
        if mode == "halve":
            p.grad.mul_(0.5)

    for k, (name, p) in enumerate(model.named_parameters()):
        if k % every == 0:
            p.register_post_accumulate_grad_hook(lambda p, name=name: hook(p, name))


def _module_hooks(model, mode: str) -> None:
    layer = model[2]  # the middle Linear: its grad_input reaches the first layer
    if mode == "full":
        layer.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))
    elif mode == "pre":
        layer.register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,))
    else:  # the deprecated non-full hook: grad_input of the module's last op (the bias add)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer.register_backward_hook(
                lambda m, gi, go: tuple(None if g is None else g * 0.5 for g in gi))


def _train(wrap: bool, install, data, bad=None, **kwargs):
    """``bad``: the index of a NaN micro-batch (``nonfinite="skip_microbatch"`` drops it; the
    native loop does not run it)."""
    torch.manual_seed(0)
    model = make_model()
    install(model)
    inner = torch.optim.AdamW(model.parameters(), lr=0.01)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, model=model, **kwargs) \
        if wrap else inner
    for w in range(WINDOWS):
        for k, (x, y) in enumerate(data[w * N:(w + 1) * N], start=w * N):
            if k == bad and not wrap:
                continue
            loss = mse(model, x, y)
            (loss * float("nan") if k == bad else loss).backward()
            if wrap:
                opt.step()  # (a no-op until the window is full)
        if not wrap:
            opt.step()
        opt.zero_grad()
    if wrap:
        opt.remove_hooks()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["read", "halve"])
def test_post_accumulate_grad_hook_sees_and_writes_the_running_window(mode):
    """A user's register_post_accumulate_grad_hook: after every backward it reads p.grad (the
    native running sum) and, with 'halve', scales it in place; the step uses what it left."""
    data = batches(N * WINDOWS, 4)
    seen_native, seen_ours = [], []
    native = _train(False, lambda m: _post_accumulate(m, mode, seen_native), data)
    ours = _train(True, lambda m: _post_accumulate(m, mode, seen_ours), data)
    assert [n for n, _ in seen_ours] == [n for n, _ in seen_native]
    for (name, a), (_, b) in zip(seen_ours, seen_native):
        assert torch.equal(a, b), f"p.grad of {name} seen by the user's hook differs"
    for a, b in zip(ours, native):
        assert torch.equal(a, b)


@pytest.mark.parametrize("every", [1, 2, 3], ids=["all", "every-2nd", "every-3rd"])
def test_post_accumulate_grad_hooks_on_some_params_of_shared_buckets(every):
    """Hooks on some params only, buckets shared by several params (the others wait for their
    bucket's fused launch): each hooked param sees the running window, the step what they
    left."""
    data = batches(N * WINDOWS, 4)
    seen_native, seen_ours = [], []
    native = _train(False, lambda m: _post_accumulate(m, "halve", seen_native, every), data)
    ours = _train(True, lambda m: _post_accumulate(m, "halve", seen_ours, every), data,
                  bucket_size_mb=SMALL_BUCKET)
    assert len(seen_ours) == len(seen_native)
    for (name, a), (_, b) in zip(seen_ours, seen_native):
        assert torch.equal(a, b), f"p.grad of {name} seen by the user's hook differs"
    for a, b in zip(ours, native):
        assert torch.equal(a, b)


def test_post_accumulate_grad_hook_writes_of_a_dropped_microbatch_go_with_it():
    """``skip_microbatch``: a NaN micro-batch is dropped with what the user's hooks wrote into
    the window during it; the rest of the window survives, as if it had not run (the native
    loop skips it)."""
    data = batches(N * WINDOWS, 4)
    native = _train(False, lambda m: _post_accumulate(m, "halve", []), data, bad=N + 1)
    ours = _train(True, lambda m: _post_accumulate(m, "halve", []), data, bad=N + 1,
                  nonfinite="skip_microbatch", bucket_size_mb=SMALL_BUCKET)
    for a, b in zip(ours, native):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["full", "pre", "legacy"])
def test_module_backward_hooks_change_the_gradient_as_natively(mode):
    """register_full_backward_hook / register_full_backward_pre_hook / the deprecated
    register_backward_hook scaling a gradient on its way: the window holds the scaled one."""
    data = batches(N * WINDOWS, 4)
    native = _train(False, lambda m: _module_hooks(m, mode), data)
    ours = _train(True, lambda m: _module_hooks(m, mode), data)
    plain = _train(True, lambda m: None, data)
    for a, b in zip(ours, native):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(ours, plain)), "the hook changed nothing"
