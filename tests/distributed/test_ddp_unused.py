"""DDP with ``find_unused_parameters=True`` and a module that a window's ``no_sync`` micro-batches
use but its sync (last) micro-batch does not (an MoE expert, a conditional head; DESIGN:
"Multi-process jobs", ``find_unused_parameters`` included). 2 gloo ranks, a plain torch loop, K=4
micro-batches per window, 3 windows.

``extra`` is used, per window: 0: in micro-batches 0-2 on both ranks; 1: in micro-batch 1 on
rank 0 only (rank 1 contributes zeros to its average); 2: nowhere (globally unused: native
leaves its ``.grad`` None on the sync step, so AdamW neither decays nor steps it).

fp32: the wrapper adds the same fp32 gradients in the same order as AccumulateGrad and averages
them as DDP does (divide by the world size, then sum), so params after 3 AdamW steps must be
bit-identical to native DDP + AdamW. bf16 (wrapper built first, ``accumkernels.ddp_comm_hook``
registered on the DDP module afterwards: Accelerate's and the Trainer's order): the result is
written out by hand without DDP or the wrapper (bf16 gradients summed into an fp32 window,
averaged in fp32, AdamW on fp32 masters, copied back), to 1e-6 relative as in test_ddp.py.
Each scenario runs with two DDP bucket layouts: ``extra`` alone in a bucket (every param of it
unused in the sync backward) and one bucket for the whole model.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from _spawn import run_scenario, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

WORLD, K, WINDOWS, LR = 2, 4, 3, 1e-2
USES = [[{0, 1, 2}, {0, 1, 2}], [{1}, set()], [set(), set()]]  # [window][rank]: micro-batches
EXTRA = 4, 5  # indices of extra.weight and extra.bias in parameters()
# DDP buckets, filled in reverse registration order: extra.bias (16 B) + extra.weight (512 B)
# reach 520 B and close a bucket of their own; None: DDP's default, one bucket for everything.
BUCKET_CAPS = {"own_bucket": 520 / 2**20, "one_bucket": None}


class Gated(torch.nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(8, 32)
        self.head = torch.nn.Linear(32, 4)
        self.extra = torch.nn.Linear(32, 4)
        self.to(dtype)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        return self.head(h) + self.extra(h) if use_extra else self.head(h)


class Swapped(torch.nn.Module):
    """No param unused, but the order its gradients arrive in changes with the micro-batch:
    ``u`` first in the forward (its gradients last) when ``flag``, ``v`` first otherwise. In
    the wrapper's one bucket the last gradient to arrive completes it, the others wait: the
    param that waited in the ``no_sync`` micro-batches completes the bucket in the sync one."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        torch.manual_seed(0)
        self.u = torch.nn.Linear(8, 8)
        self.v = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 4)
        self.to(dtype)

    def forward(self, x: torch.Tensor, flag: bool) -> torch.Tensor:
        first, second = (self.u, self.v) if flag else (self.v, self.u)
        return self.head(torch.tanh(second(torch.tanh(first(x)))))


MODELS = {"gated": Gated, "swapped": Swapped}


