"""Every private PyTorch API the wrapper relies on (accumkernels._torch_private) still behaves as
it did on the torch versions it was checked on. A failure here names the entry that torch
changed: fix that one accessor, not its callers."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                   register_optimizer_step_pre_hook)

from accumkernels import _torch_private as tp


def test_queue_callback_runs_at_the_end_of_the_backward():
    order = []
    x = torch.randn(3, requires_grad=True)

    def hook(grad):
        tp.queue_callback(lambda: order.append("end"))
        order.append("hook")
    x.register_hook(hook)
    (x * 2).sum().backward()
    assert order == ["hook", "end"], "queue_callback: the engine's final callbacks changed"


def test_current_autograd_node_inside_and_outside_a_backward():
    assert tp.current_autograd_node() is None, "current_autograd_node outside a backward"
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    y.register_hook(lambda g: seen.append(tp.current_autograd_node()))
    y.sum().backward()
    assert seen and seen[0] is not None, "current_autograd_node inside a backward"


def test_compiled_autograd_flag_names_exist():
    ca = pytest.importorskip("torch._dynamo.compiled_autograd")
    assert hasattr(ca, "in_compiled_autograd_region") or hasattr(ca, "compiled_autograd_enabled"), \
        "compiled_autograd_on: torch renamed the compiled autograd flags"
    assert tp.compiled_autograd_on() is False


def test_fused_optimizers_take_grad_scale():
    p = torch.nn.Parameter(torch.randn(4))
    assert tp.takes_grad_scale(torch.optim.AdamW([p], fused=True)), "takes_grad_scale: fused"
    assert not tp.takes_grad_scale(torch.optim.AdamW([p], foreach=True))


@pytest.mark.parametrize("cls", [torch.optim.Rprop, torch.optim.ASGD, torch.optim.NAdam,
                                 torch.optim.AdamW])
def test_initial_state_hook_sees_the_state_before_the_update(cls):
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = torch.randn(4)
    opt = cls([p], lr=0.5)
    seen = []
    assert tp.initial_state_hook(opt, lambda g: seen.append(
        {k: v.clone() for k, v in opt.state[p].items()})), "initial_state_hook: _init_group"
    opt.step()
    assert len(seen) == 1 and float(seen[0]["step"]) == 0.0, "initial_state_hook: before the update"
    assert float(opt.state[p]["step"]) == 1.0
    assert not tp.initial_state_hook(torch.optim.LBFGS([p]), lambda g: None)


def test_post_accumulate_hook_runs_first_after_reordering():
    p = torch.nn.Parameter(torch.randn(3))
    assert not tp.has_post_accumulate_hooks(p), "has_post_accumulate_hooks: none yet"
    log = []
    user = p.register_post_accumulate_grad_hook(lambda t: log.append("user"))
    assert tp.has_post_accumulate_hooks(p), "has_post_accumulate_hooks: _post_accumulate_grad_hooks"
    ours = p.register_post_accumulate_grad_hook(lambda t: log.append("ours"))
    tp.run_post_accumulate_hook_first(p, ours)
    (p * 2).sum().backward()
    assert log == ["ours", "user"], "run_post_accumulate_hook_first: the engine's order"
    user.remove()
    (p * 2).sum().backward()
    assert log == ["ours", "user", "ours"], "run_post_accumulate_hook_first: handles still remove"


def test_global_step_hooks_are_the_registries_torch_fills():
    pre, post = tp.global_step_hooks()
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert handle.id in pre, "global_step_hooks: the pre-hook registry moved"
    finally:
        handle.remove()
    handle = register_optimizer_step_post_hook(lambda *a: None)
    try:
        assert handle.id in post, "global_step_hooks: the post-hook registry moved"
    finally:
        handle.remove()


def test_scheduler_patch_is_recognised():
    p = torch.nn.Parameter(torch.randn(2))
    opt = torch.optim.SGD([p], lr=0.1)
    torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.__dict__.pop("_opt_called", None)
    tp.record_scheduler_step(opt)
    recorded = getattr(opt, "_opt_called", False) or getattr(opt, "_step_count", 0) > 0
    assert recorded, "record_scheduler_step: the LR scheduler's step patch changed its markers"


def test_fsdp2_private_pieces():
    pytest.importorskip("torch.distributed.fsdp")
    base = tp.fsdp2_reduce_scatter_base()
    assert callable(getattr(base, "__call__", None)) and hasattr(base, "allocate"), \
        "fsdp2_reduce_scatter_base: FSDP2's ReduceScatter policy changed"
    assert isinstance(tp.fsdp2_offload_unsafe(), bool)


def test_ddp_comm_hooks_lists_a_registered_python_hook(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2))

        def hook(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, hook)
        assert hook in tp.ddp_comm_hooks(ddp), "ddp_comm_hooks: DDP's _comm_hooks changed"
    finally:
        dist.destroy_process_group()
