"""Backend ``"cpu"`` of the fused master step: csrc/master_step_cpu.cpp (AVX-512, AVX2 or portable
code picked at run time, OpenMP over chunks of the whole list). The kernel also counts Adam's
steps and checks that no two arrays share memory before it writes anything (it then returns the
pair instead)."""

from __future__ import annotations

import torch

from accumkernels.ops.backends import master_step_ref, native


def is_available(device: torch.device) -> bool:
    return device.type == "cpu" and hasattr(native._C, "master_adam_step_cpu")


def _ptrs(tensors) -> list[int]:
    return [] if tensors is None else [t.data_ptr() for t in tensors]


def _cpu_flags(**on: bool) -> int:
    flags = native._C.MASTER_STEP_CPU_FLAGS
    bits = flags["fma"] if master_step_ref.fused_multiply_add() else 0
    for name, value in on.items():
        if value:
            bits |= flags[name]
    return bits


def _scalar_ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
              lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw, grad_scale,
              found_inf, write_grad):
    """The native Adam step, steps included; returns two arrays that share memory (nothing
    written) or None."""
    codes = native.DTYPE_CODES
    return native._C.master_adam_step_cpu(
        [_ptrs(masters), _ptrs(weights), _ptrs(grads), _ptrs(exp_avgs), _ptrs(exp_avg_sqs),
         _ptrs(max_exp_avg_sqs)], _ptrs(state_steps), [m.numel() for m in masters],
        [codes[w.dtype] for w in weights], float(lr), beta1, beta2, weight_decay, eps,
        _cpu_flags(amsgrad=amsgrad, maximize=maximize, adamw=adamw, write_grad=write_grad),
        _scalar_ptr(grad_scale), _scalar_ptr(found_inf), torch.get_num_threads())


def sgd(masters, weights, grads, momentum_buffers, *, lr, momentum, dampening,
             weight_decay, nesterov, maximize, is_first_step, grad_scale, found_inf, write_grad):
    """The native SGD step; returns two arrays that share memory (nothing written) or None."""
    codes = native.DTYPE_CODES
    return native._C.master_sgd_step_cpu(
        [_ptrs(masters), _ptrs(weights), _ptrs(grads), _ptrs(momentum_buffers), [], []],
        [m.numel() for m in masters], [codes[w.dtype] for w in weights], float(lr), momentum,
        dampening, weight_decay,
        _cpu_flags(momentum=momentum_buffers is not None, nesterov=nesterov, maximize=maximize,
                   first_step=is_first_step, write_grad=write_grad),
        _scalar_ptr(grad_scale), _scalar_ptr(found_inf), torch.get_num_threads())
