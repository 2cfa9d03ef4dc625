"""Lightning Fabric: the recipe (an ``AccumulatingOptimizer`` given to ``fabric.setup``, by hand
or by name) and the one line (``accumkernels.integrations.fabric.setup``) against the same
Fabric loop natively (_fabric_workers.py): ``fabric.no_backward_sync``, ``fabric.clip_gradients``
(it bites on every window), a LambdaLR, ``fabric.save``/``fabric.load`` mid-training, on 1
process and on 2 gloo ranks (``strategy="ddp"``).

fp32 is compared bit for bit (parameters and the norms ``clip_gradients`` returns), for the
reasons in _integrations_common.py: the wrapper adds the same fp32 micro-batch gradients in the
same order as autograd, and under DDP its comm hook averages the window as DDP averages its
bucket. A run resumed from ``fabric.save`` at a window's end ends where the uninterrupted run
does; in the middle of a window too on one process (the wrapper's state carries the window).
On two ranks a mid-window checkpoint holds rank 0's window only (Fabric saves rank 0's state):
loading it is refused on every rank alike (neither trains on while the other waits).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")  # the tiny GPT-2

import _fabric_workers as workers  # noqa: E402
from _integrations_common import CLIP, STEPS, check_bf16, check_ranks_agree, first_difference  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(),
                                reason="torch.distributed is not available")


def _check(res: dict, what: str) -> None:
    native = res["native"]
    assert not native["wrapped"], what
    assert len(native["norms"]) == STEPS and all(n > CLIP for n in native["norms"]), what
    for mode in ("recipe", "by_name", "oneline"):
        run = res[mode]
        assert run["wrapped"], f"{what}, {mode}"
        assert run["norms"] == native["norms"], f"{what}, {mode}: clip norms differ"
        diff = first_difference(run["params"], native["params"])
        assert diff is None, f"{what}, {mode} vs native: {diff}"
        assert run["lr"] == native["lr"], f"{what}, {mode}: LR schedule"
    assert res["by_name"]["optimizer"] == "accumkernels.optimizers.AdamW", what
    for mode in ("native", "oneline"):
        resumed = res[f"{mode}_resumed"]
        assert resumed["norms"] == native["norms"][2:], f"{what}, {mode} resumed"
        diff = first_difference(resumed["params"], native["params"])
        assert diff is None, f"{what}, {mode} resumed at a window's end: {diff}"


def test_fabric_one_process_equals_native(tmp_path):
    """1 process: recipe, by name and one line bit-identical to native Fabric; resumes from
    ``fabric.save`` at a window's end and in the middle of one; bf16 closer to float64."""
    res = workers.scenario_fabric(str(tmp_path), 1, bf16=True)
    _check(res, "fabric, 1 process")
    mid = res["mid_window_resumed"]
    diff = first_difference(mid["params"], res["native"]["params"])
    assert diff is None, f"resumed in the middle of a window: {diff}"
    assert mid["norms"] == res["native"]["norms"][1:]
    check_bf16({"bf16_oneline": res["bf16_oneline"], "bf16_native": res["bf16_native"],
                "f64_native": res["f64_native"]}, "fabric")


def test_fabric_ddp_two_ranks_equals_native(tmp_path):
    """2 gloo ranks, ``strategy="ddp"``: the one line and the by-name class through it (the comm
    hook on Fabric's DDP module) bit-identical to native DDP, ranks agreeing; the recipe by hand
    given to ``setup`` too, and refused at its first step without it; a mid-window checkpoint
    refused on every rank alike."""
    results = workers.run_fabric_ranks(tmp_path)
    for rank, res in enumerate(results):
        _check(res, f"fabric ddp, rank {rank}")
    for key in ("native", "oneline", "by_name"):
        check_ranks_agree(results, key, f"fabric ddp {key}")
    for res in results:
        refused = res["mid_window_refused"]
        assert refused is not None and "middle of a window" in refused, refused
    for res in results:  # plain fabric.setup under DDP: refused at the first step, by name
        assert "nothing reduces" in res["without_hook"] and "ddp_comm_hook" in res["without_hook"]


# -- refusals before Fabric touches anything ------------------------------------------------------

def _bf16_true_fabric():
    from lightning.fabric import Fabric

    return Fabric(accelerator="cpu", devices=1, precision="bf16-true")


def _unchanged(model: torch.nn.Module, before: dict) -> None:
    for name, p in model.named_parameters():
        assert p.dtype is torch.float32, f"{name} cast to {p.dtype} by a refused setup"
        assert torch.equal(p.detach(), before[name]), f"{name} changed by a refused setup"
    assert not any(hasattr(p, "main_grad") for p in model.parameters())


@pytest.mark.parametrize("options, error, match", [
    ({"reduction": "avg"}, ValueError, "reduction"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm"),
    ({"reductoin": "sum"}, TypeError, "did you mean 'reduction'"),
    ({"accumulation_steps": 4}, ValueError, "accumulation_steps=None"),
])
def test_setup_refuses_bad_options_before_fabric_casts_the_model(options, error, match):
    """``precision="bf16-true"``: Fabric casts the module in ``setup_module``; a bad option is
    refused before, so the module keeps its fp32 params (dtype and values) and no wrapper."""
    from accumkernels.integrations.fabric import setup

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(error, match=match):
        setup(_bf16_true_fabric(), model, optimizer, **options)
    _unchanged(model, before)
    assert not optimizer.state


def test_setup_refuses_options_for_an_optimizer_already_wrapped():
    """A by-name class or a wrapper built by hand takes its options where it is built: given to
    ``setup`` they are refused (never dropped), before Fabric casts the module; without options
    the wrapper is kept as it is."""
    import accumkernels.optimizers as by_name
    from accumkernels import AccumulatingOptimizer
    from accumkernels.integrations.fabric import setup

    builders = (lambda m: by_name.AdamW(m.parameters(), lr=1e-3),
                lambda m: AccumulatingOptimizer(torch.optim.SGD(m.parameters(), lr=0.1)))
    for build in builders:
        model = torch.nn.Linear(4, 2)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        optimizer = build(model)
        with pytest.raises(ValueError, match="already an AccumulatingOptimizer.*max_grad_norm=1.0"):
            setup(_bf16_true_fabric(), model, optimizer, max_grad_norm=1.0)
        assert optimizer.config.max_grad_norm is None
        for name, p in model.named_parameters():
            assert p.dtype is torch.float32 and torch.equal(p.detach(), before[name]), name
