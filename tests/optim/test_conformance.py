"""It is a torch.optim.Optimizer (DESIGN section of that name): AccumulatingOptimizer keeps
PyTorch's own optimizer contracts.

PyTorch checks every optimizer of ``optim_db`` against a set of contracts (TestOptimRenewed in
its test/test_optim.py): steps, closures, state dicts, hooks, error inputs. The same contracts
are restated here with ``AccumulatingOptimizer(optim_cls(params, **kwargs))`` in the
optimizer's place and native PyTorch, run on an identical model and data, as the judge.

Configurations (_conformance_common.py): ``ALL_CONFIGS`` is every CPU input of every
optim_db optimizer plus its foreach / fused / tensor-lr variants; contracts that do not depend
on the update rule run on ``SAMPLE`` (per optimizer its default and one config of each variant
kind) or ``DEFAULTS`` (one per optimizer). fp32 params are compared bit for bit (see the
precision note there). What stays refused is refused at construction with a ValueError or
TypeError naming the problem. The state-dict contracts (weights_only, both ways with native,
older torch, deepcopy/pickle, torch.distributed.checkpoint) run on the same configurations in
test_checkpoint.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _conformance_common import (
    ALL_CONFIGS,
    DEFAULTS,
    INFOS,
    SAMPLE,
    Config,
    OptimizerErrorEnum,
    assert_moved,
    assert_refused,
    assert_same,
    assert_same_params,
    batches,
    drive,
    fresh,
    ids,
    lockstep,
    loss_of,
    make_model,
    pair,
    snapshot,
    train_step,
    trained,
    wrap,
)
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

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


# -- hooks -----------------------------------------------------------------------------------------

def role(obj, opt) -> str:
    """What a hook received: the optimizer it was registered on, the wrapped one, or other."""
    return "opt" if obj is opt else "inner" if obj is getattr(opt, "optimizer", None) else "other"


def step_hook_log(opt, log: list) -> list:
    """Global (0 pre, 5 post) and per-instance (1 pre, 2 post) step hooks appending to log."""
    def hook(tag):
        return lambda o, args, kwargs: log.append((tag, role(o, opt), len(args), sorted(kwargs)))
    return [register_optimizer_step_pre_hook(hook(0)), opt.register_step_pre_hook(hook(1)),
            opt.register_step_post_hook(hook(2)), register_optimizer_step_post_hook(hook(5))]


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_step_hooks_fire_once_per_step_in_native_order(config: Config) -> None:
    """Global and per-instance step hooks: once per step, order [0, 1, 2, 5], native's args."""
    n_model, native, model, opt = pair(config)
    logs = []
    for m, o in ((n_model, native), (model, opt)):
        log: list = []
        handles = step_hook_log(o, log)
        try:
            for batch in batches(2):
                train_step(m, o, batch, config)
        finally:
            for h in handles:
                h.remove()
        logs.append(log)
    assert [e[0] for e in logs[0]] == [0, 1, 2, 5] * 2  # the restated contract, natively
    assert logs[1] == logs[0]


def test_no_op_step_fires_no_step_hooks() -> None:
    """Hooks mark real steps: a mid-window step() (accumulation_steps=2) fires none of them."""
    config = next(c for c in DEFAULTS if c.name == "SGD")
    _, _, model, opt = pair(config, accumulation_steps=2)
    log: list = []
    handles = step_hook_log(opt, log)
    try:
        for k, batch in enumerate(batches(2)):
            loss_of(model, batch).backward()
            opt.step()
            assert [e[0] for e in log] == ([] if k == 0 else [0, 1, 2, 5]), f"micro-batch {k}"
    finally:
        for h in handles:
            h.remove()


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_state_dict_hooks_run_like_native(config: Config) -> None:
    """state_dict pre hooks see the optimizer before packing, post hooks may rewrite the dict."""
    _, native, _, opt = trained(config, steps=1)
    results = []
    for o in (native, opt):
        log: list = []

        def pre(x, o=o, log=log):
            log.append(("pre", role(x, o)))
            x.state["marker"] = 1

        def post(x, sd, o=o, log=log):
            log.append(("post", role(x, o), sd["state"].pop("marker", None)))
            sd["post_hook_ran"] = True
            return sd
        o.register_state_dict_pre_hook(pre)
        o.register_state_dict_post_hook(post)
        sd = o.state_dict()
        o.state.pop("marker", None)
        results.append((log, sd.get("post_hook_ran"), "marker" in sd["state"]))
    assert results[0] == ([("pre", "opt"), ("post", "opt", 1)], True, False)  # natively
    assert results[1] == results[0]


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_load_state_dict_hooks_run_like_native(config: Config) -> None:
    """load pre hooks run in order (prepend first), one's returned dict replaces the input,
    in-place edits are loaded; the post hook runs after loading."""
    n_model, native, model, opt = trained(config, steps=1)
    logs = []
    for kind, (m, o) in (("native", (n_model, native)), ("wrapper", (model, opt))):
        _, dst = fresh(config, m, kind)
        log: list = []

        def edit(x, sd, dst=dst, log=log):
            log.append(("edit", role(x, dst), sd["param_groups"][0]["lr"]))
            sd["param_groups"][0]["lr"] = 0.002

        def replace(x, sd, dst=dst, log=log):
            log.append(("replace", role(x, dst), {"state", "param_groups"} <= set(sd)))
            new = copy.deepcopy(sd)
            new["param_groups"][0]["lr"] = 0.003
            return new
        dst.register_load_state_dict_pre_hook(edit)
        dst.register_load_state_dict_pre_hook(replace, prepend=True)
        dst.register_load_state_dict_post_hook(
            lambda x, dst=dst, log=log: log.append(("post", role(x, dst), x.param_groups[0]["lr"])))
        dst.load_state_dict(copy.deepcopy(o.state_dict()))
        logs.append(log)
    assert logs[0] == [("replace", "opt", True), ("edit", "opt", 0.003), ("post", "opt", 0.002)]
    assert logs[1] == logs[0]


