"""Training-loop patterns from real projects, each against the same loop run natively.

* nanoGPT's loop with ``torch.amp.GradScaler``: one window overflows, ``scaler.step`` skips it
  (``opt.step()`` is never called, ``zero_grad`` follows) and the next window trains like native.
* Gradient checkpointing (``torch.utils.checkpoint``, reentrant and not; and PEFT LoRA on a tiny
  HF model with ``gradient_checkpointing_enable()``): ONE micro-batch per user backward, however
  many nested backwards the recomputation runs.
* A gradient penalty (``torch.autograd.grad(loss, params, create_graph=True)``) between backwards
  is no micro-batch and does not touch the window.
* Lightning manual optimization: the docs' recipe (step every N batches, clip_gradients, leftovers
  carried into the next epoch's window) and the step-every-micro-batch style with
  ``accumulation_steps=N``.
* Lightning's ``BackboneFinetuning`` (calls ``add_param_group`` mid-training): trains like native or
  raises a clear error naming ``add_param_group`` and a workaround.

Tolerances: see tests/_native_common.py (fp32: bit-for-bit expected, REL = 1e-6 norm-wise).
Two more such patterns live with their subject in tests/optim/: ``zero_grad(set_to_none=False)``
with params that get no gradient (test_zero_grad.py) and bf16 weights changed outside the
optimizer (test_masters.py).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from _native_common import (
    CLIP,
    D_IN,
    D_OUT,
    N_ACCUM,
    SMALL_BUCKET,
    Run,
    assert_grads_match_native,
    assert_moved,
    assert_same_params,
    assert_values_match,
    grad_norm,
    mlp,
    mlp_batches,
    mse,
    random_seed,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from accumkernels import AccumulatingOptimizer

LR = 0.1


# -- nanoGPT + GradScaler --------------------------------------------------------------------------

@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_nanogpt_loop_with_grad_scaler_skips_overflowing_window(accumulation_steps):
    """nanoGPT's train.py inner loop: autocast forward, loss / N, scaler.scale(loss).backward() per
    micro-step, then scaler.unscale_(opt), clip_grad_norm_(model.parameters(), 1.0),
    scaler.step(opt), scaler.update(), opt.zero_grad(set_to_none=True). One micro-batch of window 1
    has an infinite loss: its window is non-finite, GradScaler skips the step (never calls
    opt.step()) and halves the scale. The wrapper (accumulation_steps=N or None) must then start
    the next window afresh, exactly like native, whose zero_grad dropped the bad window.

    (Before commit 1a87787, the first backward after the skipped window raised
    "a backward pass started after the window ... was complete".)"""
    pytest.importorskip("transformers")
    from _integrations_common import VOCAB, tiny_gpt2

    try:
        torch.amp.GradScaler("cpu")
    except (RuntimeError, ValueError, TypeError) as e:
        pytest.skip(f"torch.amp.GradScaler('cpu') unsupported: {e}")

    iters, n, overflow = 5, N_ACCUM, (1, 2)
    start = tiny_gpt2(seed=random_seed())
    g = torch.Generator().manual_seed(random_seed())
    data = [torch.randint(0, VOCAB, (2, 17), generator=g) for _ in range(iters * n)]

    def train(wrap):
        model = copy.deepcopy(start)
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        if wrap:
            opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps,
                                        reduction="sum")
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12, growth_interval=2)
        run, scales = Run(model, opt), []
        for it in range(iters):
            for micro_step in range(n):
                xy = data[it * n + micro_step]
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    logits = model(input_ids=xy[:, :-1]).logits
                    loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), xy[:, 1:].reshape(-1))
                    loss = loss / n
                if (it, micro_step) == overflow:
                    loss = loss * float("inf")
                run.losses.append(loss.item())
                scaler.scale(loss).backward()
                run.micro_norms.append(grad_norm(model.parameters()))
            scaler.unscale_(opt)
            run.clip_norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
            scales.append(scaler.get_scale())
        return run, scales

    native, native_scales = train(False)
    ours, scales = train(True)
    # GradScaler skipped exactly the overflowing window, and later ones stepped (scale grows).
    assert native_scales == [2.0 ** 12, 2.0 ** 11, 2.0 ** 11, 2.0 ** 12, 2.0 ** 12], native_scales
    assert scales == native_scales
    assert_values_match(ours.losses, native.losses, "losses")
    assert_values_match(ours.micro_norms, native.micro_norms, "per-micro-batch grad norms")
    assert_values_match(ours.clip_norms, native.clip_norms, "clip norms")
    assert all(s["step"].item() == iters - 1 for s in ours.opt.state.values())
    assert_moved(ours.model, start)
    assert_same_params(native.model, ours.model, rtol=0, atol=1e-5)


# -- gradient checkpointing ------------------------------------------------------------------------

class CheckpointedMLP(nn.Module):
    """Residual blocks and the head under torch.utils.checkpoint: with use_reentrant=True every
    trainable param but the input layer gets its gradient inside a nested backward, the head's
    (the first gradients of the backward) included."""

    def __init__(self, use_reentrant: bool, width: int = 16):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Linear(D_IN, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, width))
            for _ in range(2))
        self.head = nn.Sequential(nn.Tanh(), nn.Linear(width, D_OUT))

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return checkpoint(self.head, h, use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("reduction, accumulation_steps", [("sum", N_ACCUM), ("mean", None)])
def test_checkpointed_model_one_microbatch_per_backward(use_reentrant, reduction,
                                                        accumulation_steps):
    """Two windows of 4 user backwards. "sum", N=4: p.grad after each backward is native's running
    window and sync_step turns True only after the 4th. "mean", None, raw loss: the step divides by
    the 4 user backwards (native: loss / 4), not by the number of nested backwards."""
    torch.manual_seed(random_seed())
    model = CheckpointedMLP(use_reentrant)
    native = copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                accumulation_steps=accumulation_steps, reduction=reduction,
                                bucket_size_mb=SMALL_BUCKET)
    native_opt = torch.optim.SGD(native.parameters(), lr=LR, momentum=0.9)
    for w in range(2):
        for k, batch in enumerate(mlp_batches(N_ACCUM)):
            mse(model, batch).backward() if reduction == "mean" else \
                (mse(model, batch) / N_ACCUM).backward()
            (mse(native, batch) / N_ACCUM).backward()
            if reduction == "sum":
                assert_grads_match_native(model, native, f"window {w}, backward {k}: ")
                assert opt.sync_step == (k == N_ACCUM - 1), f"window {w}, after backward {k}"
        for o in (opt, native_opt):
            o.step()
            o.zero_grad()
        assert_same_params(native, model)
    assert_moved(model, CheckpointedMLP(use_reentrant))


@pytest.mark.parametrize("use_reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_peft_lora_with_gradient_checkpointing(use_reentrant):
    """PEFT LoRA (random A and B, so every LoRA param has a gradient from the start) on a tiny
    GPT-2 with gradient_checkpointing_enable(): only the LoRA params train, and all of them get
    their gradients inside the checkpointed blocks. accumulation_steps=4: p.grad after every user
    backward equals native's, sync_step only after the 4th, params after each step equal."""
    pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from _integrations_common import tiny_gpt2, token_batches

    seed = random_seed()

    def lora_gpt2():
        base = tiny_gpt2(seed=seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation of the alias; fan_in_fan_out notices
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            torch.manual_seed(seed + 1)
            model = peft.get_peft_model(base, peft.LoraConfig(
                r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0,
                init_lora_weights=False, fan_in_fan_out=True))
        model.train()
        return model

    model, native = lora_gpt2(), lora_gpt2()
    assert model.base_model.model.is_gradient_checkpointing
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert 0 < len(trainable) < len(list(model.parameters()))
    opt = AccumulatingOptimizer(torch.optim.AdamW(trainable, lr=1e-2), accumulation_steps=N_ACCUM,
                                reduction="sum")
    native_opt = torch.optim.AdamW([p for p in native.parameters() if p.requires_grad], lr=1e-2)
    start = [p.detach().clone() for p in trainable]
    samples = token_batches(2 * N_ACCUM * 2, seed=random_seed())
    batches = [{k: torch.stack([s[k] for s in samples[i:i + 2]]) for k in samples[0]}
               for i in range(0, len(samples), 2)]
    for w in range(2):
        for k in range(N_ACCUM):
            batch = batches[w * N_ACCUM + k]
            (model(**batch).loss / N_ACCUM).backward()
            (native(**batch).loss / N_ACCUM).backward()
            assert_grads_match_native(model, native, f"window {w}, backward {k}: ")
            assert opt.sync_step == (k == N_ACCUM - 1), f"window {w}, after backward {k}"
        for o in (opt, native_opt):
            o.step()
            o.zero_grad()
        assert_same_params(native, model, rtol=0, atol=1e-5)
    assert all(not torch.equal(p, s) for p, s in zip(trainable, start))


# -- gradient penalty between backwards ------------------------------------------------------------

@pytest.mark.parametrize("reduction, accumulation_steps", [("sum", N_ACCUM), ("mean", None)])
def test_gradient_penalty_autograd_grad_does_not_touch_the_window(reduction, accumulation_steps):
    """Each micro-batch: grads = torch.autograd.grad(loss, params, create_graph=True) (no .grad
    is written natively), then (loss + 0.1 * sum |grad|^2).backward() (/ N natively and with
    "sum"). "sum", N=4: after the autograd.grad call p.grad is still the running window and
    sync_step has not moved; after the backward p.grad is native's. "mean", None: the step divides
    by the 4 backwards only. Params after each step equal native's."""
    model = mlp(seed=random_seed())
    native, start = copy.deepcopy(model), copy.deepcopy(model)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9),
                                accumulation_steps=accumulation_steps, reduction=reduction,
                                bucket_size_mb=SMALL_BUCKET)
    native_opt = torch.optim.SGD(native.parameters(), lr=LR, momentum=0.9)
    for w in range(2):
        for k, batch in enumerate(mlp_batches(N_ACCUM)):
            sync_before = opt.sync_step
            total = {}
            for mod in (model, native):
                loss = mse(mod, batch)
                grads = torch.autograd.grad(loss, list(mod.parameters()), create_graph=True)
                total[id(mod)] = loss + 0.1 * sum(g.pow(2).sum() for g in grads)
            assert opt.sync_step == sync_before, f"window {w}: autograd.grad moved the window"
            if reduction == "sum":
                if k > 0:
                    assert_grads_match_native(model, native,
                                              f"window {w}, after autograd.grad {k}: ")
                (total[id(model)] / N_ACCUM).backward()
            else:
                total[id(model)].backward()
            (total[id(native)] / N_ACCUM).backward()
            if reduction == "sum":
                assert_grads_match_native(model, native, f"window {w}, after backward {k}: ")
                assert opt.sync_step == (k == N_ACCUM - 1), f"window {w}, after backward {k}"
        for o in (opt, native_opt):
            o.step()
            o.zero_grad()
        assert_same_params(native, model)
    assert_moved(model, start)


