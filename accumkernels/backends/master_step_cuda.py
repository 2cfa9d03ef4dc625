"""Backend ``"cuda"`` of the fused master step (and the test-only ``"cuda_host"`` emulation).

The CUDA kernel (csrc/master_step_kernel.h, launched by csrc/master_step_cuda.cu) resyncs the fp32
master from a user-written bf16/fp16 weight, unscales the gradient, applies torch's fused
Adam/AdamW/SGD update bit for bit and writes the rounded weight back, in one pass over memory.
``adam_host``/``sgd_host`` play the same kernel source block by block on CPU tensors.
"""

from __future__ import annotations

import torch


def is_available(device: torch.device) -> bool:
    return False


def host_available() -> bool:
    return False


def adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
         lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw,
         grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's CUDA kernel is not written yet")


def sgd(masters, weights, grads, momentum_buffers, *,
        lr, momentum, dampening, weight_decay, nesterov, maximize, is_first_step,
        grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's CUDA kernel is not written yet")


def adam_host(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
              lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw,
              grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's host emulation is not written yet")


def sgd_host(masters, weights, grads, momentum_buffers, *,
             lr, momentum, dampening, weight_decay, nesterov, maximize, is_first_step,
             grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's host emulation is not written yet")
