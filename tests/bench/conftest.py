"""The benchmark tests never append to the committed suite files: every run in this folder (and
the subprocesses it starts) writes its rows under a temporary results folder instead."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _results_elsewhere(tmp_path_factory):
    old = os.environ.get("ACCUMBENCH_RESULTS_DIR")
    os.environ["ACCUMBENCH_RESULTS_DIR"] = str(tmp_path_factory.mktemp("suite-files"))
    yield
    if old is None:
        os.environ.pop("ACCUMBENCH_RESULTS_DIR", None)
    else:
        os.environ["ACCUMBENCH_RESULTS_DIR"] = old
