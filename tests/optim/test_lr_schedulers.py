"""LR schedulers see the wrapper's real steps: no false "Detected call of `lr_scheduler.step()`
before `optimizer.step()`" warning, and the same learning rates per step as natively.

torch's ``LRScheduler`` patches ``step`` on the optimizer instance it is built on, to record that
the optimizer stepped; at its first ``step()`` it warns if it saw none. The wrapper steps the
inner optimizer through the class's unwrapped ``step`` (torch's global step hooks run once, on
the wrapper), so that instance patch must be honoured by ``optim.protocol`` itself. A scheduler
built on the inner optimizer before wrapping is what the one-line integrations (Accelerate,
Lightning, the HF Trainer given ``optimizers=``) meet; the README's manual recipes build it on
the wrapper. Each test runs the same script natively and with the wrapper, recording every
warning: the wrapper's run may emit only warnings the native run emits too. Schedulers built on
the wrapper (StepLR, LambdaLR, OneCycleLR, CosineAnnealingLR, ReduceLROnPlateau, two param
groups) set the learning rates the real steps use, as natively.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    batches,
    make_model,
    mse,
)

from accumkernels.optim import AccumulatingOptimizer

SCHED_WARNING = "lr_scheduler.step()"
N = 4  # micro-batches per window
MICRO_BATCHES = 10  # windows of 4, 4 and a short one of 2


def _recorded(run):
    """``run()``'s result and the warnings it emitted, as (category, message) pairs."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    return out, [(w.category.__name__, str(w.message)) for w in caught]


def _check(native_run, wrapped_run, steps: int | None = None):
    """The wrapped run emits no warning the native run does not, and the same learning rates."""
    native_lrs, native_warnings = _recorded(native_run)
    lrs, ours = _recorded(wrapped_run)
    assert not [m for _, m in native_warnings if SCHED_WARNING in m], native_warnings
    extra = [w for w in ours if w not in native_warnings]
    assert not extra, f"warnings the native run does not emit: {extra}"
    assert lrs == native_lrs, f"learning rates {lrs} vs native {native_lrs}"
    if steps is not None:
        assert len(lrs) == steps, lrs
    assert len(set(lrs)) > 1, f"the schedule did not move: {lrs}"


# -- plain PyTorch loops ---------------------------------------------------------------------------
def _decay(step: int) -> float:
    return 1.0 / (1 + step)


