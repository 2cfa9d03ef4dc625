"""A one-element tensor ``lr`` of every floating dtype, on every backend of the fused master step.

The GPU backends ("cuda", played here by its host emulation, and "triton", under the
interpreter) read a tensor lr on the step's device as float32, as torch's fused CUDA kernels do:
an lr of another dtype is converted (float64 rounded to nearest, bf16/fp16 exactly), so the step
equals the same backend's step with the float32 tensor of that value. The CPU backends ("cpu",
"torch") read it as a double, as torch's CPU fused kernels do (``lr.item()``), so the step equals
the one with the Python number. Before the fix the CUDA kernel read the bytes of a float64 or
bf16 lr as a float32 (max |Δmaster| 5.2e11 and 1.9e25; a bf16 lr read 2 bytes past its end).
Tensor betas are not accepted (a number each): refused before anything is written.
"""

from __future__ import annotations

import pytest
import torch

from accumkernels import master_adam_step_, master_sgd_step_
from accumkernels.ops import master_step as ms
from accumkernels.ops.backends import master_step_cuda as msc

from test_master_step import assert_same, clone, make_state

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

LR_DTYPES = [torch.float64, torch.bfloat16, torch.float16]
LR = 3.0000001e-3  # no float32, bf16 or fp16 value: every conversion rounds
SIZES = [1, 7, 33, 1030]
KINDS = ["adam_f32", "adam_f64", "sgd"]


def _triton():
    try:
        from accumkernels.ops.backends import master_step_triton as mst
    except ImportError:
        return None
    if mst.triton is None or not mst.is_available(torch.device("cpu")):
        return None
    return mst


BACKENDS = [
    pytest.param("torch", id="torch"),
    pytest.param("cpu", id="cpu", marks=pytest.mark.skipif(
        "cpu" not in ms.available_backends("cpu"), reason="accumkernels._C not built")),
    pytest.param("cuda_host", id="cuda-host", marks=pytest.mark.skipif(
        not msc.host_available(), reason="accumkernels._C not built")),
    pytest.param("triton", id="triton-interpreter", marks=pytest.mark.skipif(
        _triton() is None, reason="no Triton interpreter here")),
]


def step(backend: str, kind: str, s: dict, lr) -> None:
    adam = dict(beta1=0.85, beta2=0.995, weight_decay=0.01, eps=1e-8, amsgrad=False,
                maximize=False, adamw=True)
    sgd = dict(momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True, maximize=False,
               is_first_step=False)
    adam_lists = (s["masters"], s["weights"], s["grads"], s["exp_avgs"], s["exp_avg_sqs"], None,
                  s["state_steps"]) if kind != "sgd" else None
    sgd_lists = (s["masters"], s["weights"], s["grads"], s.get("momentum_buffers"))
    if backend in ("torch", "cpu"):
        if kind == "sgd":
            master_sgd_step_(*sgd_lists, lr=lr, **sgd, backend=backend)
        else:  # the installed torch's Adam form
            master_adam_step_(*adam_lists, lr=lr, **adam, backend=backend)
        return
    mod, suffix = (msc, "_host") if backend == "cuda_host" else (_triton(), "")
    common = dict(grad_scale=None, found_inf=None, write_grad=True)
    if kind == "sgd":
        getattr(mod, "sgd" + suffix)(*sgd_lists, lr=lr, **sgd, **common)
    else:
        getattr(mod, "adam" + suffix)(*adam_lists, lr=lr, **adam, **common,
                                      arithmetic=kind[-3:].replace("f", "fp", 1))


def arrays(s: dict) -> list:
    return [t for k in ("masters", "weights", "grads", "exp_avgs", "exp_avg_sqs",
                        "momentum_buffers") for t in s.get(k) or []]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", LR_DTYPES, ids=["fp64", "bf16", "fp16"])
