"""Kernel robustness (DESIGN: "Robust to the user's own hands", the op layer): tensors whose memory
is not their value are refused (neg-bit views, tensor subclasses with their own
``__torch_dispatch__``: wrapper subclasses, DTensor), and a LaunchPlan never writes through an
address it has not re-checked (storage moved by ``share_memory_``, resized, or a view re-pointed). A
refused call leaves every tensor bit-identical; a moved plan gives the float64-reference result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import HAS_CUDA
from reference import Reference
from torch.utils._pytree import tree_map

import accumkernels
from accumkernels import MasterGradBuffer
from accumkernels.ops.plan import LaunchPlan

BACKENDS = ["cpu", "torch", "cuda_host"] + ([] if HAS_CUDA else ["triton"])
ROOT = Path(__file__).resolve().parents[2]  # the repository


def rand(n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Random values over several binades (never zeros)."""
    x = torch.randn(n) * torch.exp2(torch.randint(-4, 4, (n,)).float())
    return x.to(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t``'s values as bytes (any strides, neg bit resolved)."""
    copy = torch.empty(t.shape, dtype=t.dtype).copy_(t.detach().resolve_neg())
    return copy.reshape(-1).view(torch.uint8)


def snapshot(*tensors: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its bytes) for plain tensors, to check a refused call wrote nothing."""
    return [(t, _bytes(t)) for t in tensors
            if type(t) is torch.Tensor or type(t) is torch.nn.Parameter]


def unchanged(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for k, (t, before) in enumerate(saved):
        assert torch.equal(_bytes(t), before), f"tensor {k} was written by a refused call"


def neg_view(n: int) -> torch.Tensor:
    """A contiguous float32 view with the neg bit: values -v, memory v (one element: the
    classic x.conj().imag; longer: torch._neg_view, as .imag of a conj vector is strided)."""
    x = torch.complex(rand(1), rand(1)).conj().imag if n == 1 else torch._neg_view(rand(n))
    assert x.is_neg() and x.is_contiguous() and x.dtype == torch.float32
    return x


# ---- neg-bit views ---------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["src", "dst", "scale", "found_inf"])
def test_neg_views_are_refused_naming_the_tensor(reader, backend, where):
    dst = [rand(5), rand(9000)]
    src = [rand(5, torch.bfloat16), rand(9000)]
    scale: float | torch.Tensor = 0.5
    found_inf = torch.zeros(1)
    if where == "src":
        src[1] = neg_view(9000)
    elif where == "dst":
        dst[1] = neg_view(9000)
    elif where == "scale":
        scale = neg_view(1)
    else:
        found_inf = torch.zeros(1, dtype=torch.complex64).conj().imag
    name = {"src": r"src\[1\]", "dst": r"dst\[1\]"}.get(where, where)
    saved = snapshot(*dst, *src, found_inf, *(scale,) * isinstance(scale, torch.Tensor))
    with pytest.raises(ValueError, match=name + r" is a negative view.*resolve_neg"):
        accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)
    unchanged(saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resolved_neg_view_gives_the_native_value(backend):
    """x.conj().imag, resolved as the error says: the value native PyTorch adds."""
    x = torch.tensor([1 + 2j]).conj().imag
    d = torch.zeros(1)
    accumkernels.accumulate_([d], [x.resolve_neg()], 1.0, backend=backend)
    assert d.item() == torch.zeros(1).add_(x).item() == -2.0


def test_neg_views_of_views_and_detached_are_refused(reader):
    base = neg_view(64)
    for k, x in enumerate([base[8:40], base.detach(), base.view(8, 8)[1], base.data]):
        d = rand(x.numel()).reshape(x.shape)
        saved = snapshot(d)
        with pytest.raises(ValueError, match=r"src\[0\] is a negative view"):
            accumkernels.accumulate_([d], [x], 1.0, backend="cpu")
        unchanged(saved)


def test_plan_and_bucket_refuse_neg_views(reader):
    params = [torch.nn.Parameter(rand(n)) for n in (7, 300)]
    buffer = MasterGradBuffer(params)
    grads = [rand(7), neg_view(300)]
    saved = snapshot(*buffer.buffers.values(), *grads)
    with pytest.raises(ValueError, match=r"src\[1\] is a negative view"):
        buffer.accumulate(params, grads, 0.5)
    unchanged(saved)
    with pytest.raises(ValueError, match=r"dst\[0\] is a negative view"):
        LaunchPlan([neg_view(4)])


# ---- tensor subclasses -----------------------------------------------------------------------

class Wrapper(torch.Tensor):
    """A wrapper subclass (no storage of its own): ops run on the wrapped tensor."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype,
                                                   device=elem.device)

    def __init__(self, elem: torch.Tensor):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, Wrapper) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["src", "dst", "scale", "found_inf"])
