"""The conformance matrix's multi-process part: rank processes on gloo (one launch per world
size runs every case of its layouts in turn; each launch under a deadline).

Every case trains the same small MLP twice on every rank, natively and with the wrapper, over
2 windows of 3 micro-batches (data per data-parallel rank; tensor-parallel peers see the same),
and compares params, clip norms and skipped steps after every step on this rank. Native
semantics per layout: DDP with ``no_sync`` but on the window's last micro-batch; plain ranks
all-reducing (averaging) ``.grad`` before the step (``process_group``); FSDP2 / HSDP / FSDP2+TP
reduce-scattering (averaging) every micro-batch. ``mean`` divides by the micro-batches, weighted
by the weights of the data-parallel ranks' micro-batches (each counted once).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _matrix_axes import OPTIMIZERS, REDUCTIONS
from _spawn import run_scenario, spawn_ranks

WINDOWS, MICRO, BATCH, CLIP = 2, 3, 4, 0.05
NAN_AT = (1, 1)
# which launch runs a layout's cases (world size, and the guard's own launch: a rank that
# raises inside a schedule must not strand the next cases)
LAUNCH = {"ddp": "w2", "process_group": "w2", "fsdp2": "w2", "pipe-gpipe": "w2",
          "pipe-zbv": "w2", "hsdp": "w4", "fsdp2-tp": "w4", "pipe-zbv-forgotten": "w2-guard"}
WORLD = {"w2": 2, "w4": 4, "w2-guard": 2, "w2-ranks": 2}


def launch_of(case: dict) -> str:
    """A case's launch: ranks that disagree run in a launch of their own (a rank left waiting
    must not strand the other cases)."""
    if case.get("ranks") in ("missing-weight", "extra-step"):
        return "w2-ranks"
    return LAUNCH[case["layout"]]


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 12)  # (tensor parallel: colwise, then rowwise: every
        self.l2 = torch.nn.Linear(12, 3)  # param on the 2-D mesh, as clip_grad_norm_ needs)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


# ranks: what one rank (rank 1) does differently. zero-weight: its micro-batch (0, 1) fully
# masked (loss x 0, add_weight(0)), natively the per-token mean over the ranks; missing-weight:
# it leaves out add_weight for (0, 1); extra-step: it calls step() after (0, 1) (no N); the last
# two have no native run: an error naming the cause on every rank, or ranks in lockstep, is
# expected. no_sync-all: DDP's no_sync() on every micro-batch, the last one too (native: the sync
# on the last), on every rank.
ODD_RANK, ODD_AT = 1, (0, 1)
DDP_OPTIONS = {"ddp-bucket-view": {"gradient_as_bucket_view": True},
               "ddp-static-graph": {"static_graph": True},
               "ddp-small-buckets": {"bucket_cap_mb": 1e-4},
               "ddp-find-unused": {"find_unused_parameters": True}}


def _shard_options(engine: str) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if engine == "fsdp2-no-reshard":
        return {"reshard_after_forward": False}
    if engine == "fsdp2-mp":
        return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                  reduce_dtype=torch.float32)}
    return {}


def _build(layout: str, engine: str = "default"):
    """(model, the module to call, data-parallel rank, data-parallel size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as _fully_shard

    def fully_shard(module, **kw):
        return _fully_shard(module, **kw, **_shard_options(engine))

    torch.manual_seed(0)
    model = Net()
    rank, world = dist.get_rank(), dist.get_world_size()
    if layout == "ddp":
        return model, torch.nn.parallel.DistributedDataParallel(
            model, **DDP_OPTIONS.get(engine, {})), rank, world
    if layout == "process_group":
        return model, model, rank, world
    if layout == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        fully_shard(model.l1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model, rank, world
    if layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
        fully_shard(model.l1, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model, rank, world
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], {"l1": ColwiseParallel(), "l2": RowwiseParallel()})
    fully_shard(model.l1, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    return model, model, mesh["dp"].get_local_rank(), 2


def _data(dp_rank: int, w: int, i: int):
    g = torch.Generator().manual_seed(100 * dp_rank + 10 * w + i)
    x, y = torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 3, generator=g)
    return x, y, float(torch.randint(1, 9, (1,), generator=g).item())


def _full(t):
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def train(case: dict, wrap: bool) -> list[dict]:
    """One run of the case on this rank; a record per step."""
    from accumkernels import AccumulatingOptimizer

    layout, red = case["layout"], REDUCTIONS[case["reduction"]]
    acts = case.get("ranks", "none")
    odd = dist.get_rank() == ODD_RANK
    model, net, dp_rank, dp_size = _build(layout, case.get("engine", "default"))
    opt = OPTIMIZERS[case["optimizer"]].build(model.parameters())
    n = MICRO if case["accum"] == "N" else None
    if wrap:
        kw = {"model": net} if layout != "process_group" else {
            "process_group": dist.group.WORLD}
        opt = AccumulatingOptimizer(opt, accumulation_steps=n, reduction=red.name,
                                    max_grad_norm=CLIP if case["clip"] == "max_grad_norm"
                                    else None, **kw)
    weighted, records = red.name == "weighted", []
    for w in range(WINDOWS):
        weights = []
        for i in range(MICRO):
            last = i == MICRO - 1
            x, y, weight = _data(dp_rank, w, i)
            at_odd = odd and (w, i) == ODD_AT
            if acts == "zero-weight" and at_odd:
                weight = 0.0
            weights.append(weight)
            # (torch's reducer refuses no_sync() under static_graph natively, an internal assert
            # 'expect_autograd_hooks_': a static-graph job syncs every micro-batch)
            sync = (last and not (wrap and acts == "no_sync-all")) or layout != "ddp" \
                or case.get("engine") == "ddp-static-graph"
            ctx = net.no_sync() if not sync else _null()
            report = wrap and weighted and not (acts == "missing-weight" and at_odd)
            with ctx:
                # (in fp32: torch 2.11 cannot backward mse_loss of a bf16 output (fsdp2-mp)
                # against an fp32 target, natively too)
                loss = F.mse_loss(net(x).float(), y, reduction="sum" if weighted else "mean")
                if case["nonfinite"] != "none" and (w, i) == NAN_AT and dist.get_rank() == 0:
                    loss = loss * float("nan")
                if acts == "zero-weight" and at_odd:
                    loss = loss * 0.0
                if report and not red.weight_after:
                    opt.add_weight(weight)
                loss.backward()
                if report and red.weight_after:
                    opt.add_weight(weight)
            if wrap and n is not None and not last:
                opt.step()
                opt.zero_grad()
            if wrap and acts == "extra-step" and at_odd:
                opt.step()
        records.append(_step(case, model, opt, wrap, weights, dp_size))
    if wrap:
        opt.remove_hooks()
    return records


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _step(case, model, opt, wrap, weights, dp_size) -> dict:
    params = [p for p in model.parameters() if p.grad is not None]
    rec = {"norm": None, "skipped": False}
    if not wrap:
        grads = [p.grad for p in params]
        if case["layout"] == "process_group":
            for g in grads:
                dist.all_reduce(g)
                g.div_(dist.get_world_size())
        red = REDUCTIONS[case["reduction"]].name
        if red == "mean":
            torch._foreach_mul_(grads, 1.0 / MICRO)
        elif red == "weighted":
            total = torch.tensor(sum(weights))
            dist.all_reduce(total)
            # grads are averaged over the dp ranks; tensor-parallel peers reported the same
            # micro-batch: the dp total is S dp/world, and S/world what the average divides by
            torch._foreach_mul_(grads, dist.get_world_size() / total.item())
        bad = torch.tensor(float(not all(bool(torch.isfinite(_local(g)).all()) for g in grads)))
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        if bad.item():
            rec["skipped"] = True
            opt.zero_grad()
            return _observe(rec, model)
    if case["clip"] == "user" or (case["clip"] == "max_grad_norm" and not wrap):
        rec["norm"] = _full(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    skipped = opt.skipped_steps if wrap else 0
    opt.step()
    if wrap:
        rec["skipped"] = opt.skipped_steps > skipped
        if case["clip"] == "max_grad_norm" and not rec["skipped"]:
            rec["norm"] = _full(opt.last_grad_norm)
    if rec["skipped"]:
        rec["norm"] = None
    opt.zero_grad()
    return _observe(rec, model)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _observe(rec: dict, model) -> dict:
    rec["params"] = {n: _full(p) for n, p in model.named_parameters()}
    return rec


def zbv_schedule() -> str:
    """The pipe-zbv layouts' schedule: ZBVZeroBubble, or on a torch that cannot run a V schedule
    on gloo even natively (_pipelining_workers.V_ON_GLOO: 2.11) InterleavedZeroBubble, the other
    schedule whose stages' weight passes come apart from their input passes."""
    from _pipelining_workers import V_ON_GLOO
    return "ZBVZeroBubble" if V_ON_GLOO else "InterleavedZeroBubble"


def train_pipe(case: dict, wrap: bool) -> list[dict]:
    """A pipeline case (2 ranks, _pipelining_workers.run_pipeline: AdamW, 4 micro-batches per
    schedule step, 3 steps); one record: every local stage's params and the clip norms. The
    native reference: the schedule's scale_grads for sum and mean, the summed loss divided by
    the weights for weighted, torchtitan's clip by the whole pipeline's norm."""
    from _pipelining_workers import N_MB, run_pipeline

    red = REDUCTIONS[case["reduction"]].name
    schedule = "GPipe" if case["layout"] == "pipe-gpipe" else zbv_schedule()
    kw = {"pp_rank": dist.get_rank(), "pp_size": dist.get_world_size(),
          "fused": case["optimizer"].endswith("fused")}
    clip = case["clip"] == "max_grad_norm"
    nan = case["nonfinite"] != "none"
    if clip:
        kw["clip"] = CLIP
    if red == "weighted":
        kw.update(weighted=True, scale_grads=False)
    if not wrap:
        kw.update(native_divide_by_weight=red == "weighted", native_clip_across=clip,
                  native_skip_nan_step=nan)
        out = run_pipeline(schedule, **kw)
    else:
        wrapper = {"reduction": red}
        if case["accum"] == "N":
            wrapper["accumulation_steps"] = N_MB
        if red == "mean":
            kw["scale_grads"] = False
        out = run_pipeline(schedule, wrapper=wrapper, stage_norm=clip, nan=nan, **kw)
    stages = sorted(k for k in out if isinstance(k, int))
    params = {f"stage{i}.{k}": t for i in stages for k, t in enumerate(out[i]["params"])}
    # (the wrapper's: every local stage's last_grad_norm, the whole pipeline's: the first)
    norms = [n[0] if isinstance(n, list) else n for n in out["norms"]]
    if nan:  # the skipped step's norm: the NaN run's against a native run without the NaN
        from _pipelining_workers import NAN_STEP
        norms = [n for k, n in enumerate(norms) if k != NAN_STEP]
    norm = torch.tensor(norms, dtype=torch.float64) if norms else None
    return [{"skipped": False, "norm": norm, "params": params}]


def train_forgotten(case: dict) -> str | None:
    """ZBV with accumulate_weight_passes(stages) left out: the contract (issue 37, item 4) is a
    clear error naming it, on every rank, before anything is stepped."""
    import accumkernels.integrations.pipelining as pipelining

    line = pipelining.accumulate_weight_passes
    pipelining.accumulate_weight_passes = lambda stages: None  # the user forgot it
    try:
        train_pipe(dict(case, layout="pipe-zbv"), wrap=True)
    except Exception as exc:  # noqa: BLE001 -- what it raises is checked
        if "accumulate_weight_passes" in str(exc):
            return None
        return f"raised without naming accumulate_weight_passes: {type(exc).__name__}: {exc}"
    finally:
        pipelining.accumulate_weight_passes = line
    return "no error without accumulate_weight_passes(stages): the run went on silently"


def compare(case: dict, native: list, ours: list) -> str | None:
    """The first departure (a message), or None."""
    for k, (a, b) in enumerate(zip(ours, native)):
        if a["skipped"] != b["skipped"]:
            return f"step {k}: the wrapper {'skipped' if a['skipped'] else 'stepped'}, " \
                   f"native {'skipped' if b['skipped'] else 'stepped'}"
        if a["norm"] is not None and b["norm"] is not None and a["norm"].shape != \
                b["norm"].shape:
            return f"step {k}: clip norms of shape {tuple(a['norm'].shape)}, native's " \
                   f"{tuple(b['norm'].shape)}"
        pairs = [("clip norm", a["norm"], b["norm"])] + [
            (f"param[{n}]", a["params"][n], b["params"][n]) for n in b["params"]]
        for name, x, y in pairs:
            if x is None or y is None:
                if (x is None) != (y is None):
                    return f"step {k}: {name} missing on one side"
                continue
            d = (x.double() - y.double()).abs().max().item()
            rel = d / max(y.double().abs().max().item(), 1e-30)
            if not rel <= 1e-6:
                return f"step {k}: {name} differs by {d:.4g} (relative {rel:.3g} > 1e-06)"
    return None


def train_disagreeing(case: dict) -> str | None:
    """ranks=missing-weight / extra-step: one rank's action has no native run. Expected: an
    error naming the cause on every rank (before any collective that would wait forever), or
    the ranks in lockstep (the same params everywhere)."""
    raised = ""
    try:
        records = train(case, wrap=True)
    except Exception as exc:  # noqa: BLE001 -- what it raises is checked
        raised, records = f"{type(exc).__name__}: {exc}", None
    named = bool(raised) and any(k in raised for k in ("add_weight", "weight", "step()"))
    flat = torch.cat([t.flatten() for t in records[-1]["params"].values()]) if records else \
        torch.zeros(0)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (bool(raised), named, flat.tolist()))
    if any(r for r, _, _ in every):
        if all(r and nm for r, nm, _ in every):
            return None
        return f"raised on some ranks only or without naming the cause: {raised or 'nothing'}"
    if all(f == every[0][2] for _, _, f in every):
        return None
    return "no error, and the ranks' params differ (they diverged silently)"


def run_cases(cases: dict) -> dict:
    out = {}
    for cid, case in cases.items():
        layout = case["layout"]
        run = train_pipe if layout.startswith("pipe") else train
        try:
            if layout == "pipe-zbv-forgotten":
                out[cid] = train_forgotten(case)
                continue
            if case.get("ranks") in ("missing-weight", "extra-step"):
                out[cid] = train_disagreeing(case)
                continue
            out[cid] = compare(case, run(case, wrap=False), run(case, wrap=True))
        except Exception as exc:  # noqa: BLE001 -- reported per case
            out[cid] = f"raised {type(exc).__name__}: {exc}"
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, kwargs["world"], lambda: run_cases(kwargs["cases"]))


def launch(out_dir: str, name: str, cases: dict, timeout: float) -> dict:
    """{case id: departure message or None} (the first rank's that departs)."""
    world = WORLD[name]
    results = spawn_ranks(_rank_main, out_dir, f"conformance-{name}",
                          {"world": world, "cases": cases}, world, timeout)
    merged = {}
    for cid in cases:
        msgs = [f"rank {r}: {res[cid]}" for r, res in enumerate(results) if res[cid]]
        merged[cid] = msgs[0] if msgs else None
    return merged
