"""The Triton kernels of the fused master step (the host side, the arithmetic notes and the
table layout: master_step_triton.py). ``master_step_kernel`` is the launch; the rest are its
pieces: finding a program's tensor, the scalars, pow, bf16/fp16 bits, the update of a block."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # triton is optional
    triton = None


if triton is not None:

    @triton.jit
    def _find_tensor(table_ptr, n_tensors, pid, SEARCH_STEPS: tl.constexpr):
        """The largest t with first_block[t] <= pid (binary search)."""
        lo = 0
        hi = n_tensors
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(table_ptr + 8 * n_tensors + mid) <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        return lo

    @triton.jit
    def _scalar(table_ptr, n_tensors, k):
        """The table's k-th float64 scalar (stored as its bits)."""
        return tl.load(table_ptr + 10 * n_tensors + k).to(tl.float64, bitcast=True)  # after ROWS

    @triton.jit
    def _pow(b, s, LIBDEVICE: tl.constexpr):
        """b ** s: libdevice's pow (torch's) on the GPU; under the interpreter (no libdevice)
        float64 squaring for an integer step, rounded to b's dtype."""
        if LIBDEVICE:
            r = libdevice.pow(b, s.to(b.dtype))
        else:
            n = s.to(tl.int64)
            acc = tl.full((), 1.0, tl.float64)
            base = b.to(tl.float64)
            for _ in tl.static_range(40):
                acc = tl.where((n & 1) == 1, acc * base, acc)
                base = base * base
                n = n >> 1
            r = acc.to(b.dtype)
        return r

    @triton.jit
    def _widen(bits, BF16: tl.constexpr):
        if BF16:
            x = (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32,
                                                                          bitcast=True)
        else:
            x = bits.to(tl.float16, bitcast=True).to(tl.float32)
        return x

    @triton.jit
    def _round(x, BF16: tl.constexpr):
        """fp32 -> bf16/fp16 bits (int16): nearest even, NaN -> 0x7fff."""
        if BF16:
            u = x.to(tl.uint32, bitcast=True)
            r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16)
        else:
            r = x.to(tl.float16).to(tl.uint16, bitcast=True)
        r = tl.where(x != x, 0x7FFF, r)  # noqa: PLR0124
        return r.to(tl.int16, bitcast=True)

    @triton.jit
    def _update(p, g, s0, s1, s2, scale, lr64, wd64, b1, b2, eps, mom, damp, bc1, bc2s, ss,
                lr32, b1_32, b2_32, wd32, eps32,
                ALGO: tl.constexpr, HAS_SCALE: tl.constexpr, MAXIMIZE: tl.constexpr,
                ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, MOMENTUM: tl.constexpr,
                FIRST: tl.constexpr, NESTEROV: tl.constexpr):
        """One block's update (the formulas of csrc/master_step_kernel.h); returns
        (p, g to store, s0, s1, s2)."""
        if HAS_SCALE:
            g = tl.div_rn(g, scale)
        gs = g
        if MAXIMIZE:
            g = -g
        if ALGO == 0:  # SGD
            if wd64 != 0.0:
                g = tl.fma(p.to(tl.float64), wd64, g.to(tl.float64)).to(tl.float32)
            if MOMENTUM:
                if FIRST:
                    b = g.to(tl.float64)
                else:
                    b = tl.fma(1.0 - damp, g.to(tl.float64), mom * s0.to(tl.float64))
                s0 = b.to(tl.float32)
                if NESTEROV:
                    g = tl.fma(b, mom, g.to(tl.float64)).to(tl.float32)
                else:
                    g = b.to(tl.float32)
            p = tl.fma(-lr64, g.to(tl.float64), p.to(tl.float64)).to(tl.float32)
        elif ALGO == 1:  # Adam, torch <= 2.10: double scalars
            if wd64 != 0.0:
                if ADAMW:
                    p = tl.fma(-(lr64 * wd64), p.to(tl.float64), p.to(tl.float64)).to(tl.float32)
                else:
                    g = tl.fma(p.to(tl.float64), wd64, g.to(tl.float64)).to(tl.float32)
            g64 = g.to(tl.float64)
            s0 = tl.fma(b1, s0.to(tl.float64), (1.0 - b1) * g64).to(tl.float32)
            s1 = tl.fma(b2, s1.to(tl.float64), ((1.0 - b2) * g64) * g64).to(tl.float32)
            u = s1
            if AMSGRAD:
                s2 = tl.where(s2 < s1, s1, s2)
                u = s2
            d = (tl.div_rn(tl.sqrt_rn(u), bc2s).to(tl.float64) + eps).to(tl.float32)
            p = p - tl.div_rn(ss * s0, d)
        else:  # Adam, torch >= 2.11: fp32 with explicit fma
            if wd32 != 0.0:
                if ADAMW:
                    p = tl.fma(-(lr32 * wd32), p, p)
                else:
                    g = tl.fma(p, wd32, g)
            s0 = tl.fma(b1_32, s0, tl.fma(-b1_32, g, g))
            g2 = g * g
            s1 = tl.fma(b2_32, s1, tl.fma(-b2_32, g2, g2))
            u = s1
            if AMSGRAD:
                s2 = tl.where(s2 < s1, s1, s2)
                u = s2
            d = tl.div_rn(tl.sqrt_rn(u), bc2s) + eps32
            p = p - tl.div_rn(ss * s0, d)
        return p, gs, s0, s1, s2

    @triton.jit
    def _step_block(m_ptrs, w_ptrs, g_ptrs, s0_ptrs, s1_ptrs, s2_ptrs, mask,
                    scale, lr64, wd64, b1, b2, eps, mom, damp, bc1, bc2s, ss, lr32, b1_32, b2_32,
                    wd32, eps32, ALGO: tl.constexpr, BF16: tl.constexpr, HAS_SCALE: tl.constexpr,
                    STORE_GRAD: tl.constexpr, MAXIMIZE: tl.constexpr, ADAMW: tl.constexpr,
                    AMSGRAD: tl.constexpr, MOMENTUM: tl.constexpr, FIRST: tl.constexpr,
                    NESTEROV: tl.constexpr, MASKED: tl.constexpr):
        """Load, resync, update and store one block (mask: lanes in range, MASKED only)."""
        p = tl.load(m_ptrs, mask=mask, other=0.0) if MASKED else tl.load(m_ptrs)
        g = tl.load(g_ptrs, mask=mask, other=0.0) if MASKED else tl.load(g_ptrs)
        wb = tl.load(w_ptrs, mask=mask, other=0) if MASKED else tl.load(w_ptrs)
        w = _widen(wb, BF16)
        s0 = p
        s1 = p
        s2 = p
        if ALGO != 0 or MOMENTUM:
            s0 = tl.load(s0_ptrs, mask=mask, other=0.0) if MASKED else tl.load(s0_ptrs)
        if ALGO != 0:
            s1 = tl.load(s1_ptrs, mask=mask, other=0.0) if MASKED else tl.load(s1_ptrs)
            if AMSGRAD:
                s2 = tl.load(s2_ptrs, mask=mask, other=0.0) if MASKED else tl.load(s2_ptrs)
        p = tl.where(w != _widen(_round(p, BF16), BF16), w, p)  # resync; NaN differs
        p, gs, s0, s1, s2 = _update(p, g, s0, s1, s2, scale, lr64, wd64, b1, b2, eps, mom, damp,
                                    bc1, bc2s, ss, lr32, b1_32, b2_32, wd32, eps32, ALGO,
                                    HAS_SCALE, MAXIMIZE, ADAMW, AMSGRAD, MOMENTUM, FIRST,
                                    NESTEROV)
        tl.store(m_ptrs, p, mask=mask)
        tl.store(w_ptrs, _round(p, BF16), mask=mask)
        if STORE_GRAD:
            tl.store(g_ptrs, gs, mask=mask)
        if ALGO != 0 or MOMENTUM:
            tl.store(s0_ptrs, s0, mask=mask)
        if ALGO != 0:
            tl.store(s1_ptrs, s1, mask=mask)
            if AMSGRAD:
                tl.store(s2_ptrs, s2, mask=mask)

    @triton.jit
    def _bias_corrections(step_ptr, lr64, b1, b2, lr32, b1_32, b2_32, ALGO: tl.constexpr,
                          LIBDEVICE: tl.constexpr):
        """Adam's 1 - beta1^step, sqrt(1 - beta2^step) and lr / (1 - beta1^step), in torch's
        fp64 form (ALGO 1) or fp32 form (ALGO 2); 1.0 for SGD."""
        bc1 = 1.0
        bc2s = 1.0
        ss = 1.0
        if ALGO == 1:
            step = tl.load(step_ptr).to(tl.float64)
            bc1 = (1.0 - _pow(b1, step, LIBDEVICE)).to(tl.float32)
            bc2s = tl.sqrt(1.0 - _pow(b2, step, LIBDEVICE)).to(tl.float32)  # sqrt.rn.f64
            ss = (lr64 / bc1.to(tl.float64)).to(tl.float32)  # div.rn.f64
        elif ALGO == 2:
            step = tl.load(step_ptr)
            bc1 = 1.0 - _pow(b1_32, step, LIBDEVICE)
            bc2s = tl.sqrt_rn(1.0 - _pow(b2_32, step, LIBDEVICE))
            ss = tl.div_rn(lr32, bc1)
        return bc1, bc2s, ss

    @triton.jit
    def master_step_kernel(
        table_ptr,  # int64 [ROWS, n] (offsets from the bases, numel, first block, aligned), then
        # 7 float64 scalars as bits: lr, beta1, beta2, weight_decay, eps, momentum, dampening
        n_tensors,
        m_base, w_base, g_base, s0_base, s1_base, s2_base, step_base,  # one tensor of each list
        # (w_base: the weights as int16); array i of list X is at X_base + table[X, i]
        lr_ptr,  # the lr (any float dtype, read as float32 like torch's), when LR_FROM_PTR
        scale_ptr,  # float32*: grad_scale, when HAS_SCALE
        found_inf_ptr,  # float32*: nonzero (2.0 too, unlike torch) -> nothing written
        ALGO: tl.constexpr, BF16: tl.constexpr, HAS_SCALE: tl.constexpr,
        STORE_GRAD: tl.constexpr, LR_FROM_PTR: tl.constexpr, HAS_FOUND_INF: tl.constexpr,
        MAXIMIZE: tl.constexpr, ADAMW: tl.constexpr, AMSGRAD: tl.constexpr,
        MOMENTUM: tl.constexpr, FIRST: tl.constexpr, NESTEROV: tl.constexpr,
        LIBDEVICE: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK: tl.constexpr,
    ):
        ok = True
        if HAS_FOUND_INF:
            ok = tl.load(found_inf_ptr) == 0.0
        if ok:
            pid = tl.program_id(0)
            lo = _find_tensor(table_ptr, n_tensors, pid, SEARCH_STEPS)
            numel = tl.load(table_ptr + 7 * n_tensors + lo)
            start = (pid - tl.load(table_ptr + 8 * n_tensors + lo)).to(tl.int64) * BLOCK
            lanes = tl.arange(0, BLOCK)
            full = (tl.load(table_ptr + 9 * n_tensors + lo) != 0) & (start + BLOCK <= numel)
            m_off = tl.load(table_ptr + lo)
            w_off = tl.load(table_ptr + n_tensors + lo)
            g_off = tl.load(table_ptr + 2 * n_tensors + lo)
            s0_off = tl.load(table_ptr + 3 * n_tensors + lo)
            s1_off = tl.load(table_ptr + 4 * n_tensors + lo)
            s2_off = tl.load(table_ptr + 5 * n_tensors + lo)

            lr64 = _scalar(table_ptr, n_tensors, 0)
            if LR_FROM_PTR:
                lr64 = tl.load(lr_ptr).to(tl.float32).to(tl.float64)  # as the CUDA kernel
            b1 = _scalar(table_ptr, n_tensors, 1)
            b2 = _scalar(table_ptr, n_tensors, 2)
            wd64 = _scalar(table_ptr, n_tensors, 3)
            eps = _scalar(table_ptr, n_tensors, 4)
            mom = _scalar(table_ptr, n_tensors, 5)
            damp = _scalar(table_ptr, n_tensors, 6)
            scale = 1.0
            if HAS_SCALE:
                scale = tl.load(scale_ptr)
            lr32 = lr64.to(tl.float32)
            b1_32 = b1.to(tl.float32)
            b2_32 = b2.to(tl.float32)
            wd32 = wd64.to(tl.float32)
            eps32 = eps.to(tl.float32)
            bc1, bc2s, ss = _bias_corrections(
                step_base + tl.load(table_ptr + 6 * n_tensors + lo), lr64, b1, b2, lr32, b1_32,
                b2_32, ALGO, LIBDEVICE)

            if full:  # a whole block of an aligned tensor: no mask, 16-byte accesses
                _step_block(m_base + tl.multiple_of(m_off + start, 4) + lanes,
                            w_base + tl.multiple_of(w_off + start, 4) + lanes,
                            g_base + tl.multiple_of(g_off + start, 4) + lanes,
                            s0_base + tl.multiple_of(s0_off + start, 4) + lanes,
                            s1_base + tl.multiple_of(s1_off + start, 4) + lanes,
                            s2_base + tl.multiple_of(s2_off + start, 4) + lanes, None,
                            scale, lr64, wd64, b1, b2, eps, mom, damp, bc1, bc2s, ss, lr32, b1_32,
                            b2_32, wd32, eps32, ALGO, BF16, HAS_SCALE, STORE_GRAD, MAXIMIZE,
                            ADAMW, AMSGRAD, MOMENTUM, FIRST, NESTEROV, False)
            else:  # the last block of a tensor, or a view at an unaligned address
                off = start + lanes
                _step_block(m_base + m_off + off, w_base + w_off + off, g_base + g_off + off,
                            s0_base + s0_off + off, s1_base + s1_off + off,
                            s2_base + s2_off + off, off < numel,
                            scale, lr64, wd64, b1, b2, eps, mom, damp, bc1, bc2s, ss, lr32, b1_32,
                            b2_32, wd32, eps32, ALGO, BF16, HAS_SCALE, STORE_GRAD, MAXIMIZE,
                            ADAMW, AMSGRAD, MOMENTUM, FIRST, NESTEROV, True)

    @triton.jit
    def pow_probe_kernel(b_ptr, s_ptr, o_ptr):
        """``_pow`` alone (libdevice), for tests/op/test_master_step_triton.py's PTX check."""
        tl.store(o_ptr, _pow(tl.load(b_ptr), tl.load(s_ptr), True))