# -- what the wrapper exposes ----------------------------------------------------------------------

@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_public_interface_of_the_inner_optimizer(config: Config) -> None:
    """Everything public on the native optimizer is there on the wrapper, which is an Optimizer
    and prints."""
    _, native, _, opt = pair(config)
    assert isinstance(opt, torch.optim.Optimizer)
    missing = [n for n in dir(native) if not n.startswith("_") and not hasattr(opt, n)]
    assert not missing, f"public names of {config.name} missing on the wrapper: {missing}"
    assert config.name in repr(opt) or "AccumulatingOptimizer" in repr(opt)


class ShiftingSGD(torch.optim.SGD):
    """Schedule-free style: eval() moves the params to another point, train() moves them back."""

    SHIFT = 0.5

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.mode = "train"

    @torch.no_grad()
    def _shift(self, sign: float, mode: str) -> None:
        if self.mode != mode:
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(sign * self.SHIFT)
            self.mode = mode

    def eval(self) -> None:
        self._shift(1.0, "eval")

    def train(self) -> None:
        self._shift(-1.0, "train")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16-masters"])
def test_train_eval_pass_through_and_move_the_model(dtype: torch.dtype) -> None:
    """opt.eval()/opt.train() reach the inner optimizer; with master weights the model's own
    weights move too (fp32 masters shifted, then rounded to bf16)."""
    config = next(c for c in DEFAULTS if c.name == "SGD")
    model = make_model(config, dtype)
    start = {n: p.detach().clone().float() for n, p in model.named_parameters()}
    opt = wrap(ShiftingSGD(model.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.Optimizer) and opt.mode == "train"
    opt.eval()
    assert opt.mode == "eval"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), (start[n] + 0.5).to(dtype)), f"eval(): {n} not shifted"
    opt.train()
    assert opt.mode == "train"
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), (start[n] + 0.5 - 0.5).to(dtype)), f"train(): {n}"


# -- errors and refusals ---------------------------------------------------------------------------

ERROR_CASES = [pytest.param(info, err, id=f"{name}-{err.optimizer_error_input.desc}")
               for name, info in INFOS.items()
               for err in info.optim_error_inputs_func(device="cpu", dtype=torch.float32)]


@pytest.mark.parametrize(("info", "err"), ERROR_CASES)
def test_error_inputs_raise_like_native(info, err) -> None:
    """optim_db's error inputs: construction errors are the inner optimizer's own; step errors
    (complex params) are refused by the wrapper at construction, naming the problem."""
    oi = err.optimizer_error_input
    params = oi.params if oi.params is not None else [nn.Parameter(torch.randn(2, 3))]

    def build():
        return info.optim_cls(params, **oi.kwargs)
    if err.error_on == OptimizerErrorEnum.STEP_ERROR:
        with pytest.raises(err.error_type, match=err.error_regex):
            build().step()
        assert any(p.is_complex() for p in params), "a step error this suite does not know"
        assert_refused(lambda: wrap(build()), "complex")
    elif issubclass(err.error_type, Warning):  # duplicate params: native warns and steps twice
        with pytest.warns(err.error_type, match=err.error_regex):
            inner = build()
        assert_refused(lambda: wrap(inner), "more than once", "duplicate")
    else:
        with pytest.raises(err.error_type, match=err.error_regex):
            build()


