"""AccumulatingOptimizer, robustness: non-finite policies, loss scaling, clipping, checkpoints,
process group."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from test_optim import (
    SMALL_BUCKET,
    batches,
    capture_grads,
    make_model,
    mse,
    params_of,
    total_rel_err,
)
from torch import nn

from accumkernels import AccumulatingOptimizer


def _sgd(model, **kw):
    return AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 bucket_size_mb=SMALL_BUCKET, **kw)


# -- non-finite gradients -----------------------------------------------------------------------

@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("poison", ["nan_loss", "inf_input"])
def test_skip_step_drops_the_window(poison, in_backward):
    N, bad = 4, 2
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                accumulation_steps=N, accumulate_in_backward=in_backward,
                                bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        if i == bad and poison == "inf_input":
            x[1, 3] = math.inf
        loss = mse(model, x, y)
        (loss * math.nan if i == bad and poison == "nan_loss" else loss).backward()
        opt.step()
    assert opt.skipped_steps == 1 and opt.micro_steps == 0
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
    assert not opt.optimizer.state  # the inner optimizer never ran
    for x, y in batches(N, 4):  # the next window is a normal one
        mse(model, x, y).backward()
        opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "weighted"])
def test_skip_microbatch_keeps_the_rest_of_the_window(reduction, in_backward):
    N, bad, lr = 4, 1, 0.1
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                reduction=reduction, nonfinite="skip_microbatch",
                                accumulate_in_backward=in_backward, bucket_size_mb=SMALL_BUCKET)
    start = params_of(model)
    weights = [float(w) for w in torch.randint(1, 9, (N,))]
    caps, handles = capture_grads(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        if reduction == "weighted":
            opt.add_weight(weights[i])
        loss = mse(model, x, y)
        (loss * math.nan if i == bad else loss).backward()
        if not in_backward:
            opt.accumulate()
    for h in handles:
        h.remove()
    assert opt.sync_step  # the dropped micro-batch still counts toward N
    assert opt.skipped_microbatches == 1
    kept = [i for i in range(N) if i != bad]
    divisor = {"mean": len(kept), "sum": 1, "weighted": sum(weights[i] for i in kept)}[reduction]
    names = [n for n, _ in model.named_parameters()]
    ref = [sum(caps[n][i].double() for i in kept) / divisor for n in names]
    # fp32 sum of 3 fp32 grads vs float64: relative ~1e-7.
    assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
    opt.step()
    assert opt.skipped_steps == 0
    for p, s, r in zip(model.parameters(), start, ref):
        torch.testing.assert_close(p.double(), s.double() - lr * r, rtol=0, atol=1e-6)


def test_skip_microbatch_all_dropped_skips_the_step():
    N = 2
    model = make_model()
    opt = _sgd(model, accumulation_steps=N, nonfinite="skip_microbatch", reduction="mean")
    start = params_of(model)
    for x, y in batches(N, 4):
        (mse(model, x, y) * math.nan).backward()
    opt.step()
    assert opt.skipped_microbatches == N and opt.skipped_steps == 1
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.encoder(x)))


@pytest.mark.parametrize("with_model", [True, False])
def test_raise_names_the_bad_param(with_model):
    model = Named()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accumulation_steps=2,
                                nonfinite="raise", model=model if with_model else None)
    x = torch.randn(4, 6)
    model(x).square().mean().backward()
    # Only head.bias receives a NaN (the extra term's gradient reaches nothing else).
    (model(x).square().mean() + model.head.bias.sum() * math.nan).backward()
    expected = "head.bias" if with_model else "parameter"  # no names without model=
    with pytest.raises(FloatingPointError, match=expected):
        opt.step()


# -- loss scaling ---------------------------------------------------------------------------------

def test_static_loss_scale_is_unscaled_in_accumulation():
    N, S = 3, 1024.0
    model = make_model()
    opt = _sgd(model, accumulation_steps=N, loss_scale=S)
    assert opt.loss_scale == S
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4):
        loss = mse(model, x, y)
        scaled = opt.scale_loss(loss)
        assert torch.equal(scaled, loss * S)
        scaled.backward()
    for h in handles:
        h.remove()
    # The captured grads are S * g; the fused unscale must divide S out. S is a power of two, so
    # only the fp32 summation of 3 terms rounds: norm-wise relative error ~1e-7 (elementwise it
    # can be larger where the terms cancel).
    ref = [sum(g.double() for g in caps[n]) / S for n, _ in model.named_parameters()]
    assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
    assert total_rel_err([p.grad for p in model.parameters()], [r * S for r in ref]) > 0.5


def test_dynamic_loss_scale_backs_off_and_grows():
    N = 2
    model = make_model()
    opt = _sgd(model, accumulation_steps=N, loss_scale="dynamic")
    opt._parts.scaler.growth_interval = 3
    scale0 = opt.loss_scale
    assert scale0 >= 2.0 ** 10

    def window(poison=False):
        before = params_of(model)
        scale = opt.loss_scale
        caps, handles = capture_grads(model)
        for i, (x, y) in enumerate(batches(N, 4)):
            if poison and i == 0:
                x[0, 0] = math.inf
            loss = mse(model, x, y)
            scaled = opt.scale_loss(loss)
            assert torch.equal(scaled, loss * scale)  # a power of two: exact
            scaled.backward()
        for h in handles:
            h.remove()
        if not poison:  # the boundary gradient is unscaled by the current S (fp32 sum: 1e-7)
            ref = [sum(g.double() for g in caps[n]) / scale for n, _ in model.named_parameters()]
            assert total_rel_err([p.grad for p in model.parameters()], ref) < 1e-6
        opt.step()
        return any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))

    assert not window(poison=True)  # overflow: the step is skipped ...
    assert opt.skipped_steps == 1 and opt.loss_scale == scale0 / 2  # ... and the scale halves
    assert window() and window() and opt.loss_scale == scale0 / 2
    assert window() and opt.loss_scale == scale0  # doubled after 3 good steps
    assert window() and opt.loss_scale == scale0


def test_dynamic_loss_scale_fp16_overflow_backs_off_until_finite():
    """A real fp16 overflow: the gradient times 2**16 exceeds 65504."""
    model = make_model(torch.float16)
    opt = _sgd(model, accumulation_steps=1, loss_scale="dynamic")
    x, y = batches(1, 4, torch.float16)[0]
    start = params_of(model)
    steps = 0
    while True:
        opt.scale_loss(mse(model, x, y) * 64).backward()
        opt.step()
        steps += 1
        if opt.skipped_steps < steps:
            break
        assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start))
        assert steps < 16
    assert steps > 1  # it did overflow at first
    assert opt.loss_scale < 2.0 ** 16
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, s) for p, s in zip(model.parameters(), start))


# -- clipping -------------------------------------------------------------------------------------

@pytest.mark.parametrize("active", [True, False])
def test_fused_clipping_matches_clip_grad_norm(active):
    N, lr = 3, 0.1
    model = make_model()
    native = copy.deepcopy(model)
    data = batches(N, 4)
    for x, y in data:  # native fp32 accumulation in .grad
        mse(native, x, y).backward()
    norm = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in native.parameters()]))
    max_norm = 0.3 * norm.item() if active else 3.0 * norm.item()
    native_norm = torch.nn.utils.clip_grad_norm_(native.parameters(), max_norm)
    torch.optim.SGD(native.parameters(), lr=lr).step()

    opt = _sgd(model, accumulation_steps=N, max_grad_norm=max_norm)
    for x, y in data:
        mse(model, x, y).backward()
    opt.step()
    # Both sides sum the same 3 fp32 grads in fp32: the norms agree to fp32 rounding (rel 1e-6)
    # and the params to a few fp32 ulps of the O(1) values.
    torch.testing.assert_close(opt.last_grad_norm, native_norm, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), native.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_fused_clipping_bf16_acts_on_fp32_master_grads():
    N, lr = 3, 0.1
    model = make_model(torch.bfloat16)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), accumulation_steps=N,
                                max_grad_norm=0.05, bucket_size_mb=SMALL_BUCKET)
    masters = [q for g in opt.param_groups for q in g["params"]]
    start = [q.detach().double() for q in masters]
    caps, handles = capture_grads(model)
    for x, y in batches(N, 4, torch.bfloat16):
        mse(model, x, y).backward()
    for h in handles:
        h.remove()
    ref = [sum(g.double() for g in caps[n]) for n, _ in model.named_parameters()]
    ref_norm = math.sqrt(sum((r ** 2).sum().item() for r in ref))
    assert ref_norm > 0.05
    opt.step()
    # Pre-clip norm of the fp32 sum of bf16 grads vs float64: relative ~1e-7.
    assert math.isclose(opt.last_grad_norm.item(), ref_norm, rel_tol=1e-6)
    coef = 0.05 / ref_norm
    for q, s, r in zip(masters, start, ref):
        torch.testing.assert_close(q.detach().double(), s - lr * coef * r, rtol=0, atol=1e-6)


# -- checkpoint / resume -----------------------------------------------------------------------

RESUME_CONFIGS = {
    # bf16 model (master weights + AdamW state), weights before and after backward, hooks: a cut
    # may fall between a backward and its step(), the boundary state included.
    # Micro-batch 1 is NaN and dropped (its weight, reported after it, must not count).
    "bf16-weighted-skipmb-hooks": {
        "dtype": torch.bfloat16, "in_backward": True,
        "kw": {"reduction": "weighted", "nonfinite": "skip_microbatch"}},
    # fp32, accumulate(), dynamic loss scale; micro-batch 1 is NaN: the first window is skipped
    # (the non-finite flag must survive a cut inside that window) and the scale backs off.
    "fp32-mean-dynamic-skipstep": {
        "dtype": torch.float32, "in_backward": False,
        "kw": {"reduction": "mean", "loss_scale": "dynamic"}},
    # 'mean' over the kept micro-batches of a window with a dropped one.
    "fp32-mean-skipmb-hooks": {
        "dtype": torch.float32, "in_backward": True,
        "kw": {"reduction": "mean", "nonfinite": "skip_microbatch"}},
}


@pytest.mark.parametrize("config", list(RESUME_CONFIGS))
def test_resume_at_every_cut_point_is_exact(config):
    cfg = RESUME_CONFIGS[config]
    N, dtype = 3, cfg["dtype"]
    template = make_model(dtype)
    data = batches(2 * N + 1, 4, dtype)  # two full windows and one micro-batch of a third
    weights = [float(n) for n in torch.randint(1, 9, (len(data),))]
    weighted = cfg["kw"]["reduction"] == "weighted"

    def build():
        model = copy.deepcopy(template)
        opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2),
                                    accumulation_steps=N, accumulate_in_backward=cfg["in_backward"],
                                    bucket_size_mb=SMALL_BUCKET, **cfg["kw"])
        opt._parts.scaler.growth_interval = 1  # the scale changes every good step: its state matters
        return model, opt

    def backward(i):
        def phase(model, opt):
            if weighted and i % 2 == 0:
                opt.add_weight(weights[i])
            loss = opt.scale_loss(mse(model, *data[i]))
            (loss * math.nan if i == 1 else loss).backward()
            if not cfg["in_backward"]:
                opt.step()  # step() moves .grad: a cut is only valid after it
        return phase

    def after(i):
        def phase(model, opt):
            if weighted and i % 2 == 1:
                opt.add_weight(weights[i])
            opt.step()
        return phase

    phases = [f(i) for i in range(len(data)) for f in (backward, after)]

    def run(cut):
        model, opt = build()
        for phase in phases[:cut]:
            phase(model, opt)
        if cut is not None:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            state = torch.load(buf, weights_only=True)
            model, opt = build()  # fresh model, optimizer and wrapper
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            for phase in phases[cut:]:
                phase(model, opt)
        return model, opt

    ref, ref_opt = run(None)
    skip_step = cfg["kw"].get("nonfinite", "skip_step") == "skip_step"
    expected = (0, 1) if skip_step else (1, 0)
    assert (ref_opt.skipped_microbatches, ref_opt.skipped_steps) == expected
    assert all(not torch.equal(p, q) for p, q in zip(ref.parameters(), template.parameters()))
    for cut in range(len(phases) + 1):
        model, opt = run(cut)
        for p, q in zip(model.parameters(), ref.parameters()):
            assert torch.equal(p, q), f"cut {cut}"
            assert torch.equal(p.main_grad, q.main_grad), f"cut {cut}"  # the open third window
        assert opt.micro_steps == ref_opt.micro_steps == 1
        assert opt.loss_scale == ref_opt.loss_scale
        assert opt.skipped_microbatches == ref_opt.skipped_microbatches
        assert opt.skipped_steps == ref_opt.skipped_steps


def test_state_dict_layout_mismatch_is_rejected():
    model = make_model()
    opt = _sgd(model, accumulation_steps=2)
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
        _sgd(smaller, accumulation_steps=2).load_state_dict(state)


def test_process_group_single_rank_gloo(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = make_model()
        twin = copy.deepcopy(model)
        opt = _sgd(model, accumulation_steps=2, process_group=dist.group.WORLD)
        twin_opt = _sgd(twin, accumulation_steps=2)
        for x, y in batches(2, 4):
            for mod, o in ((model, opt), (twin, twin_opt)):
                mse(mod, x, y).backward()
                o.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p, q)  # the average over one rank is the identity
    finally:
        dist.destroy_process_group()


def test_something_that_is_no_optimizer_state_dict_is_a_clear_error():
    model = make_model()
    opt = _sgd(model, accumulation_steps=2)
    with pytest.raises(ValueError, match="neither an optimizer state dict"):
        opt.load_state_dict({"weights": torch.ones(2)})


def _version1(state: dict) -> dict:
    """The checkpoint as the single-class wrapper (format version 1) wrote it."""
    own = state["accumkernels"]
    window = {k: v for k, v in own["window"].items() if k != "main_grad"}
    old = {k: v for k, v in own.items() if k not in ("version", "param_shapes", "window")}
    old["optimizer"] = {"state": state["state"], "param_groups": state["param_groups"]}
    old["main_grad"] = own["window"]["main_grad"]
    old["window"] = dict(window, step_calls=1, unmoved=0, at_boundary=False)
    old["window"]["boundary_only"] = bool(window["boundary_only"])
    return old


def test_version1_checkpoint_loads_and_resumes_exactly():
    N = 4
    model = make_model()
    data = batches(2 * N, 4)
    opt = _sgd(model, accumulation_steps=N)
    for x, y in data[:N + 2]:  # one window stepped, two micro-batches into the next
        mse(model, x, y).backward()
        opt.step()
    buf = io.BytesIO()
    torch.save(_version1(opt.state_dict()), buf)
    resumed = copy.deepcopy(model)
    opt2 = _sgd(resumed, accumulation_steps=N)
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
    opt = _sgd(model, accumulation_steps=2)
    mse(model, *batches(1, 4)[0]).backward()
    state = opt.state_dict()
    before = [t.clone() for t in state["accumkernels"]["window"]["main_grad"]]
    state["accumkernels"] = dict(state["accumkernels"], version=4)
    with pytest.raises(ValueError, match="version 4"):
        opt.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in
               zip(before, opt.state_dict()["accumkernels"]["window"]["main_grad"]))
    assert opt.micro_steps == 1
