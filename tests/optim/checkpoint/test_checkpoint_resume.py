"""Resuming in the middle of a window is exact (DESIGN: "state_dict()/load_state_dict()"): a
checkpoint taken at any point -- between a backward and its ``step()``, at the boundary, in a
window holding a NaN micro-batch, with gradients still in ``.grad``
(``accumulate_in_backward=False``) -- resumes with the same result as not stopping, through
``torch.save``/``torch.load(weights_only=True)`` into a fresh model, optimizer and wrapper, or
in memory. The state dict's format and refusals: test_checkpoint.py.
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    assert_params_close,
    batches,
    make_model,
    mse,
    params_of,
    roundtrip,
    wrap_sgd,
)

from accumkernels import AccumulatingOptimizer

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
            opt.zero_grad()  # (keeps a window still filling; without it the next adds to it)
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


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("cut", ["after-nan", "at-boundary"])
def test_in_memory_round_trip_keeps_a_nan_window_skipped(cut, in_backward):
    """``opt.load_state_dict(opt.state_dict())`` is a no-op: a window holding a NaN micro-batch
    is still skipped (the live non-finite flag must survive being copied onto itself)."""
    N = 3
    model = make_model()
    opt = wrap_sgd(model, accumulation_steps=N, accumulate_in_backward=in_backward)
    start = params_of(model)
    for i, (x, y) in enumerate(batches(N, 4)):
        loss = mse(model, x, y)
        (loss * math.nan if i == 1 else loss).backward()
        if cut == "at-boundary" and i == N - 1:
            opt.load_state_dict(opt.state_dict())
        opt.step()
        if cut == "after-nan" and i == 1:
            opt.load_state_dict(opt.state_dict())
    assert all(torch.equal(p, s) for p, s in zip(model.parameters(), start)), \
        "a NaN window reached the weights"
    assert opt.skipped_steps == 1 and opt.micro_steps == 0
    for x, y in batches(N, 4):
        mse(model, x, y).backward()
        opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))


def test_resume_mid_window_keeps_grads_not_yet_accumulated():
    """accumulate_in_backward=False, checkpoint after 2 of 4 backwards with no accumulate()/step()
    in between (Trainer-style loop): the grads sitting in .grad must survive the checkpoint."""
    N, lr = 4, 0.1
    template = make_model()
    data = batches(2 * N, 4)
    cut = N + 2

    def build():
        model = copy.deepcopy(template)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                    accumulation_steps=N, accumulate_in_backward=False,
                                    bucket_size_mb=SMALL_BUCKET)
        return model, opt

    def train(model, opt, indices):
        for i in indices:
            mse(model, *data[i]).backward()
            if (i + 1) % N == 0:
                opt.step()
                opt.zero_grad()  # (as the native loop: without it the next window adds to it)

    native = copy.deepcopy(template)
    native_opt = torch.optim.SGD(native.parameters(), lr=lr, momentum=0.9)
    for w in range(2):
        for x, y in data[w * N:(w + 1) * N]:
            mse(native, x, y).backward()
        native_opt.step()
        native_opt.zero_grad()
    whole, whole_opt = build()
    train(whole, whole_opt, range(2 * N))
    assert_params_close(whole, native, what="uninterrupted: ")

    model, opt = build()
    train(model, opt, range(cut))
    state = roundtrip({"model": model.state_dict(), "opt": opt.state_dict()})
    model, opt = build()  # fresh model, optimizer and wrapper
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["opt"])
    train(model, opt, range(cut, 2 * N))
    assert opt.micro_steps == 0
    # fp32 sums of the same grads, possibly in another order: a few ulps of O(1) params.
    assert_params_close(model, whole, what="resumed: ")
