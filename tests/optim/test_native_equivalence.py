"""Visibility — the invariant (DESIGN section of that name), against native PyTorch.

Between backwards every model param's ``p.grad`` is what native PyTorch would hold -- the running
window (sum of the micro-batch gradients, ``reduction="sum"``), summed in fp32 -- as a zero-copy
fp32 view of ``p.main_grad``, never None mid-window; what a user or framework does to it in place
(clipping, scaling) is what the step uses; the next backward still moves its gradients with one
fused launch per bucket. Frameworks that call ``step()`` only at window ends work with
``accumulation_steps=None``.

The wrapper before commit 1a87787 failed most of these for one reason: it released
``p.grad`` right after each fused launch and showed the window only once it had decided the window
ended (from ``accumulation_steps``, a Lightning closure, or Accelerate's global ``GradientState``),
so mid-window ``p.grad`` was None and a clip/scale at a point it did not guess acted on nothing.
Tolerances: see tests/_native_common.py. How gradients reach the window: test_intake.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _native_common import (
    CLIP,
    GPT_CLIP,
    N_ACCUM,
    SMALL_BUCKET,
    U32,
    LaunchRecorder,
    accelerate_state_reset_after,  # noqa: F401  (fixture)
    assert_grads_match_native,
    assert_moved,
    assert_runs_match,
    assert_same_params,
    assert_values_match,
    capture_grads,
    grad_is_window_view,
    grad_norm,
    mlp,
    mlp_batches,
    mse,
    random_seed,
    reset_accelerate,
    run_accelerate,
    run_lightning,
    run_trainer,
)

from accumkernels import AccumulatingOptimizer, MasterGradBuffer

LR = 0.1


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)


def wrapped(model, accumulation_steps, **kw):
    kw.setdefault("bucket_size_mb", SMALL_BUCKET)
    return AccumulatingOptimizer(sgd(model), accumulation_steps=accumulation_steps,
                                 reduction="sum", **kw)


# -- 1. p.grad after every micro-batch -------------------------------------------------------------

@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_fp32_grad_is_the_running_window_after_every_microbatch(accumulation_steps):
    """fp32 model, 3 windows of 4: after each backward p.grad == native's running sum (an fp32
    view aliasing p.main_grad, never None); after step + zero_grad() it is None like native's."""
    model = mlp(seed=random_seed())
    native, start = copy.deepcopy(model), copy.deepcopy(model)
    opt, native_opt = wrapped(model, accumulation_steps), sgd(native)
    for w in range(3):
        for k, batch in enumerate(mlp_batches(N_ACCUM)):
            (mse(model, batch) / N_ACCUM).backward()
            (mse(native, batch) / N_ACCUM).backward()
            assert_grads_match_native(model, native, f"window {w}, micro-batch {k}: ")
        opt.step()
        native_opt.step()
        opt.zero_grad()
        native_opt.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        assert_same_params(native, model)
    assert_moved(model, start)


def test_bf16_grad_is_fp32_window_within_fp32_bound():
    """bf16 params: p.grad is fp32 (Tensor.grad_dtype) aliasing p.main_grad, and after k
    micro-batches it is the float64 sum of the k bf16 gradients up to fp32 summation rounding:
    elementwise |p.grad - S_k| <= 1.01 (k-1) 2**-24 sum|g_i| (the first write is exact)."""
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("needs Tensor.grad_dtype")
    n = 8
    model = mlp(torch.bfloat16, seed=random_seed())
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR), accumulation_steps=n,
                                bucket_size_mb=SMALL_BUCKET)
    assert opt.master_weights
    caps, handles = capture_grads(model)
    for k, batch in enumerate(mlp_batches(n, dtype=torch.bfloat16), start=1):
        mse(model, batch).backward()
        for name, p in model.named_parameters():
            why = grad_is_window_view(p)
            assert why is None, f"micro-batch {k}, {name}: {why}"
            assert p.dtype == torch.bfloat16 and len(caps[name]) == k
            exact = sum(g.double() for g in caps[name])
            bound = 1.01 * (k - 1) * U32 * sum(g.double().abs() for g in caps[name])
            excess = ((p.grad.double() - exact).abs() - bound).max().item()
            assert excess <= 0, f"micro-batch {k}, {name}: outside the fp32 bound by {excess:.3g}"
    for h in handles:
        h.remove()
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before))


# -- 2. in-place changes to p.grad are what the step uses ------------------------------------------

