"""Backend ``"triton"`` of the fused master step: one Triton launch per device and weight dtype.

The same step as the CUDA kernel (csrc/master_step_kernel.h documents the arithmetic): the master
takes a weight the user wrote, the gradient is unscaled, the master and its state get torch's fused
SGD/Adam/AdamW update, the weight is written back rounded. Each program is one block of one
tensor; it finds its tensor by binary search in a small int64 table (element offsets of every
array from one base tensor per list, numel, first block, an alignment flag), which also carries
the step's scalars as float64 bit patterns (exact: Triton types Python floats as fp32). found_inf,
grad_scale, a tensor lr and every step are read by the kernel: no host synchronisation.

Bit-exact arithmetic in Triton: launches pass ``enable_fp_fusion=False`` (no contraction of a*b+c
behind our back), FMAs are explicit ``tl.fma``, fp32 divisions and square roots ``tl.div_rn`` /
``tl.sqrt_rn`` (plain fp32 ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs; the fp64 ones
are IEEE: div.rn.f64, sqrt.rn.f64), pow is libdevice's (the function torch's kernel calls).
Weights move as int16 bits and are rounded in integer arithmetic for bf16 (NaN -> 0x7fff, as
cvt.rn).

Under ``TRITON_INTERPRET=1`` (CPU tensors, tests) Triton cannot call libdevice: pow is then
exponentiation by squaring in float64 for an integer step, and NaN payloads follow numpy, not the
GPU's canonical NaN; everything else is computed exactly as on the GPU.
"""

from __future__ import annotations

import os

import torch

from accumkernels._util import on_device, triton_usable
from accumkernels.backends import master_step_cuda

from accumkernels.backends.master_step_triton_kernels import triton

if triton is not None:
    from accumkernels.backends.master_step_triton_kernels import master_step_kernel

BLOCK = 1024
NUM_WARPS = 8  # 4 fp32 per thread: 16-byte accesses, 80-118 registers (sm_90, AOT)
ALIGN = 16
ROWS = 10  # table rows: 7 offsets (master, weight, grad, state0..2, step), numel, block, aligned
SGD, ADAM_F64, ADAM_F32 = 0, 1, 2


