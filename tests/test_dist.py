"""The distribution: the sdist carries what the build needs and nothing else, the wheel carries
the package, one ``_C`` and the license, under the platform tag auditwheel gives it, and each
artifact installed into a fresh venv with only torch (and Triton) passes a smoke test run outside
the checkout: the op on every CPU backend, the README's first example, the wrapper against native
PyTorch on a tiny model, ``build_info()`` and ``python -m accumkernels``.

``make dist-check`` (part of ``make test``) builds the artifacts with ``make dist`` and runs this
file with ACCUMKERNELS_DIST_DIR (where they are) and ACCUMKERNELS_DIST_BASE (a venv holding torch
and Triton only, whose site-packages the fresh venvs see through a ``.pth`` line). Installing the
sdist builds a wheel from it again, unpacked in pip's isolated temporary build (CPU kernels only:
the same path without nvcc). Without those variables the tests skip: building takes minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DIST = os.environ.get("ACCUMKERNELS_DIST_DIR")
BASE = os.environ.get("ACCUMKERNELS_DIST_BASE")

pytestmark = pytest.mark.skipif(not DIST, reason="needs ACCUMKERNELS_DIST_DIR: run by "
                                "`make dist-check` (in `make test`), which builds the artifacts")

# Files of the checkout the sdist carries besides accumkernels/ and csrc/.
TOP_LEVEL = {"CMakeLists.txt", "LICENSE", "MANIFEST.in", "README.md", "pyproject.toml", "setup.py"}
# What setuptools writes into an sdist.
GENERATED = re.compile(r"^(PKG-INFO|setup\.cfg|accumkernels\.egg-info/[^/]+)$")
# What auditwheel grafts into a repaired wheel (libgomp, the OpenMP runtime).
GRAFTED = re.compile(r"^accumkernels\.libs/lib[\w.+-]+\.so[\d.]*$")
# Shared libraries _C must never need: it links no libtorch, no Python library, and the CUDA
# runtime statically (the driver is opened at run time).
NEVER_NEEDED = ("libtorch", "libc10", "libpython", "libcudart", "libcuda.so")


def _tracked() -> set[str]:
    """The checkout's files (git's list; the working tree's where there is no git)."""
    proc = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                          check=False)
    if proc.returncode == 0:
        return set(proc.stdout.split())
    return {p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".so"}


def _package_files() -> set[str]:
    return {f for f in _tracked() if f.startswith("accumkernels/")}


def _one(pattern: str) -> Path:
    found = sorted(Path(DIST).glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {DIST}, found {[p.name for p in found]}"
    return found[0]


@pytest.fixture(scope="module")
def sdist() -> Path:
    return _one("accumkernels-*.tar.gz")


@pytest.fixture(scope="module")
def wheel() -> Path:
    return _one("accumkernels-*.whl")


def test_sdist_holds_what_the_build_needs_and_nothing_else(sdist: Path) -> None:
    """CMakeLists.txt, every csrc/ file, the package, setup.py, pyproject.toml, README, LICENSE;
    no tests/, no benchmarks/, no built extension."""
    with tarfile.open(sdist) as tar:
        names = {m.name for m in tar.getmembers() if m.isfile()}
    top = sdist.name[: -len(".tar.gz")] + "/"
    assert all(n.startswith(top) for n in names), names
    names = {n[len(top):] for n in names}
    tracked = _tracked()
    wanted = TOP_LEVEL | {f for f in tracked if f.startswith(("accumkernels/", "csrc/"))}
    shipped = {n for n in names if not GENERATED.match(n)}
    assert not wanted - shipped, f"missing from the sdist: {sorted(wanted - shipped)}"
    assert not shipped - wanted, f"does not belong in the sdist: {sorted(shipped - wanted)}"
    assert any(n.startswith("csrc/") and n.endswith(".cu") for n in shipped)


def test_wheel_holds_the_package_one_extension_and_the_license(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = {n for n in zf.namelist() if not n.endswith("/")}  # no directory entries
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    info = next(n for n in names if n.endswith(".dist-info/WHEEL")).rsplit("/", 1)[0]
    extensions = {n for n in names if re.fullmatch(r"accumkernels/_C\.[\w.-]+\.so", n)}
    assert len(extensions) == 1, names
    dist_info = {f"{info}/{f}" for f in ("METADATA", "WHEEL", "RECORD", "top_level.txt",
                                         "licenses/LICENSE")}
    rest = {n for n in names - _package_files() - extensions - dist_info
            if not GRAFTED.match(n) and not n.startswith(f"{info}/sboms/")}  # auditwheel's SBOM
    assert not rest, f"does not belong in the wheel: {sorted(rest)}"
    assert not _package_files() - names, f"missing: {sorted(_package_files() - names)}"
    assert "License-Expression: Apache-2.0" in meta and "Requires-Dist: torch>=2.11" in meta


def test_wheel_tag_is_what_auditwheel_says(wheel: Path) -> None:
    """`make dist` repaired the wheel: its platform tag is the one `auditwheel show` reports."""
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel)],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = re.search(r'consistent\s+with\s+the\s+following\s+platform\s+tag:\s+"([^"]+)"',
                     proc.stdout)
    assert said, proc.stdout
    platform = wheel.stem.split("-")[-1]
    assert said.group(1).startswith("manylinux_"), proc.stdout
    assert said.group(1) in platform.split("."), (platform, proc.stdout)


