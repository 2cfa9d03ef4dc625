"""state_dict()/load_state_dict() (DESIGN section of that name): a torch optimizer state dict
(``state``/``param_groups`` equal to native's, loadable with ``weights_only=True``) carrying the
wrapper's own state; it loads both ways with a native optimizer and from an older torch,
survives ``deepcopy``/pickle and ``torch.distributed.checkpoint``'s
``get_optimizer_state_dict``/``set_optimizer_state_dict`` (one process), carries no window
between windows, and loads the wrapper's format version 1. A state dict that does not fit
(another layout or shapes, another kind of loss scale, a missing key, an unknown version, not an
optimizer state dict) is refused with a ValueError and changes nothing.

Resuming mid-window: test_checkpoint_resume.py; under DDP: tests/distributed/test_ddp_checkpoint.py;
FSDP2 through DCP: tests/distributed/test_fsdp2.py. The torch-format contracts run on the
optim_db configurations of test_conformance.py (tests/optim/_conformance_common.py).
"""

from __future__ import annotations

import copy
import io
import json
import pickle

import pytest
import torch
from _conformance_common import (
    DEFAULTS,
    SAMPLE,
    Config,
    assert_same,
    continue_alike,
    drive,
    fresh,
    ids,
    same_outcome,
    torch_sd,
    trained,
)
from _optim_common import (
    SMALL_BUCKET,
    batches,
    checksum,
    make_model,
    mse,
    roundtrip,
    wrap_sgd,
)
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from accumkernels import AccumulatingOptimizer

# -- a torch optimizer state dict ------------------------------------------------------------------


@pytest.mark.parametrize("config", SAMPLE, ids=ids(SAMPLE))
def test_state_dict_is_a_torch_optimizer_state_dict(config: Config) -> None:
    """Top-level ``state``/``param_groups`` equal to native's; loadable with weights_only."""
    _, native, _, opt = trained(config)
    sd = opt.state_dict()
    assert {"state", "param_groups"} <= set(sd), f"top-level keys {sorted(sd)}"
    assert_same(torch_sd(sd), native.state_dict(), "state_dict")
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    assert_same(torch.load(buf, weights_only=True), sd, "torch.load(weights_only=True)")


@pytest.mark.parametrize("direction", ["wrapper->wrapper", "native->wrapper", "wrapper->native"])
@pytest.mark.parametrize("config", SAMPLE, ids=ids(SAMPLE))
def test_load_state_dict_then_continue(config: Config, direction: str) -> None:
    """A state dict loads into a fresh optimizer of the other kind (or the same), is not
    modified by loading, and training continues exactly as in the source."""
    n_model, native, model, opt = trained(config)
    src_kind, dst_kind = direction.split("->")
    src = (model, opt) if src_kind == "wrapper" else (n_model, native)
    sd = src[1].state_dict()
    loaded = copy.deepcopy(sd)  # native state dicts alias the live state: load a copy
    dst = fresh(config, src[0], dst_kind)
    dst[1].load_state_dict(loaded)
    assert_same(loaded, sd, "the state dict after loading it")
    continue_alike(config, src, dst)


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_loads_older_native_state_dict(config: Config) -> None:
    """A native state dict from an older torch (no maximize/foreach/... flags, python-number
    ``step``) loads into the wrapper and continues as it does in a native optimizer."""
    n_model, native, _, _ = trained(config)
    sd = native.state_dict()
    for group in sd["param_groups"]:
        for flag in config.info.not_og_supported_flags:
            group.pop(flag, None)
    for st in sd["state"].values():
        if torch.is_tensor(st.get("step")):
            st["step"] = st["step"].item()
    a, b = fresh(config, n_model, "native"), fresh(config, n_model, "wrapper")
    a[1].load_state_dict(copy.deepcopy(sd))
    b[1].load_state_dict(copy.deepcopy(sd))
    continue_alike(config, a, b)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_copies_keep_state_and_work(config: Config, how: str) -> None:
    """deepcopy/pickle give a wrapper with the same public attributes and state dict, which
    steps its (copied) params like a native optimizer copied the same way."""
    _, native, _, opt = trained(config, steps=1)
    dup = copy.deepcopy if how == "deepcopy" else (lambda o: pickle.loads(pickle.dumps(o)))
    ours, theirs = dup(opt), dup(native)
    assert isinstance(ours, AccumulatingOptimizer)
    if how == "deepcopy":
        public = lambda o: {k for k in vars(o) if not k.startswith("_")}  # noqa: E731
        assert public(ours) == public(opt)
    assert_same(ours.state_dict(), opt.state_dict(), f"{how}: state_dict")
    params = [[p for g in o.param_groups for p in g["params"]] for o in (theirs, ours)]
    grads = [torch.randn_like(p) for p in params[0]]

    def step(o, ps):
        def work():
            o.zero_grad()
            for p, g in zip(ps, grads):
                p.grad = g.clone()
            return torch.zeros(())
        return lambda: drive(o, config, work)
    if same_outcome(step(theirs, params[0]), step(ours, params[1])):
        assert_same([p.detach() for p in params[1]], [p.detach() for p in params[0]], how)


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_distributed_checkpoint_state_dict(config: Config) -> None:
    """torch.distributed.checkpoint's get/set_optimizer_state_dict (one process, no group)."""
    n_model, native, model, opt = trained(config)
    osd = get_optimizer_state_dict(model, opt)
    assert_same(torch_sd(osd), get_optimizer_state_dict(n_model, native),
                "get_optimizer_state_dict")
    assert all("accumkernels" in g for g in osd["param_groups"]), "the bookkeeping was dropped"
    a, b = fresh(config, n_model, "native"), fresh(config, model, "wrapper")
    if opt._needs_closure:
        # DCP creates a fresh native optimizer's state with an lr=0 step without a closure,
        # which LBFGS refuses; the wrapper shows its state's keys already (live_state.py), so
        # DCP loads it without that step. The native one loads by its own load_state_dict.
        with pytest.raises(TypeError):
            set_optimizer_state_dict(*a, copy.deepcopy(get_optimizer_state_dict(n_model, native)))
        a[1].load_state_dict(copy.deepcopy(native.state_dict()))
        set_optimizer_state_dict(*b, copy.deepcopy(osd))
        continue_alike(config, a, b)
    # (a fresh optimizer has no state: DCP creates it with an lr=0 step on zero gradients)
    elif same_outcome(lambda: set_optimizer_state_dict(*a, copy.deepcopy(osd)),
                      lambda: set_optimizer_state_dict(*b, copy.deepcopy(osd))):
        continue_alike(config, a, b)


