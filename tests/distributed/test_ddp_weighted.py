"""``reduction="weighted"`` under DistributedDataParallel and ``process_group=`` (DESIGN: "Weights
across ranks"): after the window's last backward, with ``add_weight`` before or after each
backward, ``p.grad`` is the final sum / total weight of both ranks, so a user's
``clip_grad_norm_`` before ``step()`` measures native's, and the step is native's.

Tolerance: DDP averages the fp32 window as natively (divide, then sum); the wrapper then
multiplies by 1 / (total / world) where the native loop multiplies by world / total: the
factors may differ in the last bit, so 1e-6 of each tensor's largest value.
"""

from __future__ import annotations

import pytest
import torch
from _ddp_weighted_workers import EXTRA_STEP, WINDOWS, run_ranks

pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ddp_weighted"))


def _close(a, b, what: str) -> None:
    err = (a.double() - b.double()).abs().max().item()
    assert err <= 1e-6 * b.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ddp_weight_faults"), name="faults")


@pytest.mark.parametrize("case", ["after", "before", "after_sync_each", "after_none",
                                  "group_after", "group_before", "empty_after", "empty_before",
                                  "group_empty_after"])
def test_weighted_under_ddp_is_native(ranks, case):
    """(``group_*``: ``process_group=`` instead of DDP, against the loop that all-reduces;
    ``empty_*``: a micro-batch without tokens on rank 1, ``add_weight(0)``: natively the
    per-token mean over the ranks' tokens.)"""
    for rank, out in enumerate(ranks):
        native = out["native_sync_each" if "sync_each" in case else
                     "native_group" if case.startswith("group") else "native"]
        if "empty" in case:
            native = out["native_group_empty" if case.startswith("group") else "native_empty"]
        ours = out[case]
        for w in range(WINDOWS):
            for i, (a, b) in enumerate(zip(ours["grads"][w], native["grads"][w])):
                _close(a, b, f"{case}, rank {rank}, window {w}: p.grad {i} before step()")
            _close(ours["norms"][w], native["norms"][w], f"{case}, rank {rank}: clip norm {w}")
        for i, (a, b) in enumerate(zip(ours["params"], native["params"])):
            _close(a, b, f"{case}, rank {rank}: param {i}")
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["after"]["params"],
                                                 ranks[1]["after"]["params"]))


@pytest.mark.parametrize("layout", ["", "group_"])
@pytest.mark.parametrize("fault", ["skip_after", "skip_before", "negative", "nan"])
def test_ranks_that_disagree_on_weights_raise_alike(faults, layout, fault):
    """Rank 1 skips one ``add_weight``, or reports a negative or NaN weight: every rank raises
    the same error (RuntimeError naming add_weight for a skipped one, ValueError for a bad
    value) at the ranks' next agreement (the sync backward, the add_weight that completes the
    others' weights, or step()) -- never a hang, never ranks normalised (and clipped) apart."""
    name = layout + fault
    errors = [out[name]["error"] for out in faults]
    assert all(e is not None for e in errors), (name, faults[0][name], faults[1][name])
    kind = "RuntimeError" if fault.startswith("skip") else "ValueError"
    needle = "disagree on the weights" if fault.startswith("skip") else "negative or non-finite"
    for rank, e in enumerate(errors):
        assert e.startswith(kind) and needle in e, (name, rank, e)
        assert "add_weight" in e, (name, rank, e)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ddp_extra_step"), name="steps")


@pytest.mark.parametrize("case", list(EXTRA_STEP))
def test_a_rank_that_steps_alone_raises_alike(steps, case):
    """``accumulation_steps=None``: rank 1 calls ``step()`` after window 1's micro-batch 1 while
    rank 0 runs on (DDP: into its sync backward, whose buckets need not match the wrapper's). Every
    rank raises an error naming step() where they meet next -- never a hang in mismatched
    collectives, never ranks stepped apart."""
    errors = [out[case]["error"] for out in steps]
    assert all(e is not None for e in errors), (case, steps[0][case], steps[1][case])
    for rank, e in enumerate(errors):
        assert e.startswith("RuntimeError") and "step()" in e, (case, rank, e)
    if case.startswith("ddp"):  # met in rank 0's sync backward, before its first bucket
        assert [out[case]["where"] for out in steps] == ["backward 1.2", "step 1.1"], steps
