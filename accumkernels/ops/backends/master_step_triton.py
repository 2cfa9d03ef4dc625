"""Backend ``"triton"`` of the fused master step: one Triton launch per device and weight dtype.

The same step as the CUDA kernel (csrc/master_step_kernel.h documents the arithmetic): the master
takes a weight the user wrote, the gradient is unscaled, the master and its state get torch's fused
SGD/Adam/AdamW update, the weight is written back rounded. Each program is one block of one
tensor; it finds its tensor by binary search in a small int64 table (element offsets of every
array from one base tensor per list, numel, first block, an alignment flag), which also carries
the step's scalars as float64 bit patterns (exact: Triton types Python floats as fp32). found_inf,
grad_scale, a tensor lr (any float dtype, taken as float32 like the CUDA kernel and
torch's) and every step are read by the kernel: no host synchronisation.

Bit-exact arithmetic in Triton: launches pass ``enable_fp_fusion=False`` (no contraction of a*b+c
behind our back), FMAs are explicit ``tl.fma``, fp32 divisions and square roots ``tl.div_rn`` /
``tl.sqrt_rn`` (plain fp32 ``/`` and ``tl.sqrt`` are approximate on NVIDIA GPUs; the fp64 ones
are IEEE: div.rn.f64, sqrt.rn.f64), pow is libdevice's (the function torch's kernel calls).
Weights move as int16 bits and are rounded in integer arithmetic for bf16 (NaN -> 0x7fff, as
cvt.rn).

pow, as nvcc compiles it: Triton links by default the libdevice it ships and turns libdevice's
flush-to-zero on (``nvvm-reflect-ftz``); Triton 3.6/3.8's libdevice then computes powf with
``ex2.approx.ftz``, a different function from nvcc's ``powf`` (what torch's fused Adam and the CUDA
kernel call: -ftz=false, a polynomial exp2). Launches therefore pass ``enable_reflect_ftz=False``
and link the CUDA toolkit's own ``nvvm/libdevice/libdevice.10.bc`` (``libdevice_path``): the fp32
pow then compiles to nvcc's instructions exactly (tests/op/test_master_step_triton.py compares the
two PTX listings, Triton 3.6, 3.8 and 3.9 against nvcc 13.0). Without a toolkit libdevice,
Triton >= 3.9's own one is used (its powf is nvcc's, same test); an older Triton refuses the fp32
Adam form rather than compute another pow. The fp64 form's pow (torch <= 2.10) is libdevice's
``__nv_pow`` without contraction, where nvcc fuses 4 of its products: bc1/bc2 are rounded to
fp32 after it, so a last-bit difference of the double shows only when 1 - beta^step sits within
one double ulp of an fp32 rounding boundary; only a GPU run compares it with torch.

Under ``TRITON_INTERPRET=1`` (CPU tensors, tests) Triton cannot call libdevice: pow is then
exponentiation by squaring in float64 for an integer step, and NaN payloads follow numpy, not the
GPU's canonical NaN; everything else is computed exactly as on the GPU.
"""

from __future__ import annotations

import functools
import glob
import os
import shutil
import sys

import torch

from accumkernels._util import on_device, triton_usable
from accumkernels.ops.backends import master_step_cuda
from accumkernels.ops.backends.triton import upload_table

from accumkernels.ops.backends.master_step_triton_kernels import triton

if triton is not None:
    from accumkernels.ops.backends.master_step_triton_kernels import master_step_kernel

BLOCK = 1024
NUM_WARPS = 8  # 4 fp32 per thread: 16-byte accesses, 80-118 registers (sm_90, AOT)
ALIGN = 16
ROWS = 10  # table rows: 7 offsets (master, weight, grad, state0..2, step), numel, block, aligned
SGD, ADAM_F64, ADAM_F32 = 0, 1, 2


def is_available(device: torch.device) -> bool:
    return triton is not None and triton_usable(device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _toolkit_libdevices() -> list[str]:
    """libdevice.10.bc of the CUDA toolkit(s) in sight: $ACCUMKERNELS_LIBDEVICE (a file), the
    toolkit of $CUDA_HOME / $CUDA_PATH / nvcc on PATH / /usr/local/cuda, pip's nvidia-* wheels."""
    explicit = os.environ.get("ACCUMKERNELS_LIBDEVICE")
    if explicit:
        return [explicit]
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    roots.append("/usr/local/cuda")
    found = [os.path.join(r, "nvvm", "libdevice", "libdevice.10.bc") for r in roots if r]
    for site in sys.path:
        found += sorted(glob.glob(os.path.join(site, "nvidia", "*", "nvvm", "libdevice",
                                               "libdevice.10.bc")))
    return [f for f in found if os.path.isfile(f)]  # first: the most specific


@functools.lru_cache(maxsize=None)
def libdevice_path() -> str | None:
    """The libdevice the kernel links (None: Triton's own, fine only on Triton >= 3.9)."""
    paths = _toolkit_libdevices()
    if os.environ.get("ACCUMKERNELS_LIBDEVICE") and not os.path.isfile(paths[0]):
        raise RuntimeError(f"ACCUMKERNELS_LIBDEVICE={paths[0]!r} is not a file")
    return paths[0] if paths else None


def _own_libdevice_is_nvccs() -> bool:
    major, minor = (int(x) for x in triton.__version__.split(".")[:2])
    return (major, minor) >= (3, 9)


def _has_reflect_ftz_option() -> bool:
    from triton.backends.nvidia.compiler import CUDAOptions

    return "enable_reflect_ftz" in CUDAOptions.__dataclass_fields__


def compile_options(algo: int) -> dict:
    """The Triton compile options of a launch of ``algo`` (also the AOT test's): no contraction,
    libdevice without flush-to-zero, the toolkit's libdevice where there is one."""
    opts = {"enable_fp_fusion": False}
    if algo == SGD:  # no libdevice call
        return opts
    if not _has_reflect_ftz_option():
        raise RuntimeError(
            f"master_adam_step_ (backend 'triton'): Triton {triton.__version__} cannot compile "
            "libdevice without flush-to-zero (no enable_reflect_ftz option); use a newer Triton "
            "or backend 'cuda'")
    opts["enable_reflect_ftz"] = False
    path = libdevice_path()
    if path is not None:
        opts["extern_libs"] = (("libdevice", path),)
    elif algo == ADAM_F32 and not _own_libdevice_is_nvccs():
        raise RuntimeError(
            f"master_adam_step_ (backend 'triton', torch's fp32 Adam form): Triton "
            f"{triton.__version__} ships a libdevice whose powf is not nvcc's (ex2.approx), and "
            "no CUDA toolkit libdevice.10.bc was found; install the CUDA toolkit (or pip's "
            "nvidia-cuda-nvcc), point ACCUMKERNELS_LIBDEVICE at its nvvm/libdevice/"
            "libdevice.10.bc, upgrade Triton to >= 3.9, or use backend 'cuda'")
    return opts


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
    options = {} if _interpreting() else compile_options(algo)
    with on_device(device):
        table = upload_table(table, device, "master_step")
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
            BLOCK=BLOCK, num_warps=NUM_WARPS, **options,
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
