"""The fused master step: the inner optimizer's update of the fp32 masters, the exact take-in of
weights the user wrote and the copy-back to the bf16/fp16 weights, in one pass.

Without it a real step over master weights reads and writes the masters three times (the exact
re-sync, the inner optimizer's step, the copy-back). With it one call of
``accumkernels.master_adam_step_`` / ``master_sgd_step_`` per group reads the window, the master,
the optimizer state and the weight once, and writes the master, the state and the weight once
(32 B per element for AdamW; see ``accumkernels/ops/master_step.py``).

It is one self-contained block the step room runs inside the inner optimizer's step hooks, with
the masters swapped into the inner optimizer (``MasterWeights.swapped``), like GradScaler's
``grad_scale``/``found_inf`` contact with a fused optimizer: it reads the group's
hyper-parameters and the optimizer's ``grad_scale``/``found_inf`` as torch's own step would, and
keeps the state in the inner optimizer's ``state`` under torch's keys (checkpoints, schedulers and
a later native step see it unchanged).

It is taken when the result is bit-identical to what the inner optimizer itself would do: the
inner optimizer is exactly ``torch.optim.Adam``, ``AdamW`` or ``SGD`` (not a subclass, whose step
may differ), with float32 masters on one device type, with no step hooks of its own
(``register_step_pre_hook``/``register_step_post_hook`` on the inner optimizer: they may write the
masters between the take-in and the copy-back, which one pass cannot interleave), and every group
holding masters has only the keys of ``IMPLEMENTED_KEYS`` (``fused=True``, neither
``differentiable`` nor ``capturable``, numbers the kernels take) plus the LR schedulers' own
bookkeeping keys and the wrapper's own. Anything else (another optimizer, ``foreach``/for-loop arithmetic, a key or a
value the kernels do not implement, SGD groups whose momentum buffers are partly created) takes
the separate passes: torch's own step over the masters, with the same result as before.

Params without masters in the same groups (fp32 params of a mixed model) are stepped by the
inner optimizer's own step, run for them alone right after (masters' ``.grad`` hidden from it).
Masters without a gradient this step are not updated; their weights are still compared exactly
(``resync_masters_``), as the separate passes do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch

from accumkernels._torch_private import has_step_hooks, unpatched_step
from accumkernels.ops import host
from accumkernels.optim.checkpoint.live_state import OWN_KEY
from accumkernels.ops.validate import is_dense, same_layout
from accumkernels.ops.master_passes import resync_masters_
from accumkernels.ops.master_step import master_adam_step_, master_sgd_step_

_SGD = (torch.optim.SGD,)


def _real(low: float, high: float = math.inf) -> Callable[[object], bool]:
    """A Python number (not a bool), finite, in [low, high): what the kernels take."""
    def ok(value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return False
        v = float(value)
        return math.isfinite(v) and low <= v and (v < high or high == math.inf)
    return ok


def _one_of(*allowed: object) -> Callable[[object], bool]:
    return lambda value: any(value is a for a in allowed)


_NON_NEGATIVE = _real(0.0)
_BETA = _real(0.0, 1.0)


def _lr(value: object) -> bool:
    """A number, or a one-element floating tensor (the kernels read it as torch does)."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.is_floating_point()
    return _NON_NEGATIVE(value)


def _betas(value: object) -> bool:
    """Two numbers in [0, 1), or one-element floating tensors of such (taken as numbers, as
    torch's fused Adam takes them)."""
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        return False
    return all(_BETA(float(b)) if isinstance(b, torch.Tensor) and b.numel() == 1
               and b.is_floating_point() else _BETA(b) for b in value)


# Per inner optimizer class, the param-group keys the fused master step implements, each with a
# test of the values it reproduces bit for bit; any other key or value takes torch's own step.
_BOOL = _one_of(True, False)
_COMMON = {"params": lambda value: True, "lr": _lr, "weight_decay": _NON_NEGATIVE,
           "maximize": _BOOL, "foreach": _one_of(None, False), "differentiable": _one_of(False),
           "fused": _one_of(True)}
_ADAM_KEYS = {**_COMMON, "betas": _betas, "eps": _NON_NEGATIVE, "amsgrad": _BOOL,
              "capturable": _one_of(False), "decoupled_weight_decay": _BOOL}
