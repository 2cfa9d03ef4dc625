"""FSDP2 (``fully_shard``; DESIGN: "Multi-process jobs"): the wrapper against native FSDP2 on 2 and
4 gloo ranks.

Every scenario trains the same model (_fsdp2_workers.py: bf16 compute, fp32 sharded
params, fp32 reduce-scatter, a 3-row head, an FSDP group and a root param unused in every other
micro-batch) from the same seed on the same data, natively and wrapped, for 3 windows of 3
micro-batches, and compares the local gradient shards after every micro-batch, the clip norms
and the params.

Tolerance: with ``reduction="sum"`` (and ``"weighted"``) the wrapper adds the same fp32
reduce-scatter outputs in the same order as FSDP2's ``grad += shard`` (``accumulate_`` computes
``dst + 1.0 * src`` in fp32: the same rounding), computes the norm with the same DTensor calls as
``clip_grad_norm_`` and steps the same inner optimizer on DTensor grads holding the same values:
bit-identical is the bar. ``"mean"`` fuses 1/N into each add where the native loop divides the
sum once: the two differ by the rounding of at most N fp32 operations per element, so
1e-6 relative (N = 3: 3 ops of 2**-24 each, with room for the norm and one step).

One process launch per world size runs all of its scenarios (CI time).
"""

from __future__ import annotations

import pytest
import torch
from _fsdp2_scenarios import (scenario_memory, scenario_nonfinite, scenario_refusals,
                              scenario_extra_step, scenario_weight_faults,
                              scenario_resume, scenario_resume_other_world, scenario_wire_bound,
                              scenario_wire_pair, scenario_written_nonfinite)
from _fsdp2_workers import ACCUM, CLIP, WINDOWS, run_ranks

pytest.importorskip("torch.distributed.fsdp", reason="torch.distributed is not available")
pytestmark = pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"),
                                reason="this torch has no FSDP2 fully_shard")

TWO_RANKS = {
    "sync_adamw": {},
    "nosync_sgd_wrapper_clip": {"nosync": "grad", "inner": "sgd", "clip": "wrapper"},
    "mean": {"reduction": "mean"},
    "weighted": {"reduction": "weighted", "weights": True, "clip": "wrapper"},
    # p.grad after the N-th backward is final: a user's clip before step() measures native's
    "weighted_user_clip": {"reduction": "weighted", "weights": True},
    "weighted_first_user_clip": {"reduction": "weighted", "weights": True, "weight_first": True},
    "memory": {"fn": scenario_memory},
    "refusals": {"fn": scenario_refusals},
    "wire": {"fn": scenario_wire_pair},
    "wire_nosync": {"fn": scenario_wire_pair, "nosync": "grad"},
    "nonfinite": {"fn": scenario_nonfinite},
    "written_nonfinite": {"fn": scenario_written_nonfinite},
    "outside_clear": {"outside_clear": True},
}
WEIGHTS = {  # (a launch of its own: its scenarios raise, or did)
    "weighted_empty": {"reduction": "weighted", "weights": True, "empty": True},
    "weighted_first_empty": {"reduction": "weighted", "weights": True, "empty": True,
                             "weight_first": True},
    "faults": {"fn": scenario_weight_faults},
}
STEPS = {"extra_step": {"fn": scenario_extra_step}}  # (a launch of its own: it raises, or hung)
FOUR_RANKS = {
    "uneven_empty": {},
    "hsdp": {"hsdp": True, "clip": "wrapper"},
    "hsdp_no_all_reduce_sgd": {"hsdp": True, "nosync": "allreduce", "inner": "sgd",
                               "unused": False},
    "hsdp_nosync": {"hsdp": True, "nosync": "grad"},
    "wire_bound": {"fn": scenario_wire_bound},
}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("fsdp2_dcp") / "mid_window")


@pytest.fixture(scope="module")
def two(tmp_path_factory, checkpoint_dir):
    scenarios = {**TWO_RANKS, "resume": {"fn": scenario_resume, "ckpt": checkpoint_dir}}
    return run_ranks(tmp_path_factory.mktemp("fsdp2_w2"), 2, scenarios, timeout=200)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("fsdp2_weights"), 2, WEIGHTS, timeout=200)


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("fsdp2_steps"), 2, STEPS, timeout=200)


