"""Shared test setup for every folder of tests/: where helper modules are found, Triton through
its interpreter on CPU-only machines, the (device, backend) pairs of the op tests, a seed per test.

Layout: one folder per subject (op/, buffer/, optim/, distributed/, integrations/, wgrad/,
tools/); shared helpers (reference.py, gpu_cases.py, _native_common.py) here at the top.

Imports: test helpers are plain modules imported by their file name (``from _ddp_workers import
run_ranks``, ``from reference import Reference``). This file puts tests/ and each of its folders
on ``sys.path`` before any test module is imported, so a helper is found from every folder, when
one file or folder is run alone, and in spawned rank processes (multiprocessing's spawn start
method hands the parent's ``sys.path`` to the child, which re-imports the worker's module by
name). The price: every module name under tests/ is unique (checked below; pytest's default
import mode refuses two test files with one basename anyway).

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection.
"""

import os
import sys
import zlib
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
_FOLDERS = [TESTS] + sorted(p for p in TESTS.iterdir()
                            if p.is_dir() and not p.name.startswith((".", "_")))
_seen: dict[str, Path] = {}
for _folder in _FOLDERS:
    for _file in _folder.glob("*.py"):
        if _file.name in ("conftest.py", "__init__.py"):
            continue
        assert _file.name not in _seen, \
            f"two test modules named {_file.name} ({_seen[_file.name]}, {_file}): rename one"
        _seen[_file.name] = _file
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# (device, backend) pairs every op test runs on. CUDA ones skip without a GPU; Triton on the
# CPU exists only through the interpreter, which is switched on only on CPU-only machines.
DEVICE_BACKENDS = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cpu", "triton", id="cpu-triton",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="triton interpreter only on CPU-only hosts")),
    pytest.param("cuda", "torch", id="cuda-torch", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
    pytest.param("cuda", "cuda", id="cuda-cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
    pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test (derived from its id) so data is random but reproducible."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_addoption(parser):
    parser.addoption("--conformance", choices=("ci", "full"), default="ci",
                     help="tests/conformance: 'full' covers every 3-way combination (slow)")


def pytest_configure(config):
    if config.getoption("--conformance") == "full":
        os.environ["ACCUMKERNELS_CONFORMANCE"] = "full"
