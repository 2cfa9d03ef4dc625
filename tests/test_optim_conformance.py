"""Conformance: AccumulatingOptimizer keeps PyTorch's own optimizer contracts (issue 19).

PyTorch checks every optimizer of ``optim_db`` against a set of contracts (TestOptimRenewed in
its test/test_optim.py): steps, closures, state dicts, hooks, error inputs. The same contracts
are restated here with ``AccumulatingOptimizer(optim_cls(params, **kwargs))`` in the
optimizer's place and native PyTorch, run on an identical model and data, as the judge.

Configurations (tests/_conformance_common.py): ``ALL_CONFIGS`` is every CPU input of every
optim_db optimizer plus its foreach / fused / tensor-lr variants; contracts that do not depend
on the update rule run on ``SAMPLE`` (per optimizer its default and one config of each variant
kind) or ``DEFAULTS`` (one per optimizer). fp32 params are compared bit for bit (see the
precision note there). What stays refused is refused at construction with a ValueError or
TypeError naming the problem.
"""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from _conformance_common import (
    ALL_CONFIGS,
    DEFAULTS,
    SAMPLE,
    Config,
    assert_moved,
    assert_same,
    assert_same_params,
    batches,
    drive,
    ids,
    loss_of,
    make_model,
    pair,
    param_groups,
    same_outcome,
    snapshot,
    torch_sd,
    train_step,
    wrap,
)
from torch.distributed.checkpoint.state_dict import (
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.optim.lr_scheduler import StepLR

from accumkernels import AccumulatingOptimizer

# Two real steps, a step on all-None gradients, the first layer frozen for two steps (it gets
# no gradient: native leaves it and its state alone) and unfrozen again; StepLR halves the LR
# after every step, so a wrapper that missed an LR change would drift at once.
PLAN = ("grad", "grad", "none", "freeze", "freeze", "unfreeze", "grad")


def lockstep(config: Config, plan=PLAN, dtype=torch.float32) -> None:
    """Run ``plan`` natively and wrapped, side by side; params equal after every step."""
    n_model, native, model, opt = pair(config, dtype)
    scheds = [StepLR(native, step_size=1, gamma=0.5), StepLR(opt, step_size=1, gamma=0.5)]
    start = snapshot(model)
    for i, (event, batch) in enumerate(zip(plan, batches(len(plan), dtype))):
        if event in ("freeze", "unfreeze"):
            for m in (n_model, model):
                m[0].requires_grad_(event == "unfreeze")
        results = [train_step(m, o, batch, config, backward=event != "none")
                   for m, o in ((n_model, native), (model, opt))]
        assert_same(results[1], results[0], f"step {i} ({event}): value step() returned")
        assert_same_params(n_model, model, f"step {i} ({event}): ")
        for s in scheds:
            s.step()
    assert_moved(model, start)


def assert_refused(build, *words: str) -> None:
    """``build()`` raises ValueError/TypeError whose message names one of ``words``."""
    with pytest.raises((ValueError, TypeError)) as info:
        build()
    msg = str(info.value).lower()
    assert any(w in msg for w in words), f"refusal does not name {words}: {info.value}"


# -- steps -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", ALL_CONFIGS, ids=ids(ALL_CONFIGS))
def test_steps_match_native(config: Config) -> None:
    """Every optim_db CPU config: several steps bit-identical to native (SparseAdam: refused)."""
    if config.sparse_only:
        assert_refused(lambda: wrap(config.build(make_model(config).parameters())), "sparse")
        return
    lockstep(config)


@pytest.mark.parametrize("mode", ["N=3 step every micro-batch", "N=None step at window end"])
@pytest.mark.parametrize("config", SAMPLE, ids=ids(SAMPLE))
def test_accumulated_windows_match_native(config: Config, mode: str) -> None:
    """Three backwards per step: native sums them in .grad; the wrapper gives the same steps,
    and its mid-window step() calls (N=3, with zero_grad() every micro-batch) change nothing."""
    every = mode.startswith("N=3")
    n_model, native, model, opt = pair(config, accumulation_steps=3 if every else None)
    start = snapshot(model)
    for w in range(2):
        micro = batches(3)

        def window(m, o):
            def work():
                o.zero_grad()
                losses = [loss_of(m, b) for b in micro]
                for loss in losses:
                    loss.backward()
                return sum(loss.detach() for loss in losses)
            return work
        drive(native, config, window(n_model, native))
        if every and not config.closure_only:
            before = snapshot(model)
            for k, b in enumerate(micro):
                loss_of(model, b).backward()
                opt.step()
                opt.zero_grad()
                if k < 2:
                    assert_same(snapshot(model), before, f"window {w}: no-op step {k} moved")
        else:
            drive(opt, config, window(model, opt))
        assert_same_params(n_model, model, f"window {w}: ")
    assert_moved(model, start)


@pytest.mark.parametrize("source", ["assigned", "autograd.grad"])
@pytest.mark.parametrize("config", SAMPLE, ids=ids(SAMPLE))
def test_assigned_gradients_step_like_native(config: Config, source: str) -> None:
    """``p.grad = g`` (random, or from torch.autograd.grad) then step(): a gradient is a gradient."""
    n_model, native, model, opt = pair(config)
    start = snapshot(model)
    for i, batch in enumerate(batches(3)):
        fixed = [torch.randn_like(p) for p in model.parameters()]

        def work_for(m, o):
            def work():
                o.zero_grad()
                loss = loss_of(m, batch)
                grads = ([g.clone() for g in fixed] if source == "assigned"
                         else torch.autograd.grad(loss, list(m.parameters())))
                for p, g in zip(m.parameters(), grads):
                    p.grad = g
                return loss.detach()
            return work
        drive(native, config, work_for(n_model, native))
        drive(opt, config, work_for(model, opt))
        assert_same_params(n_model, model, f"step {i}: ")
    assert_moved(model, start)


@pytest.mark.parametrize("config", SAMPLE, ids=ids(SAMPLE))
def test_zero_grads_kept_by_zero_grad_are_stepped(config: Config) -> None:
    """zero_grad(set_to_none=False), then step() with no backward: native applies the zero
    gradients (momentum, weight decay, maximize move the params); so must the wrapper."""
    n_model, native, model, opt = pair(config)
    batch = batches(1)[0]
    for m, o in ((n_model, native), (model, opt)):
        train_step(m, o, batch, config)
    for i in range(2):
        for m, o in ((n_model, native), (model, opt)):
            def work(m=m, o=o):
                o.zero_grad(set_to_none=False)
                return loss_of(m, batch).detach()
            drive(o, config, work)
        assert_same_params(n_model, model, f"zero-grad step {i}: ")


CLOSURE_CONFIGS = [c for c in SAMPLE if not c.closure_only]


@pytest.mark.parametrize("config", CLOSURE_CONFIGS, ids=ids(CLOSURE_CONFIGS))
def test_step_with_closure_matches_native(config: Config) -> None:
    """``opt.step(closure)`` runs the closure once and returns its loss, as natively (LBFGS,
    which requires a closure, runs every step through one in test_steps_match_native)."""
    n_model, native, model, opt = pair(config)
    for i, batch in enumerate(batches(3)):
        returned = []
        for m, o in ((n_model, native), (model, opt)):
            calls = []

            def closure(m=m, o=o, calls=calls):
                calls.append(1)
                o.zero_grad()
                loss = loss_of(m, batch)
                loss.backward()
                return loss
            returned.append(o.step(closure))
            assert len(calls) == 1, f"step {i}: closure ran {len(calls)} times"
        assert returned[0] is not None
        assert_same(returned[1], returned[0], f"step {i}: returned loss")
        assert_same_params(n_model, model, f"step {i}: ")


# -- state dicts -----------------------------------------------------------------------------------

def trained(config: Config, steps: int = 2, **kwargs):
    """``pair()`` after ``steps`` identical training steps."""
    n_model, native, model, opt = pair(config, **kwargs)
    for batch in batches(steps):
        train_step(n_model, native, batch, config)
        train_step(model, opt, batch, config)
    return n_model, native, model, opt


def fresh(config: Config, like: torch.nn.Module, kind: str):
    """A new model with ``like``'s weights, and a new optimizer on it (native or wrapped)."""
    model = make_model(config, next(like.parameters()).dtype)
    model.load_state_dict(like.state_dict())
    inner = config.build(param_groups(config, model))
    return model, (wrap(inner) if kind == "wrapper" else inner)


def continue_alike(config: Config, a, b, steps: int = 2) -> None:
    """Train (model, opt) pairs ``a`` and ``b`` on the same data; params equal throughout."""
    start = snapshot(b[0])
    for i, batch in enumerate(batches(steps)):
        train_step(*a, batch, config)
        train_step(*b, batch, config)
        assert_same_params(a[0], b[0], f"step {i} after loading: ")
    assert_moved(b[0], start)


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
    assert_same(osd, get_optimizer_state_dict(n_model, native), "get_optimizer_state_dict")
    a, b = fresh(config, n_model, "native"), fresh(config, model, "wrapper")
    # (a fresh optimizer has no state: DCP creates it with an lr=0 step on zero gradients)
    if same_outcome(lambda: set_optimizer_state_dict(*a, copy.deepcopy(osd)),
                    lambda: set_optimizer_state_dict(*b, copy.deepcopy(osd))):
        continue_alike(config, a, b)


def test_checkpoint_between_windows_carries_no_window() -> None:
    """Between windows the wrapper's extra state is scalars, not an empty fp32 window."""
    config = next(c for c in DEFAULTS if c.name == "Adam")
    _, _, model, opt = trained(config, accumulation_steps=2)
    sd = opt.state_dict()
    extra = [v for k, v in sd.items() if k not in ("state", "param_groups")]
    tensors = []
    pending = list(extra)
    while pending:
        v = pending.pop()
        if torch.is_tensor(v):
            tensors.append(v)
        elif isinstance(v, dict):
            pending += list(v.values())
        elif isinstance(v, (list, tuple)):
            pending += list(v)
    n_params = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in tensors) < n_params, \
        f"{sum(t.numel() for t in tensors)} tensor elements besides state/param_groups"
