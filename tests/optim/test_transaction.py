"""A backward is one transaction (DESIGN, correctness rules): however it ends (it completes, a
hook raises half-way) and whichever hooks the user registered after wrapping, ``.grad``, the
window, the next clear and the next step are what native PyTorch gives. Each test runs one loop
twice, natively and through the wrapper (C hooks and Python hooks), and compares ``.grad`` where
the loop looks at it and the params after each step: fp32, bit for bit."""

from __future__ import annotations

import pytest
import torch
from _optim_common import SMALL_BUCKET, batches, make_model, mse

from accumkernels import AccumulatingOptimizer
from accumkernels.optim.intake import hooks as intake_hooks


class _Boom(RuntimeError):
    pass


@pytest.fixture(params=["c", "python"])
def hooks(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(intake_hooks, "C_HOOKS", None)
    return request.param


class Twin:
    """One loop, native (``wrap=False``) or through the wrapper; ``seen`` records ``.grad``."""

    def __init__(self, wrap: bool, *, opt_kw=None, inner=torch.optim.SGD, lr=0.05,
                 before_wrap=None):
        torch.manual_seed(0)
        self.wrap = wrap
        self.model = make_model()
        if before_wrap is not None:
            before_wrap(self.model)
        self.inner = inner(self.model.parameters(), lr=lr)
        self.opt = AccumulatingOptimizer(self.inner, model=self.model, **(opt_kw or {})) \
            if wrap else self.inner
        self.seen: list = []
        self.armed = False
        # a tensor hook on the middle layer's output that raises while armed: the last layer
        # has its gradients by then, the first two never get theirs
        self.model[2].register_forward_hook(self._arm)

    def _arm(self, module, inputs, out):
        out.register_hook(self._bomb)

    def _bomb(self, g):
        if self.armed:
            raise _Boom("a hook raised in the middle of the backward")
        return g

    @property
    def params(self):
        return list(self.model.parameters())

    def backward(self, x, y, *, raises=False, scale=1.0):
        self.armed = raises
        try:
            loss = mse(self.model, x, y) * scale
            if raises:
                with pytest.raises(_Boom):
                    loss.backward()
            else:
                loss.backward()
        finally:
            self.armed = False

    def look(self, what: str) -> None:
        self.seen.append((what, [None if p.grad is None else p.grad.detach().float().clone()
                                 for p in self.params]))

    def step(self):
        self.opt.step()
        self.seen.append(("params", [p.detach().clone() for p in self.params]))


def assert_same(ours: Twin, native: Twin) -> None:
    assert [w for w, _ in ours.seen] == [w for w, _ in native.seen]
    for (what, a_list), (_, b_list) in zip(ours.seen, native.seen):
        for k, (a, b) in enumerate(zip(a_list, b_list)):
            assert (a is None) == (b is None), f"{what}: param {k}: {a} vs native {b}"
            if a is not None:
                assert torch.equal(a, b), \
                    f"{what}: param {k} off by {(a - b).abs().max().item():.3g}"


def _twins(loop, **kw):
    native, ours = Twin(False, **kw), Twin(True, **kw)
    loop(native)
    loop(ours)
    assert_same(ours, native)


# -- 1. a backward that raises half-way -------------------------------------------------------
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("n", [None, 2], ids=["N=None", "N=2"])
@pytest.mark.parametrize("bucket", [SMALL_BUCKET, 25], ids=["buckets", "one-bucket"])
def test_backward_raising_half_way_leaves_native_grad(hooks, n, bucket, clip, in_backward):
    """The second micro-batch's backward raises from a tensor hook: ``.grad`` then holds what
    AccumulateGrad already added (the last layer's gradients), a user's clip sees that, the step
    uses what the clip left, and the next window is normal."""
    data = batches(6, 4)

    def loop(t: Twin):
        for w in range(2):
            t.backward(*data[3 * w])
            t.backward(*data[3 * w + 1], raises=True)
            t.look(f"after the raise, window {w}")
            if clip:
                torch.nn.utils.clip_grad_norm_(t.params, 0.3)
                t.look(f"after the clip, window {w}")
            t.step()
            t.opt.zero_grad()
        t.backward(*data[5])
        t.look("a backward after")
        t.backward(*data[2])
        t.step()

    _twins(loop, opt_kw={"accumulation_steps": n, "bucket_size_mb": bucket,
                         "accumulate_in_backward": in_backward})


@pytest.mark.parametrize("n", [None, 4], ids=["N=None", "N=4"])
def test_backward_after_a_raised_one_is_its_own_microbatch(hooks, n):
    """A backward that raised is closed when it raises: the next backwards are micro-batches of
    their own (counted, their gradients added once): ``reduction="mean"`` divides by 4."""
    data = batches(4, 4)

    def loop(t: Twin):
        t.backward(*data[0], scale=1.0 if t.wrap else 0.25)
        t.backward(*data[1], raises=True, scale=1.0 if t.wrap else 0.25)
        if n is not None:
            t.look("after the raise")  # (N=4 fuses 1/4: native's units; None divides at step)
        for x, y in data[2:]:
            t.backward(x, y, scale=1.0 if t.wrap else 0.25)
            if n is not None:
                t.look("after a later backward")
        if t.wrap:
            assert t.opt.micro_steps == 4
        t.step()

    _twins(loop, opt_kw={"accumulation_steps": n, "reduction": "mean"})


# -- 5. what no other test holds ----------------------------------------------------------------
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("n", [None, 2], ids=["N=None", "N=2"])
def test_outside_clear_between_backwards_counts_as_natively(hooks, in_backward, n):
    """``model.zero_grad()`` between two backwards of a window, ``reduction="mean"``: with N
    None the clear drops the window (natively the first gradients are gone: the step's mean is
    over the one backward after it); with N given a window still filling is kept (as
    ``opt.zero_grad()`` keeps it: natively the loop that clears every micro-batch divides by N
    and never clears). Both intakes alike."""
    data = batches(4, 4)
    native_scale = 1.0 if n is None else 0.5

    def loop(t: Twin):
        for w in range(2):
            if t.wrap or n is not None:  # (natively the clear drops it: not run)
                t.backward(*data[2 * w], scale=1.0 if t.wrap else native_scale)
            if t.wrap:
                t.model.zero_grad()
            t.backward(*data[2 * w + 1], scale=1.0 if t.wrap else native_scale)
            if t.wrap:
                assert t.opt.micro_steps == (1 if n is None else 2)
            t.step()
            t.look(f"after step {w}")
            t.opt.zero_grad()

    _twins(loop, opt_kw={"accumulation_steps": n, "reduction": "mean",
                         "accumulate_in_backward": in_backward})


def _halve(p, mode: str) -> None:
    if mode == "assign":
        p.grad = p.grad * 0.5
    else:
        p.grad.mul_(0.5)


def halving(mode: str, when: str = "before"):
    """A post-accumulate hook on every param halving ``.grad`` (assigned anew or in place),
    registered before wrapping (``Twin(before_wrap=...)``) or after (called on the twin)."""
    def install(model):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: _halve(p, mode))
    return install


