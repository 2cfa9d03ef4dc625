"""Shared test setup for every folder of tests/: where helper modules are found, Triton through
its interpreter on CPU-only machines, the (device, backend) pairs of the op tests, a seed per test.

Layout: one folder per subject, mirroring the package (op/, buffer/, optim/ with a folder per
room of the wrapper: intake/, step/, checkpoint/; distributed/, integrations/, wgrad/, tools/,
bench/); shared helpers (reference.py, gpu_cases.py, _native_common.py) here at the top.

Imports: test helpers are plain modules imported by their file name (``from _ddp_workers import
run_ranks``, ``from reference import Reference``). This file puts tests/ and each of its folders
(at any depth) on ``sys.path`` before any test module is imported, so a helper is found from
every folder, when one file or folder is run alone, and in spawned rank processes
(multiprocessing's spawn start method hands the parent's ``sys.path`` to the child, which
re-imports the worker's module by name). The price: every module name under tests/ is unique (checked below; pytest's default
import mode refuses two test files with one basename anyway).

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection.
"""

import os
import sys
import zlib
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent
_FOLDERS = [TESTS] + sorted(p for p in TESTS.rglob("*") if p.is_dir() and not any(
    part.startswith((".", "_")) for part in p.relative_to(TESTS).parts))
_seen: dict[str, Path] = {}
# one conftest.py, this one: the test modules import its names as ``conftest`` from any folder
_extra = [p for p in TESTS.rglob("conftest.py") if p.parent != TESTS]
assert not _extra, f"a conftest.py below tests/ shadows this one for `from conftest import`: {_extra}"
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

import pytest

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


# -- the CPU kernels' SIMD levels ------------------------------------------------------------------
# The op and master-step test files (SIMD_FILES) run once per SIMD level of the CPU kernels
# (csrc/cpu_simd.h: generic, avx2, avx512), switched in this process through
# _C.set_cpu_simd_cap. A level above this CPU's is skipped, saying so. Tests that do not reach the
# CPU kernels (another backend, a GPU) and tests marked `simd_once` (they start processes of their
# own) run at the machine's own level only.
SIMD_FILES = frozenset({
    "test_accumulate.py", "test_norm_sq.py", "test_strides.py",
    "test_master_step.py", "test_master_ops.py", "test_master_step_lr_dtypes.py",
    "test_fused_master.py", "test_masters_resync.py",
})
SIMD_LEVELS = ("generic", "avx2", "avx512")


def _simd_detected() -> str | None:
    try:
        from accumkernels.ops.backends import native
    except Exception:  # noqa: BLE001 - the import's own tests report it
        return None
    return None if native._C is None else native._C.cpu_simd()["detected"]


SIMD_DETECTED = _simd_detected()


def _simd_params():
    if SIMD_DETECTED is None:
        return [pytest.param(None, id="simd-none")]
    top = SIMD_LEVELS.index(SIMD_DETECTED)
    return [pytest.param(level, id=f"simd-{level}", marks=pytest.mark.skipif(
        i > top, reason=f"SIMD level {level} is above this CPU's ({SIMD_DETECTED}): not run here"))
        for i, level in enumerate(SIMD_LEVELS)]


@pytest.fixture(params=_simd_params())
def cpu_simd(request):
    """The CPU kernels capped at this SIMD level for the test (the level's name, or None when
    accumkernels._C is not built)."""
    level = request.param
    if level is None:
        yield None
        return
    from accumkernels.ops.backends import native
    before = native._C.set_cpu_simd_cap(level)
    try:
        assert native._C.cpu_simd()["level"] == level
        yield level
    finally:
        native._C.set_cpu_simd_cap(before)


_NOT_CPU_KERNELS = ("torch", "triton", "cuda", "ref")


def pytest_collection_modifyitems(config, items):
    """The SIMD files' tests use `cpu_simd`; below the top level only those reaching the CPU
    kernels are kept."""
    keep, dropped = [], []
    for item in items:
        spec = getattr(item, "callspec", None)
        level = spec.params.get("cpu_simd") if spec is not None else None
        if level is None or level == SIMD_DETECTED:
            keep.append(item)
            continue
        params = spec.params
        other = (params.get("backend") in _NOT_CPU_KERNELS or params.get("device") == "cuda"
                 or item.get_closest_marker("simd_once") is not None
                 or item.get_closest_marker("gpu") is not None)
        (dropped if other else keep).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collection_finish(session):
    """Each SIMD file must use the fixture (a file added to SIMD_FILES without it would run at one
    level only)."""
    missing = {Path(item.fspath).name for item in session.items
               if Path(item.fspath).name in SIMD_FILES and "cpu_simd" not in item.fixturenames}
    assert not missing, f"SIMD files whose tests do not use the cpu_simd fixture: {missing}"


@pytest.fixture(autouse=True, scope="session")
def _bench_results_elsewhere(tmp_path_factory):
    """No test appends to the committed suite files (benchmarks/results/*.jsonl): every run, and
    the subprocesses it starts, writes its rows under a temporary results folder instead."""
    old = os.environ.get("ACCUMBENCH_RESULTS_DIR")
    os.environ["ACCUMBENCH_RESULTS_DIR"] = str(tmp_path_factory.mktemp("suite-files"))
    yield
    if old is None:
        os.environ.pop("ACCUMBENCH_RESULTS_DIR", None)
    else:
        os.environ["ACCUMBENCH_RESULTS_DIR"] = old


@pytest.fixture(params=["cxx", "python"])
def reader(request, monkeypatch):
    """The op with the C++ tensor reader (the fast path, its own write checks) or with the
    Python rules alone (tests/op)."""
    from accumkernels.ops.backends import native

    if request.param == "cxx" and not native.READER:
        pytest.skip(f"C++ tensor reader is off: {native.READER_NOTE}")
    if request.param == "python":
        monkeypatch.setattr(native, "READER", False)
    return request.param