def test_checkpoint_marks_the_window_empty_between_windows() -> None:
    """Every key is always there (a template for dcp.load must hold what a saved state dict
    brings); between windows the bookkeeping says the window is empty, and loading it leaves an
    empty window."""
    config = next(c for c in DEFAULTS if c.name == "Adam")
    _, _, model, opt = trained(config, accumulation_steps=2)
    sd = opt.state_dict()
    assert set(sd) == {"state", "param_groups"}, sorted(sd)
    own = json.loads(sd["param_groups"][0]["accumkernels"])
    assert "window" not in own
    assert all(g["accumkernels"] == sd["param_groups"][0]["accumkernels"]
               for g in sd["param_groups"])
    other = fresh(config, model, "wrapper")[1]
    other.load_state_dict(copy.deepcopy(sd))
    assert other.micro_steps == 0 and other._parts.window.empty
    # mid-window: the window travels per param, in state
    x = torch.randn(3, next(model.parameters()).shape[1])
    model(x).square().mean().backward()
    sd = opt.state_dict()
    windows = [e["accumkernels_window"] for e in sd["state"].values()]
    assert [w.shape for w in windows] == [p.shape for p in model.parameters()]
    assert json.loads(sd["param_groups"][0]["accumkernels"])["window"]["micro_steps"] == 1


# -- the wrapper's own state and its versions ------------------------------------------------------


def test_state_dict_layout_mismatch_is_rejected():
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=2)
    mse(model, *batches(1, 4)[0]).backward()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    other = AccumulatingOptimizer(torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.1),
                                  accumulation_steps=2, bucket_size_mb=25)
    # The flat layout does not depend on the bucket size, so a different bucketing loads fine.
    other.load_state_dict(state)
    for p, q in zip(model.parameters(), other.param_groups[0]["params"]):
        assert torch.equal(p.main_grad, q.main_grad)
    smaller = make_model(widths=(12, 8, 5))
    with pytest.raises(ValueError, match="does not match"):
        wrap_sgd(smaller, accumulation_steps=2).load_state_dict(state)


def test_something_that_is_no_optimizer_state_dict_is_a_clear_error():
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=2)
    with pytest.raises(ValueError, match="neither an optimizer state dict"):
        opt.load_state_dict({"weights": torch.ones(2)})


def _version1(opt) -> dict:
    """The checkpoint as the single-class wrapper (format version 1) wrote it: the inner
    optimizer's state dict under "optimizer", the flat fp32 buffer(s) as "main_grad"."""
    state = opt.state_dict()
    own = json.loads(state["param_groups"][0]["accumkernels"])
    window = dict(own["window"])
    old = {k: v for k, v in own.items() if k not in ("version", "shapes", "window")}
    old["found_inf"] = torch.tensor([own["found_inf"]])
    old["master_weights"] = []
    old["optimizer"] = torch_sd(state)
    old["main_grad"] = [t.clone() for t in opt._parts.window.storage.buffers.values()]
    old["window"] = dict(window, step_calls=1, unmoved=0, at_boundary=False)
    old["window"]["boundary_only"] = bool(window["boundary_only"])
    return old


