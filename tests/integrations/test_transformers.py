"""HF Transformers: the Trainer with AccumulatingOptimizer given through ``optimizers=`` (the
recipe), and ``AccumulatingTrainer`` instead of ``Trainer`` (the one line,
accumkernels.integrations.transformers).

The recipe: how Trainer (transformers 5.x) accumulates, and why the wrapper uses
``reduction="sum"``:

* Trainer runs its own accumulation loop (it sets Accelerate's gradient_accumulation_steps to 1,
  so ``accelerator.backward`` does not divide). For each window it prefetches the N micro-batches
  and counts ``num_items_in_batch`` = the predicted tokens (labels != -100, after the causal
  shift) of the whole window. GPT-2 accepts loss kwargs, so its loss is
  ``sum(token losses) / num_items_in_batch`` and Trainer does not divide by N again. The native
  fp32 ``.grad`` therefore already holds the exact per-token mean gradient of the window, whatever
  the token counts: the wrapper must only sum, i.e. ``reduction="sum"``. (For models without
  loss kwargs Trainer divides by the window's micro-batch count itself: "sum" again.)
* It calls ``optimizer.step()`` only at window boundaries, after clipping ``model.parameters()``
  with ``accelerator.clip_grad_norm_`` (whose return value it logs as ``grad_norm``), then the
  scheduler, then ``model.zero_grad()``. So the recipe is ``accumulation_steps=None``: every
  ``step()`` ends the window, the short one at the end of an epoch included. ``p.grad`` is the
  running fp32 window after every backward, so Trainer's clip sees the window. The wrapper reads
  none of Trainer's or Accelerate's state.

The one line: the Trainer script (_integrations_workers.train_trainer) uses the Trainer's
defaults (AdamW, linear schedule, Accelerate-built DDP with ``find_unused_parameters=True``)
with ``gradient_accumulation_steps=4``, ``max_grad_norm``, two epochs of windows 4, 4, 2 and a
resume from ``checkpoint-2``. The comparisons and why fp32 is bit-for-bit:
_integrations_common.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _integrations_workers as workers  # noqa: E402
from _integrations_common import (  # noqa: E402
    LR,
    MAX_GRAD_NORM,
    N_ACCUM,
    STEPS,
    TokenDataset,
    assert_moved,
    assert_same_params,
    check_bf16,
    check_fp32,
    check_ranks_agree,
    distance,
    first_difference,
    fresh_accelerate_state,  # noqa: F401  (fixture)
    linear_decay,
    run_ranks,
    snapshot,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("fresh_accelerate_state"),
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch.distributed is not available")]


# -- the recipe: optimizers=(AccumulatingOptimizer(...), scheduler), one process -------------------

MICRO_BATCH = 2


def train_with_trainer(model, samples, tmp_path, *, wrap: bool, max_steps: int = -1,
                       epochs: float = 1, max_grad_norm: float = MAX_GRAD_NORM,
                       max_grad_norm_wrapper: float | None = None,
                       accumulation_steps: int | None = None, save_steps: int = 0,
                       resume_from: str | None = None):
    """Trainer run; returns (log_history, optimizer it was given)."""
    from transformers import Trainer, TrainingArguments

    total = max_steps if max_steps > 0 else 8
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, reduction="sum",
                                    max_grad_norm=max_grad_norm_wrapper)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(total))
    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        logging_steps=1, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=N_ACCUM, max_grad_norm=max_grad_norm,
        max_steps=max_steps, num_train_epochs=epochs, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=TokenDataset(samples),
                      optimizers=(opt, scheduler))
    trainer.train(resume_from_checkpoint=resume_from)
    return [h for h in trainer.state.log_history if "grad_norm" in h], opt


def test_trainer_matches_native(tmp_path):
    """GA=4, clipping at 0.5 (active every step), LambdaLR on the wrapper: same logs, params."""
    steps = 4
    samples = token_batches(steps * N_ACCUM * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)

    native_logs, _ = train_with_trainer(native, samples, tmp_path / "native", wrap=False,
                                        max_steps=steps)
    our_logs, opt = train_with_trainer(ours, samples, tmp_path / "ours", wrap=True,
                                       max_steps=steps)

    assert len(native_logs) == len(our_logs) == steps
    native_norms = [h["grad_norm"] for h in native_logs]
    assert all(n > MAX_GRAD_NORM for n in native_norms), native_norms  # clipping took effect
    # The pre-clip norm Trainer computes from p.grad: the wrapper's window, bit-for-bit.
    assert [h["grad_norm"] for h in our_logs] == pytest.approx(native_norms, rel=1e-6)
    assert [h["learning_rate"] for h in our_logs] == [h["learning_rate"] for h in native_logs]
    assert [h["loss"] for h in our_logs] == pytest.approx([h["loss"] for h in native_logs],
                                                          rel=1e-6)
    assert opt.micro_steps == 0 and opt.skipped_steps == 0
    assert_moved(ours, start)
    assert_same_params(native, ours)


def test_trainer_bf16_model_clips_fp32_window(tmp_path):
    """bf16 model, master weights: Trainer's clip_grad_norm_ on model.parameters() sees the fp32
    window (p.grad is an fp32 view, via Tensor.grad_dtype) and scales what the step uses.

    Reference: the same Trainer run with Trainer's clipping off (max_grad_norm=0; it still logs
    the norm of p.grad) and the wrapper clipping instead (its fused max_grad_norm). Both
    accumulate identically; only the norm's summation order differs (per-tensor norms vs one
    flat buffer): a relative difference of a few fp32 ulps in the norm and the clip coefficient.
    The fp32 master weights then agree to ~lr * 1e-6 (atol 1e-6). Their bf16 copies, the model
    params, may differ by one bf16 rounding step where a master sits at a rounding boundary:
    rtol 2**-8 (one bf16 ulp is at most 2**-7 relative, half of that after round-to-nearest).
    """
    if not hasattr(torch.Tensor, "grad_dtype"):
        pytest.skip("needs Tensor.grad_dtype for fp32 .grad on bf16 params")
    steps = 3
    samples = token_batches(steps * N_ACCUM * MICRO_BATCH)
    start = tiny_gpt2(dtype=torch.bfloat16)
    ours, ref = copy.deepcopy(start), copy.deepcopy(start)

    logs, opt = train_with_trainer(ours, samples, tmp_path / "ours", wrap=True, max_steps=steps)
    ref_logs, ref_opt = train_with_trainer(ref, samples, tmp_path / "ref", wrap=True,
                                           max_steps=steps, max_grad_norm=0.0,
                                           max_grad_norm_wrapper=MAX_GRAD_NORM)

    assert opt.master_weights and ref_opt.master_weights
    ref_norms = [h["grad_norm"] for h in ref_logs]
    assert all(n > MAX_GRAD_NORM for n in ref_norms), ref_norms
    assert [h["grad_norm"] for h in logs] == pytest.approx(ref_norms, rel=1e-5)
    for m, r in zip(opt.master_params, ref_opt.master_params):
        torch.testing.assert_close(m, r, atol=1e-6, rtol=0)
    for p, q in zip(ours.parameters(), ref.parameters()):
        assert p.dtype == torch.bfloat16
        # masters agree to 1e-6, but two of them on either side of a bf16 rounding boundary
        # round to neighbouring bf16 values: one bf16 step (2**-7 relative) apart at most
        torch.testing.assert_close(p.float(), q.float(), atol=1e-6, rtol=2 ** -7)
    assert_moved(ours, start)


def test_trainer_checkpoint_resume(tmp_path):
    """bf16 model: Trainer saves optimizer.state_dict() (the wrapper's: inner AdamW state, fp32
    master weights, window) at step 2 and a fresh Trainer + wrapper resumes from it. Everything
    is restored exactly and the remaining steps compute the same thing: bit-for-bit equal to the
    uninterrupted run (the tolerance is the usual safety margin)."""
    steps = 4
    samples = token_batches(steps * N_ACCUM * MICRO_BATCH)
    start = tiny_gpt2(dtype=torch.bfloat16)
    full, resumed = copy.deepcopy(start), copy.deepcopy(start)
    full_logs, _ = train_with_trainer(full, samples, tmp_path / "full", wrap=True,
                                      max_steps=steps, save_steps=2)
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert (checkpoint / "optimizer.pt").exists()
    resumed_logs, opt = train_with_trainer(resumed, samples, tmp_path / "resumed", wrap=True,
                                           max_steps=steps, resume_from=str(checkpoint))
    assert opt.master_weights
    assert [h["grad_norm"] for h in resumed_logs] == [h["grad_norm"] for h in full_logs]
    assert all(s["step"].item() == steps for s in opt.state.values())
    assert_moved(resumed, start)
    assert_same_params(full, resumed)


@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_trainer_short_last_window_matches_native(tmp_path, accumulation_steps):
    """10 micro-batches per epoch, GA=4: windows of 4, 4, 2 per epoch, two epochs. Trainer steps
    the short window (normalised by its own token count); so must the wrapper, after clipping.
    (Fixed in 7f38bc6: the step() used to be a no-op and the next epoch's backward raised.)"""
    samples = token_batches(10 * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_logs, _ = train_with_trainer(native, samples, tmp_path / "native", wrap=False, epochs=2)
    our_logs, opt = train_with_trainer(ours, samples, tmp_path / "ours", wrap=True, epochs=2,
                                       accumulation_steps=accumulation_steps)
    assert len(native_logs) == 6
    assert [h["grad_norm"] for h in our_logs] == pytest.approx(
        [h["grad_norm"] for h in native_logs], rel=1e-6)
    assert all(s["step"].item() == 6 for s in opt.state.values())
    assert_same_params(native, ours)


@pytest.mark.parametrize("per_epoch", [2, 1])
def test_trainer_epoch_shorter_than_window(tmp_path, per_epoch):
    """Every window is the short end-of-epoch one, the very first window included."""
    samples = token_batches(per_epoch * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_logs, _ = train_with_trainer(native, samples, tmp_path / "native", wrap=False, epochs=3)
    our_logs, opt = train_with_trainer(ours, samples, tmp_path / "ours", wrap=True, epochs=3)
    assert len(native_logs) == 3
    assert [h["grad_norm"] for h in our_logs] == pytest.approx(
        [h["grad_norm"] for h in native_logs], rel=1e-6)
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_same_params(native, ours)


# -- the one line: AccumulatingTrainer, 1 process and 2 ranks --------------------------------------

@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return workers.scenario_trainer(str(tmp_path_factory.mktemp("trainer1")), 1, bf16=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank Trainer scenario in one pair of processes (start-up dominates)."""
    return run_ranks(tmp_path_factory.mktemp("trainer2"), "trainer", timeout=300,
                     conditional=True)


def test_one_process_equals_native(one_process):
    check_fp32(one_process, "Trainer, 1 process")
    assert one_process["oneline"]["steps"] == STEPS


def test_two_ranks_equal_native_ddp(two_ranks):
    for rank, res in enumerate(two_ranks):
        check_fp32(res, f"Trainer, rank {rank} of 2")
    check_ranks_agree(two_ranks, "oneline", "Trainer")


def test_bf16_closer_to_float64(two_ranks):
    """bf16 on 2 ranks (the DDP path: DDP reduces the fp32 window, not bf16 buckets)."""
    for rank, res in enumerate(two_ranks):
        check_bf16(res, f"rank {rank}: Trainer bf16")


def test_trainer_defaults_conditional_module_equals_native(two_ranks):
    """A module used only in no_sync micro-batches, with the Trainer's DDP defaults
    (find_unused_parameters=True): native DDP trains it; the one line gives the same result."""
    for rank, res in enumerate(two_ranks):
        native, ours = res["conditional"]["native"], res["conditional"]["oneline"]
        assert "error" not in native, f"rank {rank}: native failed: {native.get('error')}"
        assert distance(native["params"], snapshot(workers.Conditional())) > 1e-2
        assert "error" not in ours, f"rank {rank}: {ours.get('error')}"
        diff = first_difference(ours["params"], native["params"])
        assert diff is None, f"rank {rank}: {diff}"


class Poisoned(torch.nn.Module):
    """The tiny GPT-2 whose 6th forward (window 1, micro-batch 1) returns an infinite loss."""

    def __init__(self):
        super().__init__()
        from _integrations_common import oneline_gpt2

        self.gpt = oneline_gpt2()
        self.calls = 0

    def forward(self, input_ids, labels, **kwargs):
        loss = self.gpt(input_ids=input_ids, labels=labels, **kwargs).loss
        self.calls += 1
        return {"loss": loss * float("inf") if self.calls == 6 else loss}


def test_skipped_window_does_not_advance_the_schedule(one_process, tmp_path):
    """A non-finite window (``nonfinite="skip_step"``) is a skipped step for the Trainer, as a
    GradScaler overflow is: no update, ``optimizer_step_was_skipped``, the LR scheduler holds.
    Native's schedule is the judge: our learning rates are native's with one step repeated."""
    res = workers.train_trainer(str(tmp_path), 1, True, model=Poisoned())
    native_lrs = one_process["native"]["lrs"]
    assert res["skipped"] == 1 and res["steps"] == STEPS
    assert res["scheduler_steps"] == STEPS - 1
    assert res["lrs"] == native_lrs[:2] + native_lrs[1:STEPS - 1], res["lrs"]
    assert all(bool(torch.isfinite(p).all()) for p in res["params"])


def test_options_pass_through_and_reserved_ones_are_refused(tmp_path):
    from transformers import TrainingArguments

    from accumkernels.integrations.transformers import AccumulatingTrainer

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    model = torch.nn.Linear(3, 1)
    with pytest.raises(ValueError, match="accumulation_steps=None"):
        AccumulatingTrainer(model=model, args=args, accumkernels={"accumulation_steps": 4})
    with pytest.raises(TypeError, match="not an AccumulatingOptimizer argument"):
        AccumulatingTrainer(model=model, args=args, accumkernels={"max_grad_nrom": 1.0})
    with pytest.raises(ValueError, match="reduction='mean'"):  # the Trainer divides already
        AccumulatingTrainer(model=model, args=args, accumkernels={"reduction": "mean"})
    trainer = AccumulatingTrainer(model=model, args=args, fp32_masters_only=True,
                                  accumkernels={"max_grad_norm": 2.0, "nonfinite": "raise"})
    opt = trainer.create_optimizer()
    assert opt.config.max_grad_norm == 2.0 and opt.config.nonfinite == "raise"
    assert opt.config.accumulation_steps is None
    assert opt.param_groups[0]["lr"] == args.learning_rate  # the Trainer's own optimizer
    assert trainer.create_optimizer() is opt  # wrapped once