def _window_loop(t: Twin, data, n: int = 3) -> None:
    """Windows of ``n`` backwards, ``.grad`` looked at after each, a step and a clear at the
    end (the wrapper's step called after every backward: a no-op until the window is full)."""
    for w in range(len(data) // n):
        for k, (x, y) in enumerate(data[n * w:n * w + n]):
            t.backward(x, y)
            t.look(f"window {w}, after backward {k}")
            if t.wrap and k < n - 1:
                t.opt.step()
        t.step()
        t.opt.zero_grad()


@pytest.mark.parametrize("mode", ["assign", "in_place"])
def test_post_accumulate_hook_that_assigns_grad_is_honoured(hooks, mode):
    """A post-accumulate hook (registered before wrapping) that assigns ``p.grad = p.grad * 0.5``
    (a new tensor, not an in-place edit): the running sum, this micro-batch in it, halved."""
    data = batches(6, 4)
    native = Twin(False, before_wrap=halving(mode))
    ours = Twin(True, before_wrap=halving(mode), opt_kw={"accumulation_steps": 3})
    _window_loop(native, data)
    _window_loop(ours, data)
    assert_same(ours, native)


@pytest.mark.parametrize("clear", ["opt", "model"])
@pytest.mark.parametrize("n", [None, 4], ids=["N=None", "N=4"])
@pytest.mark.parametrize("bucket", [SMALL_BUCKET, 25], ids=["buckets", "one-bucket"])
def test_dropped_first_microbatch_after_a_clear_shows_no_earlier_window(hooks, bucket, n, clear):
    """``nonfinite="skip_microbatch"``, params with a user's post-accumulate hook: the first
    micro-batch after a clear is non-finite and dropped. ``.grad`` then is what it is natively
    without that micro-batch (None: cleared), never an earlier window's contents or the dropped
    gradient; the window goes on from it."""
    data = batches(8, 4)
    seen = []

    def install(model):
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad is None))

    def loop(t: Twin):
        for w in range(2):
            for k, (x, y) in enumerate(data[4 * w:4 * w + 4]):
                bad = k == 0 and w == 1
                if bad and not t.wrap:
                    t.look("after the dropped one")
                    continue
                t.backward(x, y, scale=float("nan") if bad else 1.0)
                t.look("after the dropped one" if bad else "after a backward")
            t.step()
            (t.model if clear == "model" else t.opt).zero_grad()

    native = Twin(False, before_wrap=install)
    ours = Twin(True, before_wrap=install,
                opt_kw={"nonfinite": "skip_microbatch", "bucket_size_mb": bucket,
                        "accumulation_steps": n})
    loop(native)
    loop(ours)
    assert_same(ours, native)