@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_inplace_scaling_of_grad_changes_the_step(accumulation_steps):
    """p.grad.mul_(0.5) after micro-batch 1, p.grad.mul_(3.0) after micro-batch 3 (mid-window),
    clip_grad_norm_(model.parameters(), 0.05) at the boundary: each acts on the window and the
    step uses the result -- native's grads, norms and params, window after window."""
    model = mlp(seed=random_seed())
    native = copy.deepcopy(model)
    opt, native_opt = wrapped(model, accumulation_steps), sgd(native)
    norms, native_norms = [], []
    for w in range(3):
        for k, batch in enumerate(mlp_batches(N_ACCUM)):
            for mod in (model, native):
                (mse(mod, batch) / N_ACCUM).backward()
            assert_grads_match_native(model, native, f"window {w}, micro-batch {k}: ")
            if k in (0, 2):
                factor = 0.5 if k == 0 else 3.0
                for mod in (model, native):
                    for p in mod.parameters():
                        assert p.grad is not None, f"window {w}, micro-batch {k}: p.grad is None"
                        p.grad.mul_(factor)
                assert_grads_match_native(model, native, f"window {w}, after mul_ at {k}: ")
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        native_norms.append(torch.nn.utils.clip_grad_norm_(native.parameters(), CLIP).item())
        assert_grads_match_native(model, native, f"window {w}, after the clip: ")
        for o in (opt, native_opt):
            o.step()
            o.zero_grad()
        assert_same_params(native, model)
    assert all(n > 2 * CLIP for n in native_norms), native_norms  # the clip acts every window
    assert_values_match(norms, native_norms, "clip_grad_norm_ results")


# -- 3. the textbook loop with a short last window -------------------------------------------------

@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_textbook_loop_short_last_window_with_clipping(accumulation_steps):
    """10 micro-batches per epoch (two epochs), loss / 4, backward(); every 4th micro-batch and at
    the end of the data clip_grad_norm_(model.parameters(), 0.05), step(), zero_grad(). Windows
    4, 4, 2 per epoch. Same losses, per-micro-batch grad norms, clip norms and params as native
    (tiny GPT-2, AdamW: bit-for-bit expected, ATOL 1e-5 margin as in the integration tests)."""
    from _integrations_common import loader, tiny_gpt2, token_batches

    batches = list(loader(token_batches(20, seed=random_seed()), 2))
    start = tiny_gpt2(seed=random_seed())

    def train(wrap):
        model = copy.deepcopy(start)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if wrap:
            opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, reduction="sum")
        losses, micro, clips = [], [], []
        for _ in range(2):
            for i, batch in enumerate(batches):
                loss = model(**batch).loss
                losses.append(loss.item())
                (loss / N_ACCUM).backward()
                micro.append(grad_norm(model.parameters()))
                if (i + 1) % N_ACCUM == 0 or i == len(batches) - 1:
                    clips.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
                    opt.step()
                    opt.zero_grad()
        return model, losses, micro, clips

    native, native_losses, native_micro, native_clips = train(False)
    ours, losses, micro, clips = train(True)
    assert len(native_clips) == 6 and all(n > 2 * CLIP for n in native_clips), native_clips
    assert_values_match(losses, native_losses, "losses")
    assert_values_match(micro, native_micro, "per-micro-batch grad norms")
    assert_values_match(clips, native_clips, "clip norms")
    assert_moved(ours, start)
    assert_same_params(native, ours, rtol=0, atol=1e-5)


# -- 4. one fused launch per bucket, no per-param add into the views -------------------------------

def test_launch_recorder_sees_a_per_param_add():
    """Self-check of the detector used below (no wrapper involved): when p.grad is a view of a flat
    buffer, native AccumulateGrad adds into it per param, and the recorder reports those writes."""
    model = mlp(seed=random_seed())
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:
        p.main_grad = flat[offset:offset + p.numel()].view(p.shape)
        offset += p.numel()
        p.grad = p.main_grad
    mse(model, mlp_batches(1)[0]).backward()
    recorder = LaunchRecorder(params)
    recorder.arm()
    with recorder.backward():
        mse(model, mlp_batches(1)[0]).backward()
    assert len(recorder.stray_writes) == len(params), recorder.stray_writes
    assert recorder.launches == []


