"""Rank processes for test_zero_weight_ranks.py: ``reduction="weighted"`` with micro-batches
that have no rows (``add_weight(0)``) on 2 gloo ranks, under FSDP2 and, as the control, DDP
(_spawn.py: a FileStore, a deadline, the result before teardown).

Each rank's micro-batch ``(w, i)`` has :func:`rows` rows. The zero-row micro-batches:

* window 0: rank 1's first micro-batch (the first write of a window is a zero gradient);
* window 1: every micro-batch of rank 1 (its window weight is 0; rank 0's is not);
* window 2: rank 0's last micro-batch (the window's N-th backward carries weight 0).

``kind="empty"``: the micro-batch really has no rows (``x[:0]``; the summed loss is 0 and its
gradients are zeros); ``kind="masked"``: it keeps its rows and the loss is multiplied by 0.

Native: the loss is summed over the rows; FSDP2 sums the reduce-scatters
(``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms(True)``: the wrapper's
own settings), DDP averages over the ranks; after the window's last backward the loop multiplies
``.grad`` by 1 / (the rows of every rank's window) (DDP: by world / rows), so the step uses the
per-row mean gradient over the window. SGD without clipping: the step is linear in the
gradient, so a wrong divisor (or a zero micro-batch that is not zero) shows in the params.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from _spawn import run_scenario, spawn_ranks

ACCUM = 3  # micro-batches per window
WINDOWS = 3
LR = 0.1
ZERO = {(0, 1, 0), (1, 1, 0), (1, 1, 1), (1, 1, 2), (2, 0, ACCUM - 1)}  # (window, rank, i)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 24)
        self.l2 = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def rows(w: int, rank: int, i: int) -> int:
    """Rows of rank ``rank``'s micro-batch ``i`` in window ``w`` (different sizes: the
    weights matter)."""
    return 0 if (w, rank, i) in ZERO else 2 + (w + 2 * rank + i) % 5


def data(w: int, rank: int, i: int, kind: str):
    g = torch.Generator().manual_seed(1000 * rank + 10 * w + i)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 3, generator=g)
    n = rows(w, rank, i)
    keep = n if n or kind == "empty" else 6  # masked: rows present, the loss times 0
    return x[:keep], y[:keep], n


def build(layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    if layout == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.l1, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def _local(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return (t.to_local() if hasattr(t, "to_local") else t).clone()


def train(layout: str, kind: str, *, wrap: bool, weight_first: bool = False,
          accumulation_steps: int | None = ACCUM) -> dict:
    """Three windows; returned: ``p.grad`` (this rank's shard) after each window's last
    backward and weight (native: once divided), and the params after each step."""
    from accumkernels import AccumulatingOptimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    model, net = build(layout)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, model=net,
                                    reduction="weighted")
    elif layout == "fsdp2":  # natively summed over the ranks, as the wrapper has FSDP2 do
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
    grads, params = [], []
    for w in range(WINDOWS):
        for i in range(ACCUM):
            x, y, n = data(w, rank, i, kind)
            if wrap and weight_first:
                opt.add_weight(n)
            last = i == ACCUM - 1
            ctx = net.no_sync() if layout == "ddp" and not last else contextlib.nullcontext()
            with ctx:
                loss = ((net(x) - y) ** 2).sum()
                (loss if n else loss * 0.0).backward()
            if wrap and not weight_first:
                opt.add_weight(n)
        if not wrap:
            total = torch.tensor(float(sum(rows(w, r, k) for r in range(world)
                                           for k in range(ACCUM))))
            factor = (world if layout == "ddp" else 1.0) / total.item()
            torch._foreach_mul_([p.grad for p in model.parameters()], factor)
        grads.append([_local(p.grad) for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        params.append([_local(p) for p in model.parameters()])
    if wrap:
        opt.remove_hooks()
    return {"grads": grads, "params": params}


RUNS = {  # name -> train() kwargs, per layout and kind
    "after": {}, "before": {"weight_first": True},
    "after_none": {"accumulation_steps": None},
    "before_none": {"weight_first": True, "accumulation_steps": None},
}


def _all() -> dict:
    out = {}
    for layout in ("fsdp2", "ddp"):
        for kind in ("empty", "masked"):
            out[(layout, kind, "native")] = train(layout, kind, wrap=False)
            for name, kwargs in RUNS.items():
                out[(layout, kind, name)] = train(layout, kind, wrap=True, **kwargs)
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, 2, _all)


def run_ranks(tmp_path, timeout: float = 300.0) -> list[dict]:
    """Every layout, kind and run on 2 spawned ranks; each rank's results."""
    return spawn_ranks(_rank_main, str(tmp_path), "zero_weight", {}, 2, timeout)