def test_wrapper_subclass_is_refused_naming_the_tensor(reader, backend, where):
    dst = [rand(5), rand(300)]
    src = [rand(5, torch.float16), rand(300)]
    scale: float | torch.Tensor = 0.5
    found_inf = torch.zeros(1)
    inner = {"src": src[1], "dst": dst[1], "scale": torch.ones(1), "found_inf": torch.zeros(1)}
    wrapped = Wrapper(inner[where].clone())
    if where == "src":
        src[1] = wrapped
    elif where == "dst":
        dst[1] = wrapped
    elif where == "scale":
        scale = wrapped
    else:
        found_inf = wrapped
    name = {"src": r"src\[1\]", "dst": r"dst\[1\]"}.get(where, where)
    saved = snapshot(*dst, *src, found_inf, wrapped.elem)
    with pytest.raises(TypeError, match=name + r" is a Wrapper, a tensor subclass"):
        accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)
    unchanged(saved)


def test_plan_refuses_wrapper_subclasses(reader):
    with pytest.raises(TypeError, match=r"dst\[1\] is a Wrapper"):
        LaunchPlan([rand(3), Wrapper(rand(3))])
    dst = [rand(3), rand(4)]
    plan = LaunchPlan(dst)
    src = [rand(3), Wrapper(rand(4))]
    saved = snapshot(*dst, src[0], src[1].elem)
    with pytest.raises(TypeError, match=r"src\[1\] is a Wrapper"):
        plan(src, 2.0)
    unchanged(saved)


_DTENSOR_WORKER = textwrap.dedent("""
    import datetime, gc, json, os, sys, torch, torch.distributed as dist
    import accumkernels
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def threads():
        return len(os.listdir("/proc/self/task"))

    def cases():
        # (a function: the mesh and the DTensors, which keep the process group alive, are
        # gone when it returns)
        out = {}
        mesh = init_device_mesh("cpu", (1,))
        for placement in (Replicate(), Shard(0)):
            for where in ("src", "dst"):
                plain = [torch.randn(6), torch.randn(8)]
                grads = [torch.randn(6), torch.randn(8)]
                before = [t.clone() for t in plain + grads]
                dt = distribute_tensor(torch.randn(8), mesh, [placement])
                local_before = dt.to_local().clone()
                dst, src = list(plain), list(grads)
                (src if where == "src" else dst)[1] = dt
                try:
                    accumkernels.accumulate_(dst, src, 0.5)
                    msg = None
                except Exception as exc:
                    msg = f"{type(exc).__name__}: {exc}"
                same = all(torch.equal(a, b) for a, b in zip(plain + grads, before))
                same = same and torch.equal(dt.to_local(), local_before)
                out[f"{type(placement).__name__}-{where}"] = [msg, same]
        dist.barrier()
        return out

    torch.set_num_threads(1)  # (no intra-op pool: the count below is gloo's threads)
    start = threads()
    dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    try:
        out = cases()
    finally:
        gc.collect()
        dist.destroy_process_group()
    # the group was the last owner of gloo's threads: they were joined here, while the
    # interpreter is whole (left running, they are torn down in its finalization, where a
    # thread that still holds a collective's tensors aborts the process)
    print(json.dumps({"cases": out, "threads_left": threads() - start}))
""")


