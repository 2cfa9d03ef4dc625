"""fuse_wgrad_accumulation: nn.Linear weight gradients written straight into the fp32 window.

References are independent of the code under test: float64 sums of ``dy^T x`` built from the
activations and output gradients that module hooks capture, and the unfused wrapper (or plain
PyTorch) run on a deep copy of the model with the same data.
"""

from __future__ import annotations

import copy
import gc
import io
import os
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from accumkernels import AccumulatingOptimizer, wgrad
from accumkernels.slot import SLOT_ATTR, SlotWrite
from accumkernels.wgrad import fuse_wgrad_accumulation, gemms

HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
               not HAS_CUDA, reason="no GPU")])]


def make_mlp(dtype=torch.float32, device="cpu") -> nn.Sequential:
    """Three Linear layers, the middle one without bias. Weight shapes (48, 24), (32, 48), (8, 32)
    differ from every activation shape used below, so a weight-shaped tensor is a weight grad."""
    return nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 32, bias=False), nn.Tanh(),
                         nn.Linear(32, 8)).to(device, dtype)


def linears(model):
    return [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def make_inputs(n, dtype=torch.float32, device="cpu", shape=(4, 5)):
    return [torch.randn(*shape, 24, device=device).to(dtype) for _ in range(n)]


def loss_fn(out):
    return out.float().square().sum()


def capture(model):
    """Per Linear: the (x, dy) pairs of every forward/backward, as autograd saw them."""
    rec = {name: [] for name, _ in linears(model)}

    def hook(name):
        def fwd(module, args, out):
            entry = [args[0].detach().clone(), None]
            rec[name].append(entry)
            if out.requires_grad:
                out.register_hook(lambda g: entry.__setitem__(1, g.detach().clone()))
        return fwd

    handles = [m.register_forward_hook(hook(name)) for name, m in linears(model)]
    return rec, handles


def reference_wgrads(rec, in_dtype=None):
    """Float64 sum over micro-batches of dy^T x (x cast to in_dtype first, as autocast does)."""
    out = {}
    for name, pairs in rec.items():
        total = 0
        for x, dy in pairs:
            x = x.to(in_dtype) if in_dtype is not None else x
            total = total + dy.reshape(-1, dy.shape[-1]).double().t() @ \
                x.reshape(-1, x.shape[-1]).double()
        out[name] = total
    return out


def rel_err(a, ref):
    """Frobenius-norm relative error against a float64 reference."""
    return ((a.double().cpu() - ref.cpu()).norm() / ref.cpu().norm()).item()


def wrap(model, **kw):
    kw.setdefault("accumulation_steps", 6)
    lr = kw.pop("lr", 0.1)
    return AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), **kw)


def pair(dtype=torch.float32, device="cpu", model=None, **kw):
    """(fused model, its optimizer, handle, unfused copy, its optimizer)."""
    model = model if model is not None else make_mlp(dtype, device)
    ref = copy.deepcopy(model)
    opt = wrap(model, **kw)
    handle = fuse_wgrad_accumulation(model, opt)
    ref_opt = wrap(ref, **kw)
    return model, opt, handle, ref, ref_opt


# -- the wrapper contract this relies on ---------------------------------------------------------

class _NoWeightGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensors
        return dy @ w, None


def test_wrapper_tolerates_a_param_whose_gradient_is_undefined():
    """What a fused weight looks like to the wrapper: autograd runs the weight's AccumulateGrad,
    and the wrapper's post-accumulate-grad hook, with an undefined gradient (here: a custom
    Function returning None for it). The wrapper must treat it as arrived with nothing to move."""
    w = nn.Parameter(torch.randn(3, 4))
    b = nn.Parameter(torch.randn(3))
    opt = AccumulatingOptimizer(torch.optim.SGD([w, b], lr=0.1), accumulation_steps=2)
    x = torch.randn(5, 4)
    for _ in range(2):
        (_NoWeightGrad.apply(x, w) + b).square().sum().backward()
    assert w.grad is None and b.grad is not None  # the boundary shows what was accumulated
    assert torch.count_nonzero(w.main_grad) == 0
    opt.step()


