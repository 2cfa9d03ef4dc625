"""Lightning: automatic optimization with AccumulatingOptimizer from ``configure_optimizers``
(the recipe), and ``callbacks=[FP32Accumulation()]`` (the one line,
accumkernels.integrations.lightning).

The recipe: what Lightning (2.x) does with ``accumulate_grad_batches=N``, and why the recipe is
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

The one line: the script (_integrations_workers.train_lightning) is an ``L.Trainer`` with
``accumulate_grad_batches=4``, ``gradient_clip_val``, a LambdaLR stepped per optimizer step,
two epochs of windows 4, 4, 2, strategy ``ddp`` on 2 CPU devices, and a resume from a
checkpoint saved at the end of the first epoch. The comparisons and why fp32 is bit-for-bit:
_integrations_common.py.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")  # the tiny GPT-2

import _integrations_workers as workers  # noqa: E402
from _integrations_common import (  # noqa: E402
    LR,
    MAX_GRAD_NORM,
    N_ACCUM,
    assert_moved,
    assert_same_params,
    check_bf16,
    check_fp32,
    check_ranks_agree,
    first_difference,
    linear_decay,
    loader,
    run_ranks,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")


# -- the recipe: AccumulatingOptimizer from configure_optimizers, one process ----------------------

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


# -- the one line: FP32Accumulation, 1 process and 2 ranks -----------------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return workers.scenario_lightning(str(tmp_path_factory.mktemp("lightning1")), 1, bf16=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank Lightning scenario in one pair of processes (start-up dominates)."""
    return run_ranks(tmp_path_factory.mktemp("lightning2"), "lightning", timeout=300)


def test_one_process_equals_native(one_process):
    check_fp32(one_process, "Lightning, 1 process", resumed_norms=slice(3, None))
    first = one_process["first_epoch"]
    assert first["norms"] == one_process["native"]["norms"][:3]


def test_two_ranks_equal_native_ddp(two_ranks):
    for rank, res in enumerate(two_ranks):
        check_fp32(res, f"Lightning, rank {rank} of 2", resumed_norms=slice(3, None))
    check_ranks_agree(two_ranks, "oneline", "Lightning")


def test_bf16_closer_to_float64(two_ranks):
    """bf16 on 2 ranks (the DDP path: DDP reduces the fp32 window, not bf16 buckets)."""
    for rank, res in enumerate(two_ranks):
        check_bf16(res, f"rank {rank}: Lightning bf16")


def test_foreign_comm_hook_refused(two_ranks):
    """2 ranks, ``strategy="ddp"``: a hook registered on Lightning's DDP module before
    ``on_fit_start`` makes ``fit`` raise ValueError naming it; the optimizer is not wrapped."""
    for res in two_ranks:
        r = res["foreign_hook"]
        assert r["error"] and "allreduce_hook" in r["error"], r
        assert r["untouched"]


def _stub_trainer(strategy_name: str, model: torch.nn.Module, opt: torch.optim.Optimizer):
    strategy = type(strategy_name, (), {})()
    strategy.model, strategy.optimizers = model, [opt]
    return types.SimpleNamespace(strategy=strategy)


@pytest.mark.parametrize("strategy", ["DeepSpeedStrategy", "FSDPStrategy"])
def test_foreign_strategies_refused_with_state_unchanged(strategy):
    from accumkernels.integrations.lightning import FP32Accumulation

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    trainer = _stub_trainer(strategy, model, opt)
    with pytest.raises(ValueError, match="grad_accum_dtype"):
        FP32Accumulation().on_fit_start(trainer, model)
    assert trainer.strategy.optimizers == [opt]
    assert not hasattr(opt, "_accumkernels_wrapper")


def test_skipped_window_skips_the_update(tmp_path):
    """A non-finite window: the wrapper drops it (``skipped_steps``), as a GradScaler overflow
    drops a step in Lightning (whose LR schedulers advance either way: it does not ask).
    Judge: the weights after the poisoned window are those before it, bit for bit, and the
    next window moves them again."""
    import lightning as L

    from accumkernels.integrations.lightning import FP32Accumulation

    class Poisoned(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)
            self.seen: list[list[torch.Tensor]] = []

        def training_step(self, batch, batch_idx):
            loss = self.net(batch).square().mean()
            return loss * float("inf") if batch_idx == 5 else loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if batch_idx % 4 == 3:
                self.seen.append([p.detach().clone() for p in self.parameters()])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    module = Poisoned()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=4,
                        callbacks=[FP32Accumulation()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(24, 4), batch_size=2))
    assert trainer.optimizers[0].skipped_steps == 1
    before, poisoned, after = module.seen
    assert first_difference(poisoned, before) is None  # window 1 did not move the weights
    assert first_difference(after, poisoned) is not None  # window 2 did
    assert all(bool(torch.isfinite(p).all()) for p in after)
