"""The fused master step under ``process_group`` on 2 and 4 gloo ranks (DESIGN: "process_group",
the fused master step): a bf16 model, fp32 masters, AdamW and SGD-momentum with ``fused=True``,
``reduction="mean"`` and ``max_grad_norm``.

The native judge runs in every rank beside the wrapper: fp32 masters stepped by torch's own fused
optimizer on the window all-reduced with ``dist.all_reduce``, clipped and normalised as the
wrapper folds it, then torch's cast. Each gradient is a multiple of 1/8 below 16 in magnitude
(the loss is ``sum(w * r)`` with such ``r``), so every fp32 sum of them -- over micro-batches and
over ranks, in any order, whatever way gloo splits the buffers -- is exact: the wrapper and the
judge must agree bit for bit (params, masters, every state tensor, losses, clip norms), and the
ranks with each other.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _spawn import run_scenario, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

N = 2
SHAPES = [(37, 13), (13,), (5, 37), (5,)]


def inner_of(kind: str, params) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, dampening=0.1, fused=True)


def r_of(rank: int, window: int, i: int) -> list[torch.Tensor]:
    """The micro-batch's gradients: multiples of 1/8 in [-16, 16) (exact in bf16 and in any fp32
    sum of a few of them)."""
    g = torch.Generator().manual_seed(1000 * window + 10 * i + rank)
    return [torch.randint(-128, 128, s, generator=g).float() / 8 for s in SHAPES]


def loss_of(weights, rs) -> torch.Tensor:
    return sum((w.float() * r).sum() for w, r in zip(weights, rs))


def scenario(rank: int, world: int, kind: str) -> dict:
    from accumkernels import AccumulatingOptimizer
    from accumkernels.optim.step import fused_master

    calls = []
    real = fused_master.step
    fused_master.step = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    torch.manual_seed(0)  # the same init on every rank
    init = [torch.randn(s) * 0.1 for s in SHAPES]
    weights = [torch.nn.Parameter(t.to(torch.bfloat16)) for t in init]
    opt = AccumulatingOptimizer(inner_of(kind, weights), accumulation_steps=N, reduction="mean",
                                max_grad_norm=0.5, process_group=dist.group.WORLD)
    ref_w = [t.to(torch.bfloat16) for t in init]
    masters = [t.float().clone().requires_grad_() for t in ref_w]
    ref = inner_of(kind, masters)
    out: dict = {"losses": [], "ref_losses": [], "norms": [], "ref_norms": []}
    for window in range(3):
        acc = [torch.zeros(s) for s in SHAPES]
        for i in range(N):
            rs = r_of(rank, window, i)
            loss = loss_of(weights, rs)
            loss.backward()
            out["losses"].append(loss.detach())
            out["ref_losses"].append(loss_of(ref_w, rs).detach())
            for a, r in zip(acc, rs):
                a.add_(r)
            opt.step()
            opt.zero_grad()
        for a in acc:
            dist.all_reduce(a)  # exact: any order gives the same sum
        factor = 1.0 / (N * world)  # "mean": the micro-batches of every rank
        norm = torch.nn.utils.get_total_norm(acc) * factor
        ref.grad_scale = torch.clamp((norm + 1e-6) / 0.5, min=1.0) / factor
        ref.found_inf = torch.zeros(())
        for m, a in zip(masters, acc):
            m.grad = a
        ref.step()
        del ref.grad_scale, ref.found_inf
        with torch.no_grad():
            for w, m in zip(ref_w, masters):
                w.copy_(m)
        out["norms"].append(opt.last_grad_norm.reshape(()))
        out["ref_norms"].append(norm.float().reshape(()))
    fused_master.step = real
    out["calls"] = len(calls)
    out["params"] = [w.detach().clone() for w in weights]
    out["ref_params"] = ref_w
    out["masters"] = [m.detach().clone() for m in opt.master_params]
    out["ref_masters"] = [m.detach().clone() for m in masters]
    out["state"] = [{k: v.clone() for k, v in opt.optimizer.state[w].items()} for w in weights]
    out["ref_state"] = [{k: v.clone() for k, v in ref.state[m].items()} for m in masters]
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    world = kwargs["world"]
    run_scenario(rank, out_dir, world,
                 lambda: {kind: scenario(rank, world, kind) for kind in ("adamw", "sgd")})


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("world", [2, 4])
def test_fused_master_step_on_ranks_equals_torch(world, tmp_path):
    ranks = spawn_ranks(_rank_main, str(tmp_path), f"fused_master_{world}", {"world": world},
                        world, timeout=240)
    for kind in ("adamw", "sgd"):
        for rank, res in enumerate(ranks):
            r = res[kind]
            assert r["calls"] == 3, f"{kind} rank {rank}: the fused master step did not run"
            for what in ("params", "masters", "losses", "norms"):
                for a, b in zip(r[what], r["ref_" + what], strict=True):
                    assert torch.equal(bits(a), bits(b)), f"{kind} rank {rank}: {what}"
            for mine, theirs in zip(r["state"], r["ref_state"], strict=True):
                assert sorted(mine) == sorted(theirs)
                for key in theirs:
                    assert torch.equal(bits(mine[key]), bits(theirs[key])), \
                        f"{kind} rank {rank}: state {key}"
            for a, b in zip(r["params"], ranks[0][kind]["params"], strict=True):
                assert torch.equal(bits(a), bits(b)), f"{kind}: rank {rank} differs from rank 0"