@pytest.fixture(scope="module")
def four(tmp_path_factory, checkpoint_dir, two):
    """Runs after ``two``: it also loads the checkpoint the 2-rank launch saved."""
    scenarios = {**FOUR_RANKS,
                 "resume": {"fn": scenario_resume_other_world, "ckpt": checkpoint_dir}}
    return run_ranks(tmp_path_factory.mktemp("fsdp2_w4"), 4, scenarios, timeout=240)


def _equal(a, b, what: str) -> None:
    assert (a is None) == (b is None), f"{what}: one run has a gradient, the other None"
    if a is not None:
        assert a.shape == b.shape and a.dtype == b.dtype, what
        assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max().item():.3g}"


def _close(a, b, what: str, rel: float = 1e-6) -> None:
    assert (a is None) == (b is None), what
    if a is not None and a.numel():
        err = (a.double() - b.double()).abs().max().item()
        assert err <= rel * b.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


def check_pair(result: dict, name: str, *, scale: float | None = None,
               unused: bool = True) -> None:
    """Wrapped vs native; ``scale``: the wrapper's gradients are native's times this;
    ``unused``: the scenario has unused params (a None gradient somewhere)."""
    native, ours = result["native"], result["ours"]
    assert len(ours["grads"]) == WINDOWS * ACCUM
    assert any(g is not None and g.numel() for gs in ours["grads"] for g in gs), name
    assert not unused or any(g is None for gs in native["grads"] for g in gs), \
        f"{name}: no None gradient (unused param, no-sync micro-batch)"
    for k, (gn, go) in enumerate(zip(native["grads"], ours["grads"])):
        for i, (a, b) in enumerate(zip(go, gn)):
            what = f"{name}: micro-batch {k}, param {i}"
            if scale is None:
                _equal(a, b, what)
            else:
                _close(a, None if b is None else b * scale, what)
    assert len(ours["norms"]) == WINDOWS
    for w, (a, b) in enumerate(zip(ours["norms"], native["norms"])):
        assert b.item() > CLIP, f"{name}: clipping must act (norm {b.item():.3g})"
        (_equal if scale is None else _close)(a.reshape(()), b.reshape(()), f"{name}: norm {w}")
    for i, (a, b) in enumerate(zip(ours["params"], native["params"])):
        (_equal if scale is None else _close)(a, b, f"{name}: param {i} after {WINDOWS} windows")


@pytest.mark.parametrize("name", ["sync_adamw", "nosync_sgd_wrapper_clip", "weighted", "wire",
                                  "wire_nosync", "outside_clear", "weighted_user_clip",
                                  "weighted_first_user_clip"])
def test_two_ranks_bit_identical_to_native(two, name):
    for rank, results in enumerate(two):
        check_pair(results[name], f"{name}, rank {rank}")


@pytest.mark.parametrize("name", ["weighted_empty", "weighted_first_empty"])
def test_a_micro_batch_without_tokens_is_weight_zero_as_natively(weights, name):
    """Rank 1's second micro-batch of every window has no tokens: ``add_weight(0)`` is
    accepted and the ranks stay in lockstep, bit-identical to native FSDP2's per-token mean."""
    for rank, results in enumerate(weights):
        check_pair(results[name], f"{name}, rank {rank}")


@pytest.mark.parametrize("fault", ["skip_after", "skip_before", "negative"])
def test_ranks_that_disagree_on_weights_raise_alike(weights, fault):
    """Rank 1 skips one ``add_weight`` or reports a negative weight: every rank raises the same
    error at the mesh's next agreement, long before any process group's own timeout."""
    kind, needle = (("RuntimeError", "disagree on the weights") if fault.startswith("skip")
                    else ("ValueError", "negative or non-finite"))
    for rank, results in enumerate(weights):
        msg = results["faults"][fault]
        assert msg is not None and msg.startswith(kind) and needle in msg, (fault, rank, msg)


