"""Backend ``"cuda"`` of the fused master step, and its test-only host emulation ``"cuda_host"``.

One pass per element over fp32 masters and their bf16/fp16 weights: the master takes a weight the
user wrote, the gradient is unscaled, the master and its state get torch's fused Adam/AdamW/SGD
update bit for bit, and the weight is written back rounded. The CUDA kernel
(csrc/master_step_kernel.h) is one launch per weight dtype for the whole list; it reads
``found_inf``, ``grad_scale``, a tensor ``lr`` and every tensor's step from device memory (no host
sync). ``adam_host``/``sgd_host`` play the same kernel source block by block on CPU tensors
(csrc/master_step_cuda_host.cpp): slow, for tests.

Adam's arithmetic follows torch's own CUDA kernel, which changed between releases: double
scalars up to torch 2.10, fp32 with explicit FMAs from 2.11 (csrc/master_step_kernel.h spells out
both). ``ADAM_F32_SINCE`` is the first torch with the fp32 form: tests/op/test_master_step_gpu.py
checks the installed torch against it on a GPU.
"""

from __future__ import annotations

import torch

from accumkernels.ops.backends import native

# The first torch release whose CUDA fused Adam(W) computes in fp32 with explicit fma (pytorch
# PR 173224, merged for 2.11). Earlier releases compute with double scalars.
ADAM_F32_SINCE = (2, 11)

# device index -> why the kernels cannot run there (None: they can); asked once per device.
_PROBLEMS: dict[int, str | None] = {}


def _c():
    return native._C


def host_available() -> bool:
    return _c() is not None and hasattr(_c(), "master_step_cuda_host")


def is_available(device: torch.device) -> bool:
    c = _c()
    if device.type != "cuda" or c is None or not hasattr(c, "master_step_cuda"):
        return False
    if not native.is_available(device):  # driver/runtime check of the extension (once)
        return False
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _PROBLEMS:
        # Load the kernels now, not inside a CUDA-graph capture that a first call could be in.
        if torch.cuda.is_current_stream_capturing():
            return True
        _PROBLEMS[index] = c.master_step_cuda_load(index) or None
    return _PROBLEMS[index] is None


