"""Mistakes of cadence (DESIGN.md, "Mistakes users make", added 2026-12-01): the wrapper says so
once (``accumkernels.optim.AccumulationWarning``), naming the fix, and a correct setup chosen on
purpose stays silent.

* an LR scheduler stepped on ``step()`` calls that did not step;
* windows of one micro-batch where ``accumulation_steps`` > 1 asked for accumulation.

Every run records the warnings and, where a training result is involved, is compared with the
native PyTorch loop it means (fp32 params: the wrapper's fp32 sums are native's).
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings

import pytest
import torch
from _optim_common import SMALL_BUCKET, batches, make_model, mse

import accumkernels
from accumkernels import _util
from accumkernels.optim import AccumulatingOptimizer, AccumulationWarning


class _Ours:
    """The AccumulationWarnings among ``caught`` so far (read while it fills)."""

    def __init__(self, caught: list):
        self._caught = caught

    def _list(self) -> list:
        return [w for w in self._caught if issubclass(w.category, AccumulationWarning)]

    def __len__(self):
        return len(self._list())

    def __getitem__(self, i):
        return self._list()[i]

    def __iter__(self):
        return iter(self._list())


@contextlib.contextmanager
def recorded():
    """The AccumulationWarnings emitted inside, every one (no once-per-location filter)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield _Ours(caught)


def _pair(n, lr=0.05, **kw):
    """A model under the wrapper (SGD with momentum) and a copy under native SGD."""
    model = make_model()
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                                accumulation_steps=n, bucket_size_mb=SMALL_BUCKET, **kw)
    return model, opt, ref, torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)


def _same(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def _moved(model, start):
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))


# -- an LR scheduler stepped on step() calls that did not step -------------------------------------
SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=64),
}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_on_every_step_call_warns_once(name, n):
    """``opt.step(); scheduler.step()`` every micro-batch with N given: the scheduler advances N
    times per real step. One warning, early (the second no-op step() after a change), pointing
    at the loop's line, naming both fixes."""
    model, opt, _, _ = _pair(n)
    sched = SCHEDULERS[name](opt)
    calls = []
    with recorded() as ours:
        for i, (x, y) in enumerate(batches(6 * n, 4)):
            mse(model, x, y).backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            calls.append(len(ours))
    assert len(ours) == 1, [str(w.message) for w in ours]
    first = calls.index(1) + 1  # the step() call it came in
    assert first == (3 if n > 2 else 4), calls
    message = str(ours[0].message)
    assert f"accumulation_steps={n}" in message and f"{n} times per real" in message
    assert "opt.sync_step" in message and "accumulation_steps=None" in message
    assert "filterwarnings('ignore', category=accumkernels.optim.AccumulationWarning)" in message
    assert ours[0].filename == __file__  # the user's opt.step() line
    assert sched.last_epoch == 6 * n  # what the warning says: N scheduler steps per real step


def test_tensor_lr_changed_in_place_warns():
    """A tensor ``lr`` (schedulers ``fill_`` it): changes are seen without reading its value."""
    model = make_model()
    opt = AccumulatingOptimizer(torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01)),
                                accumulation_steps=4)
    sched = SCHEDULERS["StepLR"](opt)
    with recorded() as ours:
        for x, y in batches(8, 4):
            mse(model, x, y).backward()
            opt.step()
            sched.step()
    assert len(ours) == 1 and "learning rate changed" in str(ours[0].message)


def test_hand_set_lr_mid_window_warns():
    model, opt, _, _ = _pair(4)
    with recorded() as ours:
        for i, (x, y) in enumerate(batches(8, 4)):
            mse(model, x, y).backward()
            opt.step()
            opt.param_groups[0]["lr"] = 0.05 / (2 + i)
    assert len(ours) == 1


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_scheduler_on_real_steps_is_silent(name):
    """The README's pattern (``real = opt.sync_step``; the scheduler after real steps only):
    silent, and the same params as the native loop with the scheduler per optimizer step."""
    n = 4
    model, opt, ref, ref_opt = _pair(n)
    sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref_opt)
    with recorded() as ours:
        for _ in range(4):
            data = batches(n, 4)
            for x, y in data:
                mse(model, x, y).backward()
                real = opt.sync_step
                opt.step()
                if real:
                    sched.step()
                opt.zero_grad()
            for x, y in data:
                mse(ref, x, y).backward()
            ref_opt.step()
            ref_sched.step()
            ref_opt.zero_grad()
    assert not ours, [str(w.message) for w in ours]
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
    _same(model, ref)


def test_trainer_style_caller_with_n_is_silent():
    """``step()`` only at window ends (N given), the scheduler after each: every call steps."""
    n = 3
    model, opt, ref, ref_opt = _pair(n)
    sched, ref_sched = SCHEDULERS["LambdaLR"](opt), SCHEDULERS["LambdaLR"](ref_opt)
    with recorded() as ours:
        for _ in range(4):
            data = batches(n, 4)
            for (x, y) in data:
                mse(model, x, y).backward()
                mse(ref, x, y).backward()
            for o, s in ((opt, sched), (ref_opt, ref_sched)):
                o.step()
                s.step()
                o.zero_grad()
    assert not ours
    _same(model, ref)