# -- the slot protocol is all it needs ------------------------------------------------------------

class _Owner:
    """A minimal owner of gradient slots (accumkernels.slot) with its own fp32 window, no
    AccumulatingOptimizer involved. Windows start as NaN: a missed first-write overwrite shows."""

    def __init__(self, params, scale=0.5, fusable=True):
        self.param_groups = [{"params": list(params)}]
        self.views = {id(p): torch.full(p.shape, float("nan")) for p in params}
        self.scale, self.fusable = scale, fusable
        self.touched, self.claims = set(), []
        self.found_inf = torch.zeros(1)
        slot = _OwnerSlot(self)
        for p in params:
            setattr(p, SLOT_ATTR, slot)

    def view(self, p):
        return self.views[id(p)]


class _OwnerSlot:
    def __init__(self, owner):
        self._owner = weakref.ref(owner)

    @property
    def owner(self):
        return self._owner()

    def check_fusable(self):
        if not self.owner.fusable:
            raise ValueError("this owner takes no fused writes")

    def claim(self, p):
        owner = self.owner
        owner.claims.append(p)
        overwrite = id(p) not in owner.touched
        owner.touched.add(id(p))
        return SlotWrite(owner.views[id(p)], owner.scale, overwrite, owner.found_inf)


def test_any_slot_owner_gets_the_fused_writes():
    """The protocol alone: eligibility is "the weight's slot is the optimizer's", the write is
    view = (0 if overwrite else view) + scale * dy^T x in fp32, and found_inf is set on a
    non-finite gradient. The bias (owned too) takes the usual path: its .grad."""
    lin = nn.Linear(6, 4)
    owner = _Owner([lin.weight, lin.bias], scale=0.5)
    handle = fuse_wgrad_accumulation(lin, owner)
    assert handle.layer_names == [""]
    rec, _ = capture(nn.Sequential(lin))
    for _ in range(2):
        lin(torch.randn(3, 6)).square().sum().backward()
    expected = 0.5 * reference_wgrads(rec)["0"]
    torch.testing.assert_close(owner.view(lin.weight).double(), expected, rtol=1e-6, atol=1e-7)
    assert owner.claims == [lin.weight, lin.weight]
    assert lin.weight.grad is None and lin.bias.grad is not None
    assert torch.count_nonzero(torch.isnan(owner.view(lin.bias))) == lin.bias.numel()
    assert owner.found_inf.item() == 0
    x = torch.randn(3, 6)
    x[1, 2] = float("inf")
    with torch.no_grad():
        lin.weight[:, 2] = 0  # the output stays finite; the weight gradient does not
    lin(x).sum().backward()
    assert owner.found_inf.item() == 1.0


def test_owner_checks_and_plain_path_once_the_slot_is_not_the_optimizers():
    lin = nn.Linear(6, 4)
    with pytest.raises(ValueError, match="no fused writes"):
        fuse_wgrad_accumulation(lin, _Owner([lin.weight], fusable=False))
    with pytest.raises(TypeError, match="AccumulatingOptimizer"):  # owns no slot
        fuse_wgrad_accumulation(lin, torch.optim.SGD(lin.parameters(), lr=0.1))
    owner = _Owner([lin.weight])
    fuse_wgrad_accumulation(lin, owner)
    thief = _Owner([lin.weight])  # another owner takes the weight over
    lin(torch.randn(3, 6)).sum().backward()
    assert lin.weight.grad is not None  # the usual path
    assert owner.claims == [] and thief.claims == []
    lin.weight.grad = None
    setattr(lin.weight, SLOT_ATTR, _OwnerSlot(owner))  # back to the fused-for owner
    lin(torch.randn(3, 6)).sum().backward()
    assert lin.weight.grad is None and owner.claims == [lin.weight]
    del owner
    gc.collect()  # the optimizer is gone: wgrad held it weakly, and writes nowhere
    lin(torch.randn(3, 6)).sum().backward()
    assert lin.weight.grad is not None


