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
from _ddp_weighted_workers import WINDOWS, run_ranks

pytest.importorskip("torch.distributed")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("ddp_weighted"))


def _close(a, b, what: str) -> None:
    err = (a.double() - b.double()).abs().max().item()
    assert err <= 1e-6 * b.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


@pytest.mark.parametrize("case", ["after", "before", "after_sync_each", "after_none",
                                  "group_after", "group_before"])
def test_weighted_under_ddp_is_native(ranks, case):
    """(``group_*``: ``process_group=`` instead of DDP, against the loop that all-reduces.)"""
    for rank, out in enumerate(ranks):
        native = out["native_sync_each" if "sync_each" in case else
                     "native_group" if case.startswith("group") else "native"]
        ours = out[case]
        for w in range(WINDOWS):
            for i, (a, b) in enumerate(zip(ours["grads"][w], native["grads"][w])):
                _close(a, b, f"{case}, rank {rank}, window {w}: p.grad {i} before step()")
            _close(ours["norms"][w], native["norms"][w], f"{case}, rank {rank}: clip norm {w}")
        for i, (a, b) in enumerate(zip(ours["params"], native["params"])):
            _close(a, b, f"{case}, rank {rank}: param {i}")
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["after"]["params"],
                                                 ranks[1]["after"]["params"]))
