"""HF Accelerate: Accelerate's gradient-accumulation loop with AccumulatingOptimizer prepared
(the recipe), and ``AccumulatingAccelerator`` instead of ``Accelerator`` (the one line,
accumkernels.integrations.accelerate).

The recipe: what Accelerate (1.x) does, and why the recipe is ``accumulation_steps=None,
reduction="sum"``:

* ``accelerator.backward(loss)`` divides the loss by ``gradient_accumulation_steps`` itself, so
  the native fp32 ``.grad`` holds the mean of the N micro-batch losses' gradients: the wrapper
  must only sum, i.e. ``reduction="sum"``.
* ``accelerator.prepare(opt)`` wraps the optimizer in ``AcceleratedOptimizer``, whose ``step()``
  and ``zero_grad()`` only reach the wrapped optimizer when ``sync_gradients`` is set (it
  round-trips ``state_dict()``/``load_state_dict()`` once for device placement, too). So every
  ``step()`` the wrapper receives ends a window, the short one at the end of the dataloader
  included: ``accumulation_steps=None``. The wrapper reads none of Accelerate's state.
* ``accelerator.clip_grad_norm_(model.parameters(), ...)`` runs on the sync micro-batch before
  ``step()``; ``p.grad`` is the running fp32 window after every backward, so it sees the window.

The one line: the script (_integrations_workers.train_accelerate) is Accelerate's ``accumulate()``
loop with ``gradient_accumulation_steps=4``, ``clip_grad_norm_`` on sync steps, a prepared LambdaLR,
two epochs of windows 4, 4, 2, and ``save_state``/``load_state`` at a window boundary. The
comparisons and why fp32 is bit-for-bit: _integrations_common.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("accelerate")
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
    fresh_accelerate_state,  # noqa: F401  (fixture)
    linear_decay,
    loader,
    run_ranks,
    tiny_gpt2,
    token_batches,
)

from accumkernels import AccumulatingOptimizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("fresh_accelerate_state"),
              pytest.mark.skipif(not torch.distributed.is_available(),
                                 reason="torch.distributed is not available")]


# -- the recipe: accelerator.prepare(AccumulatingOptimizer(...)), one process ----------------------

MICRO_BATCH = 2


def train_with_accelerate(model, samples, *, wrap: bool, epochs: int = 1,
                          accumulation_steps: int | None = None):
    """The loop from Accelerate's gradient-accumulation guide. Returns (clip norms, optimizer)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    accelerator = Accelerator(gradient_accumulation_steps=N_ACCUM, cpu=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, reduction="sum")
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, linear_decay(8))
    model, prepared_opt, dataloader, scheduler = accelerator.prepare(
        model, opt, loader(samples, MICRO_BATCH), scheduler)
    norms = []
    model.train()
    for _ in range(epochs):
        for batch in dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                    norms.append(norm.item())
                prepared_opt.step()
                scheduler.step()
                prepared_opt.zero_grad()
    return norms, opt


def test_accelerate_matches_native():
    samples = token_batches(3 * N_ACCUM * MICRO_BATCH)  # 3 full windows
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)

    native_norms, _ = train_with_accelerate(native, samples, wrap=False)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True)

    assert len(native_norms) == 3
    assert all(n > MAX_GRAD_NORM for n in native_norms), native_norms  # clipping took effect
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert opt.micro_steps == 0 and opt.skipped_steps == 0
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_moved(ours, start)
    assert_same_params(native, ours)


@pytest.mark.parametrize("accumulation_steps", [N_ACCUM, None])
def test_accelerate_short_last_window_matches_native(accumulation_steps):
    """10 micro-batches per epoch, N=4: windows 4, 4, 2 in each of two epochs; Accelerate syncs
    (clips and steps) the short one at the end of the dataloader, and so must the wrapper.
    (Fixed in 7f38bc6: the step() used to be a no-op and the next epoch's backward raised.)"""
    samples = token_batches(10 * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_norms, _ = train_with_accelerate(native, samples, wrap=False, epochs=2)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True, epochs=2,
                                           accumulation_steps=accumulation_steps)
    assert len(native_norms) == 6
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert all(s["step"].item() == 6 for s in opt.state.values())
    assert_same_params(native, ours)


@pytest.mark.parametrize("per_epoch", [2, 1])
def test_accelerate_epoch_shorter_than_window(per_epoch):
    """Every window is the short end-of-dataloader one, the very first window included.
    (Fixed in 0176121 for one micro-batch per epoch: sync_gradients is then never False, and the
    wrapper used to wait for N micro-batches, so no step and no .grad for the clip.)"""
    samples = token_batches(per_epoch * MICRO_BATCH)
    start = tiny_gpt2()
    native, ours = copy.deepcopy(start), copy.deepcopy(start)
    native_norms, _ = train_with_accelerate(native, samples, wrap=False, epochs=3)
    our_norms, opt = train_with_accelerate(ours, samples, wrap=True, epochs=3)
    assert len(native_norms) == 3
    assert our_norms == pytest.approx(native_norms, rel=1e-6)
    assert all(s["step"].item() == 3 for s in opt.state.values())
    assert_same_params(native, ours)


# -- the one line: AccumulatingAccelerator, 1 process and 2 ranks ----------------------------------

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


def test_make_skips_visible_on_a_plain_accelerator():
    """``make_skips_visible(prepared)`` on an optimizer a plain ``Accelerator`` prepared: a window
    the wrapper skipped (a NaN) reads as ``step_was_skipped``, a real step does not; anything but
    Accelerate's own AcceleratedOptimizer over a wrapper is refused by name, unchanged."""
    from accelerate import Accelerator

    from accumkernels import AccumulatingOptimizer
    from accumkernels.integrations.accelerate import make_skips_visible

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    accelerator = Accelerator(cpu=True)
    model, prepared = accelerator.prepare(model, AccumulatingOptimizer(inner, model=model))
    make_skips_visible(prepared)
    make_skips_visible(prepared)  # twice: a no-op
    for poison, skipped in ((float("nan"), True), (1.0, False)):
        loss = model(torch.randn(3, 4)).sum() * poison
        accelerator.backward(loss)
        prepared.step()
        prepared.zero_grad()
        assert prepared.step_was_skipped is skipped
        assert accelerator.optimizer_step_was_skipped is skipped
    with pytest.raises(TypeError, match="AcceleratedOptimizer"):
        make_skips_visible(inner)
    plain = accelerator.prepare(torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1))
    with pytest.raises(TypeError, match="no AccumulatingOptimizer"):
        make_skips_visible(plain)
