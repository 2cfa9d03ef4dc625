"""Rank processes for test_pipelining.py: every ``torch.distributed.pipelining`` schedule, native
and with one AccumulatingOptimizer per stage, on spawned gloo ranks (see _spawn.py: a FileStore,
a deadline per launch, the result written before teardown, a barrier, ``os._exit``).

The model: a 4-layer MLP (16 -> 32 -> 32 -> 32 -> 4, Tanh between), the same init on every rank
(seeded), split into 2 stages (one per rank: GPipe, 1F1B) or 4 stages (two per rank: the looped
schedules round-robin, the V schedules ZBVZeroBubble and DualPipeV in a V). Every schedule step
runs N_MB = 4 micro-batches of MICRO samples; the data is the same on every rank of a pipeline
(only stage 0 reads the input, only the last stage the target), each data-parallel replica's
its own.

The target carries a per-sample weight column ``m`` (1, or 0/1 for the weighted runs): the loss is
``((out - y)**2 * m).mean()`` (or ``.sum()`` for ``reduction="weighted"``), so a native reference
can drop a micro-batch exactly (``m = 0``: its gradient is exactly 0) where the wrapper drops a
non-finite one.

A run (:func:`run_pipeline`) returns, per local stage index, the params after STEPS schedule
steps (float64 copies of the exact values), the start, the fp32 masters of bf16 runs and the
wrapper's counters. Scenarios, one process launch each (start-up of the ranks dominates):
``schedules`` (2 ranks: every schedule x every case), ``guard_and_clip`` (2 ranks: the
refusals, clipping by the pipeline's norm), ``two_d`` (4 ranks: 2 stages x 2 replicas).
"""

from __future__ import annotations

import csv
import os
import tempfile

import torch
import torch.distributed as dist

from _spawn import run_scenario, spawn_ranks

N_MB = 4  # micro-batches per schedule step (= accumulation_steps)
MICRO = 4  # samples per micro-batch
STEPS = 3  # schedule steps (optimizer steps) per run
LR = 1e-2
BF16_LR = 1e-3
WIDTHS = (16, 32, 32, 32, 4)
NAN_STEP, NAN_MB = 1, 2  # where the non-finite micro-batch sits (a middle one of a middle step)
LOSS_SCALE = 1024.0
CLIP = 0.05  # below every window's whole-model norm: clipping always takes effect
WIDE = 512  # hidden width of the runs whose all-reduce takes long enough to be raced

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
             "ZBVZeroBubble", "DualPipeV", "CustomCSV")
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV", "CustomCSV")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# torch 2.11's multi-stage schedules warm every link between neighbouring stages up with a p2p
# send, the link between the two stages a V places on one rank included; gloo cannot send to its
# own rank ("Pair is not connected"), so a V schedule fails on gloo in its first step natively,
# without the wrapper (measured: 2.11.0 fails; 2.13.0 and 2.14.1 run; 2.12.0's source has the
# new warm-up, which skips those links).
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
V_ON_GLOO = _TORCH >= (2, 12)
V_SKIP_REASON = (f"torch {torch.__version__}'s V schedules (ZBVZeroBubble, DualPipeV) send their "
                 "warm-up to the stage on their own rank, which gloo cannot: they fail natively "
                 "(torch >= 2.12 runs them)")


# DDP around a stage's module (static_graph=True): torch 2.11's reducer fails its internal assert
# ``expect_autograd_hooks_`` in the stage's backward, natively (measured: 2.11.0 fails, 2.13.0 and
# 2.14.1 run; 2.12 not run).
DDP_IN_STAGE = _TORCH >= (2, 13)
DDP_SKIP_REASON = (f"torch {torch.__version__}'s DDP reducer fails inside a pipeline stage "
                   "(expect_autograd_hooks_ INTERNAL ASSERT), natively: torch >= 2.13 runs it")


def runnable(names) -> tuple[str, ...]:
    """``names`` without the V schedules where this torch cannot run them on gloo."""
    return tuple(n for n in names if V_ON_GLOO or n not in V_SCHEDULES)


