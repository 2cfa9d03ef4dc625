"""Triton backend: one launch per source dtype for a whole tensor list.

The host builds a small int64 table per call: for every tensor its element offsets from two base
pointers (one dst and one src of the launch, chosen 16-byte aligned), its size, its first block
and whether both its pointers are 16-byte aligned. Every program finds its tensor by binary
search in the block prefix sums. A full block of an aligned pair takes a path with alignment
hints and no mask, which Triton compiles to 16-byte loads and stores; tails and unaligned views
take the masked path. Runs on CUDA tensors (launched on their device, on its current stream),
and on CPU tensors under ``TRITON_INTERPRET=1`` (tests only). With ``norm_sq`` the table gets a
sixth row (each tensor's norm slot), the launch's slots are zeroed (``index_fill_``, one small
launch) and each program atomically adds its block's sum of squares (``accumulate_norm_kernel``;
the plain kernel is unchanged). ``resync_masters_`` uses the same table and the same two paths.
Launches pass ``enable_fp_fusion=False``: the one multiply-add is an explicit ``tl.fma``, as the
CUDA kernel's ``fmaf``, so both backends give the same bits whatever Triton's default.

This module is the host side (tuning knobs, launch tables, their upload, the launches); the
``@triton.jit`` kernels are in triton_kernels.py.
"""

from __future__ import annotations

import torch

from accumkernels._util import on_device, triton_usable
from accumkernels.ops.backends import triton_kernels
from accumkernels.ops.backends.triton_kernels import triton

if triton is not None:  # module names of the launches: tests patch them, sass_check compiles them
    _accumulate_kernel = triton_kernels.accumulate_kernel
    _accumulate_norm_kernel = triton_kernels.accumulate_norm_kernel
    _resync_kernel = triton_kernels.resync_kernel

# Elements per program: 4096 fp32 = 16 KB of dst per program, enough to hide latency with
# 4 warps while keeping the tail of small tensors short. Read at every launch, so a tuning
# script may set them.
BLOCK = 4096
NUM_WARPS = 4
TAIL = 512  # elements per step of the masked path (see triton_kernels.py)
# bf16/fp16 source elements per hinted access: 8 = 16-byte loads, whose layout Triton converts
# to the fp32 dst's through shared memory (50-56 registers on sm_90); 4 = 8-byte loads in the dst's
# own layout (no shared memory, 32-35 registers). A tuning knob: see benchmarks/NOTES.md.
HALF_SRC_VEC = 8
ALIGN = 16  # bytes: one 128-bit access
# Every launch names its contraction setting (Triton's default changes in 3.10): off, so the only
# FMAs are the kernel's explicit tl.fma and the bits do not depend on the Triton version.
FP_FUSION = False

# Pointer tables of launches captured in CUDA graphs. A captured launch re-reads its table on
# every replay, and its host-to-device copy re-reads the pinned host buffer, so both must live
# as long as the graph. They are tied to the graph object (attribute below): freed with it. A
# capture that torch did not start has no graph object; its tables go to _UNOWNED, keyed by
# content (capturing the same list again reuses them) and bounded by _UNOWNED_LIMIT bytes.
# Pinning the host side during a capture needs torch's capture-aware pinned allocator (blocks
# allocated while capturing are never handed out again while a graph may read them): torch 2.11
# has it (ATen/core/CachingHostAllocator.h, was_allocated_during_stream_capture_); an older torch
# fails the pin with "operation not permitted when stream is capturing", which invalidates the
# whole capture, so upload_table refuses first (2.10 is not verified: refused too).
_PIN_IN_CAPTURE_SINCE = (2, 11)
_GRAPH_ATTR = "_accumkernels_triton_tables"
_UNOWNED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_UNOWNED_LIMIT = 64 << 20


def is_available(device: torch.device) -> bool:
    return triton is not None and triton_usable(device)