@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_one_fused_launch_per_bucket_while_grads_are_visible(accumulation_steps):
    """Micro-batches 2..4 of a window start with every p.grad a visible view of p.main_grad. Each
    backward must move its gradients with exactly one fused launch per bucket (the buckets a
    MasterGradBuffer with the same params and bucket_size_mb has: several here), covering every
    param once, reading views that still hold the previous running window (so AccumulateGrad did
    not add into them first), and no ATen op may write into the master buffer outside a launch.
    Afterwards p.grad is native's running window again."""
    model = mlp(seed=random_seed())
    native = copy.deepcopy(model)
    params = list(model.parameters())
    expected_buffer = MasterGradBuffer(list(copy.deepcopy(model).parameters()),
                                       bucket_size_mb=SMALL_BUCKET)
    n_buckets = len(expected_buffer.buckets)
    bucket_of = {i: expected_buffer.bucket_of(q).index
                 for i, q in enumerate(expected_buffer.params)}
    assert n_buckets >= 3, "the test needs several buckets"
    opt = wrapped(model, accumulation_steps)  # noqa: F841  (a user holds the optimizer)
    recorder = LaunchRecorder(params)
    for k, batch in enumerate(mlp_batches(N_ACCUM)):
        if k > 0:
            for name, p in model.named_parameters():
                why = grad_is_window_view(p)
                assert why is None, f"before micro-batch {k}, {name}: {why}"
            recorder.arm()
            with recorder.backward():
                (mse(model, batch) / N_ACCUM).backward()
            assert recorder.stray_writes == [], \
                f"micro-batch {k}: ATen writes into the master buffer outside a fused launch: " \
                f"{recorder.stray_writes}"
            assert recorder.stale == [], \
                f"micro-batch {k}: views changed before their launch (a per-param add): " \
                f"{recorder.stale}"
            assert all(None not in idx for idx, _ in recorder.launches), recorder.launches
            launched = sorted(i for idx, _ in recorder.launches for i in idx)
            assert launched == list(range(len(params))), f"micro-batch {k}: {recorder.launches}"
            assert len(recorder.launches) == n_buckets, \
                f"micro-batch {k}: {len(recorder.launches)} launches for {n_buckets} buckets"
            for idx, overwrite in recorder.launches:
                assert len({bucket_of[i] for i in idx}) == 1, f"a launch spans buckets: {idx}"
                assert not overwrite, f"micro-batch {k}: overwrote the running window"
        else:
            (mse(model, batch) / N_ACCUM).backward()
        (mse(native, batch) / N_ACCUM).backward()
        assert_grads_match_native(model, native, f"micro-batch {k}: ")


# -- 6. frameworks that step at window ends, accumulation_steps=None -------------------------------
# 6 micro-batches per epoch, two epochs, gradient accumulation 4: windows 4, 2 per epoch, the short
# one stepped by the framework at the end of the epoch, clipping active in every window.
# Compared with the same run on the stock optimizer: losses, the norm of p.grad after every
# micro-batch (what a user logging gradients mid-window sees), the pre-clip norms, the params.

def _gpt2_case():
    from _integrations_common import tiny_gpt2, token_batches

    return tiny_gpt2(seed=random_seed()), token_batches(12, seed=random_seed())


def _check_framework_run(ours, native, start, windows):
    assert len(native.clip_norms) == windows, native.clip_norms
    assert all(n > GPT_CLIP for n in native.clip_norms), native.clip_norms
    assert_runs_match(ours, native, "wrapper vs native")
    assert all(s["step"].item() == windows for s in ours.opt.state.values())
    assert_moved(ours.model, start)


@pytest.mark.usefixtures("accelerate_state_reset_after")
def test_trainer_accumulation_steps_none_is_native(tmp_path):
    start, samples = _gpt2_case()
    reset_accelerate()
    native = run_trainer(start, samples, tmp_path / "native", wrap=False)
    reset_accelerate()
    ours = run_trainer(start, samples, tmp_path / "ours", wrap=True, accumulation_steps=None)
    reset_accelerate()
    assert len(native.micro_norms) == 2 * 4  # the non-final micro-batches of 4 windows
    _check_framework_run(ours, native, start, 4)


@pytest.mark.usefixtures("accelerate_state_reset_after")
def test_prepared_accelerate_optimizer_accumulation_steps_none_is_native():
    start, samples = _gpt2_case()
    reset_accelerate()
    native = run_accelerate(start, samples, wrap=False)
    reset_accelerate()
    ours = run_accelerate(start, samples, wrap=True, accumulation_steps=None)
    reset_accelerate()
    assert len(native.micro_norms) == 12
    _check_framework_run(ours, native, start, 4)


def test_lightning_accumulation_steps_none_is_native():
    start, samples = _gpt2_case()
    native = run_lightning(start, samples, wrap=False)
    ours = run_lightning(start, samples, wrap=True, accumulation_steps=None)
    assert len(native.micro_norms) == 12
    _check_framework_run(ours, native, start, 4)