def _plain(where: str | None, accumulation_steps: int | None) -> list[float]:
    """The README's loops: ``where`` is None (native), ``"inner"`` (scheduler built on the
    inner optimizer, then wrapped) or ``"wrapper"``. With ``accumulation_steps=N`` ``step()``
    is called every micro-batch and ``flush()`` ends the short last window."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if where == "inner":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    if where is not None:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps)
    if where != "inner":
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(2, 8, generator=g), torch.randn(2, 4, generator=g))
            for _ in range(MICRO_BATCHES)]
    lrs = []
    for i, (x, y) in enumerate(data):
        (torch.nn.functional.mse_loss(model(x), y) / N).backward()
        window_end = (i + 1) % N == 0 or i + 1 == len(data)
        if where is not None and accumulation_steps is not None:
            opt.step()  # a no-op until the window is complete
            if window_end:
                if i + 1 == len(data):
                    opt.flush()
                lrs.append(opt.param_groups[0]["lr"])
                scheduler.step()
            opt.zero_grad()  # kept mid-window
        elif window_end:
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            scheduler.step()
            opt.zero_grad()
    lrs.append(scheduler.get_last_lr()[0])
    return lrs


WINDOWS = -(-MICRO_BATCHES // N)


@pytest.mark.parametrize("accumulation_steps", [None, N], ids=["steps_None", f"steps_{N}"])
def test_plain_loop_scheduler_on_inner(accumulation_steps):
    """The scheduler built on the optimizer before wrapping (what the integrations do)."""
    _check(lambda: _plain(None, None), lambda: _plain("inner", accumulation_steps), WINDOWS + 1)


@pytest.mark.parametrize("accumulation_steps", [None, N], ids=["steps_None", f"steps_{N}"])
def test_plain_loop_scheduler_on_wrapper(accumulation_steps):
    _check(lambda: _plain(None, None), lambda: _plain("wrapper", accumulation_steps), WINDOWS + 1)


def test_mid_window_step_is_not_a_step():
    """A no-op ``step()`` mid-window does not count as an optimizer step for a scheduler built
    on the inner optimizer: ``scheduler.step()`` before any real step warns, as natively."""
    def run(wrapped: bool):
        model = torch.nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
        if wrapped:
            opt = AccumulatingOptimizer(opt, accumulation_steps=N)
        model(torch.randn(3, 4)).sum().backward()
        if wrapped:
            opt.step()  # 1 micro-batch of N: no step
            assert opt.micro_steps == 1
        scheduler.step()
        return scheduler.get_last_lr()

    native_lrs, native_warnings = _recorded(lambda: run(False))
    lrs, ours = _recorded(lambda: run(True))
    assert any(SCHED_WARNING in m for _, m in native_warnings)
    assert any(SCHED_WARNING in m for _, m in ours), ours
    assert lrs == native_lrs


# -- the frameworks (tiny GPT-2 from a config, CPU, one process) -----------------------------------
@pytest.fixture
def out_dir():
    with tempfile.TemporaryDirectory() as d:
        yield d


def _frameworks():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import _integrations_common as common
    return common


RECIPES = ["oneline", "manual"]  # the one-line integration; the README's manual recipe


@pytest.mark.parametrize("recipe", RECIPES)
def test_accelerate(recipe):
    """``oneline``: ``AccumulatingAccelerator`` prepares the optimizer and a scheduler built on
    it; ``manual``: ``Accelerator``, the optimizer wrapped before ``prepare`` and the scheduler
    built on the wrapper. The README's loop: clip on sync steps, step, scheduler step."""
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")
    c = _frameworks()
    from _integrations_workers import _reset_accelerate

    def run(wrapped: bool) -> list[float]:
        from accelerate import Accelerator

        from accumkernels.integrations.accelerate import AccumulatingAccelerator

        _reset_accelerate()
        if wrapped and recipe == "oneline":
            accelerator = AccumulatingAccelerator(cpu=True, gradient_accumulation_steps=c.ACCUM)
        else:
            accelerator = Accelerator(cpu=True, gradient_accumulation_steps=c.ACCUM)
        model = c.oneline_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
        if wrapped and recipe == "manual":
            opt = AccumulatingOptimizer(opt)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, c.oneline_decay)
        loader = torch.utils.data.DataLoader(c.TokenDataset(c.token_samples(1)), batch_size=c.MICRO)
        model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
        lrs = []
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(model(**batch).loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                    lrs.append(opt.param_groups[0]["lr"])
                opt.step()
                scheduler.step()
                opt.zero_grad()
        assert type(opt.optimizer).__name__ == ("AccumulatingOptimizer" if wrapped else "AdamW")
        return lrs + [scheduler.get_last_lr()[0]]

    _check(lambda: run(False), lambda: run(True), 4)


@pytest.mark.parametrize("recipe", RECIPES)
def test_lightning(recipe, out_dir):
    """``configure_optimizers`` returns an optimizer and a step-interval scheduler:
    ``oneline``: the plain optimizer, wrapped by ``FP32Accumulation`` at fit start (the scheduler
    was built on it); ``manual``: the wrapper, the scheduler built on it."""
    L = pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    c = _frameworks()
    from accumkernels.integrations.lightning import FP32Accumulation

    class Tiny(L.LightningModule):
        def __init__(self, wrap: bool):
            super().__init__()
            self.model = c.oneline_gpt2()
            self.wrap = wrap
            self.lrs: list[float] = []

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def on_before_optimizer_step(self, optimizer):
            self.lrs.append(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=c.LR)
            if self.wrap:
                opt = AccumulatingOptimizer(opt)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, c.oneline_decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def run(wrapped: bool) -> list[float]:
        module = Tiny(wrapped and recipe == "manual")
        trainer = L.Trainer(
            accelerator="cpu", devices=1, accumulate_grad_batches=c.ACCUM, max_steps=3,
            gradient_clip_val=1.0,
            callbacks=[FP32Accumulation()] if wrapped and recipe == "oneline" else [],
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out_dir)
        loader = torch.utils.data.DataLoader(c.TokenDataset(c.token_samples(1)), batch_size=c.MICRO)
        trainer.fit(module, loader)
        assert type(trainer.optimizers[0]).__name__ == (
            "AccumulatingOptimizer" if wrapped else "AdamW")
        return module.lrs + [trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]]

    _check(lambda: run(False), lambda: run(True), 4)


