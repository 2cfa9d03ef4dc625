"""The conformance matrix, multi-process part: every pair of (layout, reduction, clip, accum,
optimizer, non-finite) and every triple of layout x reduction x clip, on gloo ranks against the
same loop run natively on the same layout. One launch per world size runs all its cases (a
deadline per launch: a hang fails, it does not stall CI)."""

from __future__ import annotations

import functools
import tempfile

import pytest
from _matrix_axes import describe
from _matrix_cases import MULTI, cases, params
from _matrix_ranks import launch, launch_of

DEADLINE = 400.0  # per launch; a quiet run needs ~30 s for all three


@functools.cache
def _results(name: str) -> dict:
    mine = {cid: c for cid, c in cases(MULTI)[0].items() if launch_of(c) == name}
    with tempfile.TemporaryDirectory() as tmp:
        return launch(tmp, name, mine, DEADLINE)


@pytest.mark.parametrize("cid", params(MULTI))
def test_case(cid):
    case = cases(MULTI)[0][cid]
    msg = _results(launch_of(case))[cid]
    assert msg is None, f"case {cid} [{describe(case)}] departs from native at {msg}"


def test_covering_array():
    all_cases, stats = cases(MULTI)
    assert stats["uncovered_pairs"] == [] and stats["progress"] == 1.0, stats
    assert len(all_cases) == stats["row_count"]
