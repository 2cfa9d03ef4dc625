"""A checkpoint in the middle of a window under DDP (DESIGN: "state_dict()/load_state_dict()":
"Under DDP a mid-window checkpoint keeps every rank's window, or is refused clearly"). Before the
window's sync backward each rank's window is its own; frameworks save rank 0's optimizer state only
(Accelerate's ``save_state``, the HF Trainer). So:

* every rank saving and loading its own state dict resumes exactly (bit-identical to not
  stopping, fp32, 2 and 4 gloo ranks, DDP, K=4);
* rank 0's state dict loaded on rank 1 is refused with a ValueError naming the problem, before
  anything changes (loading it would silently replace rank 1's part of the window by rank 0's),
  and rank 0 refuses it too (the ranks agree), so no rank trains on alone; so is a mid-window
  checkpoint through DCP (``get_state_dict`` + ``dcp.save``: each key written from one rank);
  ``state_dict()`` warns when it holds a rank-local window;
* after the sync backward (the window averaged, the same on every rank) rank 0's state dict
  resumes on every rank, exactly.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch
import torch.distributed as dist

from _spawn import run_scenario, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

K, LR = 4, 1e-2


def build(params: list[torch.Tensor] | None = None):
    from accumkernels import AccumulatingOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    if params is not None:
        with torch.no_grad():
            for p, saved in zip(model.parameters(), params):
                p.copy_(saved)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), model=ddp)
    return model, ddp, opt


def micro_batch(ddp, opt, rank: int, window: int, i: int, step: bool = True) -> None:
    g = torch.Generator().manual_seed(100 * window + 10 * i + rank + 1)
    x, y = torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)
    sync = i == K - 1
    with contextlib.nullcontext() if sync else ddp.no_sync():
        (torch.nn.functional.mse_loss(ddp(x), y) / K).backward()
    if sync and step:
        opt.step()
        opt.zero_grad()


def snapshot(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def resumed(rank: int, cut: int, source: int | None) -> dict:
    """Window 0, then window 1 up to micro-batch ``cut`` (exclusive); save; rebuild everything
    from the params and the state dict of rank ``source`` (None: this rank's own); finish."""
    model, ddp, opt = build()
    for i in range(K):
        micro_batch(ddp, opt, rank, 0, i)
    for i in range(cut):
        micro_batch(ddp, opt, rank, 1, i)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sd = opt.state_dict()
    warned = any("rank-local" in str(w.message) or "own until" in str(w.message)
                 for w in caught)
    objects = [sd, snapshot(model)]
    if source is not None:
        dist.broadcast_object_list(objects, src=source)
    model, ddp, opt = build(objects[1])
    out: dict = {"warned": warned}
    try:
        opt.load_state_dict(objects[0])
    except ValueError as exc:
        out.update(refused=str(exc), micro_steps=opt.micro_steps, window_empty=opt._parts.window.empty)
    # the refused rank starts window 1 again (as a user would): same counts, same collectives
    for i in range(0 if "refused" in out else cut, K):
        micro_batch(ddp, opt, rank, 1, i)
    out["params"] = snapshot(model)
    return out


def resumed_after_sync(rank: int) -> dict:
    """The whole of window 1's backwards (the last one syncs: DDP averaged the window), then
    rank 0's state dict on every rank, then step()."""
    model, ddp, opt = build()
    for i in range(K):
        micro_batch(ddp, opt, rank, 0, i)
    for i in range(K):
        micro_batch(ddp, opt, rank, 1, i, step=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        objects = [opt.state_dict(), snapshot(model)]
    dist.broadcast_object_list(objects, src=0)
    model, ddp, opt = build(objects[1])
    opt.load_state_dict(objects[0])
    opt.step()
    return {"params": snapshot(model), "warned": bool(caught)}


def through_dcp(rank: int, ckpt: str) -> dict:
    """Window 0, then 2 micro-batches of window 1; ``get_state_dict(ddp, opt)`` and
    ``dcp.save`` (each key written once, from one rank); a fresh model and wrapper load it
    through a template built inside ``opt.window_template()`` and ``set_state_dict``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, ddp, opt = build()
    for i in range(K):
        micro_batch(ddp, opt, rank, 0, i)
    for i in range(2):
        micro_batch(ddp, opt, rank, 1, i)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the rank-local window's warning)
        msd, osd = get_state_dict(ddp, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt)
    model, ddp, opt = build()
    with opt.window_template():
        msd, osd = get_state_dict(ddp, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=ckpt)
    out: dict = {}
    try:
        set_state_dict(ddp, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    except ValueError as exc:
        out.update(refused=str(exc), micro_steps=opt.micro_steps)
    dist.barrier()
    return out


def scenario(rank: int, ckpt: str) -> dict:
    model, ddp, opt = build()
    for window in range(2):
        for i in range(K):
            micro_batch(ddp, opt, rank, window, i)
    out = {"straight": snapshot(model)}
    for name, cut, source in (("own", 2, None), ("rank0_mid", 2, 0), ("rank0_synced", K - 1, 0)):
        out[name] = resumed(rank, cut, source)
    out["after_sync"] = resumed_after_sync(rank)
    out["dcp"] = through_dcp(rank, ckpt)
    return out


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, kwargs["world"],
                 lambda: scenario(rank, os.path.join(out_dir, "dcp")))


@pytest.fixture(scope="module", params=[2, 4], ids=["2ranks", "4ranks"])
def ranks(request, tmp_path_factory):
    world = request.param
    return spawn_ranks(_rank_main, str(tmp_path_factory.mktemp(f"ddp_ckpt{world}")), "ckpt",
                       {"world": world}, world, timeout=180)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_every_rank_its_own_state_dict_resumes_exactly(ranks):
    for rank, res in enumerate(ranks):
        run = res["own"]
        assert "refused" not in run, f"rank {rank}: {run.get('refused')}"
        assert run["warned"], f"rank {rank}: no warning for a rank-local window"
        assert same(run["params"], res["straight"]), f"rank {rank}: resume differs"
    moved = (ranks[0]["straight"][0] - build_initial()[0]).abs().max().item()
    assert moved > 0


def build_initial() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    return snapshot(model)


def test_rank0_mid_window_state_dict_is_refused_on_every_rank(ranks):
    """Refused where it is not the rank's own (naming it), and on rank 0 too: a rank that
    loaded would train on into collectives the others never reach."""
    r0 = ranks[0]["rank0_mid"]
    assert "refuses it too" in r0.get("refused", ""), r0.get("refused")
    assert r0["micro_steps"] == 0 and r0["window_empty"]
    for rank, res in enumerate(ranks[1:], start=1):
        run = res["rank0_mid"]
        assert "refused" in run, f"rank {rank} silently took rank 0's window"
        assert "rank 0's window" in run["refused"]
        assert f"rank {rank} of {len(ranks)}" in run["refused"]
        assert run["micro_steps"] == 0 and run["window_empty"]  # nothing changed


def test_a_mid_window_dcp_checkpoint_is_refused_on_every_rank(ranks):
    """``get_state_dict(ddp, opt)`` + ``dcp.save`` in the middle of a window: DCP writes each
    key once, from one rank, so no rank gets its own window back. Every rank refuses it alike
    (ValueError), nothing loaded; none trains on with a window mixed from the ranks'."""
    for rank, res in enumerate(ranks):
        run = res["dcp"]
        assert "refused" in run, f"rank {rank} loaded a window mixed from the ranks'"
        assert "load_state_dict" in run["refused"] and "window" in run["refused"]
        assert run["micro_steps"] == 0, rank


def test_rank0_state_dict_taken_before_the_sync_micro_batch_is_refused_too(ranks):
    """Cut before the last micro-batch: still rank-local (the sync backward has not run)."""
    assert all("refused" in res["rank0_synced"] for res in ranks)


def test_after_the_sync_backward_rank0_state_dict_resumes_every_rank(ranks):
    for rank, res in enumerate(ranks):
        run = res["after_sync"]
        assert not run["warned"], f"rank {rank}: warned about an averaged window"
        assert same(run["params"], res["straight"]), f"rank {rank}: resume differs"
