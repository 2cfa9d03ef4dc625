"""Backend ``"torch"`` of the fused master step, in plain torch ops: the readable definition.

Per tensor, when ``found_inf`` is absent or zero (otherwise nothing is written: any nonzero value,
NaN included, in every backend; torch's fused kernels skip only on exactly 1.0, so a GradScaler
flag summed over two devices, 2.0, makes torch step with non-finite gradients where this skips;
the steps still move as torch's, +1 then -found_inf):

1. the fp32 master takes its bf16/fp16 weight where ``weight != master.to(weight.dtype)`` (a
   weight the user wrote; NaN differs);
2. ``g = grad / grad_scale`` in fp32, stored back into ``grad`` with ``write_grad`` (torch's fused
   kernels store it);
3. the master and its state get the update torch's own fused kernel computes for an fp32 param;
4. ``weight.copy_(master)`` (torch's cast: round to nearest even).

On the CPU, step 3 is written out below, operation by operation, as torch's fused CPU kernels
compute it (aten/src/ATen/native/cpu/FusedAdamKernel.cpp and FusedSGDKernel.cpp; checked bit for
bit against torch 2.13 with its AVX512, AVX2 and DEFAULT kernels, 1 and 2 threads):

* fp32 arithmetic; each hyper-parameter is rounded to fp32 once, after any arithmetic on it in
  double (``float(1 - beta1)``, ``float(1 - lr * weight_decay)``, ``float(-lr / (1 - beta1**step))``
  with ``step`` the fp32 state step);
* an AVX2/AVX512 build fuses the multiply-adds written ``_fma`` below (one rounding); the DEFAULT
  build rounds every product (``fused_multiply_add()`` says which runs);
* torch runs vector code over chunks that start at multiples of 16 elements, so only the last
  ``n % 8`` elements of each tensor run its scalar loop, whose compiled multiply-add pairs one
  product differently (``exp_avg_sq`` in Adam, the momentum buffer in SGD): ``TAIL`` below.

Everything else is the same at every position. With a NaN or inf among the inputs the results
are NaN/inf in the same places as torch's, but a NaN's sign and payload bits may differ (torch's
vector and scalar code propagate NaNs differently).

On other devices, step 3 is torch's own fused op for that device (``torch._fused_adamw_``,
``torch._fused_adam_``, ``torch._fused_sgd_``) on the masters, with steps 1, 2 and 4 as above and
``found_inf`` read on the device (no host sync).
"""

from __future__ import annotations

import math
import struct

import torch

# torch's scalar loop computes the last n % TAIL elements of each tensor (see above).
TAIL = 8


def is_available(device: torch.device) -> bool:
    return True


def fused_multiply_add() -> bool:
    """Whether torch's CPU kernels fuse multiply-adds: true for its AVX2/AVX512 kernels, false
    for its DEFAULT ones (``ATEN_CPU_CAPABILITY=default``, or a CPU without AVX2)."""
    return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


def _f32(x: float) -> float:
    """``x`` rounded to the nearest fp32 (torch's ``scalar_t(x)``; too large: inf)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _fma(a, b, c, fused: bool) -> torch.Tensor:
    """fp32 ``a * b + c`` (tensors or fp32-exact floats): rounded once when ``fused`` (an FMA
    instruction), else the product first.

    The fused form is computed in float64: the product of two fp32 values is exact there, the
    sum ``s`` is rounded, and Knuth's TwoSum gives its exact error ``e``. ``s`` rounds to the
    correct fp32 unless it lies exactly halfway between two fp32 values while ``e`` is not zero:
    then the true value lies on ``e``'s side of the tie.
    """
    if not fused:
        return a * b + c
    d = [x.double() if isinstance(x, torch.Tensor) else x for x in (a, b, c)]
    p = d[0] * d[1]
    s = p + d[2]
    bb = s - p
    e = (p - (s - bb)) + (d[2] - bb)
    r = s.float()
    up = torch.nextafter(r, torch.full_like(r, math.inf))
    down = torch.nextafter(r, torch.full_like(r, -math.inf))
    r = torch.where((s == (r.double() + up.double()) / 2) & (e > 0), up, r)
    return torch.where((s == (r.double() + down.double()) / 2) & (e < 0), down, r)


def _skipped(found_inf: torch.Tensor | None) -> bool:
    return found_inf is not None and found_inf.item() != 0


def _resynced(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Step 1: the master, or the weight where the user wrote it."""
    return torch.where(weight != master.to(weight.dtype), weight.float(), master)