# -- Lightning manual optimization -----------------------------------------------------------------

def _train_manual(start, batches, *, wrap, style, epochs=2):
    """Lightning manual optimization on an MLP. style "docs": the docs' recipe (loss / N,
    manual_backward, every N-th batch of the epoch clip_gradients + step + zero_grad; the leftover
    batches of an epoch stay in the window). style "every": step() + zero_grad() every micro-batch
    with accumulation_steps=N (native: the same loop stepping every N-th micro-batch overall)."""
    import lightning as L

    run = Run(copy.deepcopy(start))

    class Manual(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.model = run.model
            self.micro = 0

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = mse(self.model, batch)
            run.losses.append(loss.item())
            self.manual_backward(loss / N_ACCUM)
            run.micro_norms.append(grad_norm(self.model.parameters()))
            self.micro += 1
            if style == "docs":
                if (batch_idx + 1) % N_ACCUM == 0:
                    run.clip_norms.append(grad_norm(self.model.parameters()))
                    self.clip_gradients(opt, gradient_clip_val=CLIP, gradient_clip_algorithm="norm")
                    opt.step()
                    opt.zero_grad()
            elif wrap or self.micro % N_ACCUM == 0:
                opt.step()
                opt.zero_grad()

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
            if wrap:
                opt = AccumulatingOptimizer(
                    opt, accumulation_steps=None if style == "docs" else N_ACCUM, reduction="sum")
            run.opt = opt
            return opt

    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Manual(), torch.utils.data.DataLoader(batches, batch_size=None))
    return run