def is_available(device: torch.device) -> bool:
    return triton is not None and triton_usable(device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _base(tensors: list[torch.Tensor]) -> int:
    """Index of the list's base tensor: a 16-byte-aligned one when there is one."""
    return next((i for i, t in enumerate(tensors) if t.data_ptr() % ALIGN == 0), 0)


def _launch(algo: int, lists: list[list[torch.Tensor] | None], scalars: list[float], *,
            flags: dict, lr_tensor, grad_scale, found_inf) -> None:
    """One launch for one weight dtype. lists: masters, weights (as int16), grads, state0..2,
    steps (None: unused)."""
    masters = lists[0]
    n = len(masters)
    device = masters[0].device
    rows: list[list[int]] = []
    bases: list[torch.Tensor] = []
    aligned = [1] * n
    for k, tensors in enumerate(lists):
        if tensors is None:
            rows.append([0] * n)
            bases.append(masters[0])
            continue
        b = _base(tensors)
        base = tensors[b]
        size = base.element_size()
        rows.append([(t.data_ptr() - base.data_ptr()) // size for t in tensors])
        bases.append(base)
        if k < 6:  # arrays (not steps): the full-block hint needs aligned addresses
            need = 8 if k == 1 else ALIGN
            for i, t in enumerate(tensors):
                aligned[i] &= int(t.data_ptr() % need == 0 and base.data_ptr() % need == 0)
    numels = [m.numel() for m in masters]
    first, total = [], 0
    for numel in numels:
        first.append(total)
        total += -(-numel // BLOCK)
    bits = torch.tensor(scalars, dtype=torch.float64).view(torch.int64).tolist()
    table = torch.tensor([x for row in rows for x in row] + numels + first + aligned + bits,
                         dtype=torch.int64)
    with on_device(device):
        if device.type != "cpu":
            host = table.pin_memory()
            if torch.cuda.is_current_stream_capturing():
                from accumkernels.backends import triton as accumulate_triton
                table = accumulate_triton._captured_table(host.view(1, -1), device).view(-1)
            else:
                table = host.to(device, non_blocking=True)
        dummy = masters[0]
        master_step_kernel[(total,)](
            table, n, *bases,
            lr_tensor if lr_tensor is not None else dummy,
            grad_scale if grad_scale is not None else dummy,
            found_inf if found_inf is not None else dummy,
            ALGO=algo, BF16=flags["bf16"],
            HAS_SCALE=grad_scale is not None,
            STORE_GRAD=grad_scale is not None and flags["write_grad"],
            LR_FROM_PTR=lr_tensor is not None, HAS_FOUND_INF=found_inf is not None,
            MAXIMIZE=flags["maximize"], ADAMW=flags["adamw"], AMSGRAD=flags["amsgrad"],
            MOMENTUM=flags["momentum"], FIRST=flags["first_step"], NESTEROV=flags["nesterov"],
            LIBDEVICE=not _interpreting(), SEARCH_STEPS=max(1, (n - 1).bit_length()),
            BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False,
        )


def _run(algo: int, lists: list, scalars: list[float], lr, grad_scale, found_inf,
         flags: dict) -> None:
    """Group by weight dtype (non-empty tensors) and launch each group."""
    device = lists[0][0].device
    lr_tensor = None
    if isinstance(lr, torch.Tensor):
        if lr.device == device:
            lr_tensor = lr
        else:
            scalars[0] = float(lr.item())
    groups: dict[torch.dtype, list[int]] = {}
    for i, w in enumerate(lists[1]):
        if w.numel():
            groups.setdefault(w.dtype, []).append(i)
    for dtype, idx in groups.items():
        sub = [None if lst is None else [lst[i] for i in idx] for lst in lists]
        sub[1] = [w.view(torch.int16) for w in sub[1]]
        _launch(algo, sub, scalars, flags={**flags, "bf16": dtype == torch.bfloat16},
                lr_tensor=lr_tensor, grad_scale=grad_scale, found_inf=found_inf)


def adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
         lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw,
         grad_scale, found_inf, write_grad, arithmetic: str | None = None) -> None:
    """Fused master Adam/AdamW step (already-checked lists on one device). ``arithmetic``: the
    torch kernel form to reproduce, "fp32" (torch >= 2.11) or "fp64" (None: the installed
    torch's)."""
    arith = arithmetic or master_step_cuda.adam_arithmetic()
    if arith not in ("fp32", "fp64"):
        raise ValueError(f"arithmetic must be 'fp32', 'fp64' or None, not {arithmetic!r}")
    lists = [masters, weights, grads, exp_avgs, exp_avg_sqs,
             max_exp_avg_sqs if amsgrad else None, state_steps]
    scalars = [float(lr) if not isinstance(lr, torch.Tensor) else 1.0, float(beta1),
               float(beta2), float(weight_decay), float(eps), 0.0, 0.0]
    flags = dict(maximize=bool(maximize), adamw=bool(adamw), amsgrad=bool(amsgrad),
                 momentum=False, first_step=False, nesterov=False, write_grad=bool(write_grad))
    _run(ADAM_F32 if arith == "fp32" else ADAM_F64, lists, scalars, lr, grad_scale, found_inf,
         flags)


def sgd(masters, weights, grads, momentum_buffers, *,
        lr, momentum, dampening, weight_decay, nesterov, maximize, is_first_step,
        grad_scale, found_inf, write_grad) -> None:
    """Fused master SGD step (already-checked lists on one device)."""
    lists = [masters, weights, grads, momentum_buffers, None, None, None]
    scalars = [float(lr) if not isinstance(lr, torch.Tensor) else 1.0, 0.0, 0.0,
               float(weight_decay), 0.0, float(momentum), float(dampening)]
    flags = dict(maximize=bool(maximize), adamw=False, amsgrad=False,
                 momentum=momentum_buffers is not None, first_step=bool(is_first_step),
                 nesterov=bool(nesterov), write_grad=bool(write_grad))
    _run(SGD, lists, scalars, lr, grad_scale, found_inf, flags)
