"""Backend ``"triton"`` of the fused master step: one Triton launch per device and weight dtype."""

from __future__ import annotations

import torch


def is_available(device: torch.device) -> bool:
    return False


def adam(masters, weights, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
         lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, adamw,
         grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's Triton kernel is not written yet")


def sgd(masters, weights, grads, momentum_buffers, *,
        lr, momentum, dampening, weight_decay, nesterov, maximize, is_first_step,
        grad_scale, found_inf, write_grad) -> None:
    raise NotImplementedError("the fused master step's Triton kernel is not written yet")