def _unscaled(grad: torch.Tensor, grad_scale: torch.Tensor | None,
              write_grad: bool) -> torch.Tensor:
    """Step 2: the gradient divided by grad_scale (and stored back with write_grad)."""
    if grad_scale is None:
        return grad
    g = grad / grad_scale.reshape(())
    if write_grad:
        grad.copy_(g)
    return g


def _store(dst: torch.Tensor, flat: torch.Tensor) -> None:
    """Write a flat result into ``dst`` (any strides)."""
    dst.copy_(flat.view(dst.shape))


def _lr_value(lr) -> float:
    return float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)


def adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
         lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw,
         grad_scale, found_inf, write_grad) -> None:
    """Fused master Adam/AdamW step (checked lists on one device; steps already incremented)."""
    if masters[0].device.type != "cpu":
        _adam_on_device(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                        state_steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay,
                        eps=eps, amsgrad=amsgrad, maximize=maximize, adamw=adamw,
                        grad_scale=grad_scale, found_inf=found_inf, write_grad=write_grad)
        return
    if _skipped(found_inf):
        return
    fused = fused_multiply_add()
    lr = _lr_value(lr)
    lerp_w = _f32(1 - beta1)  # exp_avg.lerp_(g, 1 - beta1), as torch's lerp computes it
    b2, c2 = _f32(beta2), _f32(1 - beta2)
    decay, wd, eps32 = _f32(1 - lr * weight_decay), _f32(weight_decay), _f32(eps)
    for i, master in enumerate(masters):
        n = master.numel()
        step = float(state_steps[i].item())
        step_size = lr / (1 - beta1**step)
        bc2_sqrt = _f32(math.sqrt(1 - beta2**step))
        p = _resynced(master, weights[i]).reshape(-1)
        g = _unscaled(grads[i], grad_scale, write_grad).reshape(-1)
        if maximize:
            g = -g
        if weight_decay != 0:
            if adamw:
                p = p * decay
            else:
                g = _fma(p, wd, g, fused)
        m, v = exp_avgs[i].reshape(-1), exp_avg_sqs[i].reshape(-1)
        if abs(lerp_w) < 0.5:
            m_new = _fma(lerp_w, g - m, m, fused)
        else:
            m_new = _fma(lerp_w - 1, g - m, g, fused)
        cg = g * c2
        v_new = _fma(cg, g, v * b2, fused)  # torch's vector code
        t = n - n % TAIL
        v_new[t:] = _fma(v[t:], b2, cg[t:] * g[t:], fused)  # its scalar loop
        d = v_new
        if amsgrad:
            mx = max_exp_avg_sqs[i].reshape(-1)
            d = torch.maximum(mx, v_new)
            d[t:] = torch.where(mx[t:] < v_new[t:], v_new[t:], mx[t:])  # std::max
            _store(max_exp_avg_sqs[i], d)
        # torch.sqrt on fp32 CPU tensors is not correctly rounded (its kernels' vector sqrt is);
        # the float64 root rounded to fp32 is.
        denom = d.double().sqrt().float() / bc2_sqrt + eps32
        p = p + (_f32(-step_size) * m_new) / denom
        _store(exp_avgs[i], m_new)
        _store(exp_avg_sqs[i], v_new)
        _store(master, p)
        weights[i].copy_(master)