# -- the model, its stages and the data -----------------------------------------------------------
def first_inputs(stages, x: torch.Tensor) -> tuple:
    """The schedule's inputs on this rank: ``x`` where it holds the first stage, else none
    (torch 2.11's single-stage schedules refuse inputs on another stage)."""
    return (x,) if any(s.is_first for s in stages) else ()


def layers(dtype: torch.dtype = torch.float32, widths=WIDTHS) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(a, b).to(dtype) for a, b in zip(widths, widths[1:])]


def stage_module(index: int, num_stages: int, dtype: torch.dtype,
                 widths=WIDTHS) -> torch.nn.Module:
    """Stage ``index`` of ``num_stages`` (2 or 4) of the MLP; Tanh after every Linear but the
    last one."""
    all_layers = layers(dtype, widths)
    per = len(all_layers) // num_stages
    mods: list[torch.nn.Module] = []
    for k in range(index * per, (index + 1) * per):
        mods.append(all_layers[k])
        if k < len(all_layers) - 1:
            mods.append(torch.nn.Tanh())
    return torch.nn.Sequential(*mods)


def stage_indices(schedule: str, pp_rank: int, pp_size: int) -> tuple[list[int], int]:
    """The stage indices this pipeline rank holds (in the order the schedule wants) and the
    number of stages."""
    if schedule in ("GPipe", "1F1B"):
        return [pp_rank], pp_size
    num = 2 * pp_size
    if schedule in ("ZBVZeroBubble", "DualPipeV"):  # V: rank r holds r and 2P-1-r
        return [pp_rank, num - 1 - pp_rank], num
    return [pp_rank, pp_rank + pp_size], num  # looped: round-robin


def batch(step: int, dtype: torch.dtype = torch.float32, *, nan: bool = False,
          mask_nan_mb: bool = False, weighted: bool = False, replica: int = 0):
    """(x, target) of one schedule step: N_MB * MICRO samples; target = [y | m]. ``replica``:
    each data-parallel replica of the pipeline sees its own data."""
    g = torch.Generator().manual_seed(1000 + step + 100 * replica)
    x = torch.randn(N_MB * MICRO, WIDTHS[0], generator=g)
    y = torch.randn(N_MB * MICRO, WIDTHS[-1], generator=g)
    if weighted:
        m = (torch.rand(N_MB * MICRO, 1, generator=g) < 0.6).float()
        m[::MICRO] = 1.0  # every micro-batch has a weight > 0
    else:
        m = torch.ones(N_MB * MICRO, 1)
    rows = slice(NAN_MB * MICRO, (NAN_MB + 1) * MICRO)
    if nan:
        x[rows.start + 1, 3] = float("nan")
    if mask_nan_mb:
        m[rows] = 0.0
    return x.to(dtype), torch.cat([y, m], dim=1)


def micro_weights(target: torch.Tensor) -> list[float]:
    """What a loader reports per micro-batch for ``reduction="weighted"``: its valid elements."""
    return [float(c[:, -1].sum()) * WIDTHS[-1] for c in target.tensor_split(N_MB)]


def make_loss(kind: str = "mean", scale: float = 1.0):
    def loss_fn(out, target):
        y, m = target[:, :-1], target[:, -1:]
        sq = (out.float() - y) ** 2 * m
        loss = sq.sum() if kind == "sum" else sq.mean()
        return loss * scale if scale != 1.0 else loss
    return loss_fn


def snapshot(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().double().clone() for p in module.parameters()]


# -- one pipeline run ------------------------------------------------------------------------------
def build_schedule(schedule: str, stages, loss_fn, scale_grads: bool):
    from torch.distributed import pipelining as pp
    from torch.distributed.pipelining import schedules as sch
    kw = {"n_microbatches": N_MB, "loss_fn": loss_fn, "scale_grads": scale_grads}
    if schedule in ("GPipe", "1F1B"):
        cls = pp.ScheduleGPipe if schedule == "GPipe" else pp.Schedule1F1B
        return cls(stages[0], **kw)
    if schedule == "CustomCSV":
        return custom_schedule(stages, kw)
    cls = {"Interleaved1F1B": pp.ScheduleInterleaved1F1B, "LoopedBFS": pp.ScheduleLoopedBFS,
           "InterleavedZeroBubble": pp.ScheduleInterleavedZeroBubble,
           "ZBVZeroBubble": pp.ScheduleZBVZeroBubble, "DualPipeV": pp.ScheduleDualPipeV}[schedule]
    assert cls is sch.get_schedule_class(schedule)
    return cls(stages, **kw)


