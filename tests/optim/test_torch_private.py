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


def test_optimizer_records_are_what_torch_puts_on_an_optimizer_instance():
    """Everything torch's machinery adds to a native optimizer's ``__dict__`` (its __init__, an
    LR scheduler's patch and its records, step, zero_grad, the step hooks) besides the state
    ``Optimizer.__getstate__`` carries and the patched ``step``: what a copy of the wrapper
    leaves behind (optim/checkpoint/copies.py)."""
    p = torch.nn.Parameter(torch.randn(3))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    opt.register_step_pre_hook(lambda *a: None)
    p.grad = torch.randn(3)
    opt.step()
    opt.zero_grad()
    scheduler.step()
    added = set(opt.__dict__) - {"defaults", "state", "param_groups", "step"}
    assert added <= tp.optimizer_records(), \
        f"optimizer_records: torch now also sets {sorted(added - tp.optimizer_records())}"
    assert added & {"_opt_called", "_step_count"}, \
        "optimizer_records: the scheduler's record changed its name"


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


def test_hook_registries_are_the_ones_torch_creates_and_fills():
    real = torch.optim.SGD([torch.nn.Parameter(torch.randn(2))], lr=0.1)
    bare = torch.optim.SGD.__new__(torch.optim.SGD)  # as the wrapper: no Optimizer.__init__
    tp.init_hook_registries(bare)
    registries = {k for k in real.__dict__ if k.startswith("_optimizer_") and k.endswith("_hooks")}
    assert registries == set(bare.__dict__), \
        "init_hook_registries: Optimizer.__init__ creates other hook registries"
    for kind in ("step_pre", "step_post", "state_dict_pre", "state_dict_post",
                 "load_state_dict_pre", "load_state_dict_post"):
        def hook(*args):
            return None
        handle = getattr(bare, f"register_{kind}_hook")(hook)
        assert list(tp.instance_hooks(bare, kind).values()) == [hook], \
            f"instance_hooks: register_{kind}_hook fills another registry"
        handle.remove()
        assert not tp.instance_hooks(bare, kind)


def test_has_step_hooks_sees_the_instances_own_hooks():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(2))], fused=True)
    assert not tp.has_step_hooks(opt)
    handle = opt.register_step_post_hook(lambda *a: None)
    assert tp.has_step_hooks(opt), "has_step_hooks: the step post-hook registry moved"
    handle.remove()
    handle = register_optimizer_step_pre_hook(lambda *a: None)
    try:
        assert not tp.has_step_hooks(opt), "has_step_hooks: a global hook is not the instance's"
    finally:
        handle.remove()


def test_unpatched_step_runs_no_global_hook():
    p = torch.nn.Parameter(torch.randn(2))
    p.grad = torch.ones(2)
    before = p.detach().clone()
    opt = torch.optim.SGD([p], lr=0.5)
    patched = type(opt).step
    assert getattr(patched, "hooked", False), "unpatched_step: torch no longer marks its patch"
    step = tp.unpatched_step(patched)
    assert step is not None and not getattr(step, "hooked", False)
    seen = []
    handle = register_optimizer_step_pre_hook(lambda *a: seen.append(1))
    try:
        step(opt)
    finally:
        handle.remove()
    assert seen == [], "unpatched_step: the global hooks still ran"
    assert torch.equal(p.detach(), before - 0.5), "unpatched_step: not the class's own step"
    assert tp.unpatched_step(lambda self: None) is None


def test_pipelining_imported_reads_sys_modules(monkeypatch):
    import sys
    pytest.importorskip("torch.distributed.pipelining")
    assert tp.pipelining_imported()
    monkeypatch.delitem(sys.modules, "torch.distributed.pipelining")
    assert not tp.pipelining_imported()


def test_fsdp2_group_mesh_is_the_param_groups_mesh(tmp_path):
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    fsdp = pytest.importorskip("torch.distributed.fsdp")
    from torch.distributed.device_mesh import init_device_mesh
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(3, 2))
        fsdp.fully_shard(model[0], mesh=mesh)
        fsdp.fully_shard(model, mesh=mesh)  # the root: no params of its own
        assert tp.fsdp2_group_mesh(model[0]) is mesh, "fsdp2_group_mesh: FSDP2's param group"
        assert tp.fsdp2_group_mesh(model) is None, "fsdp2_group_mesh: a module without params"
    finally:
        dist.destroy_process_group()


def test_flat_leaves_flattens_nested_outputs():
    """The FSDP2 intake finds the tensors of a module's output at any depth."""
    from accumkernels._torch_private import flat_leaves
    a, b, c = torch.randn(2), torch.randn(3), torch.randn(1)
    assert [t is x for t, x in zip(flat_leaves((a, [b, {"k": c}])), (a, b, c))] == [True] * 3
