"""Every stride pattern (DESIGN.md, "Any param layout"): ``accumulate_``, ``LaunchPlan`` and
``MasterGradBuffer`` on dense tensors of any dimension order, and the fused master ops on
strided tensors, bit for bit what torch's fused step gives on the same strides.

The rule under test: a dst is dense and non-overlapping in any dimension order (contiguous,
``channels_last``, a transpose); its src has the same strides (over the dimensions of size > 1)
and the two pair element by element in memory order. A src in another layout, or a dst or src
with gaps or overlaps, is refused with a ValueError naming it, before anything is written. The
buffer (whose views have their params' layouts) copies a gradient in another layout into the
view's layout before the launch. On 9a2fd23 every non-contiguous case raised "is not
contiguous", and the master ops took the torch reference, which differs from torch's fused step
in the last bits.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import DEVICE_BACKENDS

import accumkernels
from accumkernels import master_adam_step_, master_sgd_step_
from accumkernels.buffer import MasterGradBuffer
from accumkernels.ops.master_passes import copy_back_, resync_masters_
from accumkernels.ops.plan import LaunchPlan

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

SHAPES = [(3, 5, 7, 2), (1, 9, 1, 4), (5, 1, 3, 1), (2, 0, 3, 3)]
PERMS = list(itertools.permutations(range(4)))


def dense(shape, perm, dtype=torch.float32, device="cpu", fill=True) -> torch.Tensor:
    """A dense tensor of ``shape`` whose memory runs over its dims in the order ``perm``
    (outermost first); random values spread over several binades."""
    stored = torch.empty([shape[d] for d in perm], dtype=torch.float32)
    if fill:
        stored.copy_(torch.randn(stored.shape) * torch.exp2(torch.randint(-5, 5, stored.shape)))
    t = stored.to(dtype).permute(*[perm.index(d) for d in range(4)]).to(device)
    assert t.shape == shape
    return t


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_every_dimension_order(device, backend, shape):
    """All 24 orders of a 4-D shape (odd sizes, ones, an empty one) in one call, bf16 and fp32
    sources, with norm_sq and found_inf: the values of the same computation on contiguous
    copies, bit for bit (elementwise), and the norms within fp32 summation error."""
    dst = [dense(shape, p, device=device) for p in PERMS]
    src = [dense(shape, p, torch.bfloat16 if i % 2 else torch.float32, device)
           for i, p in enumerate(PERMS)]
    want = [d.contiguous() for d in dst]  # (.contiguous() copies the non-contiguous ones)
    want = [w.clone() if w.data_ptr() == d.data_ptr() else w for w, d in zip(want, dst)]
    accumkernels.accumulate_(want, [x.contiguous() for x in src], 0.75, backend=backend)
    norm_sq = torch.full((len(dst),), -1.0, device=device)
    found_inf = torch.zeros(1, device=device)
    strides = [d.stride() for d in dst]
    accumkernels.accumulate_(dst, src, 0.75, norm_sq=norm_sq, found_inf=found_inf,
                             backend=backend)
    for i, (d, w) in enumerate(zip(dst, want)):
        assert d.stride() == strides[i]
        assert torch.equal(bits(d), bits(w)), f"order {PERMS[i]}"
    norms = torch.stack([w.double().square().sum() for w in want]).float()
    torch.testing.assert_close(norm_sq.cpu(), norms.cpu(), rtol=1e-5, atol=0)
    assert found_inf.item() == 0.0


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
def test_mismatched_or_holey_layouts_are_refused(device, backend):
    shape = (3, 5, 7, 2)
    cases = [
        (dense(shape, (0, 2, 3, 1), device=device), dense(shape, (0, 1, 2, 3), device=device),
         r"src\[1\] has strides \(70, 14, 2, 1\) but dst\[1\] has strides \(70, 1, 10, 5\)"),
        (torch.zeros(3, 10, 7, 2, device=device)[:, ::2], dense(shape, (0, 1, 2, 3),
                                                                device=device),
         r"dst\[1\] is not dense"),
        (dense(shape, (3, 2, 1, 0), device=device),
         torch.randn(3, 5, 7, 4, device=device)[..., :2], r"src\[1\] is not dense"),
        (torch.zeros(1, 5, 7, 2, device=device).expand(shape), torch.zeros(shape, device=device),
         r"dst\[1\] is not dense"),
    ]
    for d, x, match in cases:
        first = torch.zeros(4, device=device)
        before = [first.clone(), d.clone()]
        with pytest.raises(ValueError, match=match):
            accumkernels.accumulate_([first, d], [torch.ones(4, device=device), x],
                                     backend=backend)
        assert torch.equal(first, before[0]) and torch.equal(d, before[1])


def test_launch_plan_takes_strided_dst():
    """A plan over permuted dst: launches on keys in any order, and refuses a src in another
    layout unless built with reorder=True (then it is copied into the dst's layout first)."""
    base = torch.zeros(3 * 5 * 7 * 2 * 3)
    shapes = [(3, 5, 7, 2)] * 3
    perms = [(0, 2, 3, 1), (3, 2, 1, 0), (0, 1, 2, 3)]
    dst, off = [], 0
    for shape, perm in zip(shapes, perms):
        view = base[off:off + 210].view([shape[d] for d in perm])
        dst.append(view.permute(*[perm.index(d) for d in range(4)]))
        off += 210
    keys = ["a", "b", "c"]
    strict = LaunchPlan(dst, keys=keys)
    src = [dense(s, p, torch.bfloat16) for s, p in zip(shapes, perms)]
    strict([src[2], src[0]], 2.0, keys=["c", "a"], overwrite=True)
    assert torch.equal(dst[0], 2.0 * src[0].float()) and torch.equal(dst[2], 2.0 * src[2].float())
    assert not dst[1].any()
    wrong = dense(shapes[1], (0, 1, 2, 3), torch.bfloat16)
    with pytest.raises(ValueError, match=r"src\[0\] has strides"):
        strict([wrong], keys=["b"])
    assert not dst[1].any()
    LaunchPlan(dst, keys=keys, reorder=True)([wrong], keys=["b"])
    assert torch.equal(dst[1], wrong.float())


def test_buffer_views_have_their_params_layouts():
    """Views are laid out like their params (dense ones; row-major for a param with gaps); a
    gradient in any dense layout lands on the right elements; relayout follows a param."""
    cl = torch.nn.Parameter(torch.randn(4, 3, 5, 5).contiguous(memory_format=torch.channels_last))
    tr = torch.nn.Parameter(torch.randn(7, 6).t())
    gappy = torch.nn.Parameter(torch.randn(6, 10)[:, ::2])
    plain = torch.nn.Parameter(torch.randn(9))
    params = [cl, tr, gappy, plain]
    buf = MasterGradBuffer(params, bucket_size_mb=1e-4)  # several buckets
    assert [buf.view(p).stride() for p in params] == [cl.stride(), tr.stride(), (5, 1), (1,)]
    grads = [torch.randn(p.shape).to(torch.bfloat16) for p in params]  # row-major
    grads[1] = grads[1].t().contiguous().t()  # the param's own layout
    buf.accumulate(params, grads, overwrite=True)  # several buckets: the general op
    for b in buf.buckets:  # one bucket at a time: its plan
        ps = list(reversed(b.params))
        buf.accumulate(ps, [grads[next(i for i, q in enumerate(params) if q is p)]
                            for p in ps], 0.5)
    for p, g in zip(params, grads):
        assert torch.equal(buf.view(p), 1.5 * g.float()), tuple(p.shape)
    held = buf.view(tr).clone()
    view = buf.view(tr)
    tr.data = tr.data.contiguous()  # the same values, now row-major
    assert buf.relayout(tr) and buf.view(tr) is view and not buf.relayout(tr)
    assert view.stride() == tr.stride() == (7, 1) and torch.equal(view, held)
    buf.accumulate([tr], [grads[1]])  # a gradient in the old layout: reordered
    assert torch.equal(view, 2.5 * grads[1].float())


# -- the fused master ops -------------------------------------------------------------------------

def _layout(t: torch.Tensor, perm) -> torch.Tensor:
    out = dense(tuple(t.shape), perm, t.dtype, fill=False)
    return out.copy_(t)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("perm", [(0, 1, 2, 3), (0, 2, 3, 1), (3, 1, 0, 2), (2, 3, 1, 0)],
                         ids=str)
@pytest.mark.parametrize("algo", ["adamw", "sgd"])
def test_master_step_matches_torch_fused_on_the_same_strides(backend, perm, algo):
    """30 steps, bf16 weights with some written by the user between steps: masters, state and
    weights bit for bit torch's fused AdamW/SGD on fp32 params of the same strides, cast back."""
    if backend == "cpu" and "cpu" not in accumkernels.ops.master_step.available_backends("cpu"):
        pytest.skip("accumkernels._C not built")
    shape = (3, 37, 5, 7)  # 3885 elements: vector blocks of 8 and a tail of 5
    master = _layout(torch.randn(shape), perm)
    weight = master.bfloat16()
    assert weight.stride() == master.stride()
    ref = torch.nn.Parameter(master.clone())
    if algo == "adamw":
        opt = torch.optim.AdamW([ref], lr=0.01, weight_decay=0.1, fused=True)
        ea, eas, step = torch.zeros_like(master), torch.zeros_like(master), torch.zeros(())
    else:
        opt = torch.optim.SGD([ref], lr=0.01, momentum=0.9, weight_decay=0.1, fused=True)
        buf = torch.empty_like(master)
    for k in range(30):
        g = _layout(torch.randn(shape), perm)
        ref.grad = g.clone()
        if k % 7 == 3:  # the user writes some weights
            hit = torch.rand(shape) < 0.1
            weight[hit] = torch.randn(int(hit.sum())).bfloat16()
            with torch.no_grad():
                ref.copy_(torch.where(weight != ref.bfloat16(), weight.float(), ref))
        opt.step()
        if algo == "adamw":
            master_adam_step_([master], [weight], [g], [ea], [eas], None, [step], lr=0.01,
                              beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8,
                              backend=backend)
        else:
            master_sgd_step_([master], [weight], [g], [buf], lr=0.01, momentum=0.9,
                             dampening=0.0, weight_decay=0.1, is_first_step=k == 0,
                             backend=backend)
    state = opt.state[ref]
    pairs = [(master, ref.detach()), (weight, ref.detach().bfloat16())]
    pairs += [(ea, state["exp_avg"]), (eas, state["exp_avg_sq"])] if algo == "adamw" \
        else [(buf, state["momentum_buffer"])]
    for got, want in pairs:
        assert got.stride() == master.stride()
        assert torch.equal(bits(got), bits(want)), (got - want).abs().max()


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_master_step_pairs_elements_across_layouts(backend):
    """Operands in different layouts (and a neg-bit weight) pair element by element: the
    result of the same step on operands all in the master's layout."""
    if backend == "cpu" and "cpu" not in accumkernels.ops.master_step.available_backends("cpu"):
        pytest.skip("accumkernels._C not built")
    shape = (5, 3, 7, 3)
    lay = {"m": (0, 2, 3, 1), "w": (3, 2, 1, 0), "g": (0, 1, 2, 3), "a": (1, 0, 3, 2)}
    m0, g0 = torch.randn(shape), torch.randn(shape)
    a0, s0 = torch.randn(shape) * 0.1, torch.rand(shape) * 0.1
    mixed = [_layout(m0, lay["m"]), _layout(m0.bfloat16(), lay["w"]), _layout(g0, lay["g"]),
             _layout(a0, lay["a"]), _layout(s0, lay["m"])]
    same = [_layout(t, lay["m"]) for t in (m0, m0.bfloat16(), g0, a0, s0)]
    neg = torch._neg_view(_layout(-m0.bfloat16(), lay["w"]))  # the weight behind a neg bit
    mixed[1] = neg
    for ts in (mixed, same):
        master_adam_step_([ts[0]], [ts[1]], [ts[2]], [ts[3]], [ts[4]], None,
                          [torch.tensor(3.0)], lr=0.01, beta1=0.9, beta2=0.99,
                          weight_decay=0.01, eps=1e-8, grad_scale=torch.tensor([2.0]),
                          backend=backend)
    for a, b in zip(mixed, same):
        assert torch.equal(a, b)
    assert mixed[0].stride() == same[0].stride()


def test_master_weight_ops_on_strided_pairs():
    """resync_masters_ and copy_back_ on channels_last and mixed-layout pairs: torch's exact
    where/cast, element by element."""
    shape = (3, 5, 7, 2)
    for wperm in [(0, 2, 3, 1), (3, 2, 1, 0)]:
        m = dense(shape, (0, 2, 3, 1))
        w = _layout(m.bfloat16(), wperm)
        hit = torch.rand(shape) < 0.2
        w[hit] = torch.randn(int(hit.sum())).bfloat16()
        want = torch.where(w != m.bfloat16(), w.float(), m)
        resync_masters_([m], [w])
        assert torch.equal(bits(m), bits(want))
        m.add_(torch.randn(shape) * 1e-3)
        copy_back_([m], [w])
        assert torch.equal(bits(w), bits(m.bfloat16()))