def test_a_rank_that_steps_alone_raises_alike(steps):
    """``accumulation_steps=None``: rank 1 calls ``step()`` after micro-batch 1 while rank 0
    runs on into micro-batch 2's forward (FSDP2's all-gather). Every rank raises the same
    error naming step() -- rank 1 in its step, rank 0 before its forward's all-gather --
    never a hang in FSDP2's collectives. Ranks that step together train on, identically."""
    together = [results["extra_step"]["together"] for results in steps]
    assert all(r["error"] is None for r in together), together
    for a, b in zip(together[0]["params"], together[1]["params"]):
        assert torch.equal(a, b)
    alone = [results["extra_step"]["alone"] for results in steps]
    for rank, r in enumerate(alone):
        assert r["error"] is not None and r["error"].startswith("RuntimeError"), (rank, r)
        assert "disagree on where the window ends" in r["error"], (rank, r)
        assert "step()" in r["error"], (rank, r)
    assert alone[0]["where"] == "forward 0.2" and alone[1]["where"] == "step 0.1", alone


def test_mean_divides_native_window_by_n(two):
    for rank, results in enumerate(two):
        check_pair(results["mean"], f"mean, rank {rank}", scale=1.0 / ACCUM)


@pytest.mark.parametrize("name", [n for n, kwargs in FOUR_RANKS.items() if "fn" not in kwargs])
def test_four_ranks_bit_identical_to_native(four, name):
    for rank, results in enumerate(four):
        check_pair(results[name], f"{name}, rank {rank}")


def test_uneven_and_empty_shards(four):
    """The 3-row head on 4 ranks: one row on ranks 0-2, an empty shard on rank 3."""
    shapes = [tuple(r["uneven_empty"]["ours"]["local_params"][-2].shape) for r in four]
    assert shapes == [(1, 24), (1, 24), (1, 24), (0, 24)]