# -- 2. a user's tensor hook registered after wrapping raises -----------------------------------
@pytest.mark.parametrize("n, clear", [(None, "model"), (None, "none"), (None, "opt"), (2, "keep")],
                         ids=["model.zero_grad", "grad=None", "opt.zero_grad", "N=2-no-clear"])
@pytest.mark.parametrize("which", [4, 0], ids=["last-layer", "first-layer"])
def test_users_tensor_hook_after_wrapping_raises(hooks, which, n, clear):
    """``p.register_hook`` added after wrapping raises in the second backward of a window:
    ``.grad`` is native's (the running sum where AccumulateGrad did not run), a clear after it
    means what it means natively (the next window does not add to the old one); with N=2 and
    no clear the raised backward is the window's second micro-batch."""
    data = batches(6, 4)

    def loop(t: Twin):
        armed = [False]

        def bomb(g):
            if armed[0]:
                raise _Boom("the user's hook raised")
            return g

        t.params[which].register_hook(bomb)  # (after the wrapper's hooks)
        for w in range(2):
            t.backward(*data[3 * w])
            t.look(f"window {w}: after a backward")
            armed[0] = True
            try:
                with pytest.raises(_Boom):
                    mse(t.model, *data[3 * w + 1]).backward()
            finally:
                armed[0] = False
            t.look(f"window {w}: after the raise")
            if clear == "model":
                t.model.zero_grad()
            elif clear == "none":
                for p in t.params:
                    p.grad = None
            elif clear == "opt":
                t.opt.zero_grad()
            else:
                t.step()
                t.opt.zero_grad()
            t.look(f"window {w}: after the clear")
            t.backward(*data[3 * w + 2])
            t.look(f"window {w}: after the clear and a backward")
            t.step()
            t.opt.zero_grad()

    _twins(loop, opt_kw={"accumulation_steps": n})


# -- 3. a post-accumulate hook registered after wrapping ----------------------------------------
def _recording(seen: list):
    def install(model):
        for k, p in enumerate(model.parameters()):
            p.register_post_accumulate_grad_hook(
                lambda p, k=k: seen.append((k, p.grad.detach().float().clone())))
    return install


@pytest.mark.parametrize("mode", ["read", "in_place", "assign"])
@pytest.mark.parametrize("bucket", [SMALL_BUCKET, 25], ids=["buckets", "one-bucket"])
def test_post_accumulate_hook_registered_after_wrapping_sees_native_grad(hooks, mode, bucket):
    """``register_post_accumulate_grad_hook`` after the wrapper was built: the hook sees native's
    ``p.grad`` (the running sum with this micro-batch in it, also on the first backward) and
    what it writes (in place, or a new ``.grad``) is what the window holds and the step uses."""
    data = batches(6, 4)
    twins = []
    for wrap in (False, True):
        t = Twin(wrap, opt_kw={"accumulation_steps": 3, "bucket_size_mb": bucket})
        seen: list = []
        _recording(seen)(t.model)
        if mode != "read":
            halving(mode)(t.model)
        _window_loop(t, data)
        twins.append((t, seen))
    (native, seen_native), (ours, seen_ours) = twins
    assert [k for k, _ in seen_ours] == [k for k, _ in seen_native]
    for (k, a), (_, b) in zip(seen_ours, seen_native):
        assert torch.equal(a, b), f"param {k}: the hook saw {a} where native shows {b}"
    assert_same(ours, native)


