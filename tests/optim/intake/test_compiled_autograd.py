"""Compiled autograd (``torch._dynamo.compiled_autograd``), one process: the wrapper trains as
natively (accumkernels.optim.intake.compiled).

Each loop runs natively and through the wrapper on the same init and fresh data, every backward
under compiled autograd, in two forms: the context manager around ``loss.backward()``
(``compiled_autograd._enable(torch.compile(backend="eager"))``) and the config flag
(``torch._dynamo.config.compiled_autograd = True``) with a torch.compile'd step that runs the
forward and the backward. fp32: params, and every ``p.grad`` after each backward, equal native
bit for bit (mid-window the sum; at the N-th backward with N given the sum divided as the step
divides it: by N for ``"mean"``, by the weights' total for ``"weighted"``). bf16: bit for bit a
loop that keeps fp32 masters by hand (fp32 sums of the bf16 gradients; with
``accumulate_in_backward=False`` autograd's bf16 sum, cast once). The by-name classes
(``accumkernels.optimizers``) and ``AccumulatingOptimizer(inner, ...)``, both
``accumulate_in_backward`` settings, the C and the Python hooks.

``fullgraph=True`` cannot trace the wrapper's hooks: Dynamo raises before the backward runs and
nothing changes; the same window then goes on with ``fullgraph=False`` as natively. What needs a
scale or a look at each gradient before it lands (``loss_scale``, ``nonfinite="skip_microbatch"``)
is refused at the backward's first hook, before any gradient of it landed.

On 88ed2c5 every backward under compiled autograd raised ``queue_callback() is only supported
when Compiled Autograd is enabled with fullgraph=True``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo import compiled_autograd

from accumkernels import AccumulatingOptimizer
from accumkernels import optimizers as by_name
from accumkernels.optim.intake import hooks as intake_hooks
from tests._native_common import D_IN, D_OUT, SMALL_BUCKET, mlp, mlp_batches, random_seed
from tests.optim._optim_common import checksum

WINDOWS = 2
WIDTHS = (D_IN, 16, D_OUT)  # (each param's two hooks are a graph break each: few params)
SGD_KW = {"lr": 0.1, "momentum": 0.9}
ADAMW_KW = {"lr": 0.01, "weight_decay": 0.01}
# (name, inner torch class, its kwargs, how the wrapper is built)
OPTIMIZERS = {
    "SGD-by-name": (torch.optim.SGD, SGD_KW, "by_name"),
    "AdamW-by-name": (torch.optim.AdamW, ADAMW_KW, "by_name"),
    "AdamW-wrapped": (torch.optim.AdamW, ADAMW_KW, "wrapped"),
}
# reduction -> (the wrapper's reduction, N)
REDUCTIONS = {"sum": ("sum", None), "mean-2": ("mean", 2), "mean-3": ("mean", 3),
              "weighted": ("weighted", 3)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles afresh (no graph of an earlier test's model or hooks is reused)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(params=["c", "python"])
def hooks(request, monkeypatch):
    if request.param == "python":
        monkeypatch.setattr(intake_hooks, "C_HOOKS", None)
    elif intake_hooks.C_HOOKS is None:
        pytest.fail("accumkernels._C lacks the C hooks (PreHook/PostHook)")
    return request.param


def _loss(model, x, y):
    return F.mse_loss(model(x).float(), y.float())


def backward_under(form: str, fullgraph: bool = False):
    """``run(model, (x, y))``: one micro-batch's forward and backward, the backward under
    compiled autograd in ``form`` ("context", "config"), or plain ("eager")."""
    if form == "eager":
        return lambda model, batch: _loss(model, *batch).backward()
    if form == "context":
        compiler = torch.compile(backend="eager", fullgraph=fullgraph)

        def run(model, batch):
            loss = _loss(model, *batch)
            with compiled_autograd._enable(compiler):
                loss.backward()
        return run
    override = {"fullgraph": True} if fullgraph else {}
    with torch._dynamo.config.patch(compiled_autograd=True,
                                    compiled_autograd_kwargs_override=override):
        @torch.compile(backend="eager")
        def step(model, x, y):
            _loss(model, x, y).backward()

    def run(model, batch):
        with torch._dynamo.config.patch(compiled_autograd=True,
                                        compiled_autograd_kwargs_override=override):
            step(model, *batch)
    return run


def _weights(n: int) -> list[float]:
    return [float(w) for w in torch.randint(1, 5, (n,))]


def _grads(model) -> list[torch.Tensor | None]:
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _window(model) -> list[torch.Tensor | None]:
    """What the wrapper shows of each param's gradient: ``.grad``, or for a bf16 param whose
    ``.grad`` is None the fp32 window in ``p.main_grad`` (under compiled autograd no fp32
    ``.grad`` sits on a bf16 param: compiled autograd could not capture the next backward)."""
    out = []
    for p in model.parameters():
        g = p.grad
        if p.dtype == torch.bfloat16:
            assert g is None or g.dtype == torch.bfloat16, "an fp32 .grad on a bf16 param"
            g = p.main_grad if g is None else g
        out.append(None if g is None else g.detach().clone())
    return out


def _build(kind: str, model, reduction: str, n, in_backward: bool, **extra):
    cls, kw, how = OPTIMIZERS[kind]
    options = dict(reduction=reduction, accumulation_steps=n, accumulate_in_backward=in_backward,
                   bucket_size_mb=SMALL_BUCKET, **extra)
    if how == "by_name":
        return getattr(by_name, cls.__name__)(model.parameters(), **kw, **options)
    return AccumulatingOptimizer(cls(model.parameters(), **kw), **options)


def _target(reduction: str, n: int, weights: list[float]) -> float:
    """What the step divides a window's sum by."""
    return {"sum": 1.0, "mean": float(n), "weighted": float(sum(weights))}[reduction]


