"""The recipe's one line forgotten (DESIGN: "Helpers a recipe names"): with the split-backward
schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV) and no
``accumulate_weight_passes(stages)``, the stages' weight passes write their gradients into
``.grad`` past the wrapper; every wrapper's ``step()`` on every rank raises, naming the line,
before anything is stepped. Schedules without a weight pass (GPipe, 1F1B) need no line for
their backwards and train as natively without it (bit for bit). 2 gloo ranks, a deadline
(_pipelining_workers.forgotten)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch.distributed.pipelining")

from _pipelining_workers import run_ranks  # noqa: E402
from test_pipelining import (assert_equal_runs, assert_trained, by_stage,  # noqa: E402
                             schedule_params)


@pytest.fixture(scope="module")
def forgotten(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("pp_forgotten"), "forgotten", timeout=180)


@pytest.mark.parametrize("schedule", schedule_params(["InterleavedZeroBubble", "ZBVZeroBubble",
                                                     "DualPipeV"]))
def test_forgotten_line_raises_on_every_rank_before_any_step(forgotten, schedule):
    for rank, out in enumerate(forgotten):
        entry = out[schedule]
        assert len(entry["errors"]) == 2, entry  # two stages per rank
        for k, msg in enumerate(entry["errors"]):
            assert msg is not None, f"{schedule}: rank {rank}, stage {k} stepped silently"
            assert "accumulate_weight_passes(stages)" in msg and "Nothing was stepped" in msg
        assert entry["untouched"], f"{schedule}: rank {rank} changed its params"


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_schedules_without_a_weight_pass_need_no_line(forgotten, schedule):
    ref = by_stage(forgotten, schedule, "native")
    ours = by_stage(forgotten, schedule, "forgotten")
    assert_trained(ours)
    assert_equal_runs(ours, ref, f"{schedule} without the line")
