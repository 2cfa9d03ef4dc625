"""Copies of a wrapper, and two wrappers over one param (DESIGN, correctness rules: "Copies
(deepcopy, pickle, copy.copy) of the wrapper and of its subclasses keep their class and
attributes, or are refused clearly; two wrappers never silently change each other's counts").

* ``copy.deepcopy``, pickle and ``torch.save``/``torch.load(weights_only=False)`` of a subclass
  of ``AccumulatingOptimizer``, of a by-name class (``accumkernels.optimizers.SGD``) or of a
  subclass of one keep the class and every attribute of the instance (set before or after the
  wrapper's ``__init__``, or later), copied with it; the copy, taken mid-window, trains on
  exactly as the same copy of a native ``torch.optim.SGD`` subclass does (fp32, bit for bit),
  and the original trains on as if no copy had been taken. Native torch's
  ``Optimizer.__getstate__`` keeps only defaults/state/param_groups, so the native subclass
  here keeps its attributes with a ``__getstate__`` of its own; the wrapper needs none. What
  torch's machinery put on the instance (hook registries, an LR scheduler's patch of ``step``
  and its records) is not carried, as natively.
* ``copy.copy`` is refused (TypeError naming ``copy.deepcopy``) with nothing changed: a second
  live wrapper over the same params and window would count the backwards in place of the first.
* A wrapper built over params that another live wrapper holds (all of them or a subset) takes
  them over with a warning; the other then refuses every use (RuntimeError naming the takeover)
  before it changes anything: params, grads and both wrappers' state stay as they were, a
  closure it was given does not run. The new wrapper trains as a new native optimizer over
  those params; the common cases (the first wrapper dropped, or its name rebound as a notebook
  re-running a cell does) train as natively.

Before this file: copies of a subclass came back without its attributes (a subclass of
``AccumulatingOptimizer``: as a plain ``AccumulatingOptimizer``); ``copy.copy`` built a second
wrapper that took the hooks over, and the original then counted 1 micro-batch of 2 (mean: params
0.25 off); a wrapper that was taken over went on stepping with the wrong count.
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import warnings

import pytest
import torch
from _optim_common import batches, checksum, make_model, mse

import accumkernels.optimizers as by_name
from accumkernels import AccumulatingOptimizer
from accumkernels.optim import AccumulationWarning

N, LR, MOMENTUM, DECAY = 2, 0.1, 0.9, 0.5


# -- subclasses with attributes of their own (module level: pickle finds them by name) -----------

class Decay:
    """A subclass's own behaviour and attributes: every ``step()`` call sets the lr to
    ``base_lr * decay ** steps`` first, counts itself in ``steps`` and logs it in ``seen``."""

    def own_attributes(self) -> None:
        self.base_lr, self.decay, self.steps, self.seen = LR, DECAY, 0, []

    def step(self, closure=None):
        for group in self.param_groups:
            group["lr"] = self.base_lr * self.decay ** self.steps
        self.steps += 1
        self.seen.append(self.steps)
        return super().step(closure)


class DecayedWrapper(Decay, AccumulatingOptimizer):
    """A subclass of the wrapper with a constructor of its own."""

    def __init__(self, params, tag: str):
        self.tag = tag  # (set before the wrapper's __init__)
        super().__init__(torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
                         accumulation_steps=N, reduction="mean")
        self.own_attributes()


class DecayedByName(Decay, by_name.SGD):
    """A subclass of the by-name class ``accumkernels.optimizers.SGD``."""

    def __init__(self, params, tag: str):
        self.tag = tag
        super().__init__(params, lr=LR, momentum=MOMENTUM, accumulation_steps=N,
                         reduction="mean")
        self.own_attributes()


class DecayedNative(Decay, torch.optim.SGD):
    """The native judge: torch's ``Optimizer.__getstate__`` carries defaults, state and
    param_groups only, so a torch subclass keeps its attributes in copies by saying so."""

    def __init__(self, params, tag: str):
        self.tag = tag
        super().__init__(params, lr=LR, momentum=MOMENTUM)
        self.own_attributes()

    def __getstate__(self):
        own = ("tag", "base_lr", "decay", "steps", "seen", "later")
        return {**super().__getstate__(), **{k: self.__dict__[k] for k in own}}


class Cached(AccumulatingOptimizer):
    """A subclass that keeps an attribute out of its copies, as any Python class does."""

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("cache", None)
        return state


KINDS = {"subclass": DecayedWrapper, "by-name-subclass": DecayedByName}
OWN = {"tag", "base_lr", "decay", "steps", "seen", "later"}


def _through_pickle(obj):
    return pickle.loads(pickle.dumps(obj))


def _through_torch_save(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUTES = {"deepcopy": copy.deepcopy, "pickle": _through_pickle, "torch.save": _through_torch_save}


def _twins():
    model = make_model()
    return model, copy.deepcopy(model)


def _microbatch(model, x, y, native: bool) -> None:
    """One backward: the wrapper divides by N itself (reduction='mean'), natively the loss is
    divided (1/2: exact)."""
    loss = mse(model, x, y)
    (loss / N if native else loss).backward()


def _window(model, opt, data, native: bool) -> None:
    for x, y in data:
        _microbatch(model, x, y, native)
    opt.step()
    opt.zero_grad()


def _assert_same(model, native_model, what: str) -> None:
    for (name, p), q in zip(model.named_parameters(), native_model.parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs from native by " \
                                  f"{(p - q).abs().max().item():.3g}"


def _copy(route: str, model, opt, native: bool):
    """The model and the optimizer copied together (the params they share copied once). No copy
    of a param carries its ``.grad`` (``Parameter.__deepcopy__``, pickle): the native copy gets
    its mid-window ``.grad`` back by hand (the wrapper's copy carries its window in its state)."""
    both = ROUTES[route]({"model": model, "opt": opt})
    if native:
        for q, p in zip(both["model"].parameters(), model.parameters()):
            q.grad = p.grad.clone()
    return both["model"], both["opt"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", KINDS)
def test_a_copy_of_a_subclass_keeps_its_class_and_attributes_and_trains_as_native(kind, route):
    model, native_model = _twins()
    opt, native = KINDS[kind](model.parameters(), "t"), DecayedNative(native_model.parameters(),
                                                                       "t")
    for o in (opt, native):
        o.later = {"set": ["after", "init"]}
    data = batches(4 * N, 3)
    _window(model, opt, data[:N], native=False)
    _window(native_model, native, data[:N], native=True)
    _microbatch(model, *data[N], native=False)  # mid-window
    _microbatch(native_model, *data[N], native=True)

    twin_model, twin = _copy(route, model, opt, native=False)
    native_twin_model, native_twin = _copy(route, native_model, native, native=True)

    assert type(twin) is type(opt)
    assert {k: getattr(twin, k) for k in OWN} == {k: getattr(opt, k) for k in OWN} \
        == {k: getattr(native_twin, k) for k in OWN}
    assert twin.later is not opt.later and twin.seen is not opt.seen  # copied, not shared
    assert twin.micro_steps == 1 and twin.reduction == "mean"
    # the copies finish the window and train one more; the originals go on alike
    for m, o, native_side in ((twin_model, twin, False), (native_twin_model, native_twin, True),
                              (model, opt, False), (native_model, native, True)):
        _microbatch(m, *data[N + 1], native=native_side)
        o.step()
        o.zero_grad()
        _window(m, o, data[2 * N:3 * N], native=native_side)
    _assert_same(twin_model, native_twin_model, f"{kind} copied by {route}")
    _assert_same(model, native_model, f"{kind}'s original after a copy by {route}")
    assert twin.steps == native_twin.steps == opt.steps == 3
    assert twin.seen == [1, 2, 3] and opt.seen == [1, 2, 3]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("kind", ["AccumulatingOptimizer", "accumkernels.optimizers.SGD"])
def test_a_copy_keeps_attributes_set_on_the_instance(kind, route):
    """The plain classes too: an attribute a user (or a framework) set on the instance."""
    model = make_model()
    if kind == "AccumulatingOptimizer":
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    else:
        opt = by_name.SGD(model.parameters(), lr=LR)
    opt.note = ["kept", 3]
    twin = ROUTES[route]({"model": model, "opt": opt})["opt"]
    assert type(twin) is type(opt) and twin.note == ["kept", 3] and twin.note is not opt.note


@pytest.mark.parametrize("route", ROUTES)
def test_a_subclass_decides_what_its_copies_carry_with_getstate(route):
    model = make_model()
    opt = Cached(torch.optim.SGD(model.parameters(), lr=LR))
    opt.cache, opt.kept = torch.randn(4), "kept"
    twin = ROUTES[route]({"model": model, "opt": opt})["opt"]
    assert type(twin) is Cached and twin.kept == "kept" and not hasattr(twin, "cache")


@pytest.mark.parametrize("route", ROUTES)
def test_a_copy_leaves_what_torch_put_on_the_instance(route):
    """An LR scheduler patches ``step`` on the instance it is built on and records its calls
    there: the patch holds the original (pickle could not carry it, a deepcopy would step the
    original), so the copy has the class's ``step``, as a native copy has. Only the instance's
    own attributes are added to what a fresh wrapper holds."""
    model = make_model()
    opt = DecayedWrapper(model.parameters(), "t")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.later = 1
    _window(model, opt, batches(N, 3), native=False)
    scheduler.step()
    assert "step" in opt.__dict__  # (the scheduler's patch)
    twin_model, twin = _copy(route, model, opt, native=False)
    fresh = DecayedWrapper(make_model().parameters(), "fresh")
    assert set(twin.__dict__) - set(fresh.__dict__) == {"later"}
    assert set(fresh.__dict__) | {"later"} == set(twin.__dict__)
    assert "step" not in twin.__dict__ and twin.steps == 1
    before = [p.detach().clone() for p in model.parameters()]
    _window(twin_model, twin, batches(N, 3), native=False)  # steps the copy, not the original
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert not all(torch.equal(p, b) for p, b in zip(twin_model.parameters(), before))


def test_a_wrapper_used_every_way_has_no_attribute_of_its_own_to_carry():
    """What the wrapper and torch put on the instance (its rooms, hook registries, an LR
    scheduler's patch and records), whatever it went through, is rebuilt by a copy, never
    carried: a plain wrapper's ``__getstate__`` is empty."""
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.AdamW(model[0].parameters(), lr=LR), model=model,
                                accumulation_steps=N, max_grad_norm=1.0, loss_scale="dynamic")
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.register_step_post_hook(lambda *args: None)
    opt.register_state_dict_post_hook(lambda *args: None)
    for group in range(2):
        for x, y in batches(N + 1, 3):
            opt.scale_loss(mse(model, x, y)).backward()
            opt.step()
            opt.zero_grad()
        opt.flush()
        scheduler.step()
        if group == 0:
            opt.add_param_group({"params": list(model[2].parameters())})
    opt.load_state_dict(opt.state_dict())
    assert opt.__getstate__() == {}


# -- copy.copy -----------------------------------------------------------------------------------

def _plain(params):
    return AccumulatingOptimizer(torch.optim.SGD(params, lr=LR, momentum=MOMENTUM),
                                 accumulation_steps=N, reduction="mean")


def _by_name(params):
    return by_name.SGD(params, lr=LR, momentum=MOMENTUM, accumulation_steps=N, reduction="mean")


def _decayed(params):
    opt = DecayedWrapper(params, "t")
    opt.base_lr, opt.decay = LR, 1.0  # (a constant lr, as the native SGD's)
    return opt


BUILDERS = {"AccumulatingOptimizer": _plain, "by-name": _by_name, "subclass": _decayed}


@pytest.mark.parametrize("kind", BUILDERS)
def test_copy_copy_is_refused_before_anything_changes(kind):
    model, native_model = _twins()
    opt = BUILDERS[kind](model.parameters())
    native = torch.optim.SGD(native_model.parameters(), lr=LR, momentum=MOMENTUM)
    data = batches(2 * N, 3)
    _window(model, opt, data[:N], native=False)
    _window(native_model, native, data[:N], native=True)
    _microbatch(model, *data[N], native=False)
    _microbatch(native_model, *data[N], native=True)
    before = checksum(opt, model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (no takeover either)
        with pytest.raises(TypeError, match=r"copy\.copy\(\) .*refused.*copy\.deepcopy"):
            copy.copy(opt)
    assert checksum(opt, model) == before, "a refused copy.copy changed something"
    _microbatch(model, *data[N + 1], native=False)  # the window still counts both backwards
    _microbatch(native_model, *data[N + 1], native=True)
    opt.step()
    native.step()
    _assert_same(model, native_model, f"{kind} after a refused copy.copy")


# -- two wrappers over one param ----------------------------------------------------------------

def _snapshot(model, opt, old):
    """What a refused call must leave: every param and ``.grad``, the new wrapper's state and
    counts (checksum), the old wrapper's inner optimizer's state."""
    buffer = io.BytesIO()
    torch.save(old.optimizer.state_dict(), buffer)
    return checksum(opt, model), buffer.getvalue()


def _refused_calls(model, old, old_sd):
    """Every use of the old wrapper, each with what it would do; ``ran`` records a closure that
    ran (none may)."""
    ran = []
    x, y = batches(1, 3)[0]

    def closure():
        ran.append(1)
        loss = mse(model, x, y)
        loss.backward()
        return loss

    def weight_pass():
        with old.weight_pass():
            pass

    def window_template():
        with old.window_template():
            pass

    extra = torch.nn.Parameter(torch.randn(3))
    calls = {
        "step": lambda: old.step(), "step(closure)": lambda: old.step(closure),
        "flush": lambda: old.flush(), "zero_grad": lambda: old.zero_grad(),
        "zero_grad(set_to_none=False)": lambda: old.zero_grad(set_to_none=False),
        "accumulate": lambda: old.accumulate(), "reset_window": lambda: old.reset_window(),
        "add_weight": lambda: old.add_weight(1.0),
        "add_param_group": lambda: old.add_param_group({"params": [extra]}),
        "scale_loss": lambda: old.scale_loss(mse(model, x, y)),
        "state_dict": lambda: old.state_dict(), "load_state_dict": lambda: old.load_state_dict(old_sd),
        "weight_pass": weight_pass, "window_template": window_template,
        "micro_steps": lambda: old.micro_steps, "sync_step": lambda: old.sync_step,
        "master_params": lambda: old.master_params,
        "deepcopy": lambda: copy.deepcopy(old), "pickle": lambda: pickle.dumps(old),
    }
    return calls, ran


@pytest.mark.parametrize("taken", ["all", "subset"])
def test_a_wrapper_taken_over_refuses_every_use_before_changing_anything(taken):
    model, native_model = _twins()
    old = _plain(model.parameters())
    native_old = torch.optim.SGD(native_model.parameters(), lr=LR, momentum=MOMENTUM)
    data = batches(3 * N, 3)
    _window(model, old, data[:N], native=False)
    _window(native_model, native_old, data[:N], native=True)
    old_sd = old.state_dict()

    def chosen(m):
        return list(m.parameters()) if taken == "all" else list(m[0].parameters())

    with pytest.warns(AccumulationWarning, match="takes over"):
        new = _plain(chosen(model))
    native_new = torch.optim.SGD(chosen(native_model), lr=LR, momentum=MOMENTUM)
    _microbatch(model, *data[N], native=False)  # (the new wrapper's window)
    _microbatch(native_model, *data[N], native=True)

    calls, ran = _refused_calls(model, old, old_sd)
    before = _snapshot(model, new, old)
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match=r"taken over.*another AccumulatingOptimizer"):
            call()
        assert _snapshot(model, new, old) == before, f"the refused {name} changed something"
    assert not ran, "a refused step(closure) ran the closure"
    assert old.param_groups[0]["lr"] == LR  # (what it shows stays readable)

    _microbatch(model, *data[N + 1], native=False)
    _microbatch(native_model, *data[N + 1], native=True)
    new.step()
    native_new.step()
    _assert_same(model, native_model, f"the wrapper that took over {taken} params")


def test_after_a_subset_is_taken_over_a_third_wrapper_takes_the_rest_silently():
    """The retired wrapper holds nothing: a wrapper over the params left to it is built without
    a warning, and the two wrappers over disjoint parts of the model train as two native
    optimizers do."""
    model, native_model = _twins()
    first = _plain(model.parameters())
    with pytest.warns(AccumulationWarning, match="takes over"):
        head = _plain(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in model[0].parameters())]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tail = _plain(rest)
    native_head = torch.optim.SGD(native_model[0].parameters(), lr=LR, momentum=MOMENTUM)
    native_tail = torch.optim.SGD([p for p in native_model.parameters() if all(
        p is not q for q in native_model[0].parameters())], lr=LR, momentum=MOMENTUM)
    for window in range(2):
        for x, y in batches(N, 3):
            _microbatch(model, x, y, native=False)
            _microbatch(native_model, x, y, native=True)
        for o in (head, tail, native_head, native_tail):
            o.step()
            o.zero_grad()
    _assert_same(model, native_model, "two wrappers over the two parts")
    with pytest.raises(RuntimeError, match="taken over"):
        first.step()