# -- precision ------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_bf16_fused_is_fp32_exact_unfused_is_not(device):
    """bf16 MLP, 6 micro-batches, reduction='sum': the fused weight gradients are an fp32 GEMM of
    exact bf16 products (a bf16 x bf16 product has 16 significant bits, exact in fp32), so their
    error is fp32 summation error only: <= K*u*sum|terms| elementwise, in practice ~sqrt(K)*u
    ~ 1e-7..1e-6 in Frobenius-norm relative terms (u = 2^-24, K = tokens per window). The unfused
    wrapper rounds each micro-batch's weight gradient to bf16 (u = 2^-8): ~1e-3."""
    N = 6
    model, opt, handle, ref, ref_opt = pair(torch.bfloat16, device, reduction="sum",
                                            accumulation_steps=N)
    assert handle.num_layers == 3
    rec, _ = capture(model)
    ref_rec, _ = capture(ref)
    for x in make_inputs(N, torch.bfloat16, device, shape=(8, 8)):
        loss_fn(model(x)).backward()
        loss_fn(ref(x)).backward()
    assert opt.sync_step and ref_opt.sync_step  # the boundary: main_grad is the window's sum
    fused_ref, unfused_ref = reference_wgrads(rec), reference_wgrads(ref_rec)
    mods, ref_mods = dict(linears(model)), dict(linears(ref))
    for name in fused_ref:
        fused = rel_err(mods[name].weight.main_grad, fused_ref[name])
        unfused = rel_err(ref_mods[name].weight.main_grad, unfused_ref[name])
        assert fused <= 1e-5, (name, fused)
        assert unfused > 1e-4, (name, unfused)  # the test can tell the two apart
        assert fused <= unfused, (name, fused, unfused)
    # Biases take the usual path: the same bf16 gradients, accumulated the same way.
    for (_, m), (_, r) in zip(linears(model), linears(ref)):
        if m.bias is not None:
            torch.testing.assert_close(m.bias.main_grad, r.bias.main_grad, rtol=0, atol=0)


class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in result if isinstance(result, (tuple, list)) else [result]:
            if isinstance(t, torch.Tensor):
                self.outputs.append((str(func), tuple(t.shape), t.dtype))
        return result


@pytest.mark.parametrize("fused", [True, False])
def test_autograd_never_materialises_a_weight_gradient(fused):
    N = 3
    model = make_mlp(torch.bfloat16)
    opt = wrap(model, accumulation_steps=N)
    if fused:
        fuse_wgrad_accumulation(model, opt)
    weights = [m.weight for _, m in linears(model)]
    seen_pre, seen_post = [], []
    for w in weights:
        w.register_hook(lambda g: seen_pre.append(g))
        w.register_post_accumulate_grad_hook(lambda p: seen_post.append(p.grad))
    shapes = {tuple(w.shape) for w in weights}
    for i, x in enumerate(make_inputs(N, torch.bfloat16)):
        loss = loss_fn(model(x))
        with _OpLog() as log:
            loss.backward()
        weight_grads = [o for o in log.outputs if o[1] in shapes and o[2] == torch.bfloat16]
        if not fused:  # the detector sees the native weight gradients
            assert weight_grads
            continue
        assert weight_grads == [], weight_grads
        # AccumulateGrad still runs for the weight (it stays an autograd input) but gets nothing.
        assert all(g is None for g in seen_pre) and all(g is None for g in seen_post)
        assert all(torch.count_nonzero(w.main_grad) > 0 for w in weights)  # written, fused
    assert opt.micro_steps == N


# -- the window and the reductions --------------------------------------------------------------

def train(model, opt, data, *, reduction="sum", loss_scale=None, steps=3, window=3):
    """Micro-batches of (x, y); step() every micro-batch when N is known (Accelerate-style),
    else at the end of each window. Returns the main_grad of every param seen at each boundary."""
    seen = []
    for i, (x, y) in enumerate(data):
        loss = F.mse_loss(model(x), y, reduction="sum" if reduction == "weighted" else "mean")
        (opt.scale_loss(loss) if loss_scale else loss).backward()
        if reduction == "weighted":
            opt.add_weight(x.shape[0])
        if steps is not None or i % window == window - 1:
            if opt.sync_step and opt.accumulate_in_backward and steps is not None:
                seen.append([p.main_grad.clone() for p in model.parameters()])
            opt.step()
    return seen