def test_wheel_extension_needs_no_torch_python_or_cuda_library(wheel: Path, tmp_path: Path) -> None:
    """The ELF's DT_NEEDED list: no libtorch/libpython, the CUDA runtime linked statically."""
    from elftools.elf.elffile import ELFFile  # auditwheel's dependency

    with zipfile.ZipFile(wheel) as zf:
        so = next(n for n in zf.namelist() if re.fullmatch(r"accumkernels/_C\.[\w.-]+\.so", n))
        path = Path(zf.extract(so, tmp_path))
    with path.open("rb") as f:
        dynamic = ELFFile(f).get_section_by_name(".dynamic")
        needed = [t.needed for t in dynamic.iter_tags() if t.entry.d_tag == "DT_NEEDED"]
    assert needed and not [n for n in needed if n.startswith(NEVER_NEEDED)], needed


# --- installed into a fresh venv, smoke-tested outside the checkout ------------------------------

SMOKE = r'''
import json, pathlib, re, sys
import torch
import accumkernels
from accumkernels import AccumulatingOptimizer, accumulate_, available_backends

where = pathlib.Path(accumkernels.__file__).resolve()
assert pathlib.Path(sys.prefix).resolve() in where.parents, f"imported from {where}"

backends = available_backends("cpu")
for backend in backends:  # dst = 0 + 0.5 * src is exact in fp32
    dst, src = [torch.zeros(4099)], [torch.randn(4099).to(torch.bfloat16)]
    accumulate_(dst, src, 0.5, backend=backend)
    assert torch.equal(dst[0], 0.5 * src[0].float()), backend

readme = (pathlib.Path(sys.argv[1])).read_text()
exec(re.search(r"```python\n(.*?)```", readme, re.S).group(1), {})  # the README's first example

def train(wrapped):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if wrapped:
        opt = AccumulatingOptimizer(opt, accumulation_steps=2)
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        model(torch.randn(4, 8, generator=gen)).square().mean().backward()
        if wrapped:
            opt.step(); opt.zero_grad()
        elif _ % 2:
            opt.step(); opt.zero_grad()
    return [p.detach() for p in model.parameters()]

for mine, native in zip(train(True), train(False)):
    torch.testing.assert_close(mine, native, rtol=1e-6, atol=1e-7)

info = accumkernels.build_info()
assert info["backends"]["cpu"] == backends
print(json.dumps(info))
'''


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / \
        "site-packages"


