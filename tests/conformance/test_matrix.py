"""The conformance matrix, single-process part: every pair of axis values of _matrix_axes
(every triple of dtype x reduction x checkpoint) against the same loop run natively.

A failure names the case id, its axis values, the first step where it departs and by how much;
``pytest tests/conformance -k s042`` reruns one case. ``--conformance=full`` (or
ACCUMKERNELS_CONFORMANCE=full): 3-way over every axis, no xfails (a developer's machine).
"""

from __future__ import annotations

import pytest
from _matrix_cases import CLEAN, SINGLE, cases, params
from _matrix_run import run_case


@pytest.mark.parametrize("cid", params(SINGLE))
def test_case(cid):
    run_case(cases(SINGLE)[0][cid], cid)


@pytest.mark.parametrize("cid", params(CLEAN))
def test_clean_case(cid):
    """The same table without the values the known bugs need (_matrix_labels
    .KNOWN_EXCLUSIONS): every pair of the rest in cases that pass today."""
    run_case(cases(CLEAN)[0][cid], cid)


@pytest.mark.parametrize("plan", [SINGLE, CLEAN], ids=["main", "clean"])
def test_covering_array(plan):
    """The generator covered every pair the constraints allow (and the triples asked for)."""
    all_cases, stats = cases(plan)
    assert stats["uncovered_pairs"] == [] and stats["progress"] == 1.0, stats
    assert len(all_cases) == stats["row_count"]