def resync_masters(masters: list[torch.Tensor], weights: list[torch.Tensor]) -> None:
    """fp32 ``masters[i]`` take ``weights[i]`` (one bf16 or fp16 dtype) wherever the weight
    differs from the master rounded to its dtype (NaN differs): one launch, no temporaries."""
    pairs = [(m, w) for m, w in zip(masters, weights) if w.numel()]
    if not pairs:
        return
    block = 1024
    rows, b_m, b_w, total = _table(pairs, block)
    device = pairs[0][0].device
    with on_device(device):
        table = upload_table(torch.tensor(rows, dtype=torch.int64), device, "resync_masters_")
        _resync_kernel[(total,)](table, len(pairs), pairs[b_m][0], pairs[b_w][1],
                                 SEARCH_STEPS=max(1, (len(pairs) - 1).bit_length()),
                                 BF16=pairs[0][1].dtype == torch.bfloat16, BLOCK=block,
                                 num_warps=NUM_WARPS, enable_fp_fusion=FP_FUSION)


def _capturing_graph():
    """The torch.cuda.CUDAGraph being captured on the current stream, or None when torch did not
    start the capture (or this torch cannot say)."""
    getter = getattr(torch.cuda.CUDAGraph, "get_currently_capturing_graph", None)
    if getter is None:
        return None
    try:
        graph = getter()
    except RuntimeError:
        return None
    return graph if hasattr(graph, "__dict__") else None


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


def upload_table(table: torch.Tensor, device: torch.device, op: str) -> torch.Tensor:
    """A launch's int64 ``table`` (CPU) on ``device``, in stream order (call it with ``device``
    current: see on_device). Outside a capture a pinned copy, which the caching allocators keep
    alive until the stream has used it; during a capture a pinned copy kept alive with the graph
    (``_captured_table``), refused cleanly where the torch cannot pin while capturing. CPU
    (interpreter): the table itself."""
    if device.type == "cpu":
        return table
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing and _torch_version() < _PIN_IN_CAPTURE_SINCE:
        raise RuntimeError(
            f"{op}(backend='triton') cannot be captured in a CUDA graph on torch "
            f"{torch.__version__}: its launch table is uploaded from pinned memory, which this "
            "torch cannot allocate while a stream is capturing (torch >= "
            f"{'.'.join(map(str, _PIN_IN_CAPTURE_SINCE))} can); use backend='cuda' or run it "
            "outside the capture")
    host = table.pin_memory()
    if capturing:
        return _captured_table(host.view(1, -1), device, op).view(table.shape)
    return host.to(device, non_blocking=True)


def _captured_table(host: torch.Tensor, device: torch.device, op: str = "accumulate_"
                    ) -> torch.Tensor:
    """Upload ``host`` (pinned) during a capture, keeping what replays read alive (see above)."""
    graph = _capturing_graph()
    if graph is not None:
        table = host.to(device, non_blocking=True)
        graph.__dict__.setdefault(_GRAPH_ATTR, []).append((host, table))
        return table
    key = (device.index, host.shape[1], tuple(host.view(-1).tolist()))
    kept = _UNOWNED.get(key)
    if kept is None:
        used = sum(h.nbytes for h, _ in _UNOWNED.values())
        if used + host.nbytes > _UNOWNED_LIMIT:
            raise RuntimeError(
                f"{op}(backend='triton'): more than "
                f"{_UNOWNED_LIMIT >> 20} MiB of pointer tables captured by CUDA graphs that "
                "torch.cuda.CUDAGraph does not own (they cannot be freed). Capture with "
                "torch.cuda.graph / CUDAGraph, or use backend='cuda'.")
        kept = _UNOWNED[key] = (host, torch.empty(host.shape, dtype=host.dtype, device=device))
    kept[1].copy_(kept[0], non_blocking=True)  # re-written by every replay of this graph
    return kept[1]


