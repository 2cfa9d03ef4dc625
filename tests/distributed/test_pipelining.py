"""Pipeline parallelism (``torch.distributed.pipelining``, issue 31): every schedule of torch 2.13
accumulates in fp32 and steps right, with one AccumulatingOptimizer per stage and the README's
one line ``accumulate_weight_passes(stages)``.

Spawned gloo ranks (_pipelining_workers.py: a FileStore, a deadline per launch, one launch per
fixture running every case). The model is a 4-layer MLP split into 2 stages (GPipe, 1F1B: one
per rank) or 4 (two per rank: Interleaved1F1B, LoopedBFS, InterleavedZeroBubble round-robin;
ZBVZeroBubble, DualPipeV in a V; a custom compute-only action list through
``_PipelineScheduleRuntime._load_csv`` mixing full backwards with split input/weight passes);
4 micro-batches per schedule step, 3 steps of AdamW.

The native reference of a wrapper run is the same schedule with the bare AdamW and the loss as
the reduction needs it: the schedule's own ``scale_grads`` (the mean over micro-batches) for
``reduction="sum"`` and for ``"mean"`` (run with ``scale_grads=False``), the gradient multiplied
by 1 / (sum of the weights) for ``"weighted"`` (a summed loss), no loss scale for
``loss_scale=1024`` (a power of two). Every scaling in play is by a power of two, and the wrapper
adds the same fp32 gradients in the same order as AccumulateGrad and the weight pass's
``weight.grad += dw``: fp32 runs are expected to agree to the last bit (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("torch.distributed.pipelining")
pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

from _pipelining_workers import (CLIP, DDP_IN_STAGE, DDP_SKIP_REASON, NAN_STEP,  # noqa: E402
                                  SCHEDULES, V_ON_GLOO, V_SCHEDULES, V_SKIP_REASON, run_ranks)

REL = 1e-6


def schedule_params(names) -> list:
    """``names`` for parametrize: the V schedules skipped, with the reason, where this torch cannot
    run them on gloo even natively (_pipelining_workers.V_ON_GLOO)."""
    skip = pytest.mark.skipif(not V_ON_GLOO, reason=V_SKIP_REASON)
    return [pytest.param(n, marks=skip) if n in V_SCHEDULES else n for n in names]


def by_stage(results: list[dict], *path) -> dict:
    """{stage index: entry} of one run, gathered over the ranks (``path`` into each rank's
    result)."""
    stages = {}
    for r in results:
        for key in path:
            r = r[key]
        stages.update({k: v for k, v in r.items() if isinstance(k, int)})
    return stages


def assert_equal_runs(ours: dict, ref: dict, what: str) -> None:
    assert sorted(ours) == sorted(ref), what
    for s in ref:
        for i, (a, b) in enumerate(zip(ours[s]["params"], ref[s]["params"], strict=True)):
            assert torch.equal(a, b), (f"{what}: stage {s} param {i} differs from native by "
                                       f"{(a - b).abs().max().item():.3g}")


def assert_close_runs(ours: dict, ref: dict, what: str, rel: float = REL) -> None:
    assert sorted(ours) == sorted(ref), what
    for s in ref:
        for i, (a, b) in enumerate(zip(ours[s]["params"], ref[s]["params"], strict=True)):
            err, scale = (a - b).abs().max().item(), b.abs().max().item()
            assert err <= rel * scale, (f"{what}: stage {s} param {i}: max |diff| {err:.3g} > "
                                        f"{rel:g} * {scale:.3g}")


def assert_trained(run: dict) -> None:
    """Guards against two runs that agree because neither stepped."""
    for s, entry in run.items():
        moved = max((a - b).abs().max().item() for a, b in zip(entry["params"], entry["start"]))
        assert moved > 1e-3, f"stage {s} did not train"


# -- every schedule, two ranks ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def schedules(tmp_path_factory):
    """Every schedule, every case: one launch of 2 ranks."""
    return run_ranks(tmp_path_factory.mktemp("pp_schedules"), "schedules", timeout=240)


# case -> (its native reference, what it is)
FP32_CASES = {
    "sum_n": "native",  # accumulation_steps=4, reduction="sum", the schedule's scale_grads
    "sum_none": "native",  # accumulation_steps=None: every step() ends the window
    "mean_n": "native",  # reduction="mean", scale_grads=False
    "mean_none": "native",
    "loss_scale": "native",  # loss_scale=1024: the loss_fn multiplies, the wrapper unscales
    "weighted_n": "native_weighted",  # summed loss, add_weight(valid elements) per micro-batch
    "weighted_none": "native_weighted",
    "skip_step": "native_skip_step",  # a NaN in micro-batch 2 of step 1: the step is skipped
    "skip_step_none": "native_skip_step",
    "skip_microbatch": "native_masked",  # ... only that micro-batch is dropped
}


@pytest.mark.parametrize("case", list(FP32_CASES))
@pytest.mark.parametrize("schedule", schedule_params(SCHEDULES))
def test_fp32_bit_identical_to_native(schedules, schedule, case):
    ours = by_stage(schedules, schedule, case)
    ref = by_stage(schedules, schedule, FP32_CASES[case])
    assert_trained(ours)
    assert_equal_runs(ours, ref, f"{schedule} {case}")
    for s, entry in ours.items():
        assert entry["micro_steps"] == 0, f"{schedule} {case}: stage {s} has a window left"


@pytest.mark.parametrize("schedule", schedule_params(SCHEDULES))
def test_nonfinite_policies_on_every_stage(schedules, schedule):
    """A NaN in a middle micro-batch reaches every stage (forward, then backward): skip_step
    drops the window on every stage's wrapper, skip_microbatch just that micro-batch, raise
    raises on every stage's step."""
    for case in ("skip_step", "skip_step_none"):
        for s, entry in by_stage(schedules, schedule, case).items():
            assert (entry["skipped_steps"], entry["skipped_microbatches"]) == (1, 0), (case, s)
    for s, entry in by_stage(schedules, schedule, "skip_microbatch").items():
        assert (entry["skipped_steps"], entry["skipped_microbatches"]) == (0, 1), s
    for s, entry in by_stage(schedules, schedule, "sum_n").items():
        assert (entry["skipped_steps"], entry["skipped_microbatches"]) == (0, 0), s
    raised = {}
    for r in schedules:
        raised.update(r[schedule]["raise"]["raised"])
    assert sorted(raised) == sorted(by_stage(schedules, schedule, "native")), raised
    for s, [(step, message)] in raised.items():
        assert step == NAN_STEP and message.startswith("non-finite gradient in "), (s, message)


