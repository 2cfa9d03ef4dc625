"""DistributedDataParallel (DESIGN: "Multi-process jobs"): 2 gloo ranks, local.

Under DistributedDataParallel the wrapper must give native DDP's result (the average over
ranks of the window's summed gradients), accumulated in fp32, with DDP's own ``no_sync``
cadence, communication only on the window's last (sync) micro-batch, and clipping on the sync
step seeing the reduced window. The DDP module reaches the wrapper either as ``model=`` or
through the public comm hook ``accumkernels.ddp_comm_hook``
(``ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)``, for frameworks that build the
DDP module after the optimizer). A multi-rank job in which the wrapper would step on rank-local
gradients is refused unless ``independent_ranks=True`` says it is meant.

Tolerance: with ``reduction="sum"`` the wrapper adds the same fp32 micro-batch gradients in the
same order as AccumulateGrad, and averages them over ranks as DDP does (divide by the world
size, then sum): the runs are expected to agree to the last bit; 1e-6 relative is the bar.
A missed reduction, a doubled one or a clip that did not take effect moves params by ~lr=1e-2.

The rank processes live in _ddp_workers.py (deadline per run, no process left behind).
"""

from __future__ import annotations

import pytest
import torch
from _ddp_workers import ACCUM, CLIP, LR, mlp, run_ranks, snapshot

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

REL = 1e-6


def assert_close_rel(ours: list[torch.Tensor], ref: list[torch.Tensor], what: str,
                     rel: float = REL) -> None:
    assert len(ours) == len(ref), what
    for i, (a, b) in enumerate(zip(ours, ref)):
        err = (a - b).abs().max().item()
        scale = b.abs().max().item()
        assert err <= rel * scale, \
            f"{what}: param {i}: max |diff| {err:.3g} > {rel:g} * {scale:.3g}"


def assert_ranks_equal(results: list[dict], key=lambda r: r["params"], what: str = "") -> None:
    first = key(results[0])
    for rank, r in enumerate(results[1:], start=1):
        for i, (a, b) in enumerate(zip(first, key(r))):
            assert torch.equal(a, b), f"{what}: rank {rank} holds a different param {i} than rank 0"


def assert_trained(params: list[torch.Tensor], start_like: list[torch.Tensor]) -> None:
    """Guards against two runs that agree because neither stepped."""
    assert max((a - b).abs().max().item() for a, b in zip(params, start_like)) > 1e-3


@pytest.fixture(scope="module")
def plain_ddp(tmp_path_factory):
    """All plain-DDP variants in one pair of processes (start-up dominates the run time)."""
    variants = ["model_arg", "public_hook", "sync_every_microbatch", "reordered",
                "unused_params", "static_graph", "mean", "bf16_public_hook"]
    results = run_ranks(tmp_path_factory.mktemp("plain_ddp"), "plain_ddp", timeout=120,
                        variants=variants)
    return {v: [r[v] for r in results] for v in variants}


@pytest.mark.parametrize("variant", ["model_arg", "public_hook", "sync_every_microbatch",
                                     "reordered", "unused_params", "static_graph", "mean"])
def test_ddp_equals_native_ddp(plain_ddp, variant):
    """fp32 MLP, AdamW, 8 steps of 4 micro-batches, clip on the sync step.

    model_arg: ``AccumulatingOptimizer(..., model=ddp)`` after DDP is built.
    public_hook: the wrapper built first (Accelerate's and the Trainer's order), then
    ``ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)``; gradient_as_bucket_view=True.
    sync_every_microbatch: no ``no_sync`` at all (DDP reduces every backward, natively too).
    reordered: a DDP bucket holds params that are not neighbours in the wrapper's buffer.
    unused_params: ``find_unused_parameters=True``, a param used on rank 0 only and one never.
    static_graph: ``static_graph=True`` (DDP reduces its first iteration at the backward's end).
    mean: ``reduction="mean"``, the loss not divided by the window length (native divides).
    DDP's buckets (20 KB) and the wrapper's (10 KB) are cut at different params."""
    ranks = plain_ddp[variant]
    for rank, r in enumerate(ranks):
        native, ours = r["native"], r["wrapper"]
        assert all(n > CLIP for n in native["norms"]), native["norms"]  # the clip bites
        # clip_grad_norm_ on the sync step reads p.grad: the reduced fp32 window, as natively
        assert ours["norms"] == pytest.approx(native["norms"], rel=REL), f"rank {rank}"
        assert ours["no_grad"] == native["no_grad"], f"rank {rank}: .grad None on other params"
        assert_close_rel(ours["params"], native["params"], f"{variant}, rank {rank}")
    assert_ranks_equal([r["wrapper"] for r in ranks], what=variant)


