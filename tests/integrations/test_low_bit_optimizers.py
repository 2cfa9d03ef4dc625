"""Low-bit and schedule-free inner optimizers by name: torchao's ``AdamW8bit``, ``AdamW4bit``,
``AdamWFp8`` and ``AdamW(bf16_stochastic_round=True)`` (accumkernels.optimizers.torchao), and
schedulefree's ``AdamWScheduleFree`` and ``SGDScheduleFree`` (accumkernels.optimizers.schedulefree),
each against its own native use on an MLP, 8 windows of 3 micro-batches:

* fp32 params: bit for bit, with a state dict saved (``torch.save``) and loaded in the middle of
  training on both sides (the low-bit states are torchao tensor subclasses);
* bf16 params: the wrapper's fp32 window and master weights end closer to the fp32 run of the
  same optimizer than native bf16 does (relative L2 error; the figures are printed).

They run where the packages install (``make clients``: torchao 0.13.0 with torch 2.13.0).
"""

from __future__ import annotations

import io
import pickle

import pytest
import torch

CASES = {  # name: (package, by-name class, inner arguments)
    "AdamW8bit": ("torchao", "AdamW8bit", {"lr": 1e-3, "block_size": 256}),
    "AdamW4bit": ("torchao", "AdamW4bit", {"lr": 1e-3, "block_size": 128}),
    "AdamWFp8": ("torchao", "AdamWFp8", {"lr": 1e-3, "block_size": 256}),
    "AdamW-bf16-stochastic-round": ("torchao", "AdamW",
                                    {"lr": 1e-3, "bf16_stochastic_round": True}),
    "AdamWScheduleFree": ("schedulefree", "AdamWScheduleFree", {"lr": 1e-3}),
    "SGDScheduleFree": ("schedulefree", "SGDScheduleFree", {"lr": 1e-2}),
}
WINDOWS, N = 8, 3


def _classes(case: str):
    package, name, kwargs = CASES[case]
    pytest.importorskip(package)
    import importlib

    ours = getattr(importlib.import_module(f"accumkernels.optimizers.{package}"), name)
    return ours, ours.inner_class, kwargs


def _model(dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(),
                               torch.nn.Linear(256, 64)).to(dtype)


def _round_trip(opt) -> None:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=False))


def _train(cls, kwargs: dict, dtype) -> list[torch.Tensor]:
    model = _model(dtype)
    opt = cls(model.parameters(), **kwargs)
    g = torch.Generator().manual_seed(1)
    data = [torch.randn(8, 64, generator=g) for _ in range(WINDOWS * N)]
    torch.manual_seed(7)  # stochastic rounding draws from the global generator
    for w in range(WINDOWS):
        if hasattr(opt, "train"):
            opt.train()  # schedule-free: the training point
        for x in data[w * N:(w + 1) * N]:
            (model(x.to(dtype)).float().square().mean() / N).backward()
        opt.step()
        opt.zero_grad()
        if w == WINDOWS // 2:
            _round_trip(opt)
    return [p.detach().clone() for p in model.parameters()]


def _relative_l2(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    num = sum(float((p.double() - r.double()).square().sum()) for p, r in zip(params, reference))
    return (num / sum(float(r.double().square().sum()) for r in reference)) ** 0.5


@pytest.mark.parametrize("case", list(CASES))
def test_low_bit_and_schedule_free_by_name_against_native(case):
    ours, native, kwargs = _classes(case)
    reference = _train(native, kwargs, torch.float32)
    fp32 = _train(ours, kwargs, torch.float32)
    for p, q in zip(reference, fp32):
        assert torch.equal(p, q), f"{case}: fp32 differs from native"
    assert not torch.equal(reference[0], _model(torch.float32)[0].weight)
    native_bf16 = _relative_l2(_train(native, kwargs, torch.bfloat16), reference)
    ours_bf16 = _relative_l2(_train(ours, kwargs, torch.bfloat16), reference)
    print(f"[bf16 vs fp32] {case}: wrapper {ours_bf16:.3g}, native {native_bf16:.3g}")
    assert ours_bf16 < native_bf16, case


def test_by_name_classes_pickle_and_refuse_by_name():
    """The lazily made classes pickle by name; a name the package lacks, or one not offered,
    is an AttributeError that says so."""
    pytest.importorskip("torchao")
    pytest.importorskip("schedulefree")
    import accumkernels.optimizers.schedulefree as sf
    import accumkernels.optimizers.torchao as ao

    assert pickle.loads(pickle.dumps(ao.AdamW8bit)) is ao.AdamW8bit
    opt = sf.SGDScheduleFree(_model(torch.float32).parameters(), lr=1e-2, reduction="mean")
    opt.train()
    copied = pickle.loads(pickle.dumps(opt))
    assert type(copied) is sf.SGDScheduleFree and copied.reduction == "mean"
    with pytest.raises(AttributeError, match="not offered"):
        _ = ao.CPUOffloadOptimizer
    with pytest.raises(AttributeError, match="no optimizer 'AdamW2bit'"):
        _ = ao.AdamW2bit
    with pytest.raises(TypeError, match="'block_sise'"):
        ao.AdamW8bit(_model(torch.float32).parameters(), block_sise=256)


@pytest.mark.parametrize("module, name, package", [
    ("accumkernels.optimizers.schedulefree", "SGDScheduleFree", "schedulefree"),
    ("accumkernels.optimizers.torchao", "AdamW8bit", "torchao"),
])
def test_a_missing_package_is_an_attribute_error_naming_it(monkeypatch, module, name, package):
    """The package not installed (simulated: a None in ``sys.modules`` makes ``import`` raise
    ModuleNotFoundError, whether or not it is installed): the attribute protocol holds,
    ``hasattr`` is False and ``getattr(..., None)`` None, and the error names what to install."""
    import importlib
    import sys

    mod = importlib.import_module(module)
    monkeypatch.delitem(mod.__dict__, name, raising=False)  # a class made earlier, cached
    for missing in [package] + [m for m in sys.modules if m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, missing, None)
    assert not hasattr(mod, name)
    assert getattr(mod, name, None) is None
    with pytest.raises(AttributeError, match=f"pip install {package}") as info:
        getattr(mod, name)
    assert isinstance(info.value.__cause__, ImportError)
    assert name in str(info.value) and module in str(info.value)
    from accumkernels.optimizers import MissingPackageError

    assert isinstance(info.value, MissingPackageError)
    assert info.value.package == package
