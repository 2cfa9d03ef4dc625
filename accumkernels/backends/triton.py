"""Triton backend: one launch per source dtype for a whole tensor list.

The host builds a small int64 table per call (dst/src addresses, sizes, first block of each
tensor); every program finds its tensor by binary search in the block prefix sums, then does
pid -> offsets -> mask like any element-wise Triton kernel. Runs on CUDA tensors, and on CPU
tensors under ``TRITON_INTERPRET=1`` (tests only).
"""

from __future__ import annotations

import torch

from accumkernels._util import triton_usable

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional
    triton = None

# Elements per program: 4096 fp32 = 16 KB of dst per program, enough to hide latency with
# 4 warps while keeping the tail of small tensors short.
BLOCK = 4096
NUM_WARPS = 4
# Pointer tables of launches captured in CUDA graphs, kept alive for the graphs' replays.
_CAPTURED_TABLES: list[tuple[torch.Tensor, torch.Tensor]] = []


def is_available(device: torch.device) -> bool:
    return triton is not None and triton_usable(device)


if triton is not None:
    _TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}

    @triton.jit
    def _accumulate_kernel(
        table_ptr,  # int64 [4, n_tensors]: dst address, src address, numel, first block id
        n_tensors,  # number of tensors in the table
        scale_ptr,  # float32* device scale, read when SCALE_FROM_PTR
        scale,  # float scale, used otherwise
        found_inf_ptr,  # float32* set to 1.0 on any inf/NaN in src, when CHECK_FINITE
        SRC_DTYPE: tl.constexpr,  # pointee dtype of every src in this launch
        SCALE_FROM_PTR: tl.constexpr,
        OVERWRITE: tl.constexpr,  # write scale*src without reading dst
        CHECK_FINITE: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # ceil(log2(n_tensors)): binary-search iterations
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        # Largest t with first_block[t] <= pid (invariant: first_block[lo] <= pid < first_block[hi]).
        lo = 0
        hi = n_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(table_ptr + 3 * n_tensors + mid) <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        dst = tl.load(table_ptr + lo).to(tl.pointer_type(tl.float32))
        src = tl.load(table_ptr + n_tensors + lo).to(tl.pointer_type(SRC_DTYPE))
        numel = tl.load(table_ptr + 2 * n_tensors + lo)
        first_block = tl.load(table_ptr + 3 * n_tensors + lo)

        offsets = (pid - first_block).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < numel
        x = tl.load(src + offsets, mask=mask, other=0.0).to(tl.float32)
        if SCALE_FROM_PTR:
            s = tl.load(scale_ptr).to(tl.float32)
        else:
            s = tl.cast(scale, tl.float32)  # fp64 under Inductor: force fp32 math
        if OVERWRITE:
            y = x * s
        else:
            y = tl.load(dst + offsets, mask=mask) + x * s
        tl.store(dst + offsets, y, mask=mask)
        if CHECK_FINITE:
            bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=0)
            if bad > 0:
                tl.store(found_inf_ptr, 1.0)


def _launch(dst, src, scale, scale_tensor, overwrite, found_inf) -> None:
    device = dst[0].device
    numels = [d.numel() for d in dst]
    first_blocks, total = [], 0
    for n in numels:
        first_blocks.append(total)
        total += triton.cdiv(n, BLOCK)
    table = torch.tensor(
        [[d.data_ptr() for d in dst], [x.data_ptr() for x in src], numels, first_blocks],
        dtype=torch.int64,
    )
    if device.type != "cpu":
        host = table.pin_memory()
        table = host.to(device, non_blocking=True)
        if torch.cuda.is_current_stream_capturing():
            # The captured copy re-reads `host` on every replay, and the kernel reads `table`:
            # both must outlive the graph (a small, bounded leak per captured call).
            _CAPTURED_TABLES.append((host, table))
    n = len(dst)
    _accumulate_kernel[(total,)](
        table,
        n,
        scale_tensor if scale_tensor is not None else table,
        float(scale),
        found_inf if found_inf is not None else table,
        SRC_DTYPE=_TL_DTYPES[src[0].dtype],
        SCALE_FROM_PTR=scale_tensor is not None,
        OVERWRITE=bool(overwrite),
        CHECK_FINITE=found_inf is not None,
        SEARCH_STEPS=max(1, (n - 1).bit_length()),
        BLOCK=BLOCK,
        num_warps=NUM_WARPS,
    )


def accumulate(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
) -> None:
    groups: dict[torch.dtype, tuple[list, list]] = {}
    for d, x in zip(dst, src):
        gd, gs = groups.setdefault(x.dtype, ([], []))
        gd.append(d)
        gs.append(x)
    for gd, gs in groups.values():
        _launch(gd, gs, scale, scale_tensor, overwrite, found_inf)
