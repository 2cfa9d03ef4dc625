"""The conformance matrix's teeth: apply each mutant of mutants/ (a patch of accumkernels/) with
``git apply`` in a scratch copy of the tree, run the matrix there, and the old tests that
concern the mutated code; print which caught it (a case that fails outside KNOWN_BUGS, or any
failing old test).

    PYTHONPATH=$PWD python tests/conformance/run_mutants.py [--ranks] [mutant name prefixes...]

``--ranks`` runs the multi-process part too (minutes per mutant).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTANTS = Path(__file__).resolve().parent / "mutants"

# the old tests of the code each mutant changes
OLD_TESTS = {
    "a": ["tests/optim/step/test_clip.py", "tests/optim/step/test_fused_fold.py",
          "tests/optim/step/test_fused_master.py"],
    "b": ["tests/optim/intake/test_weight_pass.py", "tests/optim/intake/test_intake.py"],
    "c": ["tests/optim/checkpoint/test_checkpoint_live_state.py"],
    "d": ["tests/optim/intake/test_weight_pass.py", "tests/optim/test_loss_scale.py"],
    "e": ["tests/optim/test_window.py", "tests/optim/test_nonfinite.py"],
    "f": ["tests/optim/intake/test_intake.py", "tests/optim/test_user_hands.py"],
    "g": ["tests/optim/checkpoint/test_checkpoint.py", "tests/optim/checkpoint/test_checkpoint_resume.py"],
}


def _pytest(tree: Path, args: list[str], timeout: float) -> tuple[str, str]:
    """(summary line, failed test ids) of pytest in ``tree``."""
    env = {**os.environ, "PYTHONPATH": f"{tree}:{os.environ.get('PYTHONPATH', '')}"}
    try:
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                              "-o", "addopts=", *args], cwd=tree, env=env, text=True,
                             capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out", ""
    lines = run.stdout.strip().splitlines()
    summary = lines[-1] if lines else run.stderr[-300:]
    failed = [m.group(1) for m in re.finditer(r"^FAILED (\S+)", run.stdout, re.M)]
    return summary, " ".join(f.split("::")[-1] for f in failed[:6])


def scratch_tree() -> Path:
    tree = Path(tempfile.mkdtemp(prefix="mutant-"))
    for name in ("accumkernels", "tests", "pyproject.toml"):
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tree / name)
    return tree


def main(argv: list[str]) -> int:
    ranks = "--ranks" in argv
    wanted = [a for a in argv if not a.startswith("--")]
    matrix = ["tests/conformance/test_matrix.py"]
    if ranks:
        matrix.append("tests/conformance/test_matrix_ranks.py")
    for patch in sorted(MUTANTS.glob("*.patch")):
        name = patch.stem
        if wanted and not any(name.startswith(w) for w in wanted):
            continue
        tree = scratch_tree()
        try:
            subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
            t = time.monotonic()
            got = _pytest(tree, matrix, 900)
            old = _pytest(tree, OLD_TESTS[name[0]], 900)
            print(f"{name}: matrix: {got[0]} [{got[1]}] ({time.monotonic() - t:.0f} s) | "
                  f"old tests ({' '.join(Path(f).name for f in OLD_TESTS[name[0]])}): "
                  f"{old[0]} [{old[1]}]", flush=True)
        finally:
            shutil.rmtree(tree, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