_SGD_KEYS = {**_COMMON, "momentum": _NON_NEGATIVE, "dampening": _real(-math.inf),
             "nesterov": _BOOL}
IMPLEMENTED_KEYS: dict[type, dict[str, Callable[[object], bool]]] = {
    torch.optim.Adam: _ADAM_KEYS, torch.optim.AdamW: _ADAM_KEYS, torch.optim.SGD: _SGD_KEYS}
# Written and read by torch's LR schedulers and SWALR alone; no step reads them.
SCHEDULER_KEYS = frozenset({"initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum",
                            "swa_lr"})
# Keys no step reads, any value: the schedulers' and the wrapper's own checkpoint key, which
# every group holds once ``opt.param_groups`` was read.
_IGNORED = SCHEDULER_KEYS | {OWN_KEY}


def implements(optimizer_class: type, group: dict) -> bool:
    """Whether every key of ``group`` is one the fused master step implements for
    ``optimizer_class``, with a value it implements, and none it reads is missing."""
    keys = IMPLEMENTED_KEYS.get(optimizer_class)
    if keys is None:
        return False
    for key, value in group.items():
        ok = keys.get(key)
        if ok is None:
            if key not in _IGNORED:
                return False
        elif not ok(value):
            return False
    if any(key not in group for key in keys):
        return False
    # the kernels refuse what torch's constructor refuses: nesterov without plain momentum
    return not group.get("nesterov") or (group["momentum"] > 0 and group["dampening"] == 0)


def applies(optimizer: torch.optim.Optimizer, masters) -> bool:
    """Whether the fused master step reproduces ``optimizer``'s own step over ``masters``
    (MasterWeights) bit for bit; asked at every step (group keys and values may change)."""
    if not masters.model_params or type(optimizer) not in IMPLEMENTED_KEYS:
        return False
    if has_step_hooks(optimizer):
        return False  # its hooks see (and may write) the masters around torch's own step
    ids = set(masters.masters)
    for group in optimizer.param_groups:
        mine = [p for p in group["params"] if id(p) in ids]
        if not mine:
            continue
        if not implements(type(optimizer), group):
            return False
        if type(optimizer) in _SGD and group["momentum"] != 0:
            has = [optimizer.state.get(p, {}).get("momentum_buffer") is not None for p in mine]
            if any(has) and not all(has):
                return False
    return True


def any_rest(optimizer: torch.optim.Optimizer, masters) -> bool:
    """Whether params without masters hold gradients (the inner step runs for them too)."""
    ids = set(masters.masters)
    return any(p.grad is not None for g in optimizer.param_groups for p in g["params"]
               if id(p) not in ids)


@torch.no_grad()
def step(optimizer: torch.optim.Optimizer, masters, *, write_grad: bool, backend: str = "auto"
         ) -> None:
    """The inner optimizer's step, inside ``masters.swapped()`` (the groups hold the masters):
    the masters with a gradient through the fused op, group by group; the weights of the others
    re-synced exactly; then torch's step for the params without masters (if any hold a
    gradient). ``write_grad``: the fused op stores the gradients divided by ``grad_scale``, as
    torch's fused step does (the caller needs that when the window must show them)."""
    master_list = masters.master_list()
    weight_of = {id(m): p for p, m in zip(masters.model_params, master_list)}
    grad_scale = getattr(optimizer, "grad_scale", None)
    found_inf = getattr(optimizer, "found_inf", None)
    stepped: list[torch.Tensor] = []
    for group in optimizer.param_groups:
        ms = [q for q in group["params"] if id(q) in weight_of and q.grad is not None]
        if not ms:
            continue
        weights = [weight_of[id(q)] for q in ms]
        grads = [q.grad for q in ms]
        common = dict(grad_scale=grad_scale, found_inf=found_inf, write_grad=write_grad,
                      backend=backend)
        if type(optimizer) in _SGD:
            _sgd(optimizer, group, ms, weights, grads, common)
        else:
            _adam(optimizer, group, ms, weights, grads, common)
        stepped.extend(ms)
    if len(stepped) < len(master_list):  # the weights of masters without a gradient
        done = {id(q) for q in stepped}
        idle = [(m, weight_of[id(m)]) for m in master_list if id(m) not in done]
        resync_masters_([m for m, _ in idle], [w for _, w in idle])
    if sum(len(g["params"]) for g in optimizer.param_groups) > len(master_list) and any(
            p.grad is not None for g in optimizer.param_groups for p in g["params"]
            if id(p) not in weight_of):
        hidden = [(q, q.grad) for q in stepped]
        for q in stepped:
            q.grad = None  # torch's step skips params without a gradient
        try:
            inner = unpatched_step(type(optimizer).step) or type(optimizer).step
            inner(optimizer)
        finally:
            for q, g in hidden:
                q.grad = g


