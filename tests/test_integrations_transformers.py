"""HF Trainer: ``AccumulatingTrainer`` instead of ``Trainer``
(accumkernels.integrations.transformers).

The Trainer script (tests/_integrations_workers.train_trainer) uses the Trainer's defaults
(AdamW, linear schedule, Accelerate-built DDP with ``find_unused_parameters=True``) with
``gradient_accumulation_steps=4``, ``max_grad_norm``, two epochs of windows 4, 4, 2 and a
resume from ``checkpoint-2``. The comparisons and why fp32 is bit-for-bit: _integrations_common.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import _integrations_workers as workers  # noqa: E402
from _integrations_common import (  # noqa: E402
    STEPS,
    check_bf16,
    check_fp32,
    check_ranks_agree,
    distance,
    first_difference,
    run_ranks,
    snapshot,
)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")


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
    """Item 2 of issue 21: native DDP trains this; the one line must give the same result."""
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
        from _integrations_common import tiny_gpt2

        self.gpt = tiny_gpt2()
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
    trainer = AccumulatingTrainer(model=model, args=args,
                                  accumkernels={"max_grad_norm": 2.0, "reduction": "mean"})
    opt = trainer.create_optimizer()
    assert opt.config.max_grad_norm == 2.0 and opt.config.reduction == "mean"
    assert opt.config.accumulation_steps is None
    assert opt.param_groups[0]["lr"] == args.learning_rate  # the Trainer's own optimizer
    assert trainer.create_optimizer() is opt  # wrapped once