def test_a_wrapper_over_the_params_of_two_wrappers_retires_both():
    model, native_model = _twins()
    head = _plain(model[0].parameters())
    tail = _plain([p for p in model.parameters() if all(p is not q for q in model[0].parameters())])
    with pytest.warns(AccumulationWarning, match="takes over") as caught:
        whole = _plain(model.parameters())
    assert sum("takes over" in str(w.message) for w in caught) == 2
    native = torch.optim.SGD(native_model.parameters(), lr=LR, momentum=MOMENTUM)
    data = batches(2 * N, 3)
    for m, o, native_side in ((model, whole, False), (native_model, native, True)):
        for w in range(2):
            _window(m, o, data[w * N:(w + 1) * N], native=native_side)
    _assert_same(model, native_model, "the wrapper that took over two wrappers' params")
    for old in (head, tail):
        with pytest.raises(RuntimeError, match="taken over"):
            old.zero_grad()


@pytest.mark.parametrize("how", ["dropped", "rebound"])
def test_a_wrapper_rebuilt_over_the_same_params_trains_as_native(how):
    """The common cases: the first wrapper was dropped (nothing to say), or its name is rebound
    to the new one (a notebook re-running a cell: the old one is alive while the new one is
    built, and warned about); the new one trains as a new native optimizer."""
    model, native_model = _twins()
    opt = _plain(model.parameters())
    native = torch.optim.SGD(native_model.parameters(), lr=LR, momentum=MOMENTUM)
    data = batches(3 * N, 3)
    _window(model, opt, data[:N], native=False)
    _window(native_model, native, data[:N], native=True)
    if how == "dropped":
        del opt
        gc.collect()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            opt = _plain(model.parameters())
    else:
        with pytest.warns(AccumulationWarning, match="takes over"):
            opt = _plain(model.parameters())
    native = torch.optim.SGD(native_model.parameters(), lr=LR, momentum=MOMENTUM)
    for m, o, native_side in ((model, opt, False), (native_model, native, True)):
        _window(m, o, data[N:2 * N], native=native_side)
        _window(m, o, data[2 * N:], native=native_side)
    _assert_same(model, native_model, f"a wrapper built after the first was {how}")