def _adam(optimizer, group: dict, ms: list, weights: list, grads: list, common: dict) -> None:
    entries = [optimizer.state[q] for q in ms]  # (a tensor's hash is a Python call: once each)
    for q, s in zip(ms, entries):
        if len(s) == 0:  # torch's lazy state for a fused step (Adam._init_group)
            s["step"] = torch.zeros((), dtype=torch.float32, device=q.device)
            s["exp_avg"] = torch.zeros_like(q, memory_format=torch.preserve_format)
            s["exp_avg_sq"] = torch.zeros_like(q, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                s["max_exp_avg_sq"] = torch.zeros_like(q, memory_format=torch.preserve_format)
    beta1, beta2 = (float(b) if torch.is_tensor(b) else b for b in group["betas"])
    fp32 = [grads, [s["exp_avg"] for s in entries], [s["exp_avg_sq"] for s in entries]]
    if group["amsgrad"]:
        fp32.append([s["max_exp_avg_sq"] for s in entries])
    grads, avgs, sqs, *mx = _as_fused(fp32, ms)
    master_adam_step_(
        ms, weights, grads, avgs, sqs, mx[0] if mx else None,
        [s["step"] for s in entries], lr=group["lr"], beta1=beta1, beta2=beta2,
        weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=group["amsgrad"],
        maximize=group["maximize"],
        adamw=group.get("decoupled_weight_decay", type(optimizer) is torch.optim.AdamW),
        **common)


def _sgd(optimizer, group: dict, ms: list, weights: list, grads: list, common: dict) -> None:
    state = optimizer.state
    momentum = group["momentum"]
    buffers = None
    first = False
    if momentum != 0:
        buffers = [state[q].get("momentum_buffer") for q in ms]
        first = all(b is None for b in buffers)
        if first:  # (torch's fused SGD: the buffers are created and set to the gradient)
            buffers = [torch.empty_like(g) for g in grads]
    fp32 = [grads] if first or buffers is None else [grads, buffers]
    grads, *given = _as_fused(fp32, ms)
    master_sgd_step_(ms, weights, grads, given[0] if given else buffers,
                     lr=group["lr"], momentum=momentum,
                     dampening=group["dampening"], weight_decay=group["weight_decay"],
                     nesterov=group["nesterov"], maximize=group["maximize"],
                     is_first_step=first, **common)
    if first:  # (later steps updated the state's own buffers in place)
        for q, b in zip(ms, buffers):
            state[q]["momentum_buffer"] = b


def _as_fused(lists: list[list], ms: list) -> list[list]:
    """Each tensor of ``lists`` as torch's fused kernels pair it with its master: by memory
    position (they pass over raw memory). A dense tensor whose strides are not its master's (Adam
    state made before ``p.data = p.data.t()``) is seen through its master's strides, as they see
    it. (All contiguous, of their masters' sizes, the masters too: as they are, told by one C++
    pass.)"""
    if host.lists_plain([ms, *lists], [host.LIST_FP32] * (len(lists) + 1)):
        return lists
    return [_as_fused_one(tensors, ms) for tensors in lists]


def _as_fused_one(tensors: list, ms: list) -> list:
    out = tensors
    for i, (t, q) in enumerate(zip(tensors, ms)):
        if t.stride() != q.stride() and not same_layout(q, t) and is_dense(t) and is_dense(q):
            out = list(out) if out is tensors else out
            out[i] = t.as_strided(q.shape, q.stride(), t.storage_offset())
    return out