def sgd(masters, weights, grads, momentum_buffers, *,
        lr, momentum, dampening, weight_decay, nesterov, maximize, is_first_step,
        grad_scale, found_inf, write_grad) -> None:
    """Fused master SGD step (checked lists on one device)."""
    if masters[0].device.type != "cpu":
        _sgd_on_device(masters, weights, grads, momentum_buffers, lr=lr, momentum=momentum,
                       dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                       maximize=maximize, is_first_step=is_first_step, grad_scale=grad_scale,
                       found_inf=found_inf, write_grad=write_grad)
        return
    if _skipped(found_inf):
        return
    fused = fused_multiply_add()
    lr = _lr_value(lr)
    wd, mom, damp, neg_lr = _f32(weight_decay), _f32(momentum), _f32(1 - dampening), _f32(-lr)
    for i, master in enumerate(masters):
        n = master.numel()
        p = _resynced(master, weights[i]).reshape(-1)
        g = _unscaled(grads[i], grad_scale, write_grad).reshape(-1)
        if maximize:
            g = -g
        if weight_decay != 0:
            g = _fma(p, wd, g, fused)
        if momentum != 0:
            buf = momentum_buffers[i].reshape(-1)
            if is_first_step:
                b = g
            else:
                b = _fma(damp, g, buf * mom, fused)  # torch's vector code
                t = n - n % TAIL
                b[t:] = _fma(buf[t:], mom, g[t:] * damp, fused)  # its scalar loop
            _store(momentum_buffers[i], b)
            g = _fma(b, mom, g, fused) if nesterov else b
        p = _fma(g, neg_lr, p, fused)
        _store(master, p)
        weights[i].copy_(master)


# -- other devices: torch's own fused op on the masters ------------------------------------------

def _prepare_on_device(masters, weights, grads, grad_scale, found_inf, write_grad):
    """Steps 1 and 2 for torch's fused op on a device: resync unless found_inf (no host sync);
    the gradients it may write (a copy without write_grad); found_inf as 0.0/1.0 (torch's
    kernels skip on exactly 1.0)."""
    skip = None if found_inf is None else found_inf.reshape(()).ne(0)
    for m, w in zip(masters, weights):
        taken = w != m.to(w.dtype)
        if skip is not None:
            taken &= ~skip
        m.copy_(torch.where(taken, w.float(), m))
    if grad_scale is not None and not write_grad:
        grads = [g.clone() for g in grads]
    flag = None if skip is None else skip.float().reshape(1)
    return grads, skip, flag


def _lr_on_device(lr, device: torch.device):
    """lr as torch's fused op for ``device`` must get it: a tensor on another device as a number
    (as the cuda backend reads it), a tensor on the device as float32, the dtype its CUDA kernels
    read it as (``*(const float*)``: a float64 or bf16 lr would be read as the wrong bytes)."""
    if not isinstance(lr, torch.Tensor):
        return lr
    if lr.device != device:
        return lr.item()
    return lr if lr.dtype == torch.float32 else lr.to(torch.float32)


def _copy_back_on_device(masters, weights, skip) -> None:
    if skip is None:
        torch._foreach_copy_(weights, masters)
        return
    for m, w in zip(masters, weights):
        w.copy_(torch.where(skip, w, m.to(w.dtype)))


def _adam_on_device(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                    state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize,
                    adamw, grad_scale, found_inf, write_grad) -> None:
    grads, skip, flag = _prepare_on_device(masters, weights, grads, grad_scale, found_inf,
                                           write_grad)
    lr = _lr_on_device(lr, masters[0].device)
    op = torch._fused_adamw_ if adamw else torch._fused_adam_
    op(masters, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [], state_steps,
       lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps, amsgrad=amsgrad,
       maximize=maximize, grad_scale=grad_scale, found_inf=flag)
    _copy_back_on_device(masters, weights, skip)


def _sgd_on_device(masters, weights, grads, momentum_buffers, *, lr, momentum, dampening,
                   weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf,
                   write_grad) -> None:
    grads, skip, flag = _prepare_on_device(masters, weights, grads, grad_scale, found_inf,
                                           write_grad)
    lr = _lr_on_device(lr, masters[0].device)
    torch._fused_sgd_(masters, grads, [] if momentum == 0 else momentum_buffers,
                      weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=dampening,
                      nesterov=nesterov, maximize=maximize, is_first_step=is_first_step,
                      grad_scale=grad_scale, found_inf=flag)
    _copy_back_on_device(masters, weights, skip)
