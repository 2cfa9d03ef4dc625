"""The Triton weight-gradient GEMM: ``C = (0 if overwrite else C) + alpha * dy^T x``.

An fp32 accumulator that loads and stores the fp32 master tile, with the finiteness check of the
result fused (no second pass). CUDA; on the CPU only under ``TRITON_INTERPRET=1`` (tests).
Triton is optional: it is imported, and the kernel defined, on first use.
"""

from __future__ import annotations

from accumkernels._util import on_device

__all__ = ["gemm_triton"]

_kernel = None


def _define_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _wgrad_kernel(
        dy_ptr, x_ptr, c_ptr, found_inf_ptr,
        M, N, K,
        stride_dk, stride_dm, stride_xk, stride_xn, stride_cm, stride_cn,
        alpha,
        OVERWRITE: tl.constexpr,  # first write of the window: do not read C
        CHECK_FINITE: tl.constexpr,  # set *found_inf_ptr = 1 if the result tile is not finite
        UPCAST: tl.constexpr,  # dot in fp32 ("ieee"): the interpreter's bf16 dot is wrong
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        # C[m, n] (+)= alpha * sum_k dy[k, m] * x[k, n]; fp32 accumulator, fp32 C.
        pid = tl.program_id(0)
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        # Grouped ordering: GROUP_M row-blocks share their x tiles in L2.
        num_pid_in_group = GROUP_M * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * GROUP_M
        group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
        pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
        pid_n = (pid % num_pid_in_group) // group_size_m

        offs_m = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
        a_ptrs = dy_ptr + offs_k[:, None] * stride_dk + offs_m[None, :] * stride_dm  # [BK, BM]
        b_ptrs = x_ptr + offs_k[:, None] * stride_xk + offs_n[None, :] * stride_xn  # [BK, BN]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=(offs_k[:, None] < k_left) & (offs_m[None, :] < M), other=0.0)
            b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
            if UPCAST:  # bf16/fp16 values are exact in fp32: same products
                acc = tl.dot(tl.trans(a.to(tl.float32)), b.to(tl.float32), acc,
                             input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(a), b, acc)
            a_ptrs += BLOCK_K * stride_dk
            b_ptrs += BLOCK_K * stride_xk
        acc = acc * alpha
        c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
        c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if not OVERWRITE:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0)
        tl.store(c_ptrs, acc, mask=c_mask)
        if CHECK_FINITE:  # masked-out lanes hold 0
            bad = ((acc != acc) | (tl.abs(acc) == float("inf"))).to(tl.int32)  # noqa: PLR0124
            if tl.max(tl.max(bad, axis=1), axis=0) > 0:
                tl.store(found_inf_ptr, 1.0)

    return _wgrad_kernel


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = _define_kernel()
    return _kernel


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def gemm_triton(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    """The GEMM signature of gemms.py; sets ``found_inf`` itself when it is on view's device."""
    M, N = view.shape
    K = dy2.shape[0]
    if view.numel() == 0:
        return True
    kernel = _get_kernel()
    if view.device.type == "cuda":
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    else:  # interpreter: small tiles keep it fast
        bm, bn, bk, warps, stages = 32, 32, 32, 4, 1
    check = found_inf is not None and found_inf.device == view.device
    grid = (_cdiv(M, bm) * _cdiv(N, bn),)
    with on_device(view.device):  # Triton launches on the current device: make it view's
        kernel[grid](
            dy2, x2, view, found_inf if check else view,
            M, N, K,
            dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), view.stride(0),
            view.stride(1),
            float(scale),
            OVERWRITE=bool(overwrite), CHECK_FINITE=check, UPCAST=view.device.type != "cuda",
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
        )
    return check