@pytest.mark.parametrize("schedule", schedule_params(SCHEDULES))
def test_bf16_closer_to_fp32_than_native(schedules, schedule):
    """bf16 params (master weights on), lr 1e-3: the wrapper's update (fp32 masters minus the
    bf16 start) is closer to the fp32 run's update than native bf16's is (there, AdamW's small
    updates are rounded into the bf16 params, and gradients summed in bf16)."""
    fp32 = by_stage(schedules, schedule, "fp32_small_lr")
    native = by_stage(schedules, schedule, "native_bf16")
    ours = by_stage(schedules, schedule, "bf16")

    def distance(run, key):
        return sum(torch.linalg.vector_norm(torch.cat([((a - s0) - (f - f0)).flatten()
                   for a, s0, f, f0 in zip(run[s][key], run[s]["start"], fp32[s]["params"],
                                           fp32[s]["start"])])).item() for s in fp32)

    d_ours, d_native = distance(ours, "masters"), distance(native, "params")
    assert d_ours < 0.5 * d_native, (d_ours, d_native)


# -- the guard and clipping across stages, two ranks -----------------------------------------------
@pytest.fixture(scope="module")
def guard_and_clip(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("pp_guard"), "guard_and_clip", timeout=180)


def test_pure_pipeline_without_independent_ranks_is_refused_with_fitting_advice(guard_and_clip):
    for r in guard_and_clip:
        message = r["pure_pipeline"]
        assert message is not None and "independent_ranks=True" in message
        assert "this stage's data-parallel group" in message
        assert "never one that spans different stages" in message
        assert r["pure_pipeline_untouched"]