def test_tensor_lr_of_any_float_dtype(backend, kind, dtype):
    if backend in ("torch", "cpu") and kind == "adam_f64":
        pytest.skip("the CPU backends follow the installed torch's Adam form")
    s = make_state(SIZES, "sgd" if kind == "sgd" else "adam")
    if kind != "sgd":
        s["state_steps"] = [t + 1 for t in s["state_steps"]]  # incremented, as the step wants
    want = clone(s)
    lr = torch.tensor([LR], dtype=dtype)
    if backend in ("torch", "cpu"):
        same = float(lr.item())  # torch's CPU fused kernels: lr.item()
    else:
        same = lr.to(torch.float32)  # torch's CUDA fused kernels: *(const float*)
    step(backend, kind, s, lr)
    step(backend, kind, want, same)
    assert_same(arrays(s), arrays(want), f"{backend} {kind} lr {dtype}")
    # and the lr mattered: a float32 lr of the unrounded value gives another step (fp64/bf16/fp16
    # all round LR), so the comparison above would catch an lr read as the wrong value
    other = clone(make_state([1030], "sgd"))
    ref = clone(other)
    step(backend, "sgd", other, torch.tensor([LR], dtype=dtype))
    step(backend, "sgd", ref, torch.tensor([LR * 1.01], dtype=torch.float32))
    assert not torch.equal(other["masters"][0], ref["masters"][0])


@pytest.mark.parametrize("name", ["beta1", "beta2"])
def test_tensor_betas_are_refused_before_writing(name):
    s = make_state([5, 9], "adam")
    before = clone(s)
    kw = dict(beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8)
    kw[name] = torch.tensor(0.9, dtype=torch.float64)
    with pytest.raises(TypeError, match=f"{name} must be a number"):
        master_adam_step_(s["masters"], s["weights"], s["grads"], s["exp_avgs"],
                          s["exp_avg_sqs"], None, s["state_steps"], lr=1e-3, **kw)
    assert_same(arrays(s), arrays(before), "after a refused call")


@pytest.mark.parametrize("kind", ["adamw", "adam", "sgd"])
@pytest.mark.parametrize("dtype", [torch.float32, *LR_DTYPES], ids=["fp32", "fp64", "bf16", "fp16"])
def test_torch_backend_hands_torch_a_float32_lr_on_the_device(monkeypatch, kind, dtype):
    """backend="torch" off the CPU calls torch's fused op for the device, whose CUDA kernels read
    a tensor lr as float32: a tensor lr on the step's device is converted to float32 first (a CPU
    one is passed as its number). Driven on meta tensors (the device path, no GPU) with torch's
    fused ops replaced by a recorder of the lr they get."""
    from accumkernels.ops.backends import master_step_ref as ref

    seen = []
    op = {"adamw": "_fused_adamw_", "adam": "_fused_adam_", "sgd": "_fused_sgd_"}[kind]
    monkeypatch.setattr(torch, op, lambda *args, lr, **kw: seen.append(lr))
    meta = torch.device("meta")

    def lists(n):
        return [[torch.empty(5, device=meta) for _ in range(2)] for _ in range(n)]

    masters, grads = lists(2)
    weights = [torch.empty(5, device=meta, dtype=torch.bfloat16) for _ in range(2)]
    for lr in (torch.tensor([LR], dtype=dtype, device=meta), torch.tensor([LR], dtype=dtype)):
        common = dict(lr=lr, weight_decay=0.01, grad_scale=None, found_inf=None, write_grad=True)
        if kind == "sgd":
            ref.sgd(masters, weights, grads, lists(1)[0], momentum=0.9, dampening=0.0,
                    nesterov=False, maximize=False, is_first_step=False, **common)
        else:
            exp_avgs, exp_avg_sqs, steps = lists(3)
            ref.adam(masters, weights, grads, exp_avgs, exp_avg_sqs, None, steps, beta1=0.9,
                     beta2=0.999, eps=1e-8, amsgrad=False, maximize=False, adamw=kind == "adamw",
                     **common)
    on_device, from_cpu = seen
    assert isinstance(on_device, torch.Tensor), on_device
    assert on_device.dtype == torch.float32 and on_device.device == meta
    assert from_cpu == pytest.approx(float(torch.tensor(LR, dtype=dtype)), rel=0, abs=0)