def test_window_memory_is_one_local_shard(two):
    """Live tensor storage mid-window: the wrapper adds at most 4 B/param / world (+ 128-byte
    alignment per param) over native FSDP2 (whose own sharded .grad the window replaces), and
    ``p.grad`` of every param lives in the window's storage."""
    for rank, results in enumerate(two):
        m = results["memory"]
        padding = 4 * 32 * len(m["local_numel"])
        assert m["window_bytes"] <= 4 * sum(m["local_numel"]) + padding
        assert m["window_bytes"] < 4 * m["numel"]  # never an unsharded copy
        per_world = 4 * -(-m["numel"] // 2)
        assert m["ours"] - m["native"] <= per_world + padding, (rank, m)
        assert m["grad_storages"] == m["window_storages"]


def test_refused_at_construction_before_any_state(two):
    expect = {"no_model": "model=", "skip_microbatch": "skip_microbatch",
              "process_group": "process_group", "not_in_backward": "accumulate_in_backward",
              "bf16": "MixedPrecisionPolicy(param_dtype=torch.bfloat16"}
    for results in two:
        r = results["refusals"]
        for name, needle in expect.items():
            assert r[name] is not None and r[name].startswith("ValueError"), (name, r[name])
            assert needle in r[name], (name, r[name])
            assert r[name + "_hooks"] == 0, f"{name}: hooks were registered before refusing"


@pytest.mark.parametrize("attrs, needle", [(("_is_flat_param",), "FSDP1"),
                                            (("ds_id", "ds_status"), "DeepSpeed")])
def test_fsdp1_and_deepspeed_params_refused(attrs, needle):
    """FSDP1 FlatParameters and DeepSpeed ZeRO-3 params own their gradient path: refused before
    any hook, naming the supported FSDP2 recipe."""
    from accumkernels import AccumulatingOptimizer

    p = torch.nn.Parameter(torch.randn(4))
    for attr in attrs:
        setattr(p, attr, True)
    with pytest.raises(ValueError, match=needle) as info:
        AccumulatingOptimizer(torch.optim.SGD([p], lr=0.1))
    assert "fully_shard" in str(info.value)
    assert p._post_accumulate_grad_hooks is None


def test_bf16_wire_halves_the_bytes(two):
    """Sync every micro-batch: every reduce-scatter goes as bf16 (half the fp32 payload) and the
    run is bit-identical to native (above: on 2 ranks the fp32 sum of two bf16 values is one
    rounding, in any order). After no-sync micro-batches the input is an fp32 sum, not
    bf16-exact: that reduce-scatter goes in fp32 (counted), still bit-identical."""
    for results in two:
        wire, nosync = results["wire"]["ours"]["wire"], results["wire_nosync"]["ours"]["wire"]
        assert wire["bytes"] > 0 and wire["fallbacks"] == 0
        assert nosync["fallbacks"] > 0


def test_bf16_wire_within_summation_order_bound(four):
    """4 ranks, bf16-exact random inputs spanning ~2**8 of magnitude: the bf16-wire sum differs
    from gloo's fp32 reduce-scatter by at most 2 (world-1) 2**-24 sum|g| elementwise (both are
    within (world-1) 2**-24 sum|g| of the exact sum), with half the bytes; a bf16 running sum
    (negative control) breaks the same bound by orders of magnitude."""
    for results in four:
        r = results["wire_bound"]
        assert r["ratio"] <= 1.0, r
        assert r["control_ratio"] > 100.0, r
        assert 2 * r["bytes"] == r["fp32_bytes"], r


def test_dcp_resume_mid_window_is_exact(two):
    """Saved with ``dcp.save`` two micro-batches into the second window, loaded into a fresh
    model and wrapper: the run ends bit-identical to the uninterrupted one."""
    for rank, results in enumerate(two):
        r = results["resume"]
        assert r["micro_steps"] == 2
        for i, (a, b) in enumerate(zip(r["resumed"], r["straight"])):
            _equal(a, b, f"rank {rank}, param {i}")


def test_dcp_checkpoint_loads_at_another_world_size(four):
    """The 2-rank mid-window checkpoint, loaded on 4 ranks (DCP reshards the window shards like
    the params and AdamW's state): the wrapper ends bit-identical to native FSDP2 on 4 ranks
    given the same params, state and the saved window as ``.grad``."""
    for rank, results in enumerate(four):
        r = results["resume"]
        assert r["micro_steps"] == 2
        assert r["shard_rows"][1] == (10, 16)  # l1.weight (40 rows) in 4 shards, not 2
        for i, (a, b) in enumerate(zip(r["ours"], r["native"])):
            _equal(a, b, f"rank {rank}, param {i}")


def test_nonfinite_on_one_rank_skips_the_step_everywhere(two):
    """The non-finite decision is agreed over the mesh: an inf in rank 1's shard only skips the
    window on both ranks (params unchanged by it, identical on both), the others step."""
    for results in two:
        r = results["nonfinite"]
        assert r["skipped"] == 1
        p0, p1, p2 = r["params"]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1)), "the poisoned window stepped"
        assert not all(torch.equal(a, b) for a, b in zip(p1, p2)), "window 2 did not step"
    for a, b in zip(two[0]["nonfinite"]["params"][-1], two[1]["nonfinite"]["params"][-1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", ["None", str(CLIP)])
def test_nonfinite_written_into_one_ranks_shard_is_agreed(two, clip):
    """A NaN the user writes into rank 1's window shard between the last backward and step():
    ``skip_step`` skips that window on both ranks (params unchanged by it, the same on both
    ranks), ``raise`` raises on both; the other windows step."""
    for rank, results in enumerate(two):
        r = results["written_nonfinite"][f"skip_step_{clip}"]
        assert r["skipped"] == 1, f"rank {rank} skipped {r['skipped']} windows"
        p0, p1, p2 = r["params"]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1)), f"rank {rank}: window 1 stepped"
        assert not all(torch.equal(a, b) for a, b in zip(p1, p2)), "window 2 did not step"
        raised = results["written_nonfinite"][f"raise_{clip}"]["raised"]
        assert [w for w, _ in raised] == [1], f"rank {rank} raised in windows {raised}"
    for policy in ("skip_step", "raise"):
        a, b = (two[k]["written_nonfinite"][f"{policy}_{clip}"]["params"][-1] for k in (0, 1))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"{policy}: the ranks diverged"


def test_bf16_exactness_check_in_chunks(monkeypatch):
    """The wire's fallback test reads the input chunk by chunk (no whole fp32 temporary): a
    value off bf16 in the last chunk, or in the first, is still seen."""
    from accumkernels.optim.fsdp2 import wire as fsdp2_wire

    monkeypatch.setattr(fsdp2_wire, "_CHECK_CHUNK", 7)
    x = torch.randn(50).to(torch.bfloat16).float()
    assert fsdp2_wire._bf16_exact(x.to(torch.bfloat16), x)
    for i in (0, 48, 49):
        y = x.clone()
        y[i] += y[i].abs() * 2.0**-12 + 2.0**-40  # between two bf16 values
        assert not fsdp2_wire._bf16_exact(y.to(torch.bfloat16), y), i