@pytest.mark.parametrize("style", ["docs", "every"])
def test_lightning_manual_optimization(style):
    """10 batches per epoch, two epochs, N=4. "docs": windows 4, 4, then 2 + 4 (the epoch's
    leftovers carried over), 4, and 2 left unstepped; "every": windows of 4 across the epoch
    boundary. Same losses, per-micro-batch grad norms, pre-clip norms and params as native."""
    pytest.importorskip("lightning")
    start = mlp(seed=random_seed())
    batches = mlp_batches(10)
    native = _train_manual(start, batches, wrap=False, style=style)
    ours = _train_manual(start, batches, wrap=True, style=style)
    if style == "docs":
        assert len(native.clip_norms) == 4 and all(n > CLIP for n in native.clip_norms)
    assert_values_match(ours.losses, native.losses, "losses")
    assert_values_match(ours.micro_norms, native.micro_norms, "per-micro-batch grad norms")
    assert_values_match(ours.clip_norms, native.clip_norms, "pre-clip norms")
    steps = 4 if style == "docs" else 5
    assert all(s["step"].item() == steps for s in ours.opt.state.values())
    assert_moved(ours.model, start)
    assert_same_params(native.model, ours.model)


# -- Lightning BackboneFinetuning (add_param_group mid-training) -----------------------------------