def test_post_accumulate_hook_registered_mid_window_and_removed(hooks):
    """Registered after the first backward of a window, removed after the window: it sees
    native's ``.grad`` while it is there; the rest of the training is native."""
    data = batches(9, 4)

    def loop(t: Twin):
        handles = []
        for w in range(3):
            for k, (x, y) in enumerate(data[3 * w:3 * w + 3]):
                if w == 0 and k == 1:
                    handles = [p.register_post_accumulate_grad_hook(lambda p: _halve(p, "in_place"))
                               for p in t.params[::2]]
                t.backward(x, y)
                t.look(f"window {w}, after backward {k}")
                if t.wrap and k < 2:
                    t.opt.step()
            t.step()
            t.opt.zero_grad()
            if w == 1:
                for h in handles:
                    h.remove()

    _twins(loop, opt_kw={"accumulation_steps": 3})


@pytest.mark.parametrize("n", [None, 2], ids=["N=None", "N=2"])
def test_post_accumulate_hook_registered_after_wrapping_raises(hooks, n):
    """A post-accumulate hook registered after wrapping raises in the second backward: the
    param's ``.grad`` holds this micro-batch (AccumulateGrad ran before the hook), the rest as
    far as the backward got; a clip and the step see that."""
    data = batches(4, 4)

    def loop(t: Twin):
        armed = [False]

        def bomb(p):
            if armed[0]:
                raise _Boom("the user's post-accumulate hook raised")

        t.params[4].register_post_accumulate_grad_hook(bomb)
        for w in range(2):
            t.backward(*data[2 * w])
            armed[0] = True
            try:
                with pytest.raises(_Boom):
                    mse(t.model, *data[2 * w + 1]).backward()
            finally:
                armed[0] = False
            t.look(f"window {w}: after the raise")
            torch.nn.utils.clip_grad_norm_(t.params, 0.3)
            t.step()
            t.opt.zero_grad()

    _twins(loop, opt_kw={"accumulation_steps": n, "bucket_size_mb": SMALL_BUCKET})


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("n", [None, 3], ids=["N=None", "N=3"])
def test_post_accumulate_hook_on_a_param_frozen_after_the_forward(hooks, when, n):
    """A param frozen between the forward and the backward (GAN code): natively AccumulateGrad
    adds nothing, yet the param's post-accumulate hooks still run and see ``.grad`` as it was
    (the running sum); a hook halving it in place halves it then too. The wrapper's pre-hook had
    hidden the window: its hooks show it again to the user's (registered before wrapping or
    after) and what they write counts."""
    data = batches(6, 4)
    twins = []
    for wrap in (False, True):
        t = Twin(wrap, opt_kw={"accumulation_steps": n},
                 before_wrap=_recording_then_halving if when == "before" else None)
        if when == "after":
            _recording_then_halving(t.model)
        first = t.params[0]
        for w in range(2):
            for k, (x, y) in enumerate(data[3 * w:3 * w + 3]):
                loss = mse(t.model, x, y)
                if k == 1:
                    first.requires_grad_(False)
                loss.backward()
                first.requires_grad_(True)
                t.look(f"window {w}, after backward {k}")
            t.step()
            t.opt.zero_grad()
        twins.append((t, t.model._seen))
    (native, seen_native), (ours, seen_ours) = twins
    assert [k for k, _ in seen_ours] == [k for k, _ in seen_native]
    for (k, a), (_, b) in zip(seen_ours, seen_native):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), \
            f"param {k}: the hook saw {a} where native shows {b}"
    assert_same(ours, native)


def _recording_then_halving(model):
    """On every param, a post-accumulate hook that records ``.grad`` and halves it in place."""
    model._seen = []

    def hook(p, k):
        model._seen.append((k, None if p.grad is None else p.grad.detach().clone()))
        if p.grad is not None:
            p.grad.mul_(0.5)
    for k, p in enumerate(model.parameters()):
        p.register_post_accumulate_grad_hook(lambda p, k=k: hook(p, k))
