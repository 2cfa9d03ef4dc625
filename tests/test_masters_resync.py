"""The master re-sync (optim.masters.resync_changed): the native CPU pass against torch's own
definition, ``where(weight != master.to(dtype), weight.float(), master)``, bit for bit."""

from __future__ import annotations

import pytest
import torch

from accumkernels.backends import native
from accumkernels.optim import masters as masters_mod

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def torch_resync(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.where(weight.ne(master.to(weight.dtype)), weight.float(), master)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical, +-0 told apart; NaNs match NaNs (their payloads carry nothing)."""
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan].view(torch.int32),
                                                        b[~nan].view(torch.int32))


def hard_masters(n: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """fp32 values over many binades, with rounding ties, ties +- 1 ulp, the dtype's
    subnormals, values that round to inf, +-0, +-inf and NaN."""
    m = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-20, 20, (n,), generator=gen))
    k = torch.randint(0, n, (n // 4,), generator=gen)
    low = m[k].to(dtype).float()
    if dtype == torch.bfloat16:
        half = torch.exp2(torch.floor(torch.log2(low.abs().clamp_min(1e-30))) - 8)
    else:
        half = torch.exp2(torch.floor(torch.log2(low.abs().clamp_min(1e-30))) - 11)
    m[k] = low + half * torch.randint(-1, 2, (k.numel(),), generator=gen).float()  # ties
    tiny = torch.finfo(dtype).tiny
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), tiny / 3,
                            -tiny / 5, torch.finfo(dtype).max * 1.001, 3e38, -3.3e38])
    m[: special.numel()] = special
    return m


@pytest.mark.skipif(native.resync_masters_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 8, 9, 4099])
def test_native_pass_equals_torch(dtype, n):
    gen = torch.Generator().manual_seed(1000 + n)
    master = hard_masters(max(n, 16), dtype, gen)[:n].contiguous()
    weight = master.to(dtype)
    changed = torch.rand(n, generator=gen) < 0.3  # changed outside the optimizer
    weight[changed] = (torch.randn(int(changed.sum()), generator=gen) * 3).to(dtype)
    weight[: min(n, 3)] = torch.tensor([-0.0, 0.0, float("nan")])[: min(n, 3)].to(dtype)
    expected = torch_resync(master.clone(), weight)
    got = master.clone()
    taken = native.resync_masters_cpu([got.data_ptr()], [weight.data_ptr()], [n],
                                      native.DTYPE_CODES[dtype])
    assert taken >= 0
    assert same_bits(got, expected), (got - expected).abs().nan_to_num(1.0).max()
    differ = weight.ne(master.to(dtype))  # torch's count of the elements to take
    assert taken == int(differ.sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_resync_changed_takes_outside_changes_only(dtype):
    """A model of several params, some weights changed in place (a .data write, which no
    version counter sees), one non-contiguous: every master ends equal to torch's rule."""
    gen = torch.Generator().manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Linear(17, 5)).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = masters_mod.MasterWeights(opt, enabled=True)
    mw.retarget(list(model.parameters()))
    for p in model.parameters():  # masters a little off the weights: a step happened
        m = mw.get(p)
        m.data.add_(torch.randn(m.shape, generator=gen) * 1e-4)
        p.data.copy_(m)
    expected = {}
    w0 = model[0].weight
    w0.data[3:7].mul_(-2.0)  # changed behind the optimizer's back
    for p in model.parameters():
        expected[id(p)] = torch_resync(mw.get(p).detach().clone(), p.detach())
    mw.resync_changed()
    for p in model.parameters():
        assert same_bits(mw.get(p).detach(), expected[id(p)])
    assert torch.equal(mw.get(w0)[3:7].to(dtype), w0.detach()[3:7])


