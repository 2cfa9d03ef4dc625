"""fuse_wgrad_accumulation: nn.Linear weight gradients written straight into the fp32 window.

For every ``nn.Linear`` whose weight an :class:`~accumkernels.AccumulatingOptimizer` manages,
the backward computes the weight gradient as one GEMM that accumulates into the weight's fp32
master gradient (``p.main_grad``)::

    main_grad = (0 if first write of the window else main_grad) + scale * dy^T x

with fp32 accumulation and fp32 output, so autograd never materialises a low-precision weight
gradient: no bf16 ``.grad`` (2 B/param less at peak), no separate accumulation pass, and no
bf16 rounding of each micro-batch's weight gradient. ``scale`` and the first-write flag come
from the wrapper (``AccumulatingOptimizer._fused_gradient_slot``), so every reduction, loss
scaling and the window logic work exactly as on the usual path. Inputs and biases take the
usual path; the weight stays an autograd input of the layer (``requires_grad`` propagates), but
its gradient edge carries nothing.

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
an in-place fp32 ``addmm`` (no upcast needed).
"""

from __future__ import annotations

import os
import types
import warnings
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from accumkernels.optim import AccumulatingOptimizer

__all__ = ["GEMM_BACKENDS", "WgradFusionHandle", "available_gemm_backends", "fuse_wgrad_accumulation"]

GEMM_BACKENDS = ("addmm_out_dtype", "triton", "mm_out_dtype", "fp32")
_LOW_PRECISION = (torch.bfloat16, torch.float16)
_AUTO_ORDER = {"cuda": ("addmm_out_dtype", "triton", "mm_out_dtype", "fp32")}


# --- the GEMM implementations -------------------------------------------------------------------
# Each: gemm(view, dy2, x2, scale, overwrite, found_inf) -> bool. view (out, in) fp32 contiguous,
# dy2 (K, out), x2 (K, in) in the same dtype. Computes view = (0 if overwrite else view) +
# scale * dy2^T x2 in fp32. Returns True if it already flagged non-finite results in found_inf.

