"""Build accumkernels._C with CMake (the shape of pybind11's cmake_example).

Environment switches:
  ACCUMKERNELS_CUDA=auto|0|1   auto (default): CUDA kernels when nvcc is found; 1: require them;
                               0: CPU kernels only.
  ACCUMKERNELS_CUDA_ARCHS      CUDA architectures, CMake syntax (default "80;90"); each must be in
                               `nvcc --list-gpu-arch` (nvcc 13: sm_75 and newer).
  ACCUMKERNELS_CUDA_STORE      stwb (default) | ptx: the CUDA kernel's 16-byte store (a tuning switch).
  MAX_JOBS                     parallel compile jobs.
  CMAKE_ARGS                   extra arguments for the CMake configure step.
  CMAKE_GENERATOR              CMake generator (default: Ninja when available).

Nothing here runs nvcc or CMake at import time: only the build_ext step does.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent.resolve()
DEFAULT_CUDA_ARCHS = "80;90"
_CUDA_MODES = {
    **dict.fromkeys(("auto", ""), "AUTO"),
    **dict.fromkeys(("1", "on", "true", "yes"), "ON"),
    **dict.fromkeys(("0", "off", "false", "no"), "OFF"),
}
_HINT = (
    "Switches to try: ACCUMKERNELS_CUDA=0 (CPU kernels only), "
    "ACCUMKERNELS_CUDA_ARCHS='80;90' (other CUDA archs), MAX_JOBS=1 (less memory), "
    "CMAKE_ARGS='...' (extra CMake arguments)."
)


class CMakeExtension(Extension):
    """An extension built by CMake from `sourcedir` (no sources for setuptools itself)."""

    def __init__(self, name: str, sourcedir: str | os.PathLike = "") -> None:
        super().__init__(name, sources=[])
        self.sourcedir = os.fspath(Path(sourcedir).resolve())


def _cuda_mode() -> str:
    raw = os.environ.get("ACCUMKERNELS_CUDA", "auto")
    try:
        return _CUDA_MODES[raw.strip().lower()]
    except KeyError:
        raise SystemExit(f"ACCUMKERNELS_CUDA must be auto, 0 or 1 (got {raw!r})") from None


def _find_nvcc() -> str | None:
    """nvcc from CUDACXX, PATH, CUDA_HOME/CUDA_PATH or /usr/local/cuda (no process is run)."""
    if os.environ.get("CUDACXX"):
        return os.environ["CUDACXX"]
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "nvcc").is_file():
            return str(Path(home) / "bin" / "nvcc")
    return None


def _find_cmake() -> str:
    found = shutil.which("cmake")
    if found:
        return found
    try:  # the `cmake` PyPI package (a build requirement) when its script is not on PATH
        import cmake

        return str(Path(cmake.CMAKE_BIN_DIR) / "cmake")
    except (ImportError, AttributeError):
        raise SystemExit("accumkernels: CMake >= 3.24 is required to build _C (pip install cmake)")


def _ninja_args() -> list[str]:
    if os.environ.get("CMAKE_GENERATOR"):
        return []
    try:  # the `ninja` PyPI package (a build requirement)
        import ninja

        exe = Path(ninja.BIN_DIR) / "ninja"
        if exe.is_file():
            return ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM:FILEPATH={exe}"]
    except (ImportError, AttributeError):
        pass
    return ["-G", "Ninja"] if shutil.which("ninja") else []


class CMakeBuild(build_ext):
    """Configure + build one CMakeExtension; the .so lands where setuptools expects it."""

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CMakeExtension):
            return super().build_extension(ext)
        import pybind11  # a build requirement; imported here, not at setup.py import time

        extdir = (Path.cwd() / self.get_ext_fullpath(ext.name)).parent.resolve()
        cfg = "Debug" if self.debug else "Release"
        mode = _cuda_mode()
        cmake_args = [
            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={extdir}{os.sep}",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dpybind11_DIR={pybind11.get_cmake_dir()}",
            f"-DCMAKE_BUILD_TYPE={cfg}",
            f"-DACCUMKERNELS_CUDA={mode}",
            *_ninja_args(),
        ]
        # Always passed, so a reused build dir does not keep an older cached list.
        archs = os.environ.get("ACCUMKERNELS_CUDA_ARCHS", "").strip() or DEFAULT_CUDA_ARCHS
        cmake_args.append(f"-DACCUMKERNELS_CUDA_ARCHS={archs}")
        store = os.environ.get("ACCUMKERNELS_CUDA_STORE", "").strip().lower() or "stwb"
        if store not in ("stwb", "ptx"):
            raise SystemExit(f"ACCUMKERNELS_CUDA_STORE must be stwb or ptx (got {store!r})")
        cmake_args.append(f"-DACCUMKERNELS_CUDA_STORE={store}")
        user_args = shlex.split(os.environ.get("CMAKE_ARGS", ""))
        if mode != "OFF" and not any(a.startswith("-DCMAKE_CUDA_COMPILER") for a in user_args):
            nvcc = _find_nvcc()
            if nvcc:  # also finds nvcc off PATH (CUDA_HOME), which CMake alone would miss
                cmake_args.append(f"-DCMAKE_CUDA_COMPILER={nvcc}")
            elif mode == "ON":
                raise SystemExit(
                    "accumkernels: ACCUMKERNELS_CUDA=1 but nvcc was not found (looked at CUDACXX, "
                    "PATH, CUDA_HOME, CUDA_PATH, /usr/local/cuda). Install the CUDA toolkit, or "
                    "build the CPU kernels only with ACCUMKERNELS_CUDA=0."
                )
        cmake_args += user_args

        build_args = ["--config", cfg]
        jobs = os.environ.get("MAX_JOBS") or (str(self.parallel) if self.parallel else "")
        if jobs:
            build_args += ["--parallel", jobs]

        build_temp = Path(self.build_temp) / ext.name
        build_temp.mkdir(parents=True, exist_ok=True)
        cmake = _find_cmake()
        self._run("configure", [cmake, ext.sourcedir, *cmake_args], build_temp)
        self._run("build", [cmake, "--build", ".", *build_args], build_temp)

        summary = build_temp / "accumkernels_build_summary.txt"
        what = summary.read_text().strip() if summary.is_file() else "unknown"
        print(f"accumkernels: built {ext.name} ({what}) into {extdir}", flush=True)

    @staticmethod
    def _run(step: str, cmd: list[str], cwd: Path) -> None:
        print(f"accumkernels: CMake {step}: {shlex.join(cmd)}", flush=True)
        try:
            subprocess.run(cmd, cwd=cwd, check=True)
        except (OSError, subprocess.CalledProcessError) as err:
            raise RuntimeError(
                f"accumkernels: the CMake {step} step of accumkernels._C failed ({err}). "
                f"The CMake/compiler output above says what went wrong. {_HINT}"
            ) from err


setup(
    ext_modules=[CMakeExtension("accumkernels._C", sourcedir=ROOT)],
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