@pytest.fixture(scope="module")
def base() -> Path:
    """The venv with torch and Triton only, whose python runs the fresh venvs."""
    if not BASE:
        pytest.skip("needs ACCUMKERNELS_DIST_BASE (a venv with torch only): `make dist-check`")
    base = Path(BASE)
    assert (base / "bin" / "python").is_file(), f"{base} is not a venv"
    return base


def _fresh_venv(base: Path, where: Path) -> Path:
    """A new venv that sees the base venv's packages after its own (a .pth line). No pip or
    setuptools of its own (the base venv's pip installs into it): torch needs setuptools>=77,
    which an ensurepip copy would shadow."""
    subprocess.run([str(base / "bin" / "python"), "-m", "venv", "--without-pip", str(where)],
                   check=True, timeout=300)
    base_site = subprocess.run([str(base / "bin" / "python"), "-c",
                                "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip()
    (_site_packages(where) / "_dist_base.pth").write_text(base_site + "\n")
    return where / "bin" / "python"


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without what would let the checkout leak in."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    return {**env, "PYTHONNOUSERSITE": "1", **extra}


def _install_and_smoke(base: Path, tmp: Path, artifact: Path, pip_args: list[str],
                       env: dict[str, str]) -> dict:
    py = _fresh_venv(base, tmp / "venv")
    pip = subprocess.run([str(base / "bin" / "python"), "-m", "pip", "--python", str(py),
                          "install", *pip_args, str(artifact)],
                         capture_output=True, text=True, env=env, cwd=tmp, timeout=1200,
                         check=False)
    assert pip.returncode == 0, (pip.stdout + pip.stderr)[-4000:]
    own = {p.name for p in _site_packages(tmp / "venv").iterdir()} - {"_dist_base.pth"}
    extra = {n for n in own if not re.match(r"accumkernels|__pycache__", n)}
    assert not extra, f"installed besides accumkernels: {sorted(extra)}"
    run = tmp / "elsewhere"  # not the checkout: nothing can be imported from it by accident
    run.mkdir()
    smoke = subprocess.run([str(py), "-c", SMOKE, str(ROOT / "README.md")], capture_output=True,
                           text=True, env=env, cwd=run, timeout=600, check=False)
    assert smoke.returncode == 0, (smoke.stdout + smoke.stderr)[-4000:]
    main = subprocess.run([str(py), "-m", "accumkernels"], capture_output=True, text=True,
                          env=env, cwd=run, timeout=300, check=False)
    assert main.returncode == 0 and "backends on cpu" in main.stdout, main.stdout + main.stderr
    return json.loads(smoke.stdout.strip().splitlines()[-1])


def test_wheel_installs_into_a_fresh_venv_and_passes_the_smoke_test(
        base: Path, wheel: Path, tmp_path: Path) -> None:
    """--no-index: nothing is fetched, so torch is the base venv's (the wheel needs no compiler,
    no download); the CPU kernels and, under the interpreter, the Triton backend run."""
    env = _clean_env(TRITON_INTERPRET="1")
    info = _install_and_smoke(base, tmp_path, wheel, ["--no-index"], env)
    assert info["native"] and info["openmp"] is True
    assert info["backends"]["cpu"][:2] == ["cpu", "torch"]
    assert "triton" in info["backends"]["cpu"]
    if info["cuda"]:
        assert info["cuda_runtime"] == "static" and info["cuda_archs"], info


def test_sdist_builds_and_installs_into_a_fresh_venv(base: Path, sdist: Path,
                                                     tmp_path: Path) -> None:
    """pip builds a wheel from the unpacked sdist in its isolated build environment (what an
    index serves where no wheel fits); built without CUDA, the package imports and says so."""
    env = _clean_env(ACCUMKERNELS_CUDA="0", MAX_JOBS=os.environ.get("MAX_JOBS", "2"))
    env.pop("TRITON_INTERPRET", None)
    info = _install_and_smoke(base, tmp_path, sdist, ["--no-cache-dir"], env)
    assert info["native"] and info["cuda"] is False and info["cuda_version"] is None
    assert info["backends"]["cpu"] == ["cpu", "torch"]