def custom_actions(pp_size: int) -> list[list[str]]:
    """A compute-only action list (torchtitan's ``pipeline_parallel_schedule_csv``) for 2 stages
    per rank, round-robin: LoopedBFS's order, with some backwards split into an input pass
    (``I``) and a weight pass (``W``) deferred to the end, mixed with full ones (``B``)."""
    rows = []
    for r in range(pp_size):
        lo, hi = r, r + pp_size
        row = [f"{lo}F{m}" for m in range(N_MB)] + [f"{hi}F{m}" for m in range(N_MB)]
        deferred = []
        for stage in (hi, lo):
            for m in reversed(range(N_MB)):
                if (m + stage) % 2:
                    row.append(f"{stage}B{m}")
                else:
                    row.append(f"{stage}I{m}")
                    deferred.append(f"{stage}W{m}")
        rows.append(row + deferred)
    return rows


def custom_schedule(stages, kw):
    """``_PipelineScheduleRuntime`` loading a compute-only CSV: how torchtitan runs a custom
    schedule (torch 2.13 has no public constructor for an action list)."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
    sched = _PipelineScheduleRuntime(stages, **kw)
    fd, path = tempfile.mkstemp(suffix=".csv")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            csv.writer(f).writerows(custom_actions(stages[0].group_size))
        sched._load_csv(path, format="compute_only")
    finally:
        os.unlink(path)
    return sched


def run_pipeline(schedule: str, *, pp_group=None, pp_rank: int, pp_size: int,
                 wrapper: dict | None = None, dtype=torch.float32, loss: str = "mean",
                 loss_scale: float = 1.0, scale_grads: bool = True, nan: bool = False,
                 mask_nan_mb: bool = False, native_skip_nan_step: bool = False,
                 weighted: bool = False, native_divide_by_weight: bool = False,
                 dp_group=None, native_dp_average: bool = False, ddp: bool = False,
                 clip: float | None = None, native_clip_across: bool = False,
                 stage_norm: bool = False, nan_last_stage: bool | str = False,
                 dp_rank: int = 0, lr: float = LR, fused: bool = False,
                 hidden: int | None = None, steps: int = STEPS,
                 forget_line: bool = False) -> dict:
    """STEPS schedule steps; returns {stage index: {"params": [...], counters...}} and, on the
    optimizer step that raised, the exception."""
    from torch.distributed.pipelining import PipelineStage

    from accumkernels import AccumulatingOptimizer
    from accumkernels.integrations.pipelining import accumulate_weight_passes

    indices, num_stages = stage_indices(schedule, pp_rank, pp_size)
    widths = WIDTHS if hidden is None else (WIDTHS[0], hidden, hidden, hidden, WIDTHS[-1])
    mods = [stage_module(i, num_stages, dtype, widths) for i in indices]
    clock = {"step": -1, "calls": 0}
    if nan_last_stage and num_stages - 1 in indices:  # a non-finite gradient on that stage only
        bias = mods[indices.index(num_stages - 1)][-1].bias

        def poison(grad):
            clock["calls"] += 1
            if clock["step"] == NAN_STEP and (clock["calls"] == NAN_MB + 1
                                              or nan_last_stage == "every micro-batch"):
                return grad * float("nan")
            return grad
        bias.register_hook(poison)
    submods = mods
    if ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        # static_graph: torch 2.13's DDP inside a pipeline stage fails its bucket rebuild at the
        # second schedule step otherwise (natively too)
        submods = [DDP(m, process_group=dp_group, static_graph=True) for m in mods]
    stages = [PipelineStage(s, i, num_stages, torch.device("cpu"), group=pp_group)
              for s, i in zip(submods, indices)]
    opts = []
    for m, s in zip(mods, submods):
        inner = torch.optim.AdamW(m.parameters(), lr=lr, fused=fused or None)
        if wrapper is None:
            opts.append(inner)
            continue
        kw = dict(wrapper)
        if ddp:
            kw["model"] = s
        elif dp_group is not None:
            kw["process_group"] = dp_group
        else:
            kw.setdefault("independent_ranks", True)
        if loss_scale != 1.0:
            kw["loss_scale"] = loss_scale
        if clip is not None:
            kw["max_grad_norm"] = clip
        opts.append(AccumulatingOptimizer(inner, **kw))
    if wrapper is not None and not forget_line:
        accumulate_weight_passes(stages)  # the README's one line
        if stage_norm:
            from accumkernels.integrations.pipelining import clip_across_stages
            clip_across_stages(opts, group=pp_group)
    sched = build_schedule(schedule, stages, make_loss("sum" if weighted else loss, loss_scale),
                           scale_grads)
    out: dict = {"raised": {}, "norms": []}
    start = {i: snapshot(m) for i, m in zip(indices, mods)}
    for step in range(steps):
        clock["step"], clock["calls"] = step, 0
        x, target = batch(step, dtype, nan=nan and step == NAN_STEP,
                          mask_nan_mb=mask_nan_mb and step == NAN_STEP, weighted=weighted,
                          replica=dp_rank)
        if weighted and wrapper is not None:
            for opt in opts:
                for w in micro_weights(target):
                    opt.add_weight(w)
        sched.step(*first_inputs(stages, x), target=target)
        if wrapper is None:
            native_boundary(mods, opts, step, target, native_skip_nan_step=native_skip_nan_step,
                            native_divide_by_weight=native_divide_by_weight and weighted,
                            dp_group=dp_group if native_dp_average else None, clip=clip,
                            across=native_clip_across, pp_group=pp_group, out=out)
            continue
        for i, opt in zip(indices, opts):
            try:
                opt.step()
            except FloatingPointError as exc:
                out["raised"].setdefault(i, []).append((step, str(exc)))
                opt.reset_window()
            opt.zero_grad()
        if clip is not None:
            out["norms"].append([float(o.last_grad_norm) for o in opts])
    for i, m, opt in zip(indices, mods, opts):
        out[i] = {"params": snapshot(m), "start": start[i]}
        if wrapper is not None:
            out[i].update(masters=[q.detach().double().clone() for q in opt.master_params]
                          if dtype != torch.float32 else None,
                          skipped_steps=opt.skipped_steps,
                          skipped_microbatches=opt.skipped_microbatches,
                          micro_steps=opt.micro_steps)
    return out


@torch.no_grad()
def native_boundary(mods, opts, step, target, *, native_skip_nan_step, native_divide_by_weight,
                    dp_group, clip, across, pp_group, out):
    """What a native loop does between ``schedule.step`` and ``optimizer.step``."""
    params = [p for m in mods for p in m.parameters() if p.grad is not None]
    if native_divide_by_weight:
        inv = 1.0 / sum(micro_weights(target))
        for p in params:
            p.grad.mul_(inv)
    if dp_group is not None:  # data parallel without DDP: average .grad over the replicas
        world = dist.get_world_size(dp_group)
        for p in params:
            dist.all_reduce(p.grad, group=dp_group)
            p.grad.div_(world)
    if clip is not None:  # torchtitan: the norm of every stage's gradients, over the PP group
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if across:
            norm = norm ** 2
            dist.all_reduce(norm, group=pp_group)
            norm = norm ** 0.5
        torch.nn.utils.clip_grads_with_norm_(params, clip, norm)
        out["norms"].append(float(norm))
    if not (native_skip_nan_step and step == NAN_STEP):
        for opt in opts:
            opt.step()
    for opt in opts:
        opt.zero_grad()


# -- scenarios ------------------------------------------------------------------------------------
def schedules_fp32(rank: int, world: int, schedules=SCHEDULES) -> dict:
    """Every schedule: native references and the wrapper's cases, fp32 and bf16."""
    results = {}
    for name in runnable(schedules):
        run = lambda **kw: run_pipeline(name, pp_rank=rank, pp_size=world, **kw)  # noqa: E731
        r = results[name] = {}
        r["native"] = run()
        r["sum_n"] = run(wrapper={"accumulation_steps": N_MB})
        r["sum_none"] = run(wrapper={})
        r["mean_n"] = run(wrapper={"accumulation_steps": N_MB, "reduction": "mean"},
                          scale_grads=False)
        r["mean_none"] = run(wrapper={"reduction": "mean"}, scale_grads=False)
        r["loss_scale"] = run(wrapper={"accumulation_steps": N_MB}, loss_scale=LOSS_SCALE)
        r["native_weighted"] = run(weighted=True, scale_grads=False,
                                   native_divide_by_weight=True)
        r["weighted_n"] = run(wrapper={"accumulation_steps": N_MB, "reduction": "weighted"},
                              weighted=True, scale_grads=False)
        r["weighted_none"] = run(wrapper={"reduction": "weighted"}, weighted=True,
                                 scale_grads=False)
        r["native_skip_step"] = run(native_skip_nan_step=True)
        r["skip_step"] = run(wrapper={"accumulation_steps": N_MB}, nan=True)
        r["skip_step_none"] = run(wrapper={}, nan=True)
        r["native_masked"] = run(mask_nan_mb=True)
        r["skip_microbatch"] = run(wrapper={"accumulation_steps": N_MB,
                                            "nonfinite": "skip_microbatch"}, nan=True)
        r["raise"] = run(wrapper={"accumulation_steps": N_MB, "nonfinite": "raise"}, nan=True,
                         steps=NAN_STEP + 1)
        # bf16: small steps (lr 1e-3), where rounding the update into bf16 params loses most
        r["fp32_small_lr"] = run(lr=BF16_LR)
        r["native_bf16"] = run(dtype=torch.bfloat16, lr=BF16_LR)
        r["bf16"] = run(wrapper={"accumulation_steps": N_MB}, dtype=torch.bfloat16, lr=BF16_LR)
    return results


