"""fuse_wgrad_accumulation: nn.Linear weight gradients written straight into the fp32 window.

For every ``nn.Linear`` whose weight's gradient window the optimizer owns, the backward computes
the weight gradient as one GEMM that accumulates into the weight's fp32 master gradient::

    main_grad = (0 if first write of the window else main_grad) + scale * dy^T x

with fp32 accumulation and fp32 output, so autograd never materialises a low-precision weight
gradient: no bf16 ``.grad`` (2 B/param less at peak), no separate accumulation pass, and no
bf16 rounding of each micro-batch's weight gradient. The window is reached only through the
gradient-slot protocol (:mod:`accumkernels.slot`): ``slot.claim(p)`` gives the view, ``scale``,
the first-write flag and the ``found_inf`` flag, so every reduction, loss scaling and the window
logic work exactly as on the usual path. Inputs and biases take the usual path; the weight stays
an autograd input of the layer (``requires_grad`` propagates), but its gradient edge carries
nothing.

Modules: ``gemms`` (the GEMM implementations, their probe and the choice among them),
``triton_gemm`` (the Triton GEMM), ``function`` (the autograd Function and the slot write),
``fuse`` (module patching, the handle, :func:`fuse_wgrad_accumulation`).

GEMM implementations (``backend=``), for bf16/fp16 GEMM inputs:

* ``"addmm_out_dtype"``: ``torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32,
  beta=0|1, alpha=scale, out=main_grad)``: cuBLAS, in place. CUDA only, and only on PyTorch
  versions whose ``addmm.dtype_out`` accepts an fp32 ``self`` (older ones require ``self`` in
  the input dtype); a probe at fuse time decides.
* ``"triton"``: a Triton GEMM with an fp32 accumulator that loads and stores the master tile
  (CUDA; on the CPU only under ``TRITON_INTERPRET=1``, for tests).
* ``"mm_out_dtype"``: ``torch.mm(dy.t(), x, out_dtype=torch.float32)`` into a temporary, then
  one ``add_``: fp32-exact too, but a transient fp32 copy of the weight gradient and one pass
  more.
* ``"fp32"``: ``torch.addmm`` in fp32 on upcast inputs, in place. bf16/fp16 values are exact in
  fp32 (and in TF32), so this is still fp32 accumulation of exact products; it costs transient
  fp32 copies of ``dy`` and ``x``. The CPU path (PyTorch has no bf16 x bf16 -> fp32 GEMM on the
  CPU), and the last resort on GPUs.

``"auto"`` takes the first that works on the device: CUDA ``addmm_out_dtype`` -> ``triton`` ->
``mm_out_dtype`` -> ``fp32``; elsewhere ``fp32``. fp32 GEMM inputs (an fp32 model) always use
an in-place fp32 ``addmm`` (no upcast needed). Each fused write (claim, GEMM, finiteness check)
runs inside the profiler range :data:`PROFILE_LABEL` (``"accumkernels::wgrad_gemm"``).
"""

from .function import PROFILE_LABEL
from .fuse import WgradFusionHandle, fuse_wgrad_accumulation
from .gemms import GEMM_BACKENDS, available_gemm_backends

__all__ = ["GEMM_BACKENDS", "PROFILE_LABEL", "WgradFusionHandle", "available_gemm_backends",
           "fuse_wgrad_accumulation"]