def random_data(sizes, dtype=torch.float32, device="cpu"):
    return [(torch.randn(n, 24, device=device).to(dtype), torch.randn(n, 8, device=device).to(dtype))
            for n in sizes]


@pytest.mark.parametrize("reduction,loss_scale,steps", [
    ("sum", None, 3), ("mean", None, 3), ("mean", None, None), ("mean", 1024.0, 3),
    ("weighted", None, 3), ("weighted", 64.0, 3), ("weighted", None, None)])
@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
def test_reductions_match_unfused(reduction, loss_scale, steps, in_backward):
    """fp32 model, two windows of 3 micro-batches with different token counts: the fused GEMM
    (beta=1, alpha=scale) and the unfused path (mm, then dst + scale*g) differ by fp32 rounding
    only, in the window's gradient and in the params after two SGD-with-momentum steps."""
    kw = {"reduction": reduction, "loss_scale": loss_scale, "accumulation_steps": steps,
              "accumulate_in_backward": in_backward}
    model = make_mlp()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), **kw)
    ref_opt = AccumulatingOptimizer(torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), **kw)
    assert fuse_wgrad_accumulation(model, opt).num_layers == 3
    data = random_data([3, 1, 5, 2, 4, 6])
    run = {"reduction": reduction, "loss_scale": loss_scale, "steps": steps}
    fused_seen = train(model, opt, data, **run)
    ref_seen = train(ref, ref_opt, data, **run)
    assert len(fused_seen) == len(ref_seen)
    for fused_grads, ref_grads in zip(fused_seen, ref_seen):
        for g, r in zip(fused_grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-7)
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert opt.micro_steps == ref_opt.micro_steps == 0
    assert opt.skipped_steps == ref_opt.skipped_steps == 0


def test_microbatch_with_only_fused_layers_counts():
    """A bias-free Linear-only model on inputs without grad: no param reaches the wrapper through
    autograd's .grad, yet every backward is one micro-batch and the step comes after N."""
    N, lr = 3, 0.5
    model = nn.Sequential(nn.Linear(6, 5, bias=False), nn.Linear(5, 3, bias=False))
    ref = copy.deepcopy(model)
    opt = wrap(model, accumulation_steps=N, lr=lr)
    fuse_wgrad_accumulation(model, opt)
    start = [p.detach().clone() for p in model.parameters()]
    for i in range(N):
        x = torch.randn(4, 6)
        loss_fn(model(x)).backward()
        loss_fn(ref(x)).backward()  # native: .grad accumulates the sum
        assert opt.micro_steps == i + 1
        assert opt.sync_step == (i == N - 1)
        opt.step()
        if i < N - 1:
            assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    assert opt.micro_steps == 0  # the window ended with the step
    for p, q, s in zip(model.parameters(), ref.parameters(), start):
        torch.testing.assert_close(p, s - lr * q.grad, rtol=1e-5, atol=1e-6)


def test_remove_restores_layers_and_training_continues():
    N = 4
    model, opt, handle, ref, ref_opt = pair(accumulation_steps=N)
    data = random_data([3, 2, 4, 1, 5, 2, 3, 4])
    for i, (x, y) in enumerate(data):
        if i == 2:  # mid-window
            handle.remove()
            assert handle.removed and handle.num_layers == 3
            for _, m in linears(model):
                assert "forward" not in m.__dict__
                assert m.forward.__func__ is nn.Linear.forward
            handle.remove()  # idempotent
        for m, o in ((model, opt), (ref, ref_opt)):
            F.mse_loss(m(x), y).backward()
            o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    # Once removed, the same layers can be fused again.
    again = fuse_wgrad_accumulation(model, opt)
    assert again.num_layers == 3
    with again:  # the handle is also a context manager
        pass
    assert again.removed