def equal_stage(index: int) -> torch.nn.Module:
    """Stages of one shape (Linear(32, 32) + Tanh), different weights per stage."""
    torch.manual_seed(100 + index)
    return torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())


def guard_and_clip(rank: int, world: int) -> dict:
    """The guard (a pure pipeline without independent_ranks; process_group over two stages) and
    clipping by the whole pipeline's norm."""
    from torch.distributed.pipelining import PipelineStage

    from accumkernels import AccumulatingOptimizer
    from accumkernels.integrations.pipelining import accumulate_weight_passes

    out: dict = {}
    cpu = torch.device("cpu")
    # 1. a pure pipeline, nothing said: refused at the first step, with advice that fits
    mod = stage_module(rank, world, torch.float32)
    stage = PipelineStage(mod, rank, world, cpu)
    opt = AccumulatingOptimizer(torch.optim.AdamW(mod.parameters(), lr=LR),
                                accumulation_steps=N_MB)
    accumulate_weight_passes(stage)
    sched = build_schedule("GPipe", [stage], make_loss(), True)
    x, target = batch(0)
    sched.step(*first_inputs([stage], x), target=target)
    before = snapshot(mod)
    try:
        opt.step()
        out["pure_pipeline"] = None
    except RuntimeError as exc:
        out["pure_pipeline"] = str(exc)
    out["pure_pipeline_untouched"] = all(torch.equal(a, b) for a, b in
                                         zip(before, snapshot(mod)))
    # 2. process_group=WORLD across two stages: refused on every rank before any broadcast,
    # stages of equal shapes (told apart by accumulate_weight_passes' mark) and of other shapes
    for case in ("equal_shapes", "other_shapes"):
        mod = equal_stage(rank) if case == "equal_shapes" else stage_module(rank, world,
                                                                            torch.float32)
        stage = PipelineStage(mod, rank, world, cpu)
        accumulate_weight_passes(stage)  # right after building the stage: the README's order
        before = snapshot(mod)
        try:
            AccumulatingOptimizer(torch.optim.AdamW(mod.parameters(), lr=LR),
                                  process_group=dist.group.WORLD)
            out[case] = None
        except ValueError as exc:
            out[case] = str(exc)
        out[case + "_untouched"] = all(torch.equal(a, b) for a, b in zip(before, snapshot(mod)))
    # 3. the wrapper built first: its broadcast cannot be undone, but the line says so
    mod = equal_stage(rank)
    stage = PipelineStage(mod, rank, world, cpu)
    kept = AccumulatingOptimizer(torch.optim.AdamW(mod.parameters(), lr=LR),  # noqa: F841
                                 process_group=dist.group.WORLD)
    try:
        accumulate_weight_passes(stage)
        out["wrapper_first"] = None
    except ValueError as exc:
        out["wrapper_first"] = str(exc)
    out["process_group_property"] = kept.process_group is dist.group.WORLD
    # 3b. an FSDP2 wrapper cannot join the pipeline's norm (its window is sharded)
    from torch.distributed.fsdp import fully_shard

    from accumkernels.integrations.pipelining import clip_across_stages
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(sharded)
    fsdp_opt = AccumulatingOptimizer(torch.optim.AdamW(sharded.parameters(), lr=LR),
                                     model=sharded)
    try:
        clip_across_stages([fsdp_opt])
        out["fsdp2_joins"] = None
    except TypeError as exc:
        out["fsdp2_joins"] = str(exc)
    dist.barrier()  # the group still works after the refusals
    # 4. clipping by the whole pipeline's norm (torchtitan's clip over the pipeline group)
    clip = {}
    for name in runnable(("GPipe", "Interleaved1F1B", "ZBVZeroBubble", "DualPipeV")):
        run = lambda **kw: run_pipeline(name, pp_rank=rank, pp_size=world, clip=CLIP,  # noqa
                                        **kw)
        clip[name] = {
            "native": run(native_clip_across=True),
            "wrapper": run(wrapper={"accumulation_steps": N_MB}, stage_norm=True),
            "wrapper_none": run(wrapper={}, stage_norm=True),
            "per_stage": run(wrapper={"accumulation_steps": N_MB}),  # without: each its own
            # a fused AdamW takes the normalisation in its grad_scale (the wrapper folds 1/4 of
            # "mean" there): the norm measured before the fold, scaled
            "native_fused": run(native_clip_across=True, fused=True),
            "mean_fused": run(wrapper={"reduction": "mean"}, scale_grads=False, fused=True,
                              stage_norm=True),
        }
    out["clip"] = clip
    # 5. a non-finite gradient on the last stage only: every stage skips together
    nan = {}
    for name in runnable(("GPipe", "ZBVZeroBubble")):
        run = lambda **kw: run_pipeline(name, pp_rank=rank, pp_size=world,  # noqa: E731
                                        nan_last_stage=True, **kw)
        nan[name] = {"native_skip_step": run(native_skip_nan_step=True),
                     "together": run(wrapper={"accumulation_steps": N_MB}, stage_norm=True),
                     "apart": run(wrapper={"accumulation_steps": N_MB})}
        # every micro-batch of that stage dropped: its step skips before measuring a norm, and
        # still takes part in the round (no rank waits for it)
        nan[name]["all_dropped"] = run_pipeline(
            name, pp_rank=rank, pp_size=world, nan_last_stage="every micro-batch",
            wrapper={"accumulation_steps": N_MB, "nonfinite": "skip_microbatch"}, clip=CLIP,
            stage_norm=True)
    out["nan_last_stage"] = nan
    return out


