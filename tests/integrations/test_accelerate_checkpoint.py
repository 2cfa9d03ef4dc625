"""Accelerate's ``save_state``/``load_state`` in the middle of a window (DESIGN:
"state_dict()/load_state_dict()": Accelerate's ``save_state`` keeps the window, or a path that
cannot is refused clearly), with ``AccumulatingAccelerator`` (the one line) and Accelerate's own
``accumulate()`` loop, ``gradient_accumulation_steps=4``, the job stopped right after
``save_state`` two micro-batches into a window and resumed by a new process-like run
(``load_state``, ``skip_first_batches``).

* one process, fp32 and bf16 (master weights): bit-identical to the run that never stopped
  (``save_state`` writes the wrapper's state dict with the window; Accelerate restores its
  step counter, so the resumed loop syncs where the uninterrupted one did);
* DDP on 2 gloo ranks: ``save_state`` writes rank 0's optimizer state only, and before the
  window's sync backward each rank's window is its own. ``state_dict()`` warns on every rank,
  and ``load_state`` on rank 1 is refused with a ValueError naming the problem (rank 0 resumes
  its own), never silently given rank 0's window. (At a window boundary DDP resumes exactly:
  test_accelerate.py.)

FSDP2 through Accelerate is not reachable here: Accelerate 1.15 turns its FSDP plugin on only
for the accelerator kinds MULTI_GPU/NPU/XPU/... (``AcceleratorState.__init__``), so on CPU with
gloo (``DistributedType.MULTI_CPU``) ``fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)``
is ignored and the model is wrapped in DDP (checked below); ``AccumulatingAccelerator`` refuses
``DistributedType.FSDP`` in any case. FSDP2 checkpoints: tests/distributed/test_fsdp2_checkpoint.py.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

pytest.importorskip("accelerate")

from _spawn import run_scenario, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")

ACCUM, MICRO, BATCHES = 4, 3, 12  # gradient_accumulation_steps, samples per batch, per rank
SAVE_AFTER = ACCUM + 2  # two micro-batches into the second window


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _data(rank: int):
    g = torch.Generator().manual_seed(17 + rank)
    n = BATCHES * MICRO
    return torch.utils.data.TensorDataset(torch.randn(n, 6, generator=g),
                                          torch.randn(n, 3, generator=g))


def run(ckpt: str, dtype: torch.dtype, *, stop: bool = False, resume: bool = False) -> dict:
    """Accelerate's accumulate() loop; ``stop``: ``save_state`` after SAVE_AFTER batches and
    end there; ``resume``: ``load_state`` and go on from there."""
    from accumkernels.integrations.accelerate import AccumulatingAccelerator

    _reset_accelerate()
    accelerator = AccumulatingAccelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3)).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # every rank reads its own data (no sharding by Accelerate: the same loader on each rank)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    loader = torch.utils.data.DataLoader(_data(rank), batch_size=MICRO)
    model, opt, loader = accelerator.prepare(model, opt, loader, device_placement=[True, True,
                                                                                   False])
    out: dict = {}
    start = 0
    if resume:
        try:
            accelerator.load_state(ckpt)
        except ValueError as exc:
            return {"refused": str(exc)}
        start = SAVE_AFTER
        out["micro_steps"] = opt.optimizer.micro_steps
    batches = list(loader)[start:]
    for k, (x, y) in enumerate(batches, start=start):
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y))
            opt.step()
            opt.zero_grad()
        if stop and k + 1 == SAVE_AFTER:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                accelerator.save_state(ckpt)
            out["warned"] = any("own until" in str(w.message) for w in caught)
            out["micro_steps"] = opt.optimizer.micro_steps
            return out
    out["params"] = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_one_process_save_state_mid_window_resumes_exactly(tmp_path, dtype):
    ckpt = str(tmp_path / "ckpt")
    straight = run(ckpt, dtype)
    saved = run(ckpt, dtype, stop=True)
    assert saved["micro_steps"] == SAVE_AFTER - ACCUM
    resumed = run(ckpt, dtype, resume=True)
    _reset_accelerate()
    assert resumed["micro_steps"] == SAVE_AFTER - ACCUM
    for a, b in zip(resumed["params"], straight["params"], strict=True):
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def ddp_scenario(ckpt: str) -> dict:
    saved = run(ckpt, torch.float32, stop=True)
    torch.distributed.barrier()  # rank 0 wrote the checkpoint
    resumed = run(ckpt, torch.float32, resume=True)
    out = {"warned": saved["warned"], "resumed": resumed}
    out["fsdp2_plugin"] = fsdp2_plugin_on_cpu()
    _reset_accelerate()
    return out


def fsdp2_plugin_on_cpu() -> dict:
    """What Accelerate builds from an FSDP2 plugin on CPU/gloo (2 ranks)."""
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    _reset_accelerate()
    accelerator = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    model = accelerator.prepare(torch.nn.Linear(4, 4))
    return {"distributed_type": str(accelerator.distributed_type),
            "model": type(model).__name__}


def _rank_main(rank: int, out_dir: str, name: str, kwargs: dict) -> None:
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2",
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    run_scenario(rank, out_dir, 2, lambda: ddp_scenario(os.path.join(out_dir, "ckpt")))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn_ranks(_rank_main, str(tmp_path_factory.mktemp("acc_ckpt")), "acc_ckpt", {},
                       2, timeout=180)


def test_ddp_save_state_mid_window_is_refused_on_every_rank(two_ranks):
    """Accelerate saves rank 0's optimizer only: a mid-window (rank-local) window would reach
    rank 1 as rank 0's, so every rank refuses it alike (one small all-reduce decides), and
    neither trains on while the other waits."""
    r0, r1 = (r["resumed"] for r in two_ranks)
    assert all(r["warned"] for r in two_ranks), "state_dict() did not warn"
    for r in (r0, r1):
        assert "refused" in r, "a rank silently took rank 0's window"
        assert "middle of a window" in r["refused"] and "window boundary" in r["refused"]


def test_accelerate_fsdp2_plugin_is_ignored_on_cpu(two_ranks):
    """Why no FSDP2 save_state test runs here: Accelerate builds DDP instead."""
    for r in two_ranks:
        assert r["fsdp2_plugin"] == {"distributed_type": "DistributedType.MULTI_CPU",
                                     "model": "DistributedDataParallel"}, r["fsdp2_plugin"]
