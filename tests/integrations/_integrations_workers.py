"""The framework scripts of the one-line tests in tests/integrations/, each written once and run
with and without its one line, on 1 process (called in the test process) or on 2 gloo ranks (called
by ``_integrations_common.run_ranks`` in every rank; the process group exists already, so the
frameworks use it). Each returns plain data: parameters, logged norms, learning rates, errors."""

from __future__ import annotations

import os

import torch
from _integrations_common import (
    ACCUM,
    CLIP,
    EPOCHS,
    LR,
    MICRO,
    RESUME_AT,
    TokenDataset,
    oneline_decay,
    oneline_gpt2,
    snapshot,
    token_samples,
)


def _barrier(world: int) -> None:
    if world > 1:
        torch.distributed.barrier()


def _reset_accelerate() -> None:
    """Accelerate keeps process-wide singletons; every script starts from fresh ones."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _dtype_runs(run, work: str) -> dict:
    """bf16 with the one line, bf16 natively, float64 natively (the reference), at the HF
    Trainer's default learning rate: AdamW's steps (~lr per element) are then below half a
    bf16 ulp of most weights (2**-14 at 0.02), the regime where bf16 training stalls."""
    return {"bf16_oneline": run(os.path.join(work, "bf16_oneline"), True, torch.bfloat16),
            "bf16_native": run(os.path.join(work, "bf16_native"), False, torch.bfloat16),
            "f64_native": run(os.path.join(work, "f64_native"), False, torch.float64)}


BF16_LR = 5e-5  # TrainingArguments' default learning_rate


# -- HF Trainer -----------------------------------------------------------------------------------
def train_trainer(out: str, world: int, oneline: bool, dtype=torch.float32, *, model=None,
                  data=None, save_steps: int = 0, resume: str | None = None,
                  options: dict | None = None, epochs: int = EPOCHS, lr: float = LR) -> dict:
    """The Trainer with its defaults (AdamW, linear schedule, DDP's find_unused_parameters on),
    ``gradient_accumulation_steps=4``, ``max_grad_norm``; 10 micro-batches per epoch and rank."""
    from transformers import Trainer, TrainingArguments

    from accumkernels.integrations.transformers import AccumulatingTrainer

    _reset_accelerate()
    model = model if model is not None else oneline_gpt2(dtype)
    args = TrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True, seed=0,
        per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        max_grad_norm=CLIP, learning_rate=lr, num_train_epochs=epochs, logging_steps=1,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        dataloader_num_workers=0)
    kwargs = {"accumkernels": options} if oneline and options else {}
    cls = AccumulatingTrainer if oneline else Trainer
    trainer = cls(model=model, args=args, train_dataset=TokenDataset(data or token_samples(world)),
                  **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    inner = trainer.optimizer.optimizer
    result = {"params": snapshot(model), "norms": [h["grad_norm"] for h in logs],
              "lrs": [h["learning_rate"] for h in logs], "steps": trainer.state.global_step,
              "scheduler_steps": trainer.lr_scheduler.last_epoch,
              "wrapped": type(inner).__name__,
              "skipped": getattr(inner, "skipped_steps", None)}
    _barrier(world)
    return result


SEQ_IN = 8


class Conditional(torch.nn.Module):
    """``extra`` is used in the first ACCUM-1 micro-batches of every window (the ``no_sync``
    ones) and not in the window's last, the sync one (an MoE expert, a conditional head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(SEQ_IN, 32)
        self.head = torch.nn.Linear(32, 4)
        self.extra = torch.nn.Linear(32, 4)
        self.calls = 0

    def forward(self, x, labels):
        h = torch.tanh(self.body(x))
        out = self.head(h)
        if self.calls % ACCUM != ACCUM - 1:
            out = out + self.extra(h)
        self.calls += 1
        return {"loss": torch.nn.functional.mse_loss(out, labels)}


def regression_samples(world: int, per_epoch: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    n = world * per_epoch * MICRO
    x, y = torch.randn(n, SEQ_IN, generator=g), torch.randn(n, 4, generator=g)
    return [{"x": x[i], "labels": y[i]} for i in range(n)]


def trainer_conditional(work: str, world: int) -> dict:
    """The Trainer's defaults (find_unused_parameters=True) and a module used only in no_sync
    micro-batches (an MoE expert, a conditional head); native DDP trains. Errors are returned,
    not raised."""
    out = {}
    for oneline in (False, True):
        name = "oneline" if oneline else "native"
        try:
            out[name] = train_trainer(os.path.join(work, f"cond_{name}"), world, oneline,
                                      model=Conditional(), data=regression_samples(world))
        except Exception as exc:  # noqa: BLE001 - reported by the test, per run
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return out


def scenario_trainer(work: str, world: int, conditional: bool = False, bf16: bool = True) -> dict:
    """fp32 native / one line / one line resumed at step RESUME_AT; the bf16 trio; the
    conditional module."""
    res = {"native": train_trainer(os.path.join(work, "native"), world, False),
           "oneline": train_trainer(os.path.join(work, "oneline"), world, True,
                                    save_steps=RESUME_AT)}
    checkpoint = os.path.join(work, "oneline", f"checkpoint-{RESUME_AT}")
    res["resumed"] = train_trainer(os.path.join(work, "resumed"), world, True, resume=checkpoint)
    if bf16:
        res.update(_dtype_runs(lambda out, oneline, dtype: train_trainer(
            out, world, oneline, dtype, lr=BF16_LR), work))
    if conditional:  # last: a failure inside DDP's backward may leave its reducer unusable
        res["conditional"] = trainer_conditional(work, world)
    return res


# -- Accelerate -----------------------------------------------------------------------------------
def train_accelerate(out: str, world: int, oneline: bool, dtype=torch.float32, *,
                     save_at: int | None = None, resume: str | None = None,
                     poison_window: int | None = None, drop_window: int | None = None,
                     options: dict | None = None, lr: float = LR) -> dict:
    """Accelerate's ``accumulate()`` loop: clip on sync steps, step, prepared scheduler step,
    zero_grad every micro-batch. ``save_at``: ``save_state`` after that many windows;
    ``resume``: ``load_state`` and skip the windows it holds. ``poison_window``: that window's
    second micro-batch has an infinite loss; ``drop_window``: native loop that leaves that
    window out by hand (no step, no scheduler step): what a skipped step must equal."""
    from accelerate import Accelerator

    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    _reset_accelerate()
    if oneline:
        accelerator = AccumulatingAccelerator(cpu=True, gradient_accumulation_steps=ACCUM,
                                              accumkernels=options)
    else:
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model = oneline_gpt2(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, oneline_decay)
    loader = torch.utils.data.DataLoader(TokenDataset(token_samples(world)), batch_size=MICRO)
    model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
    skip = 0
    if resume is not None:
        accelerator.load_state(resume)
        skip = RESUME_AT * ACCUM
    norms, skipped, window = [], [], 0
    for _ in range(EPOCHS):
        batches = accelerator.skip_first_batches(loader, skip) if skip else loader
        skip = 0
        for i, batch in enumerate(batches):
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                if window == poison_window and i % ACCUM == 1:
                    loss = loss * float("inf")
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                if not (accelerator.sync_gradients and window == drop_window):
                    opt.step()
                    scheduler.step()
                if accelerator.sync_gradients:
                    skipped.append(accelerator.optimizer_step_was_skipped)
                opt.zero_grad()
            if accelerator.sync_gradients:
                window += 1
                if save_at is not None and window == save_at:
                    accelerator.save_state(out)
    result = {"params": snapshot(accelerator.unwrap_model(model)), "norms": norms,
              "skipped": skipped, "lr": scheduler.get_last_lr()[0],
              "wrapped": type(opt.optimizer).__name__}
    _barrier(world)
    return result


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _untouched(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    """Nothing of accumkernels reached the model or the optimizer (no wrapper, no slot)."""
    from accumkernels.slot import SLOT_ATTR

    return (not hasattr(opt, "_accumkernels_wrapper")
            and not any(hasattr(p, SLOT_ATTR) for p in model.parameters()))


def _refused(call) -> str | None:
    try:
        call()
    except ValueError as exc:
        return str(exc)
    return None


def accelerate_refusals(world: int) -> dict:
    """On real DDP/FSDP1 modules (2 ranks): FSDP1 and a foreign DDP comm hook are refused by
    ``AccumulatingAccelerator.prepare`` with nothing changed; our own hook already registered
    is accepted (idempotent)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel as DDP

    import accumkernels
    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    _reset_accelerate()
    accelerator = AccumulatingAccelerator(cpu=True)
    out = {}
    fsdp = FullyShardedDataParallel(_mlp(), device_id=torch.device("cpu"))
    opt = torch.optim.AdamW(fsdp.parameters(), lr=LR)
    out["fsdp1"] = _refused(lambda: accelerator.prepare(opt, fsdp))
    out["fsdp1_untouched"] = _untouched(fsdp, opt) and not accelerator._optimizers
    foreign = DDP(_mlp())
    foreign.register_comm_hook(None, allreduce_hook)
    opt = torch.optim.AdamW(foreign.parameters(), lr=LR)
    out["foreign_hook"] = _refused(lambda: accelerator.prepare(opt, foreign))
    out["foreign_untouched"] = _untouched(foreign, opt) and not accelerator._optimizers
    ours = DDP(_mlp())
    ours.register_comm_hook(ours.process_group, accumkernels.ddp_comm_hook)
    opt = torch.optim.AdamW(ours.parameters(), lr=LR)
    model, opt = accelerator.prepare(ours, opt)
    out["own_hook_accepted"] = [h.__name__ for h, _ in model._comm_hooks]
    out["own_hook_wrapped"] = type(opt.optimizer).__name__
    _barrier(world)
    return out


def scenario_accelerate(work: str, world: int, bf16: bool = True) -> dict:
    state = os.path.join(work, "state")
    res = {"native": train_accelerate(work, world, False),
           "oneline": train_accelerate(state, world, True, save_at=RESUME_AT),
           "resumed": train_accelerate(work, world, True, resume=state)}
    if bf16:
        res.update(_dtype_runs(lambda out, oneline, dtype: train_accelerate(
            out, world, oneline, dtype, lr=BF16_LR), work))
    if world > 1:
        res["refusals"] = accelerate_refusals(world)
    return res


# -- Lightning ------------------------------------------------------------------------------------
def _lightning_module(dtype, lr: float):
    import lightning as L

    class TinyGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = oneline_gpt2(dtype)
            self.norms: list[float] = []

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in self.parameters()
                 if p.grad is not None]))))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=lr)
            scheduler = torch.optim.lr_scheduler.LambdaLR(opt, oneline_decay)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    return TinyGPT()


def train_lightning(out: str, world: int, oneline: bool, dtype=torch.float32, *,
                    epochs: int = EPOCHS, resume: str | None = None, save: str | None = None,
                    options: dict | None = None, lr: float = LR) -> dict:
    """``L.Trainer`` with ``accumulate_grad_batches=4`` and ``gradient_clip_val``, strategy
    ``ddp`` on 2 CPU devices (``auto`` on one); ``save``/``resume``: a checkpoint at the end of
    the first epoch (a window boundary mid-training) and a fresh Trainer resuming from it."""
    import lightning as L

    from accumkernels.integrations.lightning import FP32Accumulation

    module = _lightning_module(dtype, lr)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        accumulate_grad_batches=ACCUM, gradient_clip_val=CLIP, max_epochs=epochs,
        callbacks=[FP32Accumulation(**(options or {}))] if oneline else [],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=out)
    loader = torch.utils.data.DataLoader(TokenDataset(token_samples(world)), batch_size=MICRO)
    trainer.fit(module, loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    opt = trainer.optimizers[0]
    result = {"params": snapshot(module.model), "norms": module.norms,
              "lr": trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0],
              "wrapped": type(opt).__name__, "skipped": getattr(opt, "skipped_steps", None)}
    _barrier(world)
    return result


def lightning_foreign_hook(work: str, world: int) -> dict:
    """A DDP comm hook registered on Lightning's DDP module (in ``configure_optimizers``, after
    the strategy built it): ``FP32Accumulation`` refuses it before wrapping anything."""
    import lightning as L
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from accumkernels.integrations.lightning import FP32Accumulation

    class Hooked(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp()
            self.opt = None

        def training_step(self, batch, batch_idx):
            return self.net(batch).square().mean()

        def configure_optimizers(self):
            self.trainer.strategy.model.register_comm_hook(None, allreduce_hook)
            self.opt = torch.optim.AdamW(self.parameters(), lr=LR)
            return self.opt

    module = Hooked()
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_epochs=1,
                        callbacks=[FP32Accumulation()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=work)
    data = torch.utils.data.DataLoader(torch.randn(8, 8), batch_size=2)
    error = _refused(lambda: trainer.fit(module, data))
    result = {"error": error, "untouched": _untouched(module.net, module.opt)}
    _barrier(world)
    return result


def scenario_lightning(work: str, world: int, bf16: bool = True) -> dict:
    ckpt = os.path.join(work, "epoch1.ckpt")
    res = {"native": train_lightning(work, world, False),
           "first_epoch": train_lightning(work, world, True, epochs=1, save=ckpt)}
    res["resumed"] = train_lightning(work, world, True, resume=ckpt)
    res["oneline"] = train_lightning(work, world, True)
    if bf16:
        res.update(_dtype_runs(lambda out, oneline, dtype: train_lightning(
            out, world, oneline, dtype, lr=BF16_LR), work))
    if world > 1:
        res["foreign_hook"] = lightning_foreign_hook(work, world)
    return res


SCENARIOS = {"trainer": scenario_trainer, "accelerate": scenario_accelerate,
             "lightning": scenario_lightning}