def two_d(rank: int, world: int) -> dict:
    """2 pipeline stages x 2 data-parallel replicas on 4 ranks: rank = 2 * replica + stage
    position; pipeline groups {0, 1}, {2, 3}; data-parallel groups {0, 2}, {1, 3}."""
    pp_size, dp_size = 2, world // 2
    pp_rank, dp_rank = rank % pp_size, rank // pp_size
    pp_groups = [dist.new_group([d * pp_size + p for p in range(pp_size)])
                 for d in range(dp_size)]
    dp_groups = [dist.new_group([d * pp_size + p for d in range(dp_size)])
                 for p in range(pp_size)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]
    out: dict = {"pp_rank": pp_rank, "dp_rank": dp_rank}
    for name in runnable(("GPipe", "1F1B", "ZBVZeroBubble")):
        run = lambda **kw: run_pipeline(name, pp_group=pp_group, pp_rank=pp_rank,  # noqa
                                        pp_size=pp_size, dp_group=dp_group, dp_rank=dp_rank,
                                        **kw)
        r = out[name] = {}
        r["native"] = run(native_dp_average=True)
        r["group_n"] = run(wrapper={"accumulation_steps": N_MB})
        r["group_none"] = run(wrapper={})
        r["group_mean"] = run(wrapper={"reduction": "mean"}, scale_grads=False)
        r["native_clip"] = run(native_dp_average=True, clip=CLIP, native_clip_across=True)
        r["group_clip"] = run(wrapper={"accumulation_steps": N_MB}, clip=CLIP, stage_norm=True)
        if name != "ZBVZeroBubble" and DDP_IN_STAGE:  # DDP inside the stage: full backwards
            r["native_ddp"] = run(ddp=True)
            r["ddp"] = run(wrapper={"accumulation_steps": N_MB}, ddp=True)
            r["ddp_none"] = run(wrapper={}, ddp=True)
    # wide layers: the schedule's scale_grads divides p.grad in place right after the last
    # backward, whose overlapped all-reduce of the same memory must be complete by then
    wide = out["wide"] = {}
    for name in runnable(("GPipe", "ZBVZeroBubble")):
        run = lambda **kw: run_pipeline(name, pp_group=pp_group, pp_rank=pp_rank,  # noqa
                                        pp_size=pp_size, dp_group=dp_group, dp_rank=dp_rank,
                                        hidden=WIDE, steps=2, **kw)
        wide[name] = {"native": run(native_dp_average=True),
                      "group_n": run(wrapper={"accumulation_steps": N_MB,
                                              "bucket_size_mb": 0.25})}
    return out