def test_version1_checkpoint_loads_and_resumes_exactly():
    N = 4
    model = make_model()
    data = batches(2 * N, 4)
    opt = wrap_sgd(model, accumulation_steps=N)
    for x, y in data[:N + 2]:  # one window stepped, two micro-batches into the next
        mse(model, x, y).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(_version1(opt), buf)
    resumed = copy.deepcopy(model)
    opt2 = wrap_sgd(resumed, accumulation_steps=N)
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf, weights_only=True))
    for mod, o in ((model, opt), (resumed, opt2)):
        for x, y in data[N + 2:]:
            mse(mod, x, y).backward()
            o.step()
    for p, q in zip(model.parameters(), resumed.parameters()):
        assert torch.equal(p, q)


def test_unknown_checkpoint_version_is_refused_and_changes_nothing():
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=2)
    mse(model, *batches(1, 4)[0]).backward()
    state = opt.state_dict()
    before = [p.main_grad.clone() for p in model.parameters()]
    for group in state["param_groups"]:
        group["accumkernels"] = json.dumps(dict(json.loads(group["accumkernels"]), version=99))
    with pytest.raises(ValueError, match="version 99"):
        opt.load_state_dict(state)
    assert all(torch.equal(a, p.main_grad) for a, p in zip(before, model.parameters()))
    assert opt.micro_steps == 1


# -- a refused load changes nothing ----------------------------------------------------------------


def _adamw_wrapper(template, **kw):
    model = copy.deepcopy(template)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=3, bucket_size_mb=SMALL_BUCKET, **kw)
    return model, opt


def _train(model, opt, data):
    for x, y in data:
        opt.scale_loss(mse(model, x, y)).backward()
        opt.step()


def _drop_window_key(key):
    def corrupt(state):
        for group in state["param_groups"]:
            own = json.loads(group["accumkernels"])
            own["window"].pop(key, None)
            group["accumkernels"] = json.dumps(own)
        return state
    return corrupt


# case: (source wrapper kwargs, target wrapper kwargs, corruption of the source's state_dict)
LOAD_REFUSALS = {
    "window-missing-kept": ({}, {}, _drop_window_key("kept")),
    "window-missing-touched": ({}, {}, _drop_window_key("touched")),
    "window-missing-divisor": ({}, {}, _drop_window_key("divisor")),
    "loss-scale-dynamic-into-static": ({"loss_scale": "dynamic"}, {"loss_scale": 1024.0}, None),
    "loss-scale-static-into-dynamic": ({"loss_scale": 1024.0}, {"loss_scale": "dynamic"}, None),
}


@pytest.mark.parametrize("case", list(LOAD_REFUSALS))
def test_refused_state_dict_changes_nothing(case):
    """A state_dict that fails validation is refused with ValueError, and the target (mid-window,
    with AdamW state) is bit-identical afterwards and trains exactly like an untouched twin."""
    src_kw, dst_kw, corrupt = LOAD_REFUSALS[case]
    template = make_model()
    src_model, src = _adamw_wrapper(template, **src_kw)
    _train(src_model, src, batches(4, 4))  # one window and one micro-batch of the next
    state = roundtrip(src.state_dict())
    if corrupt is not None:
        state = corrupt(state)

    data = batches(4, 4)  # other data: every tensor of the target differs from the source's
    model, opt = _adamw_wrapper(template, **dst_kw)
    twin, twin_opt = _adamw_wrapper(template, **dst_kw)
    _train(model, opt, data)
    _train(twin, twin_opt, data)
    before = checksum(opt, model)
    assert before == checksum(twin_opt, twin)

    with pytest.raises(Exception) as info:
        opt.load_state_dict(state)
    assert checksum(opt, model) == before, f"the refused load ({info.value!r}) changed the wrapper"
    assert isinstance(info.value, ValueError), f"expected ValueError, got {info.value!r}"

    more = batches(5, 4)
    _train(model, opt, more)
    _train(twin, twin_opt, more)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_state_of_other_shapes_with_the_same_padded_size_is_refused():
    """Linear(4, 8) and Linear(8, 4) have the same number of params and the same padded buffer;
    the load must be refused (ValueError, nothing changed), not fail at the next Adam step."""
    def build(model):
        opt = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=1e-2),
                                    accumulation_steps=2)
        x = torch.randn(3, model.in_features)
        for _ in range(3):  # one window (Adam state exists) and one micro-batch of the next
            model(x).square().mean().backward()
            opt.step()
        return opt

    def window_sizes(opt):
        return [e["accumkernels_window"].numel() for e in opt.state_dict()["state"].values()]

    src = build(nn.Linear(4, 8))
    assert window_sizes(src) == [32, 8]
    state = roundtrip(src.state_dict())
    model = nn.Linear(8, 4)
    opt = build(model)
    assert window_sizes(opt) == [32, 4]
    before = checksum(opt, model)
    with pytest.raises(ValueError):
        opt.load_state_dict(state)
    assert checksum(opt, model) == before
    model(torch.randn(3, 8)).square().mean().backward()  # the wrapper still works
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
