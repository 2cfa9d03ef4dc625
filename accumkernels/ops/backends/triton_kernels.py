"""The Triton kernels of the accumulate op and of ``resync_masters_`` (the host side, the launch
table's layout and the tuning knobs: triton.py). ``accumulate_kernel``, ``accumulate_norm_kernel``
and ``resync_kernel`` are the launches; the rest are their pieces: finding a program's tensor, one
block of the accumulation, one block of the re-sync."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional
    triton = None


if triton is not None:

    @triton.jit
    def _accumulate_block(
        d_ptrs,  # float32 pointers of this block's dst elements
        x_ptrs,  # source pointers of the same elements
        mask,  # lanes in range (MASKED only)
        s,  # fp32 scale
        found_inf_ptr,
        MASKED: tl.constexpr,
        OVERWRITE: tl.constexpr,
        CHECK_FINITE: tl.constexpr,
        NORM: tl.constexpr,  # return the sum of squares of the written values
    ):
        if MASKED:
            x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_ptrs).to(tl.float32)
        # An explicit fma (one rounding), as the CUDA kernel's fmaf: not left to Triton's
        # contraction, which the launches turn off (triton.FP_FUSION) and Triton 3.10 turns off
        # anyway.
        if OVERWRITE:
            y = x * s
        elif MASKED:
            y = tl.fma(x, s, tl.load(d_ptrs, mask=mask))
        else:
            y = tl.fma(x, s, tl.load(d_ptrs))
        if MASKED:
            tl.store(d_ptrs, y, mask=mask)
        else:
            tl.store(d_ptrs, y)
        if CHECK_FINITE:  # on the result: a non-finite src, or an overflowed sum
            nonfinite = (y != y) | (tl.abs(y) == float("inf"))  # noqa: PLR0124
            if MASKED:
                nonfinite = nonfinite & mask
            bad = tl.max(nonfinite.to(tl.int32), axis=0)
            if bad > 0:
                tl.store(found_inf_ptr, 1.0)
        sq = 0.0
        if NORM:
            y2 = y * y
            if MASKED:
                y2 = tl.where(mask, y2, 0.0)
            sq = tl.sum(y2, axis=0)
        return sq

    @triton.jit
    def _find_tensor(table_ptr, n_tensors, pid, SEARCH_STEPS: tl.constexpr):
        """The table row of program ``pid``: the largest t with first_block[t] <= pid (binary
        search, first_block[lo] <= pid < first_block[hi])."""
        lo = 0
        hi = n_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(table_ptr + 3 * n_tensors + mid) <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        return lo

    @triton.jit
    def _accumulate_body(table_ptr, n_tensors, dst_base, src_base, scale_ptr, scale, found_inf_ptr,
                         norm_ptr, SCALE_FROM_PTR: tl.constexpr, OVERWRITE: tl.constexpr,
                         CHECK_FINITE: tl.constexpr, NORM: tl.constexpr,
                         SEARCH_STEPS: tl.constexpr, SRC_VEC: tl.constexpr, BLOCK: tl.constexpr,
                         TAIL: tl.constexpr):
        """One program (see accumulate_kernel); NORM: atomically adds its block's sum of
        squares to norm_ptr[table[5, tensor]] (zeroed before the launch)."""
        pid = tl.program_id(0)
        lo = _find_tensor(table_ptr, n_tensors, pid, SEARCH_STEPS)
        dst_off = tl.load(table_ptr + lo)
        src_off = tl.load(table_ptr + n_tensors + lo)
        numel = tl.load(table_ptr + 2 * n_tensors + lo)
        first_block = tl.load(table_ptr + 3 * n_tensors + lo)
        aligned = tl.load(table_ptr + 4 * n_tensors + lo)

        if SCALE_FROM_PTR:
            s = tl.load(scale_ptr).to(tl.float32)
        else:
            s = tl.cast(scale, tl.float32)  # fp64 under Inductor: force fp32 math
        start = (pid - first_block).to(tl.int64) * BLOCK
        lanes = tl.arange(0, BLOCK)
        sq = tl.zeros((), dtype=tl.float32)
        if (aligned != 0) & (start + BLOCK <= numel):
            # A full block of a 16-byte-aligned pair (the bases are aligned too: triton._table):
            # the hints are true, and with no mask Triton issues 128-bit accesses.
            d_first = tl.multiple_of(dst_off + start, 4)  # 4 fp32 = 16 bytes
            x_first = tl.multiple_of(src_off + start, SRC_VEC)
            part = _accumulate_block(dst_base + d_first + lanes, src_base + x_first + lanes, None,
                                     s, found_inf_ptr, False, OVERWRITE, CHECK_FINITE, NORM)
            if NORM:
                sq += part
        else:  # the last block of a tensor, or a view at an unaligned address
            # In slices of TAIL elements: scalar accesses need a pointer per element, and a whole
            # block of them would set the register count of the entire kernel.
            for k in range(0, BLOCK, TAIL):
                if start + k < numel:  # a short tensor's block skips its empty slices
                    offsets = start + k + tl.arange(0, TAIL)
                    part = _accumulate_block(dst_base + dst_off + offsets,
                                             src_base + src_off + offsets, offsets < numel, s,
                                             found_inf_ptr, True, OVERWRITE, CHECK_FINITE, NORM)
                    if NORM:
                        sq += part
        if NORM:
            tl.atomic_add(norm_ptr + tl.load(table_ptr + 5 * n_tensors + lo), sq)

    @triton.jit
    def accumulate_kernel(
        table_ptr,  # int64 [5, n_tensors]: dst offset, src offset (elements from the bases),
        # numel, first block id, 1 if both pointers are 16-byte aligned (else 0)
        n_tensors,  # number of tensors in the table
        dst_base,  # float32*: a dst of this launch (16-byte aligned if any is); dst i is at
        # dst_base + table[0, i]
        src_base,  # source dtype*: the same for src (table[1, i])
        scale_ptr,  # float32* device scale, read when SCALE_FROM_PTR
        scale,  # float scale, used otherwise
        found_inf_ptr,  # float32* set to 1.0 on any inf/NaN result, when CHECK_FINITE
        SCALE_FROM_PTR: tl.constexpr,
        OVERWRITE: tl.constexpr,  # write scale*src without reading dst
        CHECK_FINITE: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,  # ceil(log2(n_tensors)): binary-search iterations
        SRC_VEC: tl.constexpr,  # source elements the hinted path may load at once (<= 16 bytes)
        BLOCK: tl.constexpr,
        TAIL: tl.constexpr,  # elements per step of the masked path (divides BLOCK)
    ):
        _accumulate_body(table_ptr, n_tensors, dst_base, src_base, scale_ptr, scale,
                         found_inf_ptr, found_inf_ptr, SCALE_FROM_PTR, OVERWRITE, CHECK_FINITE,
                         False, SEARCH_STEPS, SRC_VEC, BLOCK, TAIL)

    @triton.jit
    def accumulate_norm_kernel(
        table_ptr,  # int64 [6, n_tensors]: accumulate_kernel's rows, then each one's norm slot
        n_tensors, dst_base, src_base, scale_ptr, scale, found_inf_ptr,
        norm_ptr,  # float32*: norm_ptr[slot] += sum of squares of the written values
        SCALE_FROM_PTR: tl.constexpr, OVERWRITE: tl.constexpr, CHECK_FINITE: tl.constexpr,
        SEARCH_STEPS: tl.constexpr, SRC_VEC: tl.constexpr, BLOCK: tl.constexpr,
        TAIL: tl.constexpr,
    ):
        _accumulate_body(table_ptr, n_tensors, dst_base, src_base, scale_ptr, scale,
                         found_inf_ptr, norm_ptr, SCALE_FROM_PTR, OVERWRITE, CHECK_FINITE, True,
                         SEARCH_STEPS, SRC_VEC, BLOCK, TAIL)

    @triton.jit
    def _resync_block(m_ptrs, w_ptrs, mask, MASKED: tl.constexpr, BF16: tl.constexpr):
        """The masters at ``m_ptrs`` take the weights at ``w_ptrs`` where they differ from the
        master rounded to the weight dtype (MASKED: only the lanes in ``mask``)."""
        if MASKED:
            m = tl.load(m_ptrs, mask=mask, other=0.0)
            w = tl.load(w_ptrs, mask=mask, other=0.0)
        else:
            m = tl.load(m_ptrs)
            w = tl.load(w_ptrs)
        if BF16:  # in integer arithmetic, exact everywhere (the interpreter's casts are not)
            u = m.to(tl.uint32, bitcast=True)
            r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000  # nearest even, as torch
            rounded = tl.where(m != m, m, r.to(tl.float32, bitcast=True))
            wide = (w.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                          bitcast=True)
        else:
            rounded = m.to(tl.float16).to(tl.float32)  # nearest even, as torch
            wide = w.to(tl.float32)
        # Written only where the weight differs (a store per lane: the loads carry the bandwidth).
        taken = wide != rounded
        if MASKED:
            taken = taken & mask
        tl.store(m_ptrs, wide, mask=taken)

    @triton.jit
    def resync_kernel(
        table_ptr,  # int64 [5, n_tensors]: master offset, weight offset (elements from the
        # bases), numel, first block id, 1 if both pointers are 16-byte aligned (else 0)
        n_tensors,  # number of pairs in the table
        m_base,  # float32*: a master of this launch (16-byte aligned if any is)
        w_base,  # bf16/fp16*: a weight of this launch, the same
        SEARCH_STEPS: tl.constexpr,  # ceil(log2(n_tensors)): binary-search iterations
        BF16: tl.constexpr,  # weights are bf16 (else fp16)
        BLOCK: tl.constexpr,
    ):
        """One program: a block of one (fp32 master, bf16/fp16 weight) pair; the master takes
        the weight where the weight differs from the master rounded to its dtype. A full block
        of an aligned pair takes the hinted, unmasked path: 16-byte loads of both."""
        pid = tl.program_id(0)
        lo = _find_tensor(table_ptr, n_tensors, pid, SEARCH_STEPS)
        m_off = tl.load(table_ptr + lo)
        w_off = tl.load(table_ptr + n_tensors + lo)
        numel = tl.load(table_ptr + 2 * n_tensors + lo)
        first_block = tl.load(table_ptr + 3 * n_tensors + lo)
        aligned = tl.load(table_ptr + 4 * n_tensors + lo)
        start = (pid - first_block).to(tl.int64) * BLOCK
        lanes = tl.arange(0, BLOCK)
        if (aligned != 0) & (start + BLOCK <= numel):
            m_first = tl.multiple_of(m_off + start, 4)  # 4 fp32 = 16 bytes
            w_first = tl.multiple_of(w_off + start, 8)  # 8 bf16/fp16 = 16 bytes
            _resync_block(m_base + m_first + lanes, w_base + w_first + lanes, None, False, BF16)
        else:  # the last block of a pair, or a view at an unaligned address
            offsets = start + lanes
            _resync_block(m_base + m_off + offsets, w_base + w_off + offsets, offsets < numel,
                          True, BF16)