def wrapped(model, opt, data, run, reduction, n, weights):
    """The wrapper's loop: every ``.grad`` after each backward, per window ``n`` backwards."""
    seen = []
    for k, batch in enumerate(data):
        if reduction == "weighted":
            opt.add_weight(weights[k])
        run(model, batch)
        seen.append(_window(model))
        if (k + 1) % n == 0:
            opt.step()
            opt.zero_grad()
    return seen


def native(model, kind, data, run, reduction, n, weights):
    """Native fp32: ``.grad`` after each backward (at the window's last the sum divided as the
    wrapper's step divides it: times 1/target), the step on the divided sum."""
    cls, kw, _ = OPTIMIZERS[kind]
    opt = cls(model.parameters(), **kw)
    seen = []
    for k, batch in enumerate(data):
        run(model, batch)
        last = (k + 1) % n == 0
        if last:
            target = _target(reduction, n, weights[k + 1 - n:k + 1])
            if target != 1.0:
                for p in model.parameters():
                    p.grad.mul_(1.0 / target)
        seen.append(_grads(model))
        if last:
            opt.step()
            opt.zero_grad()
    return seen


def hand_kept(model, kind, data, run, reduction, n, weights, in_backward, n_given):
    """bf16 model, fp32 masters kept by hand: each backward's bf16 gradient added in fp32
    (``accumulate_in_backward=False``: autograd's bf16 sum over the window, cast once), divided
    at the window's end, the torch optimizer on the masters, cast back. The gradient as the
    wrapper shows it: the fp32 sum (or autograd's bf16 sum while it stays in ``.grad``: until
    the N-th backward, with N None until the step)."""
    cls, kw, _ = OPTIMIZERS[kind]
    params = list(model.parameters())
    masters = [nn.Parameter(p.detach().float()) for p in params]
    opt = cls(masters, **kw)
    acc: list[torch.Tensor | None] = [None] * len(params)
    seen = []
    for k, batch in enumerate(data):
        run(model, batch)
        last = (k + 1) % n == 0
        moved = in_backward or (last and n_given)
        if not moved:
            seen.append(_grads(model))  # (autograd's bf16 sum, in .grad)
        if moved or last:
            for i, p in enumerate(params):
                g = p.grad.float()
                acc[i] = g if acc[i] is None else acc[i].add_(g)
                p.grad = None
        if last:
            target = _target(reduction, n, weights[k + 1 - n:k + 1])
            if target != 1.0:
                for a in acc:
                    a.mul_(1.0 / target)
        if moved:
            seen.append([a.clone() for a in acc])
        if last:
            for m, a in zip(masters, acc):
                m.grad = a
            opt.step()
            opt.zero_grad()
            acc = [None] * len(params)
            with torch.no_grad():
                for p, m in zip(params, masters):
                    p.copy_(m)
    return seen


def _assert_same(ours, ref, what):
    for k, (a, b) in enumerate(zip(ours, ref)):
        for i, (g, h) in enumerate(zip(a, b)):
            assert (g is None) == (h is None), f"{what}: backward {k}, param {i}: .grad " \
                                               f"{'None' if g is None else 'set'} vs native"
            if g is not None:
                assert g.dtype == h.dtype and torch.equal(g, h), \
                    f"{what}: backward {k}, param {i}: .grad differs by {(g - h).abs().max()}"