def _table(pairs: list[tuple[torch.Tensor, torch.Tensor]], block: int
           ) -> tuple[list[list[int]], int, int, int]:
    """The launch table's rows (see triton_kernels.accumulate_kernel), the indices of the dst and
    src used as bases, and the number of blocks. Bases: an aligned dst and an aligned src when
    there are (every tensor of a fresh allocation is), so that for an aligned pair "offset is a
    multiple of 16 bytes" and "address is aligned" say the same; the hints rely on it."""
    dst_ptrs = [d.data_ptr() for d, _ in pairs]
    src_ptrs = [x.data_ptr() for _, x in pairs]
    itemsize = pairs[0][1].element_size()
    b_dst = next((i for i, p in enumerate(dst_ptrs) if p % ALIGN == 0), 0)
    b_src = next((i for i, p in enumerate(src_ptrs) if p % ALIGN == 0), 0)
    base_d, base_s = dst_ptrs[b_dst], src_ptrs[b_src]
    bases_aligned = base_d % ALIGN == 0 and base_s % ALIGN == 0
    rows: list[list[int]] = [[], [], [], [], []]
    total = 0
    for i, (pd, ps) in enumerate(zip(dst_ptrs, src_ptrs)):
        if (pd - base_d) % 4 or (ps - base_s) % itemsize:
            raise ValueError(f"accumulate_: tensor {i}'s data is not aligned to its element size")
        numel = pairs[i][0].numel()
        rows[0].append((pd - base_d) // 4)
        rows[1].append((ps - base_s) // itemsize)
        rows[2].append(numel)
        rows[3].append(total)
        rows[4].append(int(bases_aligned and pd % ALIGN == 0 and ps % ALIGN == 0))
        total += -(-numel // block)
    return rows, b_dst, b_src, total


def _launch(dst, src, scale, scale_tensor, overwrite, found_inf, norm_sq, slots) -> None:
    """One launch for a list of one src dtype (non-empty tensors; with norm_sq, one slot each):
    norm_sq's slots are zeroed first, in stream order, then the programs atomically add to them.
    """
    pairs = list(zip(dst, src))
    if not pairs:
        return
    device = pairs[0][0].device
    block = BLOCK
    rows, b_dst, b_src, total = _table(pairs, block)
    if norm_sq is not None:
        rows.append(list(slots))
    n = len(pairs)
    with on_device(device):
        table = upload_table(torch.tensor(rows, dtype=torch.int64), device, "accumulate_")
        head = (table, n, pairs[b_dst][0], pairs[b_src][1],
                scale_tensor if scale_tensor is not None else table, float(scale),
                found_inf if found_inf is not None else table)
        if norm_sq is None:
            kernel = _accumulate_kernel
        else:
            norm_sq.index_fill_(0, table[5], 0.0)
            kernel, head = _accumulate_norm_kernel, (*head, norm_sq)
        kernel[(total,)](
            *head,
            SCALE_FROM_PTR=scale_tensor is not None,
            OVERWRITE=bool(overwrite),
            CHECK_FINITE=found_inf is not None,
            SEARCH_STEPS=max(1, (n - 1).bit_length()),
            SRC_VEC=HALF_SRC_VEC if pairs[0][1].element_size() == 2 else 4,
            BLOCK=block,
            TAIL=min(TAIL, block),
            num_warps=NUM_WARPS,
            enable_fp_fusion=FP_FUSION,
        )


def accumulate(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
    norm_sq: torch.Tensor | None = None,
    norm_slots: list[int] | None = None,
) -> None:
    groups: dict[torch.dtype, tuple[list, list, list]] = {}
    slots = norm_slots if norm_slots is not None else range(len(dst))
    for d, x, k in zip(dst, src, slots):
        gd, gs, gk = groups.setdefault(x.dtype, ([], [], []))
        gd.append(d)
        gs.append(x)
        gk.append(k)
    for gd, gs, gk in groups.values():
        _launch(gd, gs, scale, scale_tensor, overwrite, found_inf, norm_sq, gk)