def test_ddp_communicates_only_on_the_sync_microbatch(plain_ddp):
    """Under ``no_sync`` nothing is sent: every collective of the wrapper's run falls in the
    window's last micro-batch (its backward), or in the clip/step that ends the window."""
    for rank, r in enumerate(plain_ddp["model_arg"]):
        calls = r["wrapper"]["collectives"]
        assert calls, "the wrapper's reduction issued no torch.distributed collective"
        quiet = [c for c in calls if c.split(":")[0] in {f"micro{i}" for i in range(ACCUM - 1)}
                 or c.startswith("between:")]
        assert not quiet, f"rank {rank}: collectives outside the sync micro-batch: {quiet}"
        assert any(c.startswith(f"micro{ACCUM - 1}:") for c in calls), calls  # overlapped


def test_ddp_bf16_model_reduces_the_fp32_window(plain_ddp):
    """bf16 params (master weights), the wrapper built *before* DDP broadcast rank 0's params
    (rank 1 started elsewhere, so its masters must follow the broadcast): the result is bf16
    micro-batch gradients summed in fp32, averaged over ranks in fp32 (not in DDP's bf16
    buckets), clipped and stepped on fp32 masters -- written out by hand without DDP as the
    reference -- and the ranks end identical."""
    ranks = plain_ddp["bf16_public_hook"]
    for rank, r in enumerate(ranks):
        reference, ours = r["native"], r["wrapper"]
        assert all(n > CLIP for n in reference["norms"]), reference["norms"]
        assert ours["norms"] == pytest.approx(reference["norms"], rel=REL), f"rank {rank}"
        assert_close_rel(ours["params"], reference["params"], f"bf16, rank {rank}")
    assert_ranks_equal([r["wrapper"] for r in ranks], what="bf16")


def test_accelerate_accumulate_loop_equals_native(tmp_path):
    """``Accelerator(cpu=True, gradient_accumulation_steps=4)`` on 2 processes, the usual
    ``accumulate()`` loop with ``clip_grad_norm_`` on sync steps: 7 windows and a short last
    one (end of the loader), native vs wrapper + ``accumkernels.ddp_comm_hook``."""
    pytest.importorskip("accelerate")
    results = run_ranks(tmp_path, "accelerate", timeout=120)
    for rank, r in enumerate(results):
        native, ours = r["native"], r["wrapper"]
        assert native["micro"] == 30 and len(native["norms"]) == 8, native["norms"]
        assert all(n > CLIP for n in native["norms"])
        assert ours["norms"] == pytest.approx(native["norms"], rel=REL), f"rank {rank}"
        assert_close_rel(ours["params"], native["params"], f"accelerate, rank {rank}")
    assert_ranks_equal([r["wrapper"] for r in results], what="accelerate")


