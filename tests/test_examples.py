"""Every ``examples/*.py`` runs as a script, exits 0 and ends with ``final loss <finite number>``
(anything may follow the number on that line).

Parametrized over the glob, so a new example is picked up without touching this file. An
example whose framework (transformers, accelerate, lightning) is not installed is skipped.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py")
                  if not p.name.startswith("_"))  # _ranks.py: what the examples share
OPTIONAL = {"transformers", "accelerate", "lightning", "triton"}
TIMEOUT_S = 300
FINAL_LINE = re.compile(r"^final loss ([^\s,;]+)")


def top_level_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_examples_exist():
    expected = {"plain_loop.py", "accelerate_loop.py", "hf_trainer.py", "lightning_module.py",
                "hf_trainer_oneline.py", "accelerate_oneline.py", "lightning_oneline.py"}
    assert expected <= {p.name for p in EXAMPLES}


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_example_runs(script: Path):
    missing = sorted(m for m in top_level_imports(script) & OPTIONAL
                     if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{script.name} needs {', '.join(missing)}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)
    tail = (f"\n--- stdout (tail) ---\n{proc.stdout[-3000:]}"
            f"\n--- stderr (tail) ---\n{proc.stderr[-3000:]}")
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode}{tail}"
    lines = [line.strip() for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"{script.name} printed nothing{tail}"
    match = FINAL_LINE.match(lines[-1])
    assert match, f"{script.name}: last line {lines[-1]!r} is not 'final loss <value>'{tail}"
    assert math.isfinite(float(match.group(1))), lines[-1]