@pytest.mark.parametrize("case", ["equal_shapes", "other_shapes"])
def test_process_group_over_two_stages_is_refused_on_every_rank(guard_and_clip, case):
    """process_group=WORLD on 2 ranks that hold different stages: ValueError on both ranks
    before anything is broadcast (the params are untouched; gloo does not abort on the other
    shapes), naming the data-parallel group and independent_ranks=True."""
    what = "different stages" if case == "equal_shapes" else "different counts, shapes"
    for r in guard_and_clip:
        assert r[case] is not None and what in r[case], r[case]
        assert "this stage's data-parallel group" in r[case]
        assert "independent_ranks=True" in r[case]
        assert r[case + "_untouched"], f"{case}: params changed by a refused construction"


def test_wrapper_built_before_the_line_over_two_stages_is_reported(guard_and_clip):
    for r in guard_and_clip:
        assert r["wrapper_first"] is not None
        assert "different stages" in r["wrapper_first"]
        assert "broadcast" in r["wrapper_first"]
        assert r["process_group_property"]  # opt.process_group: the group it reduces over


def test_clip_across_stages_refuses_an_fsdp2_wrapper(guard_and_clip):
    for r in guard_and_clip:
        assert r["fsdp2_joins"] is not None and "not FSDP2" in r["fsdp2_joins"]


@pytest.mark.parametrize("schedule", schedule_params(["GPipe", "Interleaved1F1B", "ZBVZeroBubble",
                                                     "DualPipeV"]))
def test_clip_across_stages_equals_torchtitans_clip(guard_and_clip, schedule):
    """``clip_across_stages(opts, group)`` with ``max_grad_norm``: the norm of every stage's
    window over the pipeline group (torchtitan: get_total_norm of the rank's grads, squared,
    all-reduced over the pipeline group; clip_grads_with_norm_), one or two stages per rank, N
    given or not, a fused AdamW taking "mean"'s 1/4 in its grad_scale. ``last_grad_norm`` is
    that norm on every stage. Without it each stage clips by its own norm (a different
    result)."""
    runs = [r["clip"][schedule] for r in guard_and_clip]
    native = by_stage(runs, "native")
    for case, ref_case in (("wrapper", "native"), ("wrapper_none", "native"),
                           ("mean_fused", "native_fused")):
        assert_close_runs(by_stage(runs, case), by_stage(runs, ref_case), f"{schedule} {case}")
        for r in runs:
            for norms, ref in zip(r[case]["norms"], r[ref_case]["norms"], strict=True):
                assert all(abs(n - ref) <= REL * ref for n in norms), (norms, ref)
                assert ref > CLIP  # clipping took effect
    apart = by_stage(runs, "per_stage")
    assert any(not torch.equal(a, b) for s in native
               for a, b in zip(apart[s]["params"], native[s]["params"]))


@pytest.mark.parametrize("schedule", schedule_params(["GPipe", "ZBVZeroBubble"]))
def test_nonfinite_on_one_stage_skips_every_stage_with_clip_across_stages(guard_and_clip,
                                                                          schedule):
    """A NaN in the last stage's gradient only (a hook): with clip_across_stages every stage
    skips that step, as a native loop that checked the pipeline's norm would; without it only
    that stage does and the stages step apart."""
    runs = [r["nan_last_stage"][schedule] for r in guard_and_clip]
    together = by_stage(runs, "together")
    assert_equal_runs(together, by_stage(runs, "native_skip_step"), f"{schedule} together")
    assert all(e["skipped_steps"] == 1 for e in together.values())
    apart = by_stage(runs, "apart")
    assert sorted(e["skipped_steps"] for e in apart.values()) != [1] * len(apart)
    # skip_microbatch dropping all of the last stage's window: that stage's step skips before
    # it measures anything, yet takes part in the pipeline's norm round (no rank hangs)
    dropped = by_stage(runs, "all_dropped")
    last = max(dropped)
    assert (dropped[last]["skipped_steps"], dropped[last]["skipped_microbatches"]) == (1, 4)
    assert all(e["skipped_steps"] == 0 for s, e in dropped.items() if s != last)


# -- pipeline x data parallel, four ranks ----------------------------------------------------------
@pytest.fixture(scope="module")
def two_d(tmp_path_factory):
    """2 stages x 2 replicas: pipeline groups {0, 1}, {2, 3}; data-parallel groups {0, 2},
    {1, 3}; each replica sees its own data."""
    return run_ranks(tmp_path_factory.mktemp("pp_2d"), "two_d", world=4, timeout=240)