@pytest.mark.parametrize("n", [None, 1])
def test_every_step_ends_the_window_is_silent(n):
    """``accumulation_steps=None`` (or 1): every step() steps; a scheduler on each is right."""
    model, opt, ref, ref_opt = _pair(n)
    sched, ref_sched = SCHEDULERS["StepLR"](opt), SCHEDULERS["StepLR"](ref_opt)
    with recorded() as ours:
        for x, y in batches(10, 4):
            for m, o, s in ((model, opt, sched), (ref, ref_opt, ref_sched)):
                mse(m, x, y).backward()
                o.step()
                s.step()
                o.zero_grad()
    assert not ours
    _same(model, ref)


def test_constant_lr_is_silent():
    """A scheduler stepped every call that keeps the lr (constant): nothing changed, nothing to
    say; the training is native accumulation of N."""
    n = 4
    model, opt, ref, ref_opt = _pair(n)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with recorded() as ours:
        for _ in range(3):
            data = batches(n, 4)
            for x, y in data:
                mse(model, x, y).backward()
                opt.step()
                sched.step()
                opt.zero_grad()  # (kept mid-window)
                mse(ref, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert not ours
    _same(model, ref)


def test_lr_by_hand_at_real_steps_is_silent():
    n = 4
    model, opt, ref, ref_opt = _pair(n)
    with recorded() as ours:
        for w in range(4):
            data = batches(n, 4)
            for x, y in data:
                mse(model, x, y).backward()
                real = opt.sync_step
                opt.step()
                if real:
                    for g in opt.param_groups:
                        g["lr"] = 0.05 * 0.5 ** (w + 1)
                opt.zero_grad()
                mse(ref, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            for g in ref_opt.param_groups:
                g["lr"] = 0.05 * 0.5 ** (w + 1)
    assert not ours
    _same(model, ref)


@pytest.mark.parametrize("per_epoch", [7, 9, 13])
def test_per_epoch_scheduler_mid_window_is_silent(per_epoch):
    """A per-epoch scheduler whose epoch ends mid-window (no flush: the window goes on into the
    next epoch, as a native loop counting micro-batches globally does): the lr changes after a
    no-op step() once per epoch, between clean windows. Silent, native's params."""
    n = 4
    model, opt, ref, ref_opt = _pair(n)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.7)
    seen = 0
    with recorded() as ours:
        for _ in range(4):
            for x, y in batches(per_epoch, 4):
                mse(model, x, y).backward()
                opt.step()
                opt.zero_grad()
                mse(ref, x, y).backward()
                seen += 1
                if seen % n == 0:
                    ref_opt.step()
                    ref_opt.zero_grad()
            sched.step()
            ref_sched.step()
    assert not ours, [str(w.message) for w in ours]
    _same(model, ref)


def test_hf_trainer_without_its_accumulation_warns(tmp_path):
    """The brief's case: a plain HF Trainer with ``gradient_accumulation_steps=1`` given
    ``AccumulatingOptimizer(..., accumulation_steps=4)`` and a scheduler: the Trainer steps the
    scheduler after every ``optimizer.step()``, three of four of them no-ops."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import _integrations_common as c
    from _integrations_workers import _reset_accelerate
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    _reset_accelerate()
    model = c.oneline_gpt2()
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=c.LR),
                                accumulation_steps=4)
    scheduler = get_linear_schedule_with_warmup(opt, 1, 20)
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        per_device_train_batch_size=c.MICRO, gradient_accumulation_steps=1, learning_rate=c.LR,
        num_train_epochs=1, save_strategy="no", dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=c.TokenDataset(c.token_samples(1)),
                      optimizers=(opt, scheduler))
    with recorded() as ours:
        trainer.train()
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert "learning rate changed after step() calls that did not step" in str(ours[0].message)


# -- windows of one micro-batch where accumulation was asked for -----------------------------------
@pytest.mark.parametrize("in_backward", [True, False])
def test_flush_after_every_backward_warns_once(in_backward):
    """``flush()`` after each backward with N=4: each window holds one micro-batch (native's
    step after every backward). Silent for two such windows, one warning at the third."""
    model, opt, ref, ref_opt = _pair(4, accumulate_in_backward=in_backward)
    counts = []
    with recorded() as ours:
        for x, y in batches(10, 4):
            mse(model, x, y).backward()
            opt.flush()
            opt.zero_grad()
            counts.append(len(ours))
            mse(ref, x, y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert counts == [0, 0] + [1] * 8
    message = str(ours[0].message)
    assert "accumulation_steps=4): 3 windows in a row ended holding a single micro-batch" \
        in message
    assert "flush() ended each one" in message and "step() after every backward" in message
    assert ours[0].filename == __file__
    _same(model, ref)


@pytest.mark.parametrize("how", ["learned", "loaded"])
def test_boundary_only_wrapper_stepped_every_backward_warns(how):
    """A wrapper that learned a boundary-only caller (its first step() on a complete window, or
    a mid-window checkpoint of one, resumed with fewer backwards per step) ends every window at
    step(): stepped after each backward, nothing accumulates."""
    n = 4
    model, opt, ref, ref_opt = _pair(n)
    for x, y in batches(n, 4):
        mse(model, x, y).backward()
        mse(ref, x, y).backward()
    opt.step()
    ref_opt.step()
    opt.zero_grad()
    ref_opt.zero_grad()
    if how == "loaded":  # two micro-batches in, then the checkpoint
        for x, y in batches(2, 4):
            mse(model, x, y).backward()
            mse(ref, x, y).backward()
        state = opt.state_dict()
        model = copy.deepcopy(model)
        opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                    accumulation_steps=n, bucket_size_mb=SMALL_BUCKET)
        opt.load_state_dict(state)  # (then windows of 3, 1, 1, 1, 1)
    counts = []
    with recorded() as ours:
        for x, y in batches(5, 4):
            for m, o in ((model, opt), (ref, ref_opt)):
                mse(m, x, y).backward()
                o.step()
                o.zero_grad()
            counts.append(len(ours))
    assert counts == ([0, 0, 1, 1, 1] if how == "learned" else [0, 0, 0, 1, 1])
    message = str(ours[0].message)
    assert "step() ended each one" in message and "calls step() only at window ends" in message
    assert f"run {n} backwards per step()" in message
    _same(model, ref)


@pytest.mark.parametrize("ending", ["flush", "step"])
def test_short_last_windows_at_epoch_ends_are_silent(ending):
    """Epochs of 9 micro-batches with N=4: windows of 4, 4 and a last one of 1, ended by
    ``flush()`` (a step-every-micro-batch loop) or by ``step()`` (a boundary-only caller)."""
    n, per_epoch = 4, 9
    model, opt, ref, ref_opt = _pair(n)
    with recorded() as ours:
        for _ in range(4):
            for i, (x, y) in enumerate(batches(per_epoch, 4)):
                mse(model, x, y).backward()
                mse(ref, x, y).backward()
                window_end = (i + 1) % n == 0 or i + 1 == per_epoch
                if ending == "flush":
                    opt.step()
                    if i + 1 == per_epoch:
                        opt.flush()
                    opt.zero_grad()
                elif window_end:
                    opt.step()
                    opt.zero_grad()
                if window_end:
                    ref_opt.step()
                    ref_opt.zero_grad()
    assert not ours, [str(w.message) for w in ours]
    _same(model, ref)


@pytest.mark.parametrize("n", [None, 1])
def test_one_microbatch_per_step_without_accumulation_is_silent(n):
    """``accumulation_steps=None`` (fp32 masters alone, GA=1) or 1: windows of one are asked for."""
    model = make_model(torch.bfloat16)
    ref = copy.deepcopy(model).float()
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                accumulation_steps=n)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    start = copy.deepcopy(model)
    with recorded() as ours:
        for x, y in batches(6, 4):
            mse(model, x.bfloat16(), y.bfloat16()).backward()
            opt.flush() if n == 1 else opt.step()
            opt.zero_grad()
            mse(ref, x.bfloat16().float(), y.bfloat16().float()).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    assert not ours
    _moved(model, start)
    for p, q in zip(opt.master_params, ref.parameters()):  # fp32 masters ~ an fp32 run
        torch.testing.assert_close(p, q, rtol=0, atol=2e-2)


# -- once per wrapper, silenced as documented ------------------------------------------------------
def _flush_every_backward(opt, model, k=4):
    for x, y in batches(k, 4):
        mse(model, x, y).backward()
        opt.flush()
        opt.zero_grad()


def test_once_per_wrapper_and_silenced_by_category():
    with recorded() as ours:
        for _ in range(2):
            model, opt, _, _ = _pair(4)
            _flush_every_backward(opt, model, 8)
    assert len(ours) == 2  # one per wrapper
    model, opt, _, _ = _pair(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=AccumulationWarning)
        _flush_every_backward(opt, model)
    assert not caught


def test_silenced_one_by_its_message():
    """``message=`` with the start of one warning silences it and leaves the other."""
    model, opt, _, _ = _pair(2)
    sched = SCHEDULERS["StepLR"](opt)
    with recorded() as ours:
        warnings.filterwarnings("ignore", category=AccumulationWarning,
                                message=r"AccumulatingOptimizer\(accumulation_steps=2\): the "
                                        r"learning rate")
        for x, y in batches(6, 4):
            mse(model, x, y).backward()
            opt.step()
            sched.step()
        _flush_every_backward(opt, model)
    assert len(ours) == 1 and "single micro-batch" in str(ours[0].message)


def test_the_category():
    assert issubclass(AccumulationWarning, UserWarning)
    assert AccumulationWarning is _util.AccumulationWarning
    assert "AccumulationWarning" in accumkernels.optim.__all__
