"""``reduction="weighted"`` with micro-batches without rows (``add_weight(0)``) on 2 gloo ranks:
FSDP2 and, as the control, DDP, against the native per-row mean over the window
(_zero_weight_workers.py: a rank's first micro-batch of a window, a rank's whole window and a
window's last micro-batch have no rows; genuinely empty or masked; the weight reported before
or after the backward; N given or not).

Tolerance. FSDP2: the wrapper adds the same fp32 reduce-scatter outputs in the same order as
FSDP2's ``grad += shard`` (the first write of a window overwrites, as native's first ``.grad``
is the shard itself) and multiplies by the same fp32 factor 1 / total: bit-identical. DDP
averages the window (each rank's sum divided by the world, then summed) as natively; the
wrapper then multiplies by 1 / (total / world) where the native loop multiplies by world /
total: the two factors may differ in the last bit (2**-24 relative), so each gradient and each
SGD step may too: 1e-6 of each tensor's largest value (3 windows, room for the momentum).
"""

from __future__ import annotations

import pytest
import torch
from _zero_weight_workers import ACCUM, RUNS, WINDOWS, ZERO, rows, run_ranks

pytest.importorskip("torch.distributed.fsdp", reason="torch.distributed is not available")
pytestmark = pytest.mark.skipif(not hasattr(torch.distributed.fsdp, "fully_shard"),
                                reason="this torch has no FSDP2 fully_shard")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(tmp_path_factory.mktemp("zero_weight"))


def _same(a: torch.Tensor, b: torch.Tensor, layout: str, what: str) -> None:
    assert a.shape == b.shape, what
    if layout == "fsdp2":
        assert torch.equal(a, b), f"{what}: max |diff| {(a - b).abs().max().item():.3g}"
    else:
        err = (a.double() - b.double()).abs().max().item()
        assert err <= 1e-6 * b.double().abs().max().item(), f"{what}: max |diff| {err:.3g}"


def test_the_data_has_the_zero_row_micro_batches():
    """Not vacuous: each pattern is there (a first micro-batch, a whole window of one rank, a
    last micro-batch), and the ranks' windows differ in size."""
    assert (0, 1, 0) in ZERO and all((1, 1, i) in ZERO for i in range(ACCUM))
    assert (2, 0, ACCUM - 1) in ZERO
    for w in range(WINDOWS):
        assert sum(rows(w, 0, i) for i in range(ACCUM)) != sum(rows(w, 1, i)
                                                             for i in range(ACCUM))


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
@pytest.mark.parametrize("kind", ["empty", "masked"])
@pytest.mark.parametrize("run", list(RUNS))
def test_zero_row_micro_batches_are_the_native_per_row_mean(ranks, layout, kind, run):
    """The params after every window are native's; with N given, ``p.grad`` after the
    window's last backward and weight is native's final per-row mean too (a user's clip there
    measures native's)."""
    for rank, out in enumerate(ranks):
        native, ours = out[(layout, kind, "native")], out[(layout, kind, run)]
        for w in range(WINDOWS):
            if RUNS[run].get("accumulation_steps", ACCUM) is not None:
                for i, (a, b) in enumerate(zip(ours["grads"][w], native["grads"][w])):
                    _same(a, b, layout, f"{layout}/{kind}/{run}, rank {rank}, window {w}: "
                                        f"p.grad {i}")
            for i, (a, b) in enumerate(zip(ours["params"][w], native["params"][w])):
                _same(a, b, layout, f"{layout}/{kind}/{run}, rank {rank}: param {i} after "
                                    f"window {w}")
        moved = [not torch.equal(a, b) for a, b in zip(native["params"][0],
                                                       native["params"][-1])]
        assert all(moved), "the steps must move every param"