REFUSALS = [pytest.param(info, what, id=f"{name}-{what}") for name, info in INFOS.items()
            for what in ("complex", "meta", "differentiable", "sparse")
            if what != "differentiable" or what in info.supported_impls
            if what != "sparse" or info.supports_sparse or info.only_supports_sparse_grads
            if what not in ("complex", "meta") or not info.only_supports_sparse_grads]


@pytest.mark.parametrize(("info", "what"), REFUSALS)
def test_refused_at_construction(info, what: str) -> None:
    """Complex and meta params, sparse gradients, differentiable=True: a ValueError/TypeError
    naming the problem when the wrapper is built, and the model is left as it was."""
    model = nn.Embedding(10, 3, sparse=True) if what == "sparse" else make_model(
        next(c for c in DEFAULTS if c.info is info))
    params = {"complex": [nn.Parameter(torch.randn(3, 2, dtype=torch.complex64))],
              "meta": [nn.Parameter(torch.empty(3, 2, device="meta"))]}.get(
        what, list(model.parameters()))
    inner = info.optim_cls(params, **({"differentiable": True} if what == "differentiable" else {}))
    if what == "sparse" and not isinstance(inner, torch.optim.SparseAdam):  # the params alone do not say their gradients will be sparse: the
        # model does (refused at construction), else the first sparse gradient (refused
        # before anything is counted or written)
        assert_refused(lambda: wrap(inner, model=model), what)
        opt = wrap(inner)
        assert_refused(lambda: model(torch.randint(0, 10, (4,))).sum().backward(), what)
        assert opt.micro_steps == 0 and opt._parts.window.empty
        opt.remove_hooks()
        for p in model.parameters():
            p.grad = None
            del p.main_grad
    else:
        assert_refused(lambda: wrap(inner), what)
    if what in ("sparse", "differentiable"):
        out = model(torch.randint(0, 10, (4,))) if what == "sparse" else model(
            torch.randn(2, 5))
        out.square().sum().backward()
        for p in model.parameters():
            assert p.grad is not None and not hasattr(p, "main_grad"), "the model was touched"


# -- what native steps, the wrapper steps ----------------------------------------------------------

@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_float64_params_train_like_native(config: Config) -> None:
    """float64 params are stepped as natively, bit for bit."""
    lockstep(config, dtype=torch.float64)


@pytest.mark.parametrize("config", DEFAULTS, ids=ids(DEFAULTS))
def test_params_without_requires_grad_but_with_grad_are_stepped(config: Config) -> None:
    """A tensor with requires_grad=False in the optimizer, given a .grad: native steps it."""
    n_model, model = make_model(config), None
    model = copy.deepcopy(n_model)
    extra = [torch.randn(2, 3)]
    extra.append(extra[0].clone())
    native = config.build(list(n_model.parameters()) + [extra[0]])
    opt = wrap(config.build(list(model.parameters()) + [extra[1]]))
    start = extra[1].clone()
    for i, batch in enumerate(batches(2)):
        g = torch.randn(2, 3)
        for m, o, e in ((n_model, native, extra[0]), (model, opt, extra[1])):
            def work(m=m, o=o, e=e):
                o.zero_grad()
                loss = loss_of(m, batch)
                loss.backward()
                e.grad = g.clone()
                return loss.detach()
            drive(o, config, work)
        assert_same(extra[1], extra[0], f"step {i}: the requires_grad=False tensor")
        assert_same_params(n_model, model, f"step {i}: ")
    assert not torch.equal(extra[1], start), "not stepped"


def test_step_hooks_fire_once_when_the_patched_step_was_wrapped_again(monkeypatch) -> None:
    """A class whose patched step another wrapper took over with ``functools.wraps`` (what
    ``torch._dynamo``'s disable does once a test has compiled something): the inner
    optimizer's step still runs the global hooks once, not twice (seen in the full suite's
    order for LBFGS)."""
    import functools

    cfg = next(c for c in DEFAULTS if c.info.optim_cls is torch.optim.LBFGS)
    torch.optim.LBFGS([torch.nn.Parameter(torch.randn(2))])  # torch patches LBFGS.step now
    patched = torch.optim.LBFGS.step

    @functools.wraps(patched)
    def again(*args, **kwargs):
        return patched(*args, **kwargs)

    monkeypatch.setattr(torch.optim.LBFGS, "step", again)
    test_step_hooks_fire_once_per_step_in_native_order(cfg)
