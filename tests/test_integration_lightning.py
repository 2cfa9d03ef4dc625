"""Lightning (2.x) automatic optimization with AccumulatingOptimizer from configure_optimizers.

What Lightning does with ``accumulate_grad_batches=N``, and why the recipe is
``accumulation_steps=None, reduction="sum"``:

* The training-step closure divides the loss by N before ``backward``: native fp32 ``.grad``
  holds the mean over the window, the wrapper must only sum (``reduction="sum"``).
* On the first N-1 micro-batches Lightning runs the closure (forward + backward) itself and
  never calls ``step()``; on the N-th it calls ``optimizer.step(closure)``, and the closure runs
  the last forward/backward, then ``on_before_optimizer_step`` and gradient clipping
  (``gradient_clip_val``), all *inside* the wrapper's ``step()``. ``p.grad`` is the running
  fp32 window after every backward, so the hooks and the clip see it; the step after the
  closure ends the window (``accumulation_steps=None``: every ``step()`` does, the short one at
  the end of an epoch included). The wrapper does not look at where a closure comes from.
* Lightning clips the parameters of ``optimizer.param_groups`` (its precision plugin's
  ``main_params``), not ``model.parameters()``: with master weights those are the fp32 masters.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _integration_common import (
    LR,
    MAX_GRAD_NORM,
    N_ACCUM,
    assert_moved,
    assert_same_params,
    linear_decay,
    loader,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer

L = pytest.importorskip("lightning")

MICRO_BATCH = 2


class GPT2Module(L.LightningModule):
    def __init__(self, model, *, wrap: bool, accumulation_steps: int | None = None):
        super().__init__()
        self.model = model
        self.wrap = wrap
        self.accumulation_steps = accumulation_steps
        self.grad_norms: list[float] = []  # what on_before_optimizer_step sees in p.grad
        self.opt = None

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        self.grad_norms.append(torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()
            if grads else 0.0)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        if self.wrap:
            opt = AccumulatingOptimizer(opt, accumulation_steps=self.accumulation_steps,
                                        reduction="sum")
        self.opt = opt
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(8))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def train_with_lightning(model, samples, *, wrap: bool, max_steps: int = -1, epochs: int = 1,
                         clip_val: float | None = MAX_GRAD_NORM, clip_algorithm: str = "norm",
                         accumulation_steps: int | None = None) -> GPT2Module:
    module = GPT2Module(model, wrap=wrap, accumulation_steps=accumulation_steps)
    trainer = L.Trainer(
        accumulate_grad_batches=N_ACCUM, accelerator="cpu", devices=1, max_steps=max_steps,
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=clip_val,
        gradient_clip_algorithm=clip_algorithm, num_sanity_val_steps=0,
    )
    trainer.fit(module, loader(samples, MICRO_BATCH))
    return module


@pytest.mark.parametrize("clip_algorithm", ["norm", "value"])
def test_lightning_matches_native(clip_algorithm):
    steps = 3
    samples = token_batches(steps * N_ACCUM * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    # gradient_clip_val=0.05 for "value": below the largest gradient elements, so it bites.
    clip_val = {"norm": MAX_GRAD_NORM, "value": 0.05}[clip_algorithm]
    kwargs = {"max_steps": steps, "clip_val": clip_val, "clip_algorithm": clip_algorithm}

    native_module = train_with_lightning(native, samples, wrap=False, **kwargs)
    our_module = train_with_lightning(ours, samples, wrap=True, **kwargs)

    assert len(native_module.grad_norms) == steps
    if clip_algorithm == "norm":
        assert all(n > MAX_GRAD_NORM for n in native_module.grad_norms)  # clipping took effect
    assert our_module.grad_norms == pytest.approx(native_module.grad_norms, rel=1e-6)
    opt = our_module.opt
    assert opt.micro_steps == 0 and opt.skipped_steps == 0
    assert all(s["step"].item() == steps for s in opt.state.values())
    assert_moved(ours, start)
    assert_same_params(native, ours)


def test_lightning_bf16_master_weights_clipping():
    """Lightning's gradient_clip_val must scale what the inner optimizer steps on.

    Lightning clips optimizer.param_groups, i.e. the wrapper's fp32 masters (fixed in 45b225f:
    their .grad used to be None at that point, so the clip silently did nothing).

    A step pre-hook on the inner AdamW measures the norm of the gradients it is handed; it must
    be min(pre-clip norm, clip_val). (Comparing parameters with a wrapper-clipped run instead
    would be chaotic in bf16: a master a few ulps off can round to a different bf16 param and
    perturb every later gradient.) Tolerance: the clip scales by clip_val / (norm + 1e-6) in
    fp32, so the clipped norm is clip_val * (1 - 1e-6 / norm) up to a few fp32 ulps: rel 1e-5.
    """
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("needs Tensor.grad_dtype for fp32 .grad on bf16 params")
    steps = 2
    samples = token_batches(steps * N_ACCUM * MICRO_BATCH)
    model = tiny_gpt2(dtype=torch.bfloat16)
    used = []

    class Recording(GPT2Module):
        def configure_optimizers(self):
            config = super().configure_optimizers()
            assert self.opt.master_weights

            def record(inner, args, kwargs):
                grads = [p.grad for g in inner.param_groups for p in g["params"]]
                assert all(g is not None and g.dtype == torch.float32 for g in grads)
                used.append(torch.linalg.vector_norm(
                    torch.stack([torch.linalg.vector_norm(g) for g in grads])).item())

            self.opt.optimizer.register_step_pre_hook(record)
            return config

    module = Recording(model, wrap=True)
    trainer = L.Trainer(
        accumulate_grad_batches=N_ACCUM, accelerator="cpu", devices=1, max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=MAX_GRAD_NORM, num_sanity_val_steps=0)
    trainer.fit(module, loader(samples, MICRO_BATCH))

    assert len(module.grad_norms) == len(used) == steps
    assert all(n > MAX_GRAD_NORM for n in module.grad_norms), module.grad_norms
    assert used == pytest.approx([MAX_GRAD_NORM] * steps, rel=1e-5)


@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_lightning_short_last_window_matches_native(accumulation_steps):
    """10 micro-batches per epoch, N=4: windows 4, 4, 2 in each of two epochs; Lightning steps
    (and clips) the short one at the end of the epoch, and so must the wrapper.
    (Fixed in 7f38bc6: the step() used to be a no-op and the next epoch's backward raised.)"""
    samples = token_batches(10 * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_module = train_with_lightning(native, samples, wrap=False, epochs=2)
    our_module = train_with_lightning(ours, samples, wrap=True, epochs=2,
                                      accumulation_steps=accumulation_steps)
    assert len(native_module.grad_norms) == 6
    assert our_module.grad_norms == pytest.approx(native_module.grad_norms, rel=1e-6)
    assert all(s["step"].item() == 6 for s in our_module.opt.state.values())
    assert_same_params(native, ours)


def test_lightning_epoch_shorter_than_window():
    """Every window is the short end-of-epoch one, the very first window included."""
    samples = token_batches(2 * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_module = train_with_lightning(native, samples, wrap=False, epochs=3)
    our_module = train_with_lightning(ours, samples, wrap=True, epochs=3)
    assert len(native_module.grad_norms) == 3
    assert our_module.grad_norms == pytest.approx(native_module.grad_norms, rel=1e-6)
    assert all(s["step"].item() == 3 for s in our_module.opt.state.values())
    assert_same_params(native, ours)