def test_checkpoint_resume_mid_window():
    """Save model + optimizer after 6 of 8 micro-batches (mid-window, N=4), load both into fresh
    objects (weights_only=True), fuse, finish: bitwise equal to an uninterrupted run."""
    N = 4
    data = random_data([3, 2, 4, 1, 5, 2, 3, 4], torch.bfloat16)

    def build(model):
        opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    accumulation_steps=N)
        fuse_wgrad_accumulation(model, opt)
        return opt

    def micro(model, opt, batch):
        x, y = batch
        F.mse_loss(model(x).float(), y.float()).backward()
        opt.step()

    model = make_mlp(torch.bfloat16)
    fresh = copy.deepcopy(model)
    opt = build(model)
    for batch in data:
        micro(model, opt, batch)

    model2 = copy.deepcopy(fresh)
    opt2 = build(model2)
    for batch in data[:6]:
        micro(model2, opt2, batch)
    blob = io.BytesIO()
    torch.save({"model": model2.state_dict(), "opt": opt2.state_dict()}, blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=True)
    model3 = copy.deepcopy(fresh)
    opt3 = build(model3)
    model3.load_state_dict(state["model"])
    opt3.load_state_dict(state["opt"])
    assert opt3.micro_steps == 2
    for batch in data[6:]:
        micro(model3, opt3, batch)
    for p, q in zip(model.parameters(), model3.parameters()):
        assert torch.equal(p, q)


# -- errors, eligibility, modes -------------------------------------------------------------------

def test_bad_arguments():
    model = make_mlp()
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="AccumulatingOptimizer"):
        fuse_wgrad_accumulation(model, plain)
    opt = wrap(model)
    with pytest.raises(TypeError, match="nn.Module"):
        fuse_wgrad_accumulation(list(model.parameters()), opt)
    with pytest.raises(ValueError, match="backend"):
        fuse_wgrad_accumulation(model, opt, backend="cublas")
    bf16 = make_mlp(torch.bfloat16)
    with pytest.raises(ValueError, match="not usable"):  # cuBLAS-only paths on a CPU model
        fuse_wgrad_accumulation(bf16, wrap(bf16), backend="addmm_out_dtype")
    assert all("forward" not in m.__dict__ for _, m in linears(bf16))  # nothing patched
    other = make_mlp()  # its own params: wrapping model's again would take them over from opt
    with pytest.raises(ValueError, match="skip_microbatch"):
        fuse_wgrad_accumulation(other, wrap(other, nonfinite="skip_microbatch"))
    assert all("forward" not in m.__dict__ for _, m in linears(other))
    handle = fuse_wgrad_accumulation(model, opt)
    with pytest.raises(RuntimeError, match="already fused"):
        fuse_wgrad_accumulation(model, opt)
    third = make_mlp()
    with pytest.raises(RuntimeError, match="already fused"):  # via another optimizer too
        fuse_wgrad_accumulation(nn.Sequential(third, model[0]), wrap(third))
    assert all("forward" not in m.__dict__ for _, m in linears(third))
    handle.remove()
    assert all("forward" not in m.__dict__ for _, m in linears(model))


def test_only_managed_trainable_plain_linears_are_fused():
    class MyLinear(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 4), MyLinear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4),
                          nn.Linear(4, 4))
    model[2].weight.requires_grad_(False)  # frozen
    model[3].forward = model[3].forward  # already patched by someone at instance level
    managed = [p for i, m in enumerate(model) if i != 4 for p in m.parameters()]
    opt = AccumulatingOptimizer(torch.optim.SGD(managed, lr=0.1))  # model[4] not managed
    handle = fuse_wgrad_accumulation(model, opt)
    assert handle.layer_names == ["0"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle.remove()
    with pytest.warns(UserWarning, match="nothing was fused"):
        empty = fuse_wgrad_accumulation(nn.Sequential(nn.ReLU()), opt)
    assert empty.num_layers == 0


def test_inference_and_eval_use_the_plain_path():
    model, opt, _, ref, _ref_opt = pair(torch.bfloat16)
    x = torch.randn(3, 24, dtype=torch.bfloat16)
    for m in (model, ref):
        m.eval()
    with torch.no_grad():
        assert torch.equal(model(x), ref(x))
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))
    model.train()
    ref.train()
    assert torch.equal(model(x), ref(x))  # same forward with autograd on
    assert opt.micro_steps == 0


