"""HF Accelerate: ``AccumulatingAccelerator`` instead of ``Accelerator``
(accumkernels.integrations.accelerate).

The script (tests/_integrations_workers.train_accelerate) is Accelerate's ``accumulate()`` loop
with ``gradient_accumulation_steps=4``, ``clip_grad_norm_`` on sync steps, a prepared LambdaLR,
two epochs of windows 4, 4, 2, and ``save_state``/``load_state`` at a window boundary. The
comparisons and why fp32 is bit-for-bit: tests/_integrations_common.py.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("transformers")  # the tiny GPT-2

import _integrations_workers as workers  # noqa: E402
from _integrations_common import (  # noqa: E402
    check_bf16,
    check_fp32,
    check_ranks_agree,
    first_difference,
    run_ranks,
)

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    return workers.scenario_accelerate(str(tmp_path_factory.mktemp("accelerate1")), 1, bf16=False)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every 2-rank Accelerate scenario in one pair of processes (start-up dominates)."""
    return run_ranks(tmp_path_factory.mktemp("accelerate2"), "accelerate", timeout=300)


def test_one_process_equals_native(one_process):
    check_fp32(one_process, "Accelerate, 1 process", resumed_norms=slice(2, None))


def test_two_ranks_equal_native_ddp(two_ranks):
    for rank, res in enumerate(two_ranks):
        check_fp32(res, f"Accelerate, rank {rank} of 2", resumed_norms=slice(2, None))
    check_ranks_agree(two_ranks, "oneline", "Accelerate")


def test_bf16_closer_to_float64(two_ranks):
    """bf16 on 2 ranks (the DDP path: DDP reduces the fp32 window, not bf16 buckets)."""
    for rank, res in enumerate(two_ranks):
        check_bf16(res, f"rank {rank}: Accelerate bf16")


def test_fsdp1_and_foreign_hooks_are_refused_on_real_modules(two_ranks):
    """2 ranks: ``prepare(optimizer, FSDP1 model)`` and ``prepare(optimizer, DDP with another
    comm hook)`` raise ValueError naming the problem, with neither object touched; a DDP that
    already carries ``accumkernels.ddp_comm_hook`` is accepted and keeps exactly that hook."""
    for rank, res in enumerate(two_ranks):
        r = res["refusals"]
        assert r["fsdp1"] and "FSDP1" in r["fsdp1"] and "grad_accum_dtype" in r["fsdp1"], r
        assert r["fsdp1_untouched"], f"rank {rank}: state changed by a refused prepare"
        assert r["foreign_hook"] and "allreduce_hook" in r["foreign_hook"], r
        assert r["foreign_untouched"], f"rank {rank}: state changed by a refused prepare"
        assert r["own_hook_accepted"] == ["ddp_comm_hook"]
        assert r["own_hook_wrapped"] == "AccumulatingOptimizer"


def test_skipped_window_is_a_skipped_step(tmp_path):
    """Window 1 gets an infinite loss: the wrapper drops it (``nonfinite="skip_step"``), the
    prepared optimizer reports ``step_was_skipped`` (so ``optimizer_step_was_skipped``), and
    the prepared scheduler holds. Judge: the native loop leaving window 1 out by hand (no step,
    no scheduler step) ends with identical parameters and learning rate."""
    ours = workers.train_accelerate(str(tmp_path), 1, True, poison_window=1)
    native = workers.train_accelerate(str(tmp_path), 1, False, drop_window=1)
    assert ours["skipped"] == [False, True, False, False, False, False]
    assert native["skipped"] == [False] * 6
    assert ours["lr"] == native["lr"]
    assert first_difference(ours["params"], native["params"]) is None


def test_comm_hook_setting_refused_at_construction(fresh_state):
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    handler = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    with pytest.raises(ValueError, match="comm_hook"):
        AccumulatingAccelerator(cpu=True, kwargs_handlers=[handler])


def test_options_pass_through(fresh_state):
    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    with pytest.raises(ValueError, match="process_group"):
        AccumulatingAccelerator(cpu=True, accumkernels={"process_group": None})
    accelerator = AccumulatingAccelerator(cpu=True, accumkernels={"max_grad_norm": 3.0,
                                                                  "master_weights": True})
    model = torch.nn.Linear(3, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, inner)
    assert opt.optimizer.optimizer is inner
    assert opt.optimizer.config.max_grad_norm == 3.0 and opt.optimizer.master_weights
    assert accelerator.prepare(opt) is opt  # prepared once, not wrapped twice


@pytest.fixture
def fresh_state():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