def test_hf_trainer_equals_native(tmp_path):
    """The HF Trainer (``gradient_accumulation_steps=4``, ``max_grad_norm``) on 2 processes:
    it wraps the model in DDP inside ``train()``; a ``TrainerCallback`` registers
    ``accumkernels.ddp_comm_hook`` on ``trainer.model_wrapped`` at ``on_train_begin``."""
    pytest.importorskip("transformers")
    results = run_ranks(tmp_path, "hf_trainer", timeout=150, out_dir=str(tmp_path))
    for rank, r in enumerate(results):
        native, ours = r["native"], r["wrapper"]
        assert native["steps"] == ours["steps"] == 8
        assert_close_rel(ours["params"], native["params"], f"hf trainer, rank {rank}")
    assert_ranks_equal([r["wrapper"] for r in results], what="hf trainer")


def test_lightning_ddp_strategy_equals_native(tmp_path):
    """Lightning ``strategy="ddp"``, ``devices=2``, ``accumulate_grad_batches=4``,
    ``gradient_clip_val``: 7 windows and a short last one; the wrapper is given
    ``model=self.trainer.strategy.model`` (the DDP module) in ``configure_optimizers``."""
    pytest.importorskip("lightning")
    results = run_ranks(tmp_path, "lightning", timeout=150)
    for rank, r in enumerate(results):
        native, ours = r["native"], r["wrapper"]
        assert len(native["norms"]) == 8 and all(n > CLIP for n in native["norms"])
        assert ours["norms"] == pytest.approx(native["norms"], rel=REL), f"rank {rank}"
        assert_close_rel(ours["params"], native["params"], f"lightning, rank {rank}")
    assert_ranks_equal([r["wrapper"] for r in results], what="lightning")


def test_nanogpt_recipe_without_model_equals_native_or_is_refused(tmp_path):
    """nanoGPT wraps the model in DDP and toggles ``require_backward_grad_sync`` itself; the
    optimizer is not told about DDP. Either the result is native DDP's, or the wrapper raises
    an error that says how to hand it the DDP module (``model=``) -- never a silent divergence
    (today: a window gradient of 0, a logged grad norm of 0.18 against native's 0.54)."""
    results = run_ranks(tmp_path, "nanogpt")
    for rank, r in enumerate(results):
        native, ours = r["native"], r["wrapper"]
        assert native["error"] is None, native["error"]
        if ours["error"] is not None:
            assert "model=" in ours["error"], ours["error"]
            continue
        assert ours["norms"] == pytest.approx(native["norms"], rel=REL)
        assert_close_rel(ours["params"], native["params"], f"nanogpt, rank {rank}")
    raised = [r["wrapper"]["error"] is not None for r in results]
    assert raised[0] == raised[1], "one rank raised, the other did not"


def test_two_ranks_without_ddp_or_process_group_are_refused(tmp_path):
    """World size 2, no DDP, no process_group: each rank would step on its own gradients.
    The wrapper raises (at construction or at the first step) naming ``process_group``;
    ``independent_ranks=True`` opts out: each rank then trains exactly like a plain AdamW on its
    own data (and the ranks differ)."""
    results = run_ranks(tmp_path, "no_ddp")
    for rank, r in enumerate(results):
        default, opt_out = r["default"], r["opt_out"]
        assert default["error"] is not None, f"rank {rank}: stepped on rank-local gradients"
        assert "process_group" in default["error"], default["error"]
        assert opt_out["error"] is None, opt_out["error"]
        assert_close_rel(opt_out["params"], opt_out["reference"], f"opt-out, rank {rank}")
        assert_trained(opt_out["params"], snapshot(mlp()))
    a, b = (r["opt_out"]["params"] for r in results)
    assert any(not torch.equal(x, y) for x, y in zip(a, b)), "independent ranks ended equal"


def test_fsdp2_works_or_is_refused_at_construction(tmp_path):
    """FSDP2 ``fully_shard`` (DTensor params and grads; today they reach the raw-pointer kernel:
    "null data pointer"). Either the wrapper refuses at construction with a message naming
    FSDP2/DTensor, or it trains like native FSDP2 with ``reduce_dtype=float32``."""
    pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed import fsdp

    if not hasattr(fsdp, "fully_shard"):
        pytest.skip("this torch has no FSDP2 fully_shard")
    results = run_ranks(tmp_path, "fsdp2")
    for rank, r in enumerate(results):
        if "refused" in r:
            msg = r["refused"]
            assert "fully_shard" in msg or "FSDP" in msg or "DTensor" in msg, msg
            continue
        assert_close_rel(r["wrapper"], r["native"], f"fsdp2, rank {rank}")
    assert ("refused" in results[0]) == ("refused" in results[1])


