"""A checkpoint of a ``process_group`` wrapper with ``accumulation_steps=N`` (DESIGN:
"state_dict()/load_state_dict()", "process_group"). The window's buckets are summed across the
ranks during its last backward (overlapped); a state dict taken after that backward and before
``step()`` holds those sums. Resuming from it must not sum them again (the reducer's progress is
part of the checkpoint): every rank saving and loading its own state dict resumes bit-identical
to not stopping, at every cut -- before the last backward (rank-local window), after it (summed;
also when one more backward past N follows the resume: the sums are turned back into shares),
and after that backward past N. 2 gloo ranks, fp32, SGD
with momentum (its step is linear in the gradient: a doubled window shows) and AdamW.

A checkpoint holding summed buckets names that in its bookkeeping; loaded into a wrapper that
does not reduce over the same ranks (no ``process_group``) it is refused, nothing changed.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
from _spawn import run_scenario, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

N, WORLD = 3, 2
# name: (backwards into window 1 at the cut, window 1 has one micro-batch past N)
CUTS = {"mid": (1, False), "after_last_backward": (N, False),
        "summed_then_past_n": (N, True), "past_n": (N + 1, True)}


class Net(torch.nn.Module):
    """An MLP and a side branch that the window's last micro-batch leaves out: its bucket is
    not moved during that backward, and is summed with the others when the window is agreed on
    at its end."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(),
                                        torch.nn.Linear(12, 3))
        self.side = torch.nn.Linear(6, 3)

    def forward(self, x, side: bool):
        return self.body(x) + self.side(x) if side else self.body(x)


def build(inner: str, params=None):
    from accumkernels import AccumulatingOptimizer

    torch.manual_seed(0)
    model = Net()
    if params is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params):
                p.copy_(saved)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9) if inner == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=1e-2))
    # bucket_size_mb tiny: several buckets, so the overlapped sums are per bucket
    return model, AccumulatingOptimizer(opt, accumulation_steps=N, bucket_size_mb=1e-4,
                                        process_group=dist.group.WORLD)


def backward(model, rank: int, window: int, i: int) -> None:
    g = torch.Generator().manual_seed(1000 * window + 10 * i + rank)
    x, y = torch.randn(5, 6, generator=g), torch.randn(5, 3, generator=g)
    torch.nn.functional.mse_loss(model(x, side=i != N - 1), y).backward()


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(inner: str, rank: int, cut: int | None, extra: bool) -> dict:
    """Windows 0, 1 and 2; window 1 with one micro-batch past N when ``extra`` (its step()
    after the N-th backward is left out, as a loop that steps at its own count would); at
    ``cut`` backwards into window 1, the state dict and a rebuilt model and wrapper."""
    model, opt = build(inner)
    out: dict = {}
    for window in range(3):
        last = N + (extra and window == 1)
        for i in range(last):
            backward(model, rank, window, i)
            if window == 1 and i + 1 == cut:
                sd = copy.deepcopy(opt.state_dict())
                own = json.loads(sd["param_groups"][0]["accumkernels"])
                out["summed"] = own["window"].get("summed")
                params = snapshot(model)
                opt.remove_hooks()
                model, opt = build(inner, params)
                opt.load_state_dict(sd)
            if i + 1 == last:
                opt.step()
                opt.zero_grad()
    out["params"] = snapshot(model)
    return out


def refused_without_the_group(rank: int) -> dict:
    """A state dict with summed buckets into a wrapper without process_group: refused."""
    from accumkernels import AccumulatingOptimizer

    model, opt = build("sgd")
    for i in range(N):
        backward(model, rank, 0, i)
    sd = opt.state_dict()
    torch.manual_seed(0)
    other_model = Net()
    other = AccumulatingOptimizer(torch.optim.SGD(other_model.parameters(), lr=0.05),
                                  accumulation_steps=N, independent_ranks=True)
    try:
        other.load_state_dict(sd)
    except ValueError as exc:
        return {"refused": str(exc), "untouched": other.micro_steps == 0}
    return {"refused": None}


def scenario(rank: int) -> dict:
    out = {}
    for inner in ("sgd", "adamw"):
        out[inner] = {"straight": train(inner, rank, None, False)["params"],
                      "straight_past_n": train(inner, rank, None, True)["params"]}
        for name, (cut, extra) in CUTS.items():
            out[inner][name] = train(inner, rank, cut, extra)
    out["refused"] = refused_without_the_group(rank)
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, WORLD, lambda: scenario(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, str(tmp_path_factory.mktemp("pg_ckpt")), "pg_ckpt", {},
                       WORLD, timeout=240)


@pytest.mark.parametrize("inner", ["sgd", "adamw"])
@pytest.mark.parametrize("cut", sorted(CUTS))
def test_every_rank_its_own_state_dict_resumes_exactly(ranks, cut, inner):
    for rank, res in enumerate(ranks):
        run = res[inner][cut]
        straight = res[inner]["straight_past_n" if CUTS[cut][1] else "straight"]
        for a, b in zip(run["params"], straight, strict=True):
            assert torch.equal(a, b), \
                f"rank {rank}, cut {cut}: max |diff| {(a - b).abs().max().item():.3g}"
        if CUTS[cut][0] >= N:  # one bucket per param (tiny buckets): the window is reduced and
            # agreed on at its last backward (p.grad shows the final average), the side's too
            assert run["summed"] == list(range(6)), f"rank {rank}: {run['summed']}"
        else:
            assert run["summed"] is None, f"rank {rank}: {run['summed']}"


def test_summed_buckets_are_refused_without_the_group(ranks):
    for rank, res in enumerate(ranks):
        r = res["refused"]
        assert r["refused"] and "summed" in r["refused"], f"rank {rank}: {r}"
        assert r["untouched"]
