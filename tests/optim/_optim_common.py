"""Shared pieces of the tests of AccumulatingOptimizer's rooms (tests/optim/): a small MLP
and its data, float64 references of what autograd hands each param, and checksums of everything
a caller can observe (for "a refused call changes nothing").

References are independent of the code under test: stock torch optimizers on plain models,
float64 sums of the per-micro-batch gradients captured with tensor hooks, or closed forms.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import math

import torch
import torch.nn.functional as F
from torch import nn

from accumkernels import AccumulatingOptimizer

# -- a small MLP, its data, float64 references -----------------------------------------------------

D_IN, D_OUT = 12, 5
# ~0.001 MB = 262 fp32 elements: the test models below span several buckets (partial buckets,
# buckets holding one param larger than the bucket size, buckets shared by several params).
SMALL_BUCKET = 0.001


def make_model(dtype=torch.float32, widths=(D_IN, 24, 16, D_OUT)) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def batches(n, m, dtype=torch.float32):
    return [(torch.randn(m, D_IN, dtype=dtype), torch.randn(m, D_OUT, dtype=dtype))
            for _ in range(n)]


def mse(model, x, y):
    return F.mse_loss(model(x), y)


def capture_grads(model):
    """Record every gradient autograd hands to each param (before any accumulation)."""
    caps = {name: [] for name, _ in model.named_parameters()}
    handles = [p.register_hook(lambda g, name=name: caps[name].append(g.detach().clone()))
               for name, p in model.named_parameters()]
    return caps, handles


def rel_err(a, ref):
    """Norm-wise relative error of a (any dtype) against a float64 reference."""
    return ((a.double() - ref).norm() / ref.norm()).item()


def total_rel_err(tensors, refs):
    num = sum(((a.double() - r) ** 2).sum() for a, r in zip(tensors, refs))
    den = sum((r ** 2).sum() for r in refs)
    return math.sqrt(num / den)


def params_of(model):
    return [p.detach().clone() for p in model.parameters()]


def run_loop(model, opt, data, zero_grad=None, per_microbatch_step=False, in_backward=True):
    """One micro-batch per (x, y): step at the boundary (Trainer-style) or after every micro-batch
    (Accelerate-style), zero_grad() after every micro-batch if asked, else after each real step
    (without any clear the next window adds to the last, as natively)."""
    for x, y in data:
        mse(model, x, y).backward()
        if not in_backward:
            opt.accumulate()
        real = opt.sync_step
        if per_microbatch_step or real:
            opt.step()
        if zero_grad is not None:  # mid-window with N: the window survives
            opt.zero_grad(set_to_none=zero_grad)
        elif real:
            opt.zero_grad()


# -- what a caller can observe, comparisons, a checkpoint's round trip -----------------------------

def _digest(obj, h) -> None:
    """Feed every tensor's bytes (with dtype and shape) and every scalar of a nested state to h."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}:".encode())
        for k in sorted(obj, key=repr):
            h.update(f"K{k!r}:".encode())
            _digest(obj[k], h)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else obj
        h.update(f"{type(obj).__name__}{len(items)}:".encode())
        for v in items:
            _digest(v, h)
    else:
        h.update(f"S{type(obj).__name__}{obj!r}:".encode())


def checksum(opt: AccumulatingOptimizer, model: nn.Module) -> str:
    """Everything a caller can observe: ``opt.state_dict()`` (every tensor's bytes and every
    scalar), the public counters, and each model param with its ``.grad`` and ``.main_grad``."""
    h = hashlib.sha256()
    _digest(opt.state_dict(), h)
    _digest([opt.micro_steps, opt.sync_step, opt.loss_scale, opt.skipped_steps,
             opt.skipped_microbatches, opt.last_grad_norm], h)
    for name, p in model.named_parameters():
        _digest([name, p, p.requires_grad, p.grad, getattr(p, "main_grad", None)], h)
    return h.hexdigest()


def count_hooks(model: nn.Module) -> int:
    """Tensor hooks (register_hook) and post-accumulate-grad hooks on the model's params."""
    return sum(len(p._backward_hooks or {}) + len(p._post_accumulate_grad_hooks or {})
               for p in model.parameters())


def assert_params_close(model, ref, atol=1e-6, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.isfinite(p).all(), f"{what}{name} is not finite"
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=atol,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


def all_close(tensors, refs, atol=1e-6) -> bool:
    return all(torch.allclose(a, b, rtol=0, atol=atol) for a, b in zip(tensors, refs))


def roundtrip(state):
    """Through torch.save / torch.load(weights_only=True), as a checkpoint goes."""
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def wrap_sgd(model, lr=0.1, **kw):
    """``AccumulatingOptimizer(SGD(lr))`` over small buckets unless ``bucket_size_mb`` is given."""
    kw.setdefault("bucket_size_mb", SMALL_BUCKET)
    return AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=lr), **kw)