@pytest.mark.parametrize("recipe", RECIPES)
def test_hf_trainer(recipe, out_dir):
    """``optimizers=(optimizer, scheduler)``: ``oneline``: ``AccumulatingTrainer`` given the
    plain optimizer (it wraps it; the scheduler was built on it); ``manual``: the README's
    recipe, ``Trainer`` given the wrapper and a scheduler built on the wrapper."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    c = _frameworks()
    from _integrations_workers import _reset_accelerate

    def run(wrapped: bool) -> list[float]:
        from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

        from accumkernels.integrations.transformers import AccumulatingTrainer

        _reset_accelerate()
        model = c.oneline_gpt2()
        opt = torch.optim.AdamW(model.parameters(), lr=c.LR)
        if wrapped and recipe == "manual":
            opt = AccumulatingOptimizer(opt)
        scheduler = get_linear_schedule_with_warmup(opt, 1, 10)
        args = TrainingArguments(
            output_dir=os.path.join(out_dir, "wrapped" if wrapped else "native"), use_cpu=True,
            report_to=[], disable_tqdm=True, seed=0, per_device_train_batch_size=c.MICRO,
            gradient_accumulation_steps=c.ACCUM, max_grad_norm=1.0, learning_rate=c.LR,
            num_train_epochs=1, logging_steps=1, save_strategy="no", dataloader_num_workers=0)
        cls = AccumulatingTrainer if wrapped and recipe == "oneline" else Trainer
        trainer = cls(model=model, args=args, train_dataset=c.TokenDataset(c.token_samples(1)),
                      optimizers=(opt, scheduler))
        trainer.train()
        inner = trainer.optimizer.optimizer  # Accelerate's AcceleratedOptimizer holds it
        assert type(inner).__name__ == ("AccumulatingOptimizer" if wrapped else "AdamW")
        return [h["learning_rate"] for h in trainer.state.log_history if "grad_norm" in h] \
            + [trainer.lr_scheduler.get_last_lr()[0]]

    _check(lambda: run(False), lambda: run(True), 4)


# -- learning rates per step, as natively ----------------------------------------------------------


SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=6),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers(name):
    N, windows = 2, 5
    model = make_model()
    ref = copy.deepcopy(model)

    def groups(mod):  # two param groups with different lrs
        return [{"params": mod[0].parameters(), "lr": 0.1},
                {"params": [p for layer in list(mod)[1:] for p in layer.parameters()]}]

    inner = torch.optim.SGD(groups(model), lr=0.05, momentum=0.9)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    ref_opt = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref_opt)
        lrs, ref_lrs = [], []
        for _ in range(windows):
            data = batches(N, 4)
            # Accelerate-style: step() every micro-batch, the scheduler after a real step.
            for x, y in data:
                (mse(model, x, y) / N).backward()
                real = opt.sync_step
                opt.step()
                if real:
                    sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
                    opt.zero_grad()  # (as the native loop clears)
            for x, y in data:
                (mse(ref, x, y) / N).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step(1.0) if name == "ReduceLROnPlateau" else ref_sched.step()
            lrs.append([g["lr"] for g in inner.param_groups])
            ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert lrs == ref_lrs
    assert len({tuple(lr) for lr in lrs}) > 1  # the schedule did change the lr
    # The lr the scheduler set is the one the steps used: same params as the native run
    # (fp32 accumulation of 2 grads on both sides, momentum SGD: differences ~1e-7).
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
