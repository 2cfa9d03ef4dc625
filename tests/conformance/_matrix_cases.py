"""The generated cases of both parts of the matrix (cached per process) and their pytest
params: a case id, and a strict xfail where KNOWN_BUGS lists it."""

from __future__ import annotations

import functools
import os

import pytest
from _matrix_axes import CLEAN, MULTI, SINGLE, Plan, case_id, full_mode, generate
from _matrix_known import KNOWN_BUGS
from _matrix_labels import BUGS


def _need_covertable() -> None:
    if os.environ.get("CI"):
        import covertable  # noqa: F401 -- in CI a missing generator is an error
    else:
        pytest.importorskip("covertable", reason="pip install covertable (the [test] extra)")


@functools.cache
def cases(plan: Plan) -> tuple[dict[str, dict], dict]:
    """{case id: case} and the generator's stats; 3-way over every axis in full mode."""
    rows, stats = generate(plan, strength=3 if full_mode() else 2)
    return {case_id(plan, k): row for k, row in enumerate(rows)}, stats


def params(plan: Plan) -> list:
    _need_covertable()
    out = []
    for cid in cases(plan)[0]:
        known = KNOWN_BUGS.get(cid) if not full_mode() else None
        marks = ()
        if known:
            why = "; ".join(f"{b}: {BUGS[b]}" for b in known)
            marks = (pytest.mark.xfail(strict=True, reason=f"known bug {why}"),)
        out.append(pytest.param(cid, id=cid, marks=marks))
    return out


__all__ = ["CLEAN", "MULTI", "SINGLE", "cases", "params"]
