"""What every integration shares: engines that own the gradient path are refused
(accumkernels._engines.refuse_foreign_engines), with nothing changed, and importing accumkernels
or its integration modules imports no framework.

DeepSpeed is not installed: its engine and its ZeRO-3 params are imitated by the attributes
DeepSpeed sets (the detection is duck-typed). FSDP1 on real modules and foreign DDP hooks on
real DDP modules are checked on 2 ranks in test_accelerate.py and test_lightning.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from accumkernels._engines import refuse_foreign_engines
from accumkernels.slot import SLOT_ATTR

ROOT = Path(__file__).resolve().parents[2]  # the repository


class FakeDeepSpeedEngine(torch.nn.Module):
    """What DeepSpeed's engine looks like from outside: a module holding ``module`` and
    ``optimizer``, answering ``zero_optimization_stage()`` and ``gradient_accumulation_steps()``."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module
        self.optimizer = None

    def zero_optimization_stage(self) -> int:
        return 2

    def gradient_accumulation_steps(self) -> int:
        return 4

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def zero3_model() -> torch.nn.Module:
    """Params marked the way ZeRO-3 marks partitioned params (ds_id, ds_status, ...)."""
    model = torch.nn.Linear(4, 2)
    for i, p in enumerate(model.parameters()):
        p.ds_id, p.ds_status, p.ds_numel = i, "NOT_AVAILABLE", p.numel()
    return model


def untouched(model: torch.nn.Module, opt: torch.optim.Optimizer) -> bool:
    return (not hasattr(opt, "_accumkernels_wrapper")
            and not any(hasattr(p, SLOT_ATTR) for p in model.parameters()))


@pytest.mark.parametrize("case", ["engine", "zero3_params", "engine_inside", "ds_optimizer"])
def test_deepspeed_refused(case):
    inner = torch.nn.Linear(4, 2)
    if case == "engine":
        model, params = FakeDeepSpeedEngine(inner), list(inner.parameters())
        kwargs = {"model": model}
    elif case == "zero3_params":
        params, kwargs = list(zero3_model().parameters()), {}
    elif case == "engine_inside":
        outer = torch.nn.Sequential(FakeDeepSpeedEngine(inner))
        params, kwargs = list(outer.parameters()), {"model": outer}
    else:
        opt = type("DeepSpeedZeroOptimizer", (torch.optim.SGD,), {})(inner.parameters(), lr=1)
        params, kwargs = list(inner.parameters()), {"optimizer": opt}
    with pytest.raises(ValueError, match="DeepSpeed") as info:
        refuse_foreign_engines(params, **kwargs)
    assert "grad_accum_dtype" in str(info.value) and "FSDP2" in str(info.value)


def test_fsdp1_flat_params_refused():
    p = torch.nn.Parameter(torch.randn(3))
    p._is_flat_param = True  # what FSDP1's FlatParameter carries
    with pytest.raises(ValueError, match="FSDP1"):
        refuse_foreign_engines([torch.nn.Parameter(torch.randn(2)), p])


def test_plain_and_ddp_models_pass():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    refuse_foreign_engines(list(model.parameters()), model,
                           optimizer=torch.optim.AdamW(model.parameters()))


def test_accelerate_refuses_a_deepspeed_engine_unchanged():
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    try:
        accelerator = AccumulatingAccelerator(cpu=True)
        for model in (FakeDeepSpeedEngine(torch.nn.Linear(4, 2)), zero3_model()):
            opt = torch.optim.AdamW(model.parameters())
            with pytest.raises(ValueError, match="DeepSpeed"):
                accelerator.prepare(opt, model)  # the optimizer first: still nothing wrapped
            assert untouched(model, opt) and not accelerator._optimizers
            assert not accelerator._models
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


def test_trainer_refuses_a_deepspeed_engine_unchanged(tmp_path):
    pytest.importorskip("transformers")
    from transformers import TrainingArguments

    from accumkernels.integrations.transformers import AccumulatingTrainer

    model = FakeDeepSpeedEngine(torch.nn.Linear(4, 2))
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = AccumulatingTrainer(model=model, args=args)
    with pytest.raises(ValueError, match="DeepSpeed"):
        trainer.create_optimizer()
    assert not any(hasattr(p, SLOT_ATTR) for p in model.parameters())


def test_importing_accumkernels_imports_no_framework():
    """Each integration imports its framework when its class is first used, not before."""
    code = ("import sys, accumkernels, accumkernels.integrations, "
            "accumkernels.integrations.transformers, accumkernels.integrations.accelerate, "
            "accumkernels.integrations.lightning\n"
            "print(sorted(m for m in ('transformers', 'accelerate', 'lightning', "
            "'pytorch_lightning') if m in sys.modules))")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                                    os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]", proc.stdout