def _assert_params(model, ref, what):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"{what}: {name} differs by {(p.float() - q.float()).abs().max()}"


def _case(kind, reduction_id, in_backward, form, dtype, hooks_kind=None):
    reduction, n = REDUCTIONS[reduction_id]
    n_loop = n or 3
    start = mlp(dtype, WIDTHS, seed=random_seed())
    data = mlp_batches(n_loop * WINDOWS, dtype=dtype)
    weights = _weights(len(data))
    run = backward_under(form)
    ours = copy.deepcopy(start)
    opt = _build(kind, ours, reduction, n, in_backward)
    seen = wrapped(ours, opt, data, run, reduction, n_loop, weights)
    ref = copy.deepcopy(start)
    if dtype == torch.float32:
        ref_seen = native(ref, kind, data, run, reduction, n_loop, weights)
    else:
        ref_seen = hand_kept(ref, kind, data, run, reduction, n_loop, weights, in_backward,
                             n is not None)
    what = f"{kind} {reduction_id} in_backward={in_backward} {form} {dtype}"
    _assert_same(seen, ref_seen, what)
    _assert_params(ours, ref, what)
    assert not torch.equal(next(ours.parameters()), next(start.parameters()))  # it trained
    return ours, data, weights, start


def _cases(*rows):
    """(optimizer, reduction, accumulate_in_backward) rows: every reduction in both settings for
    the by-name SGD, and each of the others under each optimizer (the compiles are slow)."""
    out = []
    for kind, reductions, settings in rows:
        for r in reductions:
            for in_backward in settings:
                mode = "in_backward" if in_backward else "unmoved"
                out.append(pytest.param(kind, r, in_backward, id=f"{kind}-{r}-{mode}"))
    return out


BOTH, ALL = (True, False), list(REDUCTIONS)
FP32_CASES = _cases(("SGD-by-name", ALL, BOTH), ("AdamW-by-name", ALL, (True,)),
                    ("AdamW-wrapped", ALL, (False,)))
CONFIG_CASES = _cases(("SGD-by-name", ["sum", "mean-2"], BOTH),
                      ("AdamW-wrapped", ["weighted"], BOTH))
BF16_CASES = _cases(("SGD-by-name", ALL, BOTH), ("AdamW-wrapped", ["sum", "mean-3"], (True,)),
                    ("AdamW-by-name", ["weighted"], (False,)))


@pytest.mark.parametrize("kind, reduction_id, in_backward", FP32_CASES)
def test_fp32_as_native_context_form(kind, reduction_id, in_backward):
    _case(kind, reduction_id, in_backward, "context", torch.float32)


@pytest.mark.parametrize("kind, reduction_id, in_backward", CONFIG_CASES)
def test_fp32_as_native_config_form(kind, reduction_id, in_backward):
    _case(kind, reduction_id, in_backward, "config", torch.float32)


@pytest.mark.parametrize("kind, reduction_id, in_backward", BF16_CASES)
def test_bf16_as_hand_kept_masters(kind, reduction_id, in_backward):
    _case(kind, reduction_id, in_backward, "context", torch.bfloat16)


@pytest.mark.parametrize("reduction_id", ["sum", "mean-2"])
def test_c_and_python_hooks_alike(hooks, reduction_id):
    _case("SGD-by-name", reduction_id, True, "context", torch.float32)


def test_compiled_model_backward_outside_as_native():
    """The config flag with a torch.compile'd model whose backward runs outside the compiled
    call: torch leaves that backward to plain autograd; the wrapper trains as natively."""
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(3 * WINDOWS)
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    with torch._dynamo.config.patch(compiled_autograd=True):
        ours_c, ref_c = torch.compile(ours, backend="eager"), torch.compile(ref, backend="eager")
        opt = _build("AdamW-wrapped", ours, "mean", 3, True)
        seen = wrapped(ours_c, opt, data, backward_under("eager"), "mean", 3, [])
        ref_seen = native(ref_c, "AdamW-wrapped", data, backward_under("eager"), "mean", 3, [])
    _assert_same(seen, ref_seen, "compiled model")
    _assert_params(ours, ref, "compiled model")