def adam_arithmetic(version: str | None = None) -> str:
    """Which form of torch's CUDA fused Adam to reproduce: ``"fp32"`` (torch >= 2.11) or
    ``"fp64"`` (earlier); ``version`` defaults to the installed torch."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    major_minor = tuple(int("".join(ch for ch in p if ch.isdigit()) or 0) for p in parts[:2])
    return "fp32" if major_minor >= ADAM_F32_SINCE else "fp64"


def _flag(name: str) -> int:
    return _c().MASTER_STEP_FLAGS[name]


def _lr(lr, device: torch.device) -> tuple[float, int, torch.Tensor | None]:
    """(scalar lr, address of a tensor lr or 0, the tensor to keep alive until the launch).
    A tensor on another device than the lists (a CPU lr for a CUDA step) is read as a number, as
    torch does; one on the lists' device is read by the kernel as float32 (torch's fused CUDA
    kernels read ``*(const float*)``): an lr of another dtype is converted first on the device
    (float64 rounded to nearest, bf16/fp16 exactly), never reinterpreted."""
    if isinstance(lr, torch.Tensor):
        if lr.device == device:
            lr32 = lr if lr.dtype == torch.float32 else lr.to(torch.float32)
            return 1.0, lr32.data_ptr(), lr32
        return float(lr.item()), 0, None
    return float(lr), 0, None


def _ptrs(tensors) -> list[int]:
    return [] if tensors is None else [t.data_ptr() for t in tensors]


def _launch(host: bool, algo: int, flags: int, rows: list, masters, weights, scalars,
            lr_ptr: int, grad_scale, found_inf) -> None:
    c = _c()
    numels = [m.numel() for m in masters]
    codes = [native.DTYPE_CODES[w.dtype] for w in weights]
    head = (algo, flags, rows, numels, codes, scalars, lr_ptr,
            0 if grad_scale is None else grad_scale.data_ptr(),
            0 if found_inf is None else found_inf.data_ptr())
    if host:
        c.master_step_cuda_host(*head)
        return
    device = masters[0].device
    stream = torch.cuda.current_stream(device).cuda_stream
    c.master_step_cuda(*head, stream, device.index if device.index is not None
                       else torch.cuda.current_device())


def _adam(host, masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps,
          *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
          found_inf, write_grad, arithmetic=None):
    c = _c()
    arith = arithmetic or adam_arithmetic()
    if arith not in ("fp32", "fp64"):
        raise ValueError(f"arithmetic must be 'fp32', 'fp64' or None, not {arithmetic!r}")
    algo = c.MASTER_STEP_ADAM_F32 if arith == "fp32" else c.MASTER_STEP_ADAM_F64
    flags = ((_flag("amsgrad") if amsgrad else 0) | (_flag("maximize") if maximize else 0)
             | (_flag("adamw") if adamw else 0) | (_flag("write_grad") if write_grad else 0))
    lr_value, lr_ptr, _lr_alive = _lr(lr, masters[0].device)
    rows = [_ptrs(masters), _ptrs(weights), _ptrs(grads), _ptrs(exp_avgs), _ptrs(exp_avg_sqs),
            _ptrs(max_exp_avg_sqs) if amsgrad else [], _ptrs(state_steps)]
    scalars = [lr_value, float(beta1), float(beta2), float(weight_decay), float(eps), 0.0, 0.0]
    _launch(host, algo, flags, rows, masters, weights, scalars, lr_ptr, grad_scale, found_inf)


def _sgd(host, masters, weights, grads, momentum_buffers, *, lr, momentum, dampening,
         weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf, write_grad):
    c = _c()
    has_buf = momentum_buffers is not None
    flags = ((_flag("momentum") if has_buf else 0) | (_flag("maximize") if maximize else 0)
             | (_flag("nesterov") if nesterov else 0)
             | (_flag("first_step") if is_first_step else 0)
             | (_flag("write_grad") if write_grad else 0))
    lr_value, lr_ptr, _lr_alive = _lr(lr, masters[0].device)
    rows = [_ptrs(masters), _ptrs(weights), _ptrs(grads), _ptrs(momentum_buffers), [], [], []]
    scalars = [lr_value, 0.0, 0.0, float(weight_decay), 0.0, float(momentum), float(dampening)]
    _launch(host, c.MASTER_STEP_SGD, flags, rows, masters, weights, scalars, lr_ptr, grad_scale,
            found_inf)


def adam(*lists, **kw) -> None:
    """Fused master Adam/AdamW step on CUDA tensors (already-checked lists, one device): the
    contract's ``adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
    found_inf, write_grad)``, plus ``arithmetic``: the torch kernel form to reproduce (None: the
    installed torch's)."""
    _adam(False, *lists, **kw)


def sgd(*lists, **kw) -> None:
    """Fused master SGD step on CUDA tensors (already-checked lists, one device): the
    contract's ``sgd(masters, weights, grads, momentum_buffers, *, lr, momentum, dampening,
    weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf, write_grad)``."""
    _sgd(False, *lists, **kw)


def adam_host(*lists, **kw) -> None:
    """``adam``'s CUDA kernel played on the CPU, on CPU tensors (tests)."""
    _adam(True, *lists, **kw)


def sgd_host(*lists, **kw) -> None:
    """``sgd``'s CUDA kernel played on the CPU, on CPU tensors (tests)."""
    _sgd(True, *lists, **kw)


def configure_host(sm_count: int = 132, capturing: bool = False) -> None:
    """The emulated device of ``*_host``: its SM count (grid = 3 blocks per SM, at most one per
    chunk) and whether its stream counts as captured (no launch depends on it: lists over 400
    tensors launch in groups either way)."""
    _c().master_step_cuda_host_configure(sm_count, capturing)


def host_launches() -> list[str]:
    """The last ``*_host`` call's launches: weight dtype, table kind, grid, chunks, tensors."""
    return _c().master_step_cuda_host_launches()