def batch(rank: int, window: int, i: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(1000 * window + 10 * i + rank)
    return torch.randn(6, 8, generator=g).to(dtype), torch.randn(6, 4, generator=g).to(dtype)


def loss_of(model, rank: int, window: int, i: int, dtype: torch.dtype) -> torch.Tensor:
    x, y = batch(rank, window, i, dtype)
    out = model(x, i in USES[window][rank])
    return torch.nn.functional.mse_loss(out.float(), y.float()) / K


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def train(rank: int, dtype: torch.dtype, cap, wrap: str | None, net: str = "gated") -> dict:
    """Native DDP (``wrap`` None), or the wrapper given ``model=ddp`` ("model") or built first
    with the hook registered on DDP afterwards ("hook_later")."""
    import accumkernels
    from accumkernels import AccumulatingOptimizer

    # float64 starts from the bf16 model's rounded weights: its distance to a bf16 run then
    # measures the training, not the start
    model = Gated(torch.bfloat16).double() if dtype == torch.float64 else MODELS[net](dtype)
    if rank == 1:  # DDP broadcasts rank 0's params when it is built
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.25)
    opt = inner = torch.optim.AdamW(model.parameters(), lr=LR)
    size = {"bucket_size_mb": 0.0007} if net == "gated" else {}  # several / one bucket
    if wrap == "hook_later":
        opt = AccumulatingOptimizer(inner, **size)
    kwargs = {} if cap is None else {"bucket_cap_mb": cap}
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True, **kwargs)
    if wrap == "hook_later":
        ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)
    elif wrap == "model":
        opt = AccumulatingOptimizer(inner, model=ddp, **size)
    no_grad = []  # per window: which params' .grad is None on the sync step
    for window in range(WINDOWS):
        for i in range(K):
            sync = contextlib.nullcontext() if i == K - 1 else ddp.no_sync()
            with sync:
                loss_of(ddp, rank, window, i, dtype).backward()
        no_grad.append([p.grad is None for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return {"params": snapshot(model), "no_grad": no_grad}


def reference_bf16(rank: int) -> dict:
    """What the wrapper computes for the bf16 model, by hand: bf16 forward/backward, gradients
    summed into fp32 windows, averaged over ranks (divide, then sum), a param no rank has a
    gradient for left out of the step, AdamW on fp32 masters, copied back to bf16."""
    model = Gated(torch.bfloat16)
    params = list(model.parameters())
    masters = [p.detach().float().requires_grad_() for p in params]
    opt = torch.optim.AdamW(masters, lr=LR)
    for window in range(WINDOWS):
        sums = [torch.zeros_like(m) for m in masters]
        got = torch.zeros(len(params))
        for i in range(K):
            grads = torch.autograd.grad(loss_of(model, rank, window, i, torch.bfloat16), params,
                                        allow_unused=True)
            for k, (s, g) in enumerate(zip(sums, grads)):
                if g is not None:
                    s.add_(g.float())
                    got[k] = 1
        dist.all_reduce(got)
        for k, (m, s) in enumerate(zip(masters, sums)):
            s.div_(WORLD)
            dist.all_reduce(s)
            m.grad = s if got[k] else None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {"params": snapshot(model)}


RUNS = {"native": (torch.float32, None), "model": (torch.float32, "model"),
        "hook_later": (torch.float32, "hook_later"),
        "bf16_hook_later": (torch.bfloat16, "hook_later"), "bf16_native": (torch.bfloat16, None),
        "f64_native": (torch.float64, None)}


def scenario(rank: int) -> dict:
    """Every run; one that raises is recorded (both ranks raise at the same point), not fatal."""
    out = {"bf16_reference": reference_bf16(rank), "swapped": {}}
    for name in ("native", "model"):
        try:
            out["swapped"][name] = train(rank, torch.float32, None, RUNS[name][1], "swapped")
        except Exception as exc:  # noqa: BLE001 - the test reports it
            out["swapped"][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    for layout, cap in BUCKET_CAPS.items():
        out[layout] = {}
        for name, (dtype, wrap) in RUNS.items():
            try:
                out[layout][name] = train(rank, dtype, cap, wrap)
            except Exception as exc:  # noqa: BLE001 - the test reports it
                out[layout][name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    run_scenario(rank, out_dir, WORLD, lambda: scenario(rank))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every run in one pair of processes (start-up dominates)."""
    return spawn_ranks(_rank_main, str(tmp_path_factory.mktemp("ddp_unused")), "unused", {},
                       WORLD, timeout=120)


def result(res: dict, layout: str, name: str) -> dict:
    run = res[layout][name]
    assert "error" not in run, f"{layout}, {name}: {run['error']}"
    return run


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if not torch.equal(x, y):
            return f"param {i}: max |diff| {(x.double() - y.double()).abs().max().item():.3g}"
    return None


def distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b)) ** 0.5


@pytest.mark.parametrize("layout", list(BUCKET_CAPS))
@pytest.mark.parametrize("wrap", ["model", "hook_later"])
def test_fp32_equals_native_ddp_bit_for_bit(ranks, layout, wrap):
    for rank, res in enumerate(ranks):
        native, ours = result(res, layout, "native"), result(res, layout, wrap)
        start = snapshot(Gated(torch.float32))
        for k in EXTRA:  # every window moved extra natively (windows 0 and 1 step it)
            assert not torch.equal(native["params"][k], start[k])
        assert native["no_grad"] == [[False] * 6, [False] * 6, [False] * 4 + [True] * 2]
        assert ours["no_grad"] == native["no_grad"], f"rank {rank}: .grad None elsewhere"
        diff = first_difference(ours["params"], native["params"])
        assert diff is None, f"{layout}, {wrap}, rank {rank}: {diff}"


def test_gradients_arriving_in_another_order_in_the_sync_backward(ranks):
    """A gradient held for its bucket in ``no_sync`` micro-batches but completing the bucket
    in the sync one: DDP, which counted it locally used, must not find its ``.grad`` gone."""
    for rank, res in enumerate(ranks):
        native, ours = result(res, "swapped", "native"), result(res, "swapped", "model")
        assert not torch.equal(native["params"][0], snapshot(Swapped(torch.float32))[0])
        diff = first_difference(ours["params"], native["params"])
        assert diff is None, f"rank {rank}: {diff}"


def test_globally_unused_window_leaves_the_param_alone(ranks):
    """Window 2 uses ``extra`` nowhere: native skips it in AdamW (no decay, no moment step);
    a wrapper that handed AdamW a zero gradient would move it (lr * weight_decay * p, and the
    moments of windows 0-1) and fail the bit-for-bit test; here also its .grad is None."""
    for res in ranks:
        for layout in BUCKET_CAPS:
            for run in ("native", "model", "hook_later", "bf16_hook_later"):
                no_grad = result(res, layout, run)["no_grad"]
                assert no_grad[2][EXTRA[0]:] == [True, True], (layout, run)


@pytest.mark.parametrize("layout", list(BUCKET_CAPS))
def test_bf16_hook_registered_later_matches_the_fp32_window_reference(ranks, layout):
    for rank, res in enumerate(ranks):
        ours = result(res, layout, "bf16_hook_later")["params"]
        reference = res["bf16_reference"]["params"]
        assert all(p.dtype == torch.bfloat16 for p in ours)
        for i, (a, b) in enumerate(zip(ours, reference)):
            err = (a.double() - b.double()).abs().max().item()
            assert err <= 1e-6 * b.double().abs().max().item(), f"{layout}, rank {rank}, {i}"
        f64 = result(res, layout, "f64_native")["params"]
        native = result(res, layout, "bf16_native")["params"]
        assert distance(ours, f64) < distance(native, f64), rank
    a, b = (res[layout]["bf16_hook_later"]["params"] for res in ranks)
    assert first_difference(a, b) is None, "ranks disagree"