def test_windows_carried_and_assigned_grads_as_native():
    """No clear between windows (the next window adds to what the step used, as native
    ``.grad`` does) and a ``.grad`` assigned mid-window (what p's gradient means from then on):
    under compiled autograd autograd adds into both as it finds them."""
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(9)
    run = backward_under("context")

    def loop(model, opt):
        seen = []
        for k, batch in enumerate(data):
            run(model, batch)
            if k == 4:
                p = next(iter(model.parameters()))
                p.grad = p.grad * 2
            seen.append(_grads(model))
            if k % 3 == 2:
                opt.step()  # (no zero_grad: the next window adds to this one)
        return seen

    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    seen = loop(ours, _build("SGD-by-name", ours, "sum", None, True))
    ref_seen = loop(ref, torch.optim.SGD(ref.parameters(), **SGD_KW))
    _assert_same(seen, ref_seen, "carried/assigned")
    _assert_params(ours, ref, "carried/assigned")


def test_user_post_accumulate_hooks_see_native_grad():
    """A post-accumulate-grad hook of the user's sees the running sum in ``.grad``, as
    natively (the wrapper's front hook finds autograd's sum in the view already)."""
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(6)
    run = backward_under("context")

    def loop(model, opt):
        seen = []
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda q: seen.append(q.grad.detach().clone()))
        for k, batch in enumerate(data):
            run(model, batch)
            if k % 3 == 2:
                opt.step()
                opt.zero_grad()
        return seen

    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    seen = loop(ours, _build("SGD-by-name", ours, "sum", None, True))
    ref_seen = loop(ref, torch.optim.SGD(ref.parameters(), **SGD_KW))
    assert len(seen) == len(ref_seen) == 6 * len(list(start.parameters()))
    for k, (g, h) in enumerate(zip(seen, ref_seen)):
        assert torch.equal(g, h), f"hook call {k}: sees {(g - h).abs().max()} off native"
    _assert_params(ours, ref, "user hooks")


@pytest.mark.parametrize("form", ["context", "config"])
def test_fullgraph_raises_before_anything_changes(form, hooks):
    """``fullgraph=True`` cannot trace the wrapper's hooks (they run eagerly): Dynamo raises
    before the backward runs, nothing changes, and the same window goes on with
    ``fullgraph=False`` as natively."""
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(6)
    loose, strict = backward_under(form), backward_under(form, fullgraph=True)
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = _build("SGD-by-name", ours, "mean", 3, True)
    seen = []
    for k, batch in enumerate(data):
        if k in (1, 3):  # mid-window, and a window's first backward
            before = checksum(opt, ours)
            match = "fullgraph=False" if hooks == "python" else "PreHook"
            with pytest.raises(torch._dynamo.exc.Unsupported, match=match):
                strict(ours, batch)
            assert checksum(opt, ours) == before, "a refused backward changed something"
            torch._dynamo.reset()  # (compiled autograd keeps the graph fullgraph=True compiles)
        loose(ours, batch)
        seen.append(_grads(ours))
        if k % 3 == 2:
            opt.step()
            opt.zero_grad()
    ref_seen = native(ref, "SGD-by-name", data, loose, "mean", 3, [])
    _assert_same(seen, ref_seen, "after fullgraph=True")
    _assert_params(ours, ref, "after fullgraph=True")


@pytest.mark.parametrize("refused", ["loss_scale", "skip_microbatch"])
def test_refused_options_raise_before_anything_lands(refused, hooks):
    """What compiled autograd cannot meet (a loss scale, a look at each micro-batch before it
    lands) raises at the backward's first hook, naming what to do instead; nothing changed, and
    the window goes on outside compiled autograd as natively."""
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(4)
    extra = {"loss_scale": 4.0} if refused == "loss_scale" else {"nonfinite": "skip_microbatch"}
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)
    opt = _build("SGD-by-name", ours, "sum", 2, True, **extra)
    compiler = torch.compile(backend="eager")
    for k, batch in enumerate(data):
        if k in (0, 1):  # a window's first backward, and mid-window
            before = checksum(opt, ours)
            loss = opt.scale_loss(_loss(ours, *batch))
            with pytest.raises(RuntimeError, match=f"{refused}.*outside compiled autograd"):
                with compiled_autograd._enable(compiler):
                    loss.backward()
            assert checksum(opt, ours) == before, "a refused backward changed something"
        opt.scale_loss(_loss(ours, *batch)).backward()
        if k % 2 == 1:
            opt.step()
            opt.zero_grad()
    native(ref, "SGD-by-name", data, backward_under("eager"), "sum", 2, [])
    for (name, p), q in zip(ours.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)  # (1/S fused: rounds)