def test_ddp_options_the_wrapper_cannot_honour_are_refused(tmp_path):
    """One process (world size 1): what model=ddp refuses when the wrapper is built."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        def build(**kwargs):
            ddp = DDP(mlp())
            if kwargs.pop("hooked", False):
                ddp.register_comm_hook(None, allreduce_hook)
            inner = torch.optim.AdamW(ddp.parameters(), lr=LR)
            return AccumulatingOptimizer(inner, model=ddp, **kwargs)

        with pytest.raises(ValueError, match="communication hook"):
            build(hooked=True)  # DDP takes one comm hook; the wrapper's must be it
        with pytest.raises(ValueError, match="skip_microbatch"):
            build(nonfinite="skip_microbatch")  # DDP sends a gradient before it could be dropped
        with pytest.raises(ValueError, match="process_group"):
            build(process_group=dist.group.WORLD)  # both would reduce the window
    finally:
        dist.destroy_process_group()


def test_nonfinite_written_on_one_rank_is_agreed(tmp_path):
    """A NaN written into rank 1's ``p.grad`` after the window was reduced (DDP's sync backward,
    or ``process_group``): both ranks skip that window (``skip_step``: params unchanged by it)
    or both raise (``raise``); the other windows step and the ranks stay identical."""
    results = run_ranks(tmp_path, "written_nonfinite", timeout=120)
    for mode in ("ddp", "process_group", "process_group_n"):
        for rank, result in enumerate(results):
            r = result[f"{mode}_skip_step"]
            assert r["skipped"] == 1, f"{mode}, rank {rank}: skipped {r['skipped']}"
            p0, p1, p2 = r["params"]
            assert all(torch.equal(a, b) for a, b in zip(p0, p1)), f"{mode}: window 1 stepped"
            assert not all(torch.equal(a, b) for a, b in zip(p1, p2)), f"{mode}: no step 2"
            assert result[f"{mode}_raise"]["raised"] == [1], (mode, rank)
        for policy in ("skip_step", "raise"):
            a, b = (results[k][f"{mode}_{policy}"]["params"][-1] for k in (0, 1))
            assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{mode}, {policy}: diverged"


def test_a_window_without_a_sync_backward_warns_once_and_keeps_the_ranks_together(tmp_path):
    """``no_sync()`` on every micro-batch (the last one forgotten): until ``step()`` ``p.grad``
    is each rank's own window, as natively without the sync (a clip measures it, bit for bit
    native's); ``step()`` averages the window over the ranks, so they stay identical (natively
    they would drift apart), equal to native's loop that averages the clipped ``.grad`` by hand;
    one warning per wrapper, on every rank, names the forgotten sync."""
    results = run_ranks(tmp_path, "no_sync_forgotten", timeout=120)
    for rank, r in enumerate(results):
        ours, native = r["ours"], r["native"]
        for a, b in zip(ours["grads"], native["grads"]):
            assert all(torch.equal(x, y) for x, y in zip(a, b)), rank
        assert all(torch.equal(a, b) for a, b in zip(ours["norms"], native["norms"])), rank
        for a, b in zip(ours["params"], native["params"]):
            assert (a - b).abs().max().item() <= 1e-6 * b.abs().max().item(), rank
        assert len(ours["warned"]) == 1 and "no_sync" in ours["warned"][0], (rank, ours["warned"])
        assert not native["warned"]
    assert all(torch.equal(a, b) for a, b in zip(results[0]["ours"]["params"],
                                                 results[1]["ours"]["params"]))
