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
from accumkernels import master_step as ms
from accumkernels.backends import master_step_cuda as msc

from test_master_step import assert_same, clone, make_state

LR_DTYPES = [torch.float64, torch.bfloat16, torch.float16]
LR = 3.0000001e-3  # no float32, bf16 or fp16 value: every conversion rounds
SIZES = [1, 7, 33, 1030]
KINDS = ["adam_f32", "adam_f64", "sgd"]


def _triton():
    try:
        from accumkernels.backends import master_step_triton as mst
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