def replica(results: list[dict], dp_rank: int) -> list[dict]:
    return [r for r in results if r["dp_rank"] == dp_rank]


@pytest.mark.parametrize("case", ["group_n", "group_none", "group_mean"])
@pytest.mark.parametrize("schedule", schedule_params(["GPipe", "1F1B", "ZBVZeroBubble"]))
def test_2d_process_group_is_the_stages_data_parallel_group(two_d, schedule, case):
    """``process_group=<this stage's data-parallel group>``: the window averaged over the
    stage's replicas equals native's manual all-reduce average of ``.grad`` before the step, to
    the last bit, on both replicas (which then hold the same params)."""
    for dp in (0, 1):
        runs = replica(two_d, dp)
        ours = by_stage(runs, schedule, case)
        assert_trained(ours)
        assert_equal_runs(ours, by_stage(runs, schedule, "native"), f"{schedule} {case} dp{dp}")
    assert_equal_runs(by_stage(replica(two_d, 0), schedule, case),
                      by_stage(replica(two_d, 1), schedule, case), "replicas differ")


@pytest.mark.parametrize("schedule", schedule_params(["GPipe", "ZBVZeroBubble"]))
def test_2d_scale_grads_after_the_overlapped_all_reduce(two_d, schedule):
    """512-wide layers, N given: the all-reduce of the window's buckets starts inside the last
    backward (overlap), and the schedule divides ``p.grad`` -- the same memory -- in place right
    after it. The sums are complete when that backward returns, so the division never races
    them (it did: every param differed from native before; bit-identical now)."""
    for dp in (0, 1):
        runs = [r["wide"] for r in replica(two_d, dp)]
        assert_equal_runs(by_stage(runs, schedule, "group_n"), by_stage(runs, schedule, "native"),
                          f"{schedule} wide dp{dp}")


@pytest.mark.parametrize("schedule", schedule_params(["GPipe", "1F1B", "ZBVZeroBubble"]))
def test_2d_clip_across_stages(two_d, schedule):
    """Windows reduced over the data-parallel group, then clipped by the pipeline's norm."""
    for dp in (0, 1):
        runs = replica(two_d, dp)
        assert_close_runs(by_stage(runs, schedule, "group_clip"),
                          by_stage(runs, schedule, "native_clip"), f"{schedule} dp{dp}")


@pytest.mark.skipif(not DDP_IN_STAGE, reason=DDP_SKIP_REASON)
@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_2d_ddp_inside_the_stage(two_d, schedule):
    """DDP around each stage's module (``model=ddp``; static_graph=True, which torch 2.13's DDP
    needs inside a pipeline stage). Native DDP does not reduce the last stage there at all (its
    gradients stay rank-local: ``native_ddp`` differs from the average); the wrapper reduces a
    window no DDP sync reduced at its step, so it equals the manual average (within fp32
    rounding: DDP's bucket path)."""
    for dp in (0, 1):
        runs = replica(two_d, dp)
        native = by_stage(runs, schedule, "native")
        for case in ("ddp", "ddp_none"):
            assert_close_runs(by_stage(runs, schedule, case), native, f"{schedule} {case} dp{dp}")
    last = by_stage(replica(two_d, 0), schedule, "native_ddp")[1]
    assert any(not torch.equal(a, b) for a, b in zip(
        last["params"], by_stage(replica(two_d, 0), schedule, "native")[1]["params"]))


# -- in process: what the lines refuse -------------------------------------------------------------
def test_clip_across_stages_refuses_what_is_not_a_stage_wrapper():
    from accumkernels import AccumulatingOptimizer
    from accumkernels.integrations.pipelining import clip_across_stages
    model = torch.nn.Linear(4, 4)
    inner = torch.optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="AccumulatingOptimizers of this rank's stages"):
        clip_across_stages([inner])
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters()))
    if not torch.distributed.is_initialized():
        with pytest.raises(ValueError, match="needs torch.distributed"):
            clip_across_stages([opt])
    assert opt._parts.sync.stage_norm is None
    assert opt.process_group is None


def test_accumulate_weight_passes_refuses_what_is_not_a_stage():
    from accumkernels.integrations.pipelining import accumulate_weight_passes
    with pytest.raises(TypeError, match="expects pipeline stages"):
        accumulate_weight_passes(torch.nn.Linear(4, 4))