def test_dtensor_on_a_one_rank_mesh_is_refused(tmp_path):
    """DTensor (Replicate and Shard(0)) as src or dst: a TypeError naming the index and
    .to_local(), not a false overlap or a null pointer; nothing written. The worker's process
    group is destroyed with nothing else holding it, so gloo's threads end before the
    interpreter does (/proc/self/task: Linux)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _DTENSOR_WORKER, str(tmp_path / "store")],
                          capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["threads_left"] == 0, "gloo's threads outlived destroy_process_group()"
    results = report["cases"]
    assert len(results) == 4
    for case, (msg, same) in results.items():
        where = case.split("-")[1]
        assert msg is not None and msg.startswith("TypeError"), (case, msg)
        assert f"{where}[1] is a DTensor" in msg and ".to_local()" in msg, (case, msg)
        assert same, f"{case}: a tensor was written by the refused call"


# ---- launch plans whose dst move -------------------------------------------------------------

def _plan_case(n_views: tuple[int, ...] = (3, 4096, 37, 9000)):
    flat = rand(sum(n_views) + 64)
    views = list(flat[32:32 + sum(n_views)].split(list(n_views)))
    return flat, views


def _launch_and_check(plan, views, dtype=torch.bfloat16, scale=0.75):
    src = [rand(v.numel(), dtype) for v in views]
    refs = [Reference(v) for v in views]
    for r, x in zip(refs, src):
        r.add(x, scale)
    plan(src, scale)
    for i, (r, v) in enumerate(zip(refs, views)):
        r.check(v, f"dst[{i}]")


@pytest.mark.parametrize("backend", ["cpu", "cuda_host"])
def test_plan_follows_share_memory_of_its_storage(backend):
    """share_memory_() moves the storage all the views live in: the next launch re-reads the
    addresses and writes the new memory (the old one is freed: writing it corrupts the heap)."""
    flat, views = _plan_case()
    plan = LaunchPlan(views, backend=backend)
    assert plan._native is not None
    _launch_and_check(plan, views)
    old = flat.data_ptr()
    flat.share_memory_()
    assert flat.data_ptr() != old and views[0].data_ptr() == flat.data_ptr() + 32 * 4
    for _ in range(2):
        _launch_and_check(plan, views, torch.float16)


def test_bucket_plan_after_model_share_memory():
    """model.share_memory() mid-window with p.grad the buffer's views (it once crashed here):
    the bucket launch after it is the float64 reference."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    params = list(model.parameters())
    buffer = MasterGradBuffer(params, bucket_size_mb=0.001)
    assert len(buffer.buckets) > 1
    for p in params:
        p.grad = buffer.view(p)
    refs = {id(p): Reference(buffer.view(p)) for p in params}

    def step(scale):
        for bucket in buffer.buckets:
            grads = [rand(p.numel(), torch.bfloat16).reshape(p.shape) for p in bucket.params]
            for p, g in zip(bucket.params, grads):
                refs[id(p)].add(g, scale)
            buffer.accumulate(bucket.params, grads, scale)

    step(0.5)
    before = next(iter(buffer.buffers.values())).data_ptr()
    model.share_memory()
    assert next(iter(buffer.buffers.values())).data_ptr() != before
    step(0.25)
    step(-1.5)
    for p in params:
        refs[id(p)].check(p.grad, "p.grad")
        assert p.grad.data_ptr() == buffer.view(p).data_ptr()


def test_plan_refuses_while_its_storage_is_freed_and_recovers():
    """FSDP-style storage.resize_(0): the launch refuses (nothing written); once the storage
    is back, the plan launches on the new memory."""
    flat, views = _plan_case()
    plan = LaunchPlan(views)
    _launch_and_check(plan, views)
    nbytes = flat.untyped_storage().nbytes()
    src = [rand(v.numel()) for v in views]
    saved = snapshot(*src)
    flat.untyped_storage().resize_(0)
    with pytest.raises(ValueError, match=r"dst\[\d\] moved since the plan was built"):
        plan(src, 1.0)
    unchanged(saved)
    flat.untyped_storage().resize_(nbytes)
    flat.copy_(rand(flat.numel()))
    _launch_and_check(plan, views)


def test_plan_never_writes_through_memory_it_did_not_recheck():
    """The owner given new memory (``.data =``): the views no longer lie in it, so the launch
    refuses (nothing written, old or new memory). Without an owner, a dst given new memory is
    followed: the launch writes the new memory, never the old one."""
    flat, views = _plan_case()
    owned = LaunchPlan(views)  # owner: their _base
    assert owned.owner is flat
    _launch_and_check(owned, views)
    old_flat = flat.data
    flat.data = rand(flat.numel())
    src = [rand(v.numel()) for v in views]
    saved = snapshot(flat, old_flat, *views, *src)
    with pytest.raises(ValueError, match=r"dst\[0\] moved since the plan was built and no "
                                         r"longer lies in the memory of the plan's owner"):
        owned(src, 1.0)
    unchanged(saved)

    separate = [rand(n) for n in (5, 300, 7)]
    plan = LaunchPlan(separate)
    _launch_and_check(plan, separate)
    old = separate[1].clone()
    old_memory = separate[1].data
    separate[1].data = rand(300)
    saved = snapshot(old_memory)
    _launch_and_check(plan, separate)
    unchanged(saved)
    assert torch.equal(old_memory, old)