@pytest.mark.skipif(native.copy_back_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 33, 4099])
def test_native_copy_back_equals_torch_cast_and_fingerprints_every_change(dtype, n):
    """The native copy-back writes torch's cast bit for bit (NaN payloads aside) and returns
    the fingerprint the weight has; changing any one element, or swapping two different ones,
    changes it."""
    gen = torch.Generator().manual_seed(50 + n)
    master = hard_masters(max(n, 16), dtype, gen)[:n].contiguous()
    weight = torch.empty(n, dtype=dtype)
    code = native.DTYPE_CODES[dtype]
    (fp,) = native.copy_back_cpu([master.data_ptr()], [weight.data_ptr()], [n], code)
    expected = master.to(dtype)
    nan = expected.isnan()
    assert torch.equal(weight.isnan(), nan)
    assert torch.equal(weight[~nan].view(torch.int16), expected[~nan].view(torch.int16))
    assert native.weight_fingerprints_cpu([weight.data_ptr()], [n]) == [fp]
    positions = range(n) if n <= 64 else list(range(40)) + list(range(n - 40, n))
    for i in positions:  # one element changed: never the same fingerprint
        changed = weight.clone()
        changed.view(torch.int16)[i] ^= 1 << int(torch.randint(0, 16, (1,), generator=gen))
        assert native.weight_fingerprints_cpu([changed.data_ptr()], [n]) != [fp], i
    if n >= 2:
        bits = weight.view(torch.int16)
        i, j = 0, n - 1
        if bits[i] != bits[j]:
            swapped = weight.clone()
            swapped.view(torch.int16)[i], swapped.view(torch.int16)[j] = bits[j], bits[i]
            assert native.weight_fingerprints_cpu([swapped.data_ptr()], [n]) != [fp]


def test_data_write_after_copy_back_is_taken_in():
    """The case version counters miss: ``p.data.clamp_()`` after a native copy-back. The
    fingerprint sees it; the master takes exactly the changed elements."""
    model = torch.nn.Linear(40, 30).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = masters_mod.MasterWeights(opt, enabled=True)
    mw.retarget(list(model.parameters()))
    for p in model.parameters():
        mw.get(p).data.add_(torch.randn(p.shape) * 1e-3)
    mw.copy_back()
    w = model.weight
    expected = torch_resync(mw.get(w).detach().clone(), w.detach().clamp(-0.05, 0.05))
    w.data.clamp_(-0.05, 0.05)
    untouched = mw.get(model.bias).detach().clone()
    mw.resync_changed()
    assert same_bits(mw.get(w).detach(), expected)
    assert torch.equal(mw.get(model.bias).detach(), untouched)


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_resync_equals_torch(dtype):
    """The GPU path's Triton kernel (run by the interpreter on CPU tensors here): one launch for
    a list of (master, weight) pairs of several sizes, torch's rule bit for bit."""
    from accumkernels.backends import triton as triton_backend

    if not triton_backend.is_available(torch.device("cpu")):
        pytest.skip("Triton's interpreter is not on (TRITON_INTERPRET=1)")
    gen = torch.Generator().manual_seed(11)
    sizes = [1, 5, 1024, 1500]
    masters_, weights, expected = [], [], []
    for n in sizes:
        m = hard_masters(max(n, 16), dtype, gen)[:n].contiguous()
        w = m.to(dtype)
        changed = torch.rand(n, generator=gen) < 0.3
        w[changed] = (torch.randn(int(changed.sum()), generator=gen) * 3).to(dtype)
        expected.append(torch_resync(m.clone(), w))
        masters_.append(m)
        weights.append(w)
    triton_backend.resync_masters(masters_, weights)
    for got, want in zip(masters_, expected):
        assert same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
def test_resync_changed_on_the_gpu(dtype):
    """MasterWeights on CUDA params: the one-launch Triton compare, torch's rule bit for bit."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(300, 70), torch.nn.Linear(70, 9)).to(dtype).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mw = masters_mod.MasterWeights(opt, enabled=True)
    mw.retarget(list(model.parameters()))
    for p in model.parameters():
        mw.get(p).data.add_(torch.randn(p.shape, generator=gen).cuda() * 1e-3)
    mw.copy_back()
    model[0].weight.data[5:9].mul_(-3.0)
    expected = {id(p): torch_resync(mw.get(p).detach().clone(), p.detach())
                for p in model.parameters()}
    mw.resync_changed()
    for p in model.parameters():
        assert same_bits(mw.get(p).detach().cpu(), expected[id(p)].cpu())