def _gemm_addmm_out_dtype(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    torch.addmm(view, dy2.t(), x2, out_dtype=torch.float32, beta=0.0 if overwrite else 1.0,
                alpha=scale, out=view)
    return False


def _gemm_mm_out_dtype(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    tmp = torch.mm(dy2.t(), x2, out_dtype=torch.float32)
    if overwrite:
        torch.mul(tmp, scale, out=view)
    else:
        view.add_(tmp, alpha=scale)
    return False


def _gemm_fp32(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    # beta=0 ignores view entirely (NaN/inf garbage from an earlier window included).
    torch.addmm(view, dy2.t().to(torch.float32), x2.to(torch.float32),
                beta=0.0 if overwrite else 1.0, alpha=scale, out=view)
    return False


_triton_kernel = None


def _get_triton_kernel():
    """Define the Triton kernel on first use (triton is optional and imported lazily)."""
    global _triton_kernel
    if _triton_kernel is not None:
        return _triton_kernel
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

    _triton_kernel = _wgrad_kernel
    return _triton_kernel


def _gemm_triton(view, dy2, x2, scale, overwrite, found_inf) -> bool:
    M, N = view.shape
    K = dy2.shape[0]
    if view.numel() == 0:
        return True
    kernel = _get_triton_kernel()
    if view.device.type == "cuda":
        bm, bn, bk, warps, stages = 128, 128, 64, 8, 3
    else:  # interpreter: small tiles keep it fast
        bm, bn, bk, warps, stages = 32, 32, 32, 4, 1
    check = found_inf is not None and found_inf.device == view.device
    grid = (_cdiv(M, bm) * _cdiv(N, bn),)
    kernel[grid](
        dy2, x2, view, found_inf if check else view,
        M, N, K,
        dy2.stride(0), dy2.stride(1), x2.stride(0), x2.stride(1), view.stride(0), view.stride(1),
        float(scale),
        OVERWRITE=bool(overwrite), CHECK_FINITE=check, UPCAST=view.device.type != "cuda",
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages,
    )
    return check


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_GEMMS = {
    "addmm_out_dtype": _gemm_addmm_out_dtype,
    "triton": _gemm_triton,
    "mm_out_dtype": _gemm_mm_out_dtype,
    "fp32": _gemm_fp32,
}


def _flag_nonfinite(view: torch.Tensor, found_inf: torch.Tensor | None) -> None:
    """found_inf = 1 if view holds inf/NaN; no host sync.

    Checking the accumulated view (not this micro-batch's gradient) is enough: inf and NaN
    survive every later addition (inf + -inf = NaN), and the first write of a window overwrites
    without reading, so a flag means this window's gradient is non-finite.
    """
    if found_inf is None or view.numel() == 0:
        return
    # max |v| is overflow-free and propagates NaN (CPU and CUDA reductions).
    bad = ~torch.isfinite(torch.linalg.vector_norm(view, float("inf")))
    found_inf.masked_fill_(bad.to(found_inf.device), 1.0)


# --- choosing an implementation -----------------------------------------------------------------

_support_cache: dict[tuple[str, str, torch.dtype], bool] = {}


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    if device.type == "cuda":
        return True
    return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"


def _probe(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Run ``name`` once on small data (both beta modes) and check it against float64."""
    gen = torch.Generator().manual_seed(0)
    k, m, n = 37, 20, 12
    dy = torch.randn(k, m, generator=gen).to(device, dtype)
    x = torch.randn(k, n, generator=gen).to(device, dtype)
    c0 = torch.randn(m, n, generator=gen).to(device)
    prod = dy.double().t() @ x.double()
    try:
        c = c0.clone()
        _GEMMS[name](c, dy, x, 0.5, False, None)
        ok = torch.allclose(c.double(), c0.double() + 0.5 * prod, rtol=1e-5, atol=1e-5)
        c.fill_(float("nan"))
        _GEMMS[name](c, dy, x, 0.5, True, None)
        ok = ok and torch.allclose(c.double(), 0.5 * prod, rtol=1e-5, atol=1e-5)
        return bool(ok)
    except Exception:  # noqa: BLE001 - any failure means "not usable here"
        return False


def _supported(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    if name == "fp32":
        return True
    if dtype not in _LOW_PRECISION:
        return False
    if name in ("addmm_out_dtype", "mm_out_dtype") and device.type != "cuda":
        return False
    if name == "triton" and not _triton_usable(device):
        return False
    key = (name, str(device), dtype)
    if key not in _support_cache:
        _support_cache[key] = _probe(name, device, dtype)
    return _support_cache[key]


def _resolve(requested: str, device: torch.device, dtype: torch.dtype) -> str:
    """The GEMM used for inputs of ``dtype`` on ``device``."""
    if dtype not in _LOW_PRECISION:
        return "fp32"  # fp32 (or fp64) inputs: a plain in-place fp32 addmm
    if requested != "auto":
        if not _supported(requested, device, dtype):
            raise ValueError(f"fuse_wgrad_accumulation: backend {requested!r} is not usable for "
                             f"{dtype} on {device} (available: "
                             f"{', '.join(available_gemm_backends(device, dtype))})")
        return requested
    for name in _AUTO_ORDER.get(device.type, ("fp32",)):
        if _supported(name, device, dtype):
            return name
    return "fp32"


def available_gemm_backends(device: torch.device | str, dtype: torch.dtype = torch.bfloat16
                            ) -> list[str]:
    """The GEMM implementations usable for ``dtype`` inputs on ``device``."""
    device = torch.device(device)
    return [name for name in GEMM_BACKENDS if _supported(name, device, dtype)]


# --- the autograd function ----------------------------------------------------------------------

@dataclass(eq=False)
class _Layer:
    """What a patched layer needs in backward."""

    module: nn.Linear
    param: nn.Parameter  # the weight as the optimizer knows it
    optimizer: AccumulatingOptimizer
    backend: str  # requested GEMM backend ("auto" or a name)
    gemms: dict = field(default_factory=dict)  # (device, dtype) -> resolved name

    def gemm_for(self, device: torch.device, dtype: torch.dtype) -> str:
        key = (device, dtype)
        name = self.gemms.get(key)
        if name is None:
            name = self.gemms[key] = _resolve(self.backend, device, dtype)
        return name


def _gradient_node(t: torch.Tensor):
    """The autograd node that receives t's gradient (AccumulateGrad for a leaf)."""
    try:
        return torch.autograd.graph.get_gradient_edge(t).node
    except (AttributeError, RuntimeError):
        return t.view_as(t).grad_fn.next_functions[0][0]


def _weight_gradient_wanted(node) -> str:
    """How this backward wants the weight's gradient: "write", "return" or "skip".

    ``loss.backward()`` (or ``backward(inputs=...)`` naming the weight): accumulate it ->
    "write". ``torch.autograd.grad(..., inputs=[..., weight])``: the caller wants it returned and
    ``.grad``/the window untouched -> "return". A backward that does not reach the weight
    (``autograd.grad`` w.r.t. inputs only, ``backward(inputs=...)`` without it) -> "skip".
    """
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if node is None or will_execute is None:
        return "write"
    try:
        return "write" if will_execute(node) else "skip"
    except RuntimeError:  # raised for a leaf that torch.autograd.grad captures
        return "return"


class _FusedLinear(torch.autograd.Function):
    """F.linear whose backward writes the weight gradient into the window (returns None for it)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, node):
        ctx.layer = layer
        ctx.node = node
        ctx.has_bias = bias is not None
        # Like native linear: x is needed for the weight gradient, the weight for the input's.
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None,
                              weight if ctx.needs_input_grad[0] else None)
        ctx.x_shape = x.shape
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = dy2.mm(weight).view(ctx.x_shape)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = dy2.sum(0)
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            mode = _weight_gradient_wanted(ctx.node)
            if mode == "write":
                layer = ctx.layer
                with torch.no_grad():
                    view, scale, overwrite, found_inf = \
                        layer.optimizer._fused_gradient_slot(layer.param)
                    name = layer.gemm_for(dy2.device, dy2.dtype)
                    flagged = _GEMMS[name](view, dy2, x2, scale, overwrite, found_inf)
                    if not flagged:
                        _flag_nonfinite(view, found_inf)
            elif mode == "return":
                grad_w = dy2.t().mm(x2)
        return grad_x, grad_w, grad_b, None, None


# --- patching -------------------------------------------------------------------------------------

# Patched module -> its _Layer. Weak: a patched module that is dropped is simply forgotten.
_PATCHED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _fused_forward(module: nn.Linear, input: torch.Tensor) -> torch.Tensor:
    layer = _PATCHED.get(module)
    weight = module.weight
    if (layer is None or weight is not layer.param or not weight.requires_grad
            or not torch.is_grad_enabled() or torch.compiler.is_compiling()):
        # Removed patch, replaced or frozen weight, inference, torch.compile: the usual path.
        return F.linear(input, weight, module.bias)
    bias = module.bias
    device_type = input.device.type
    if _autocast_enabled(device_type):
        # What autocast does for linear: run it in the autocast dtype. Cast here so the
        # function (and the fused GEMM) sees the low-precision tensors.
        dtype = torch.get_autocast_dtype(device_type)
        input = input.to(dtype) if input.is_floating_point() else input
        weight = weight.to(dtype)
        bias = bias.to(dtype) if bias is not None else None
    return _FusedLinear.apply(input, weight, bias, layer, _gradient_node(module.weight))


# Pickling a patched module stores its forward as getattr(module, "forward"): the class forward.
_fused_forward.__name__ = "forward"


def _autocast_enabled(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except TypeError:  # very old torch: no device argument
        return device_type == "cuda" and torch.is_autocast_enabled()


class WgradFusionHandle:
    """Returned by :func:`fuse_wgrad_accumulation`; ``remove()`` restores the layers."""

    def __init__(self, layers: dict[str, _Layer], backend: str):
        self._layers = layers
        self.backend = backend
        self._removed = False

    @property
    def num_layers(self) -> int:
        """Number of ``nn.Linear`` layers patched."""
        return len(self._layers)

    @property
    def layer_names(self) -> list[str]:
        """Qualified names (in the model) of the patched layers."""
        return list(self._layers)

    @property
    def gemm_backends(self) -> dict[str, str]:
        """``"<device> <dtype>" -> GEMM implementation`` chosen so far (probed at fuse time)."""
        out = {}
        for layer in self._layers.values():
            for (device, dtype), name in layer.gemms.items():
                out[f"{device} {str(dtype).removeprefix('torch.')}"] = name
        return out

    @property
    def removed(self) -> bool:
        return self._removed

    def remove(self) -> None:
        """Restore every patched layer's forward (idempotent). Graphs already built keep writing."""
        if self._removed:
            return
        for layer in self._layers.values():
            module = layer.module
            if _PATCHED.get(module) is layer:
                del _PATCHED[module]
            current = module.__dict__.get("forward")
            if isinstance(current, types.MethodType) and current.__func__ is _fused_forward \
                    and current.__self__ is module:
                del module.forward
        self._removed = True

    def __enter__(self) -> WgradFusionHandle:  # noqa: PYI034
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{self.num_layers} layers"
        return f"WgradFusionHandle({state}, backend={self.backend!r})"


def _is_stale_patch(module: nn.Module) -> bool:
    """Our forward, bound to this module, but not registered: a copy.deepcopy of a fused module
    (deepcopy rebinds the method to the copy). It runs the plain path; it may be fused anew."""
    current = module.__dict__.get("forward")
    return (isinstance(current, types.MethodType) and current.__func__ is _fused_forward
            and current.__self__ is module and module not in _PATCHED)


def _eligible(module: nn.Module, opt: AccumulatingOptimizer) -> bool:
    if not isinstance(module, nn.Linear):
        return False
    if type(module).forward is not nn.Linear.forward:  # a subclass with its own forward
        return False
    if "forward" in module.__dict__ and not _is_stale_patch(module):
        return False  # someone else patched this instance
    w = module.weight
    return (type(w) is nn.Parameter and w.layout == torch.strided and w.is_floating_point()
            and w.requires_grad and w.dim() == 2 and w in opt._buffer)


def fuse_wgrad_accumulation(model: nn.Module, optimizer: AccumulatingOptimizer, *,
                            backend: str = "auto") -> WgradFusionHandle:
    """Compute the weight gradient of every managed ``nn.Linear`` straight into its fp32 window.

    Patched: each ``nn.Linear`` in ``model`` (plain ``nn.Linear.forward``, not already patched
    at instance level) whose weight ``optimizer`` manages and requires grad. Its backward
    computes ``main_grad (+)= scale * dy^T x`` as one GEMM with fp32 accumulation and output,
    ``beta=0`` on the window's first write; the input and bias gradients take the usual path.
    Other layers and params are untouched. Inputs with more than 2 dims are flattened over the
    leading dims. Under ``torch.no_grad()``/inference and under ``torch.compile`` a patched layer
    runs the plain ``F.linear`` (unfused). Under autocast it runs in the autocast dtype, as native
    linear does.

    ``backend``: ``"auto"`` or one of :data:`GEMM_BACKENDS` (see the module docstring); checked
    (and on CUDA probed) now for the layers' devices.

    Returns a handle: ``num_layers`` (how many were patched; 0 gives a ``UserWarning``),
    ``layer_names``, ``gemm_backends``, ``remove()`` (restores the layers; idempotent; also a
    context manager).

    Raises ``TypeError`` for a model that is not an ``nn.Module`` or an optimizer that is not an
    ``AccumulatingOptimizer``; ``ValueError`` for ``nonfinite='skip_microbatch'`` (a fused write
    cannot be undone) or an unknown/unusable backend; ``RuntimeError`` if a layer of ``model`` is
    already fused (call ``remove()`` first).

    Not supported: double backward through a fused weight's gradient (``create_graph=True``
    gives correct input gradients, but the weight-gradient write is not differentiable), tensor
    hooks on a fused weight (they see no gradient), and autocast's weight-cast cache (a layer
    called several times per forward under autocast casts its weight each time).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fuse_wgrad_accumulation: model must be an nn.Module, "
                        f"got {type(model).__name__}")
    if not isinstance(optimizer, AccumulatingOptimizer):
        raise TypeError(f"fuse_wgrad_accumulation: optimizer must be an AccumulatingOptimizer, "
                        f"got {type(optimizer).__name__}")
    if optimizer.nonfinite == "skip_microbatch":
        raise ValueError("fuse_wgrad_accumulation: nonfinite='skip_microbatch' is not supported "
                         "(a fused weight-gradient write cannot be undone); use 'skip_step' or "
                         "'raise'")
    if backend != "auto" and backend not in GEMM_BACKENDS:
        raise ValueError(f"fuse_wgrad_accumulation: backend must be 'auto' or one of "
                         f"{', '.join(map(repr, GEMM_BACKENDS))}; got {backend!r}")

    candidates: dict[str, nn.Linear] = {}
    for name, module in model.named_modules():
        if module in _PATCHED:
            raise RuntimeError(f"fuse_wgrad_accumulation: layer {name or '<model>'!r} is already "
                               "fused; call remove() on its handle first")
        if _eligible(module, optimizer):
            candidates[name] = module

    layers: dict[str, _Layer] = {}
    for name, module in candidates.items():
        layer = _Layer(module, module.weight, optimizer, backend)
        # Resolve (on CUDA: probe) now rather than in the middle of a backward. Auto: the weight
        # dtype, and on CUDA the autocast dtypes too. An explicit backend must work for the
        # weight dtype, or for bf16 when the weights are fp32 (it then serves autocast).
        w = module.weight
        if backend == "auto":
            dtypes = {w.dtype} | (set(_LOW_PRECISION) if w.device.type == "cuda" else set())
        else:
            dtypes = {w.dtype if w.dtype in _LOW_PRECISION else torch.bfloat16}
        for dtype in dtypes:
            layer.gemms[(w.device, dtype)] = _resolve(backend, w.device, dtype)
        layers[name] = layer

    if not layers:
        warnings.warn("fuse_wgrad_accumulation: no nn.Linear in the model has a weight managed "
                      "by this optimizer (that requires grad); nothing was fused",
                      UserWarning, stacklevel=2)
    for layer in layers.values():
        _PATCHED[layer.module] = layer
        layer.module.forward = types.MethodType(_fused_forward, layer.module)
    return WgradFusionHandle(layers, backend)