@pytest.mark.parametrize("reduction_id", list(REDUCTIONS))
def test_as_the_eager_wrapper(reduction_id):
    """Against the wrapper without compiled autograd, and with the two mixed (plain and compiled
    backwards alternating: at the first compiled one, mid-window, the 1/N fused so far is given
    up for good): params bit for bit alike, ``.grad`` alike after every backward except where
    the eager wrapper fuses 1/N (``"mean"``, N a power of two: mid-window it shows the sum
    times 1/N; natively, and under compiled autograd, ``.grad`` holds the sum)."""
    reduction, n = REDUCTIONS[reduction_id]
    n_loop = n or 3
    start = mlp(widths=WIDTHS, seed=random_seed())
    data = mlp_batches(n_loop * WINDOWS)
    weights = _weights(len(data))
    ca, plain = backward_under("context"), backward_under("eager")
    mixed = lambda model, batch, k=iter(range(len(data))): (  # noqa: E731
        ca if next(k) % 2 else plain)(model, batch)
    runs = {}
    for name, run in (("compiled", ca), ("eager", plain), ("mixed", mixed)):
        model = copy.deepcopy(start)
        opt = _build("SGD-by-name", model, reduction, n, True)
        runs[name] = (model, wrapped(model, opt, data, run, reduction, n_loop, weights))
    fused = reduction == "mean" and n & (n - 1) == 0
    for k, (ours, eager) in enumerate(zip(runs["compiled"][1], runs["eager"][1])):
        mid = (k + 1) % n_loop != 0
        for i, (g, h) in enumerate(zip(ours, eager)):
            want = g * (1.0 / n) if fused and mid else g
            assert torch.equal(want, h), f"backward {k}, param {i}: eager shows another .grad"
    # (the mixed run's first backward is plain, before any compiled one: the eager wrapper's)
    _assert_same(runs["mixed"][1][:1], runs["eager"][1][:1], "mixed, first backward")
    _assert_same(runs["mixed"][1][1:], runs["compiled"][1][1:], "mixed")
    _assert_params(runs["compiled"][0], runs["eager"][0], "compiled vs eager")
    _assert_params(runs["mixed"][0], runs["eager"][0], "mixed vs eager")


def test_bf16_first_compiled_backward_mid_window_fails_in_torch_and_changes_nothing():
    """bf16 params show their fp32 view in ``.grad`` until the wrapper met compiled autograd;
    a first compiled backward that finds them there cannot be captured (torch: its fake copy of
    the param takes no ``grad_dtype``) and raises before it runs. Nothing changed; with N given
    ``opt.zero_grad()`` keeps the window and clears ``.grad``, and the window goes on under
    compiled autograd as the hand-kept masters do (the fix the docs give)."""
    start = mlp(torch.bfloat16, WIDTHS, seed=random_seed())
    data = mlp_batches(3 * WINDOWS, dtype=torch.bfloat16)
    ca, plain = backward_under("context"), backward_under("eager")
    ours = copy.deepcopy(start)
    opt = _build("SGD-by-name", ours, "mean", 3, True)
    for k, batch in enumerate(data):
        if k == 1:
            before = checksum(opt, ours)
            with pytest.raises(NotImplementedError, match="compiled autograd"):
                ca(ours, batch)
            assert checksum(opt, ours) == before, "the failed backward changed something"
            torch._dynamo.reset()
            opt.zero_grad()  # (N given: the window stays, .grad is cleared)
        (plain if k == 0 else ca)(ours, batch)
        if k % 3 == 2:
            opt.step()
            opt.zero_grad()
    ref = copy.deepcopy(start)
    hand_kept(ref, "SGD-by-name", data, plain, "mean", 3, [], True, True)
    _assert_params(ours, ref, "after the failed capture")


def test_low_precision_params_warn_that_only_opt_zero_grad_clears():
    """bf16 params under compiled autograd show no window in ``.grad`` (it is in
    ``p.main_grad``): ``model.zero_grad()`` cannot reach it, and the first compiled backward
    says so once (an AccumulationWarning naming ``opt.zero_grad()``); an fp32 model does not."""
    import warnings

    from accumkernels.optim import AccumulationWarning

    for dtype, warns in ((torch.bfloat16, True), (torch.float32, False)):
        torch._dynamo.reset()
        model = nn.Linear(4, 2).to(dtype)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(2):
                with compiled_autograd._enable(torch.compile(backend="eager")):
                    model(torch.randn(3, 4, dtype=dtype)).float().sum().backward()
        ours = [w for w in seen if issubclass(w.category, AccumulationWarning)]
        assert len(ours) == (1 if warns else 0), [str(w.message) for w in ours]
        if warns:
            assert "opt.zero_grad()" in str(ours[0].message)
        opt.step()