def test_deepcopy_of_a_fused_model_is_plain():
    """A deep copy of a fused model (deepcopy rebinds the patched forward to the copy) runs the
    usual path, leaves the original's window alone, and can be fused with its own optimizer."""
    model, opt, _, _, _ref_opt = pair(accumulation_steps=2)
    clone = copy.deepcopy(model)
    before = [p.main_grad.clone() for p in model.parameters()]
    loss_fn(clone(torch.randn(3, 24))).backward()
    assert all(p.grad is not None for p in clone.parameters())
    assert all(torch.equal(p.main_grad, b) for p, b in zip(model.parameters(), before))
    assert opt.micro_steps == 0
    clone.zero_grad()
    clone_opt = wrap(clone, accumulation_steps=2)
    assert fuse_wgrad_accumulation(clone, clone_opt).num_layers == 3
    seen = []
    clone[0].weight.register_hook(seen.append)
    loss_fn(clone(torch.randn(3, 24))).backward()
    assert clone_opt.micro_steps == 1 and seen == [None]  # fused: autograd carried nothing


def test_autograd_grad_does_not_write_and_returns_the_weight_gradient():
    """torch.autograd.grad w.r.t. inputs leaves the window alone; w.r.t. a fused weight it returns
    the gradient (like native) instead of writing it. Window counting is the wrapper's, as for
    unfused layers."""
    model, opt, _, ref, ref_opt = pair()
    x = torch.randn(5, 24, requires_grad=True)
    before = [p.main_grad.clone() for p in model.parameters()]
    (gx,) = torch.autograd.grad(loss_fn(model(x)), [x])
    (rx,) = torch.autograd.grad(loss_fn(ref(x)), [x])
    torch.testing.assert_close(gx, rx, rtol=1e-5, atol=1e-6)
    w, rw = model[2].weight, ref[2].weight
    (gw,) = torch.autograd.grad(loss_fn(model(x)), [w])
    (rgw,) = torch.autograd.grad(loss_fn(ref(x)), [rw])
    torch.testing.assert_close(gw, rgw, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(p.main_grad, b) for p, b in zip(model.parameters(), before))
    assert opt.micro_steps == ref_opt.micro_steps
    assert w.grad is None
    # backward(inputs=...) without the weight does not write it either.
    loss_fn(model(x)).backward(inputs=[model[0].bias])
    assert torch.equal(w.main_grad, before[2])


def test_input_gradient_flows_through_fused_layers():
    model, _opt, _, ref, _ref_opt = pair()
    x = torch.randn(2, 3, 24, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    loss_fn(model(x)).backward()
    loss_fn(ref(xr)).backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_one_dim_input():
    model, _opt, _, ref, _ref_opt = pair(accumulation_steps=1)
    x = torch.randn(24)
    loss_fn(model(x)).backward()
    loss_fn(ref(x)).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.main_grad, q.main_grad, rtol=1e-5, atol=1e-7)


def test_tied_weights():
    """Two Linear layers sharing one weight: both write into the same window (first overwrites,
    second accumulates), whichever comes first."""
    a, b = nn.Linear(8, 8), nn.Linear(8, 8)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b)
    model, _opt, handle, ref, _ref_opt = pair(model=model, accumulation_steps=2)
    assert handle.num_layers == 2
    for _ in range(2):
        x = torch.randn(5, 8)
        loss_fn(model(x)).backward()
        loss_fn(ref(x)).backward()
    torch.testing.assert_close(model[0].weight.main_grad, ref[0].weight.main_grad,
                               rtol=1e-5, atol=1e-6)


def test_autocast_fp32_model():
    """fp32 weights under bf16 autocast: the GEMM sees the bf16 activations and output gradients
    (what native autocast linear uses) and accumulates their exact products in fp32."""
    model, _opt, _, ref, _ref_opt = pair(accumulation_steps=4)
    rec, _ = capture(model)
    ref_rec, _ = capture(ref)
    for x in make_inputs(4, shape=(6, 5)):
        for m in (model, ref):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = m(x)
            loss_fn(out).backward()
    fused_ref = reference_wgrads(rec, torch.bfloat16)
    unfused_ref = reference_wgrads(ref_rec, torch.bfloat16)
    mods, ref_mods = dict(linears(model)), dict(linears(ref))
    for name in fused_ref:
        assert rel_err(mods[name].weight.main_grad, fused_ref[name]) <= 1e-5
        assert rel_err(ref_mods[name].weight.main_grad, unfused_ref[name]) > 1e-4
    torch.testing.assert_close(model[0].bias.main_grad, ref[0].bias.main_grad, rtol=0, atol=0)


