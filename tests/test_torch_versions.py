"""The torch versions the package declares, and the refusal of a feature the installed torch
lacks: an error naming the torch release that brought it, never a crash deep inside."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from accumkernels import _torch_private as tp

ROOT = Path(__file__).resolve().parents[1]


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


def test_declared_floor_is_the_checked_one_and_the_installed_torch_meets_it():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"torch>={tp.TORCH_FLOOR}" in deps, deps
    assert _release(torch.__version__) >= _release(tp.TORCH_FLOOR), torch.__version__


def test_every_feature_is_found_on_a_supported_torch():
    """The table's look-ups are real paths (a typo would refuse every user)."""
    missing = [f for f in tp.FEATURES if not tp.has_feature(f)]
    assert not missing, f"torch {torch.__version__} lacks {missing}"
    for version, _ in tp.FEATURES.values():
        assert _release(version) <= _release(tp.TORCH_FLOOR)


@pytest.mark.parametrize("owner,name,feature", [
    (torch.library, "custom_op", "torch.library.custom_op"),
    (torch.library, "register_fake", "torch.library.register_fake"),
    (torch.compiler, "is_compiling", "torch.compiler.is_compiling"),
])
def test_import_refuses_a_torch_without_a_core_feature(monkeypatch, owner, name, feature):
    monkeypatch.delattr(owner, name)
    version = tp.FEATURES[feature][0]
    expected = f"accumkernels needs {feature}, new in torch {version}; this is torch " \
        f"{torch.__version__} (accumkernels is tested on torch >= {tp.TORCH_FLOOR})"
    with pytest.raises(ImportError, match=re.escape(expected)):
        tp.check_core()


def test_import_accumkernels_names_the_missing_feature():
    """The check runs at ``import accumkernels``, before the ops register."""
    code = "import torch; del torch.library.custom_op; import accumkernels"
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode != 0
    assert "ImportError: accumkernels needs torch.library.custom_op, new in torch 2.4" \
        in out.stderr, out.stderr[-2000:]


def test_bf16_reduce_scatter_refused_without_custom_reduce_scatter(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    monkeypatch.delattr(FSDPModule, "set_custom_reduce_scatter")
    monkeypatch.delitem(sys.modules, "accumkernels.optim.fsdp2.wire", raising=False)
    with pytest.raises(ImportError, match=r"accumkernels.optim.fsdp2.wire needs "
                                          r"FSDPModule.set_custom_reduce_scatter, new in torch "
                                          r"2\.9"):
        import accumkernels.optim.fsdp2.wire  # noqa: F401
