"""accumulate_ is capturable in a CUDA graph: replays read the new src, scale and dst values."""

from __future__ import annotations

import pytest
import torch
from reference import Reference

import accumkernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("n_tensors", [3, 1200], ids=["short", "long_list"])
def test_capture_and_replay(backend, n_tensors):
    numels = torch.randint(1, 5000, (n_tensors,)).tolist()
    dst = [torch.randn(n, device="cuda") for n in numels]
    src = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in numels]
    scale = torch.tensor([0.5], device="cuda")
    found_inf = torch.zeros(1, device="cuda")
    accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)  # warm-up
    torch.cuda.synchronize()

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)

    for replay in range(3):  # new data in the captured buffers before each replay
        for d, x in zip(dst, src):
            d.normal_()
            x.copy_(torch.randn_like(x, dtype=torch.float32))
        scale.fill_(0.25 * (replay + 1))
        refs = [Reference(d) for d in dst]
        for r, x in zip(refs, src):
            r.add(x, 0.25 * (replay + 1))
        graph.replay()
        torch.cuda.synchronize()
        for r, d in zip(refs, dst):
            r.check(d)
    assert found_inf.item() == 0.0
    src[-1][0] = float("nan")
    graph.replay()
    torch.cuda.synchronize()
    assert found_inf.item() == 1.0


@pytest.mark.parametrize("n_tensors", [3, 1200], ids=["short", "long_list"])
def test_bucket_plan_launch_capture_and_replay(n_tensors):
    """A MasterGradBuffer bucket launch (its cached plan) captured in a graph replays on the
    new gradient values."""
    numels = torch.randint(1, 5000, (n_tensors,)).tolist()
    params = [torch.nn.Parameter(torch.randn(n, device="cuda")) for n in numels]
    buf = accumkernels.MasterGradBuffer(params, bucket_size_mb=float("inf"))
    grads = [torch.randn(n, device="cuda").to(torch.bfloat16) for n in numels]
    buf.accumulate(params, grads, 0.5)  # warm-up: builds the plan outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        buf.accumulate(params, grads, 0.5)
    for _ in range(2):
        for p, g in zip(params, grads):
            buf.view(p).normal_()
            g.copy_(torch.randn_like(g, dtype=torch.float32))
        refs = [Reference(buf.view(p)) for p in params]
        for r, g in zip(refs, grads):
            r.add(g, 0.5)
        graph.replay()
        torch.cuda.synchronize()
        for r, p in zip(refs, params):
            r.check(buf.view(p))