# -- non-finite gradients ------------------------------------------------------------------------

def test_nonfinite_microbatch_skips_the_step():
    model, opt, _, ref, ref_opt = pair(torch.bfloat16, accumulation_steps=3)
    start = [p.detach().clone() for p in model.parameters()]
    for i in range(3):
        x = torch.randn(4, 24, dtype=torch.bfloat16)
        if i == 1:
            x[2, 5] = float("inf")
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_fn(m(x)).backward()
            o.step()
    assert opt.skipped_steps == ref_opt.skipped_steps == 1
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))


def test_only_a_fused_weight_nonfinite_is_caught():
    """An inf that reaches only a fused weight's gradient (the bias gradient is finite): the
    check on the GEMM's result sets the flag."""
    lin = nn.Linear(3, 2)
    opt = wrap(lin, accumulation_steps=1)
    fuse_wgrad_accumulation(lin, opt)
    x = torch.randn(4, 3)
    x[0, 1] = float("inf")
    with torch.no_grad():
        lin.weight[:, 1] = 0  # the output stays finite, so dy and the bias gradient do too
    lin(x).sum().backward()
    assert torch.isfinite(lin.bias.main_grad).all()
    assert not torch.isfinite(lin.weight.main_grad).all()
    opt.step()
    assert opt.skipped_steps == 1


def test_first_write_of_a_window_ignores_stale_garbage():
    """beta=0 on the first micro-batch: NaN left in main_grad (e.g. from a skipped window) is
    overwritten, not propagated."""
    model, opt, _, ref, _ref_opt = pair(torch.bfloat16, accumulation_steps=2)
    for _, m in linears(model):
        m.weight.main_grad.fill_(float("nan"))
    for _ in range(2):
        x = torch.randn(4, 24, dtype=torch.bfloat16)
        loss_fn(model(x)).backward()
        loss_fn(ref(x)).backward()
    for _, m in linears(model):
        assert torch.isfinite(m.weight.main_grad).all()
    opt.step()
    assert opt.skipped_steps == 0


# -- the GEMM implementations --------------------------------------------------------------------

def _gemm_params():
    out = []
    for device in ("cpu", "cuda"):
        for name in wgrad.GEMM_BACKENDS:
            marks = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="no GPU")] \
                if device == "cuda" else []
            if device == "cpu" and name in ("addmm_out_dtype", "mm_out_dtype"):
                continue  # CUDA-only (PyTorch has no CPU kernel for out_dtype)
            out.append(pytest.param(device, name, marks=marks, id=f"{device}-{name}"))
    return out


