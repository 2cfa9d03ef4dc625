"""accumulate_ is capturable in a CUDA graph: replays read the new src, scale and dst values.

The Triton backend's launch tables during a capture (CPU tests, capture simulated): every launch
(accumulate_, resync_masters_, the fused master step) uploads through ``upload_table``, which
keeps each captured table and its pinned host copy alive with the graph, and refuses the capture
before pinning on a torch whose pinned allocator cannot allocate while capturing.
"""

from __future__ import annotations

import pytest
import torch
from reference import Reference

import accumkernels

from accumkernels.ops.backends import triton as tb

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
needs_triton = pytest.mark.skipif(tb.triton is None, reason="triton is not installed")


class FakeGraph:
    """Stands for the torch.cuda.CUDAGraph being captured (tables are tied to its __dict__)."""


@pytest.fixture
def capturing(monkeypatch):
    """A capture in progress as upload_table sees it; the "device" is meta (a real copy)."""
    graph = FakeGraph()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(tb, "_capturing_graph", lambda: graph)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())
    return graph


@needs_triton
def test_captured_tables_live_with_the_graph(capturing, monkeypatch):
    monkeypatch.setattr(tb, "_torch_version", lambda: (2, 11))
    tables = [torch.randint(0, 1 << 40, (4, 7)), torch.randint(0, 1 << 40, (13,))]
    for t in tables:
        out = tb.upload_table(t, torch.device("meta"), "resync_masters_")
        assert out.device.type == "meta" and out.shape == t.shape
    kept = capturing.__dict__[tb._GRAPH_ATTR]
    assert len(kept) == 2  # one (pinned host, device table) pair per captured launch
    for (host, dev), t in zip(kept, tables):
        assert torch.equal(host.view(-1), t.view(-1)) and dev.device.type == "meta"


@needs_triton
@pytest.mark.parametrize("version", [(2, 4), (2, 9), (2, 10)])
def test_capture_refused_before_pinning_where_torch_cannot_pin(capturing, monkeypatch, version):
    monkeypatch.setattr(tb, "_torch_version", lambda: version)

    def no_pin(self):
        raise AssertionError("pinned during a capture this torch cannot pin in")

    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pin)
    with pytest.raises(RuntimeError, match=r"accumulate_\(backend='triton'\) cannot be captured"):
        tb.upload_table(torch.zeros(5, 3, dtype=torch.int64), torch.device("meta"),
                        "accumulate_")
    assert tb._GRAPH_ATTR not in capturing.__dict__


@needs_triton
def test_every_triton_launch_uploads_through_upload_table(monkeypatch):
    """accumulate_, resync_masters_ and the master step (resync_masters_ used to pin and drop
    its table, with no capture handling)."""
    if not tb.is_available(torch.device("cpu")):
        pytest.skip("no Triton interpreter here")
    from accumkernels.ops.backends import master_step_triton as mst

    seen = []

    def record(table, device, op):
        seen.append(op)
        return table

    monkeypatch.setattr(tb, "upload_table", record)
    monkeypatch.setattr(mst, "upload_table", record)
    m = [torch.randn(5), torch.randn(1030)]
    w = [x.to(torch.bfloat16) for x in m]
    tb.resync_masters(m, w)
    tb.accumulate([x.clone() for x in m], w, 0.5, None, False, None)
    mst.sgd(m, [x.clone() for x in w], [torch.randn_like(x) for x in m], None, lr=0.1,
            momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
            is_first_step=False, grad_scale=None, found_inf=None, write_grad=False)
    assert seen == ["resync_masters_", "accumulate_", "master_step"]


@needs_gpu
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


@needs_gpu
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


@needs_gpu
@needs_triton
def test_triton_resync_and_master_step_replay_after_pinned_churn():
    """resync_masters and the master step (Triton) captured, then pinned blocks of their tables'
    sizes are allocated and scribbled on (a dropped pinned table would be handed out again):
    every replay still computes what the same calls compute eagerly."""
    from accumkernels.ops.backends import master_step_triton as mst

    numels = [5, 1030, 4096 * 3 + 1]
    m = [torch.randn(n, device="cuda") for n in numels]
    w = [x.to(torch.bfloat16) for x in m]
    g = [torch.randn_like(x) for x in m]

    def calls(m, w, g):
        tb.resync_masters(m, w)
        mst.sgd(m, w, g, None, lr=0.01, momentum=0.0, dampening=0.0, weight_decay=0.0,
                nesterov=False, maximize=False, is_first_step=False, grad_scale=None,
                found_inf=None, write_grad=False)

    calls(m, w, g)  # warm-up (compiles)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        calls(m, w, g)
    for _ in range(3):
        junk = [torch.full((64,), -1, dtype=torch.int64).pin_memory() for _ in range(64)]
        del junk
        for x, y in zip(w, g):
            x.copy_(torch.randn_like(x, dtype=torch.float32))
            y.normal_()
        want = [x.clone() for x in m], [x.clone() for x in w], [x.clone() for x in g]
        calls(*want)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(m + w, want[0] + want[1]):
            assert torch.equal(a, b)