def forgotten(rank: int, world: int) -> dict:
    """``accumulate_weight_passes(stages)`` forgotten: the split-backward schedules raise at
    every wrapper's ``step()`` on every rank, naming the line, with nothing stepped; the
    schedules without a weight pass (GPipe, 1F1B) train as natively without it."""
    from torch.distributed.pipelining import PipelineStage

    from accumkernels import AccumulatingOptimizer

    out: dict = {}
    for name in runnable(("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")):
        indices, num_stages = stage_indices(name, rank, world)
        mods = [stage_module(i, num_stages, torch.float32) for i in indices]
        stages = [PipelineStage(m, i, num_stages, torch.device("cpu"))
                  for m, i in zip(mods, indices)]
        opts = [AccumulatingOptimizer(torch.optim.AdamW(m.parameters(), lr=LR),
                                      accumulation_steps=N_MB, independent_ranks=True)
                for m in mods]
        sched = build_schedule(name, stages, make_loss(), True)
        x, target = batch(0)
        sched.step(x, target=target)
        before = [snapshot(m) for m in mods]
        errors = []
        for opt in opts:
            try:
                opt.step()
                errors.append(None)
            except RuntimeError as exc:
                errors.append(str(exc))
        out[name] = {"errors": errors, "untouched": all(
            torch.equal(a, b) for m, snap in zip(mods, before)
            for a, b in zip(snap, snapshot(m)))}
    for name in ("GPipe", "1F1B"):
        run = lambda **kw: run_pipeline(name, pp_rank=rank, pp_size=world, **kw)  # noqa: E731
        out[name] = {"native": run(), "forgotten": run(wrapper={"accumulation_steps": N_MB},
                                                       forget_line=True)}
    return out


SCENARIOS = {"schedules": schedules_fp32, "guard_and_clip": guard_and_clip, "two_d": two_d,
             "forgotten": forgotten}


def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    world = kwargs.pop("world")
    torch.set_num_threads(1)  # tiny ops on a few shared cores: intra-op threads only contend
    run_scenario(rank, out_dir, world, lambda: SCENARIOS[scenario](rank, world, **kwargs))


def run_ranks(tmp_path, scenario: str, world: int = 2, timeout: float = 150.0,
              **kwargs) -> list:
    """Run ``scenario`` on ``world`` spawned gloo ranks; each rank's result, rank order."""
    return spawn_ranks(_rank_main, str(tmp_path), scenario, {"world": world, **kwargs}, world,
                       timeout)