def _interpreter_cannot_loop() -> str | None:
    """Triton 3.6's interpreter hands a kernel's integer arguments in as one-element arrays, and
    numpy 2.4 no longer turns those into Python ints, so ``range(tl.cdiv(K, BLOCK_K))`` raises
    (measured: Triton 3.6 + numpy 2.4.6 fails, Triton 3.8 and 3.9 with the same numpy run). Only
    the interpreter: the compiled kernel takes K as a scalar register."""
    try:
        import numpy
        import triton
    except ImportError:
        return None
    tv = tuple(int(x) for x in triton.__version__.split(".")[:2])
    nv = tuple(int(x) for x in numpy.__version__.split(".")[:2])
    if os.environ.get("TRITON_INTERPRET") == "1" and tv < (3, 8) and nv >= (2, 4):
        return (f"Triton {triton.__version__}'s interpreter cannot range over a runtime bound "
                f"with numpy {numpy.__version__} (the CPU refuses backend='triton' there)")
    return None


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter, inf
@pytest.mark.parametrize("device,name", _gemm_params())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_gemm_implementations(device, name, dtype):
    if not gemms.supported(name, torch.device(device), dtype):
        if name == "triton" and device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("Triton on the CPU needs TRITON_INTERPRET=1")
        if name == "triton" and device == "cpu" and _interpreter_cannot_loop():
            pytest.skip(_interpreter_cannot_loop())
        if name in ("addmm_out_dtype", "mm_out_dtype"):  # depends on the torch version
            pytest.skip(f"torch {torch.__version__}: {name} fails its probe here (auto falls back)")
        pytest.fail(f"{name} not usable for {dtype} on {device}")
    gemm = gemms.GEMMS[name]
    for k, m, n in [(37, 20, 12), (0, 5, 3), (1, 1, 1), (70, 65, 33)]:
        dy = torch.randn(k, m, device=device).to(dtype)
        x = torch.randn(k, n, device=device).to(dtype)
        c0 = torch.randn(m, n, device=device)
        prod = dy.double().t() @ x.double()
        # Any fp32 summation order of the k+1 exact terms: |error| <= (k + 2) u sum|terms|.
        bound = (k + 2) * 2.0**-24 * (c0.double().abs()
                                      + 0.25 * (dy.double().abs().t() @ x.double().abs())) + 1e-30
        c = c0.clone()
        found_inf = torch.zeros(1, device=device)
        flagged = gemm(c, dy, x, 0.25, False, found_inf)
        if not flagged:
            gemms.flag_nonfinite(c, found_inf)
        assert ((c.double() - (c0.double() + 0.25 * prod)).abs() <= bound).all()
        c.fill_(float("nan"))
        gemm(c, dy, x, 0.25, True, None)
        assert ((c.double() - 0.25 * prod).abs() <= bound).all()
        assert found_inf.item() == 0
    # inf in the input -> flagged (by the kernel or the separate check)
    dy = torch.randn(8, 4, device=device).to(dtype)
    dy[3, 2] = float("inf")
    c = torch.zeros(4, 5, device=device)
    found_inf = torch.zeros(1, device=device)
    if not gemm(c, dy, torch.randn(8, 5, device=device).to(dtype), 1.0, False, found_inf):
        gemms.flag_nonfinite(c, found_inf)
    assert found_inf.item() == 1.0


@pytest.mark.skipif(HAS_CUDA or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton on the CPU: interpreter on CPU-only hosts")
def test_triton_backend_end_to_end_under_interpreter():
    pytest.importorskip("triton")
    if _interpreter_cannot_loop():
        pytest.skip(_interpreter_cannot_loop())
    model = make_mlp(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt, ref_opt = wrap(model, accumulation_steps=2), wrap(ref, accumulation_steps=2)
    handle = fuse_wgrad_accumulation(model, opt, backend="triton")
    assert handle.gemm_backends == {"cpu bfloat16": "triton"}
    assert fuse_wgrad_accumulation(ref, ref_opt).gemm_backends == {"cpu bfloat16": "fp32"}
    for x in make_inputs(2, torch.bfloat16):
        loss_fn(model(x)).backward()
        loss_fn(ref(x)).backward()
    for (_, m), (_, r) in zip(linears(model), linears(ref)):
        torch.testing.assert_close(m.weight.main_grad, r.weight.main_grad, rtol=1e-5, atol=1e-6)


# -- GPU ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no GPU")
def test_cuda_auto_backend_and_peak_memory():
    """On CUDA "auto" picks a fused fp32-output GEMM, and the fused backward peaks no higher than
    the unfused one (which holds bf16 weight gradients until their bucket is moved)."""
    device = torch.device("cuda")
    model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).to(
        device, torch.bfloat16)
    ref = copy.deepcopy(model)
    opt, _ref_opt = wrap(model, master_weights=False), wrap(ref, master_weights=False)
    handle = fuse_wgrad_accumulation(model, opt)
    assert handle.gemm_backends["cuda:0 bfloat16"] in ("addmm_out_dtype", "triton",
                                                       "mm_out_dtype")
    x = torch.randn(1024, 512, device=device, dtype=torch.bfloat16)
    peaks = []
    for m in (model, ref):
        loss_fn(m(x)).backward()  # warm-up (cuBLAS workspaces)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss_fn(m(x)).backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[0] <= peaks[1], peaks