WORKAROUND_WORDS = ("instead", "workaround", "rebuild", "re-create", "recreate",
                    "new accumulatingoptimizer", "from the start", "configure_optimizers")


def test_lightning_backbone_finetuning_add_param_group():
    """BackboneFinetuning freezes the backbone, then at epoch 1 unfreezes it and calls
    optimizer.add_param_group on the wrapper (and rescales that group's lr every epoch). Accepted:
    the same params as native after 3 epochs (accumulate_grad_batches=2, accumulation_steps=None),
    or an error that names add_param_group and a workaround usable when a callback adds the group
    during training. (Before commit 1a87787, a NotImplementedError "add param groups
    to the inner optimizer before wrapping it" named neither the call nor anything a
    callback-driven run could do.)"""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.callbacks import BackboneFinetuning

    seed = random_seed()
    batches = mlp_batches(6)

    def train(wrap):
        torch.manual_seed(seed)

        class Finetune(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.backbone = nn.Sequential(nn.Linear(D_IN, 16), nn.Tanh())
                self.head = nn.Linear(16, D_OUT)
                self.opt = None

            def training_step(self, batch, batch_idx):
                x, y = batch
                return F.mse_loss(self.head(self.backbone(x)), y)

            def configure_optimizers(self):
                opt = torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
                if wrap:
                    opt = AccumulatingOptimizer(opt, accumulation_steps=None, reduction="sum")
                self.opt = opt
                return opt

        module = Finetune()
        start = copy.deepcopy(module)
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=3, accumulate_grad_batches=2, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, callbacks=[BackboneFinetuning(
                unfreeze_backbone_at_epoch=1, lambda_func=lambda epoch: 1.5,
                backbone_initial_ratio_lr=0.1, should_align=True, verbose=False)])
        trainer.fit(module, torch.utils.data.DataLoader(batches, batch_size=None))
        return module, start

    native, start = train(False)
    assert len(native.opt.param_groups) == 2
    assert_moved(native.backbone, start.backbone)
    try:
        ours, _ = train(True)
    except Exception as e:  # noqa: BLE001 -- any type, if the message helps
        message = str(e).lower()
        assert "add_param_group" in message and any(w in message for w in WORKAROUND_WORDS), \
            f"{type(e).__name__} without a usable workaround: {e}"
        return
    assert len(ours.opt.param_groups) == 2
    assert_same_params(native, ours)
