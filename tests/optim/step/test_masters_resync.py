"""The master re-sync (optim.masters.resync_changed): the native CPU pass against torch's own
definition, ``where(weight != master.to(dtype), weight.float(), master)``, bit for bit; every
user write of a bf16/fp16 weight (``.data``, numpy, ``untyped_storage()``, a crafted swap that
kept the old fingerprint) taken in exactly; the native copy-back against torch's cast.

Random data is drawn fresh on every run (``fresh_gen``); a failure names its seed."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from accumkernels import AccumulatingOptimizer
from accumkernels.ops.backends import native
from accumkernels.optim import masters as masters_mod

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


@pytest.fixture
def fresh_gen() -> tuple[torch.Generator, int]:
    """A generator with a seed drawn from the OS (not the per-test seed of conftest): every run
    tests new data. Assertion messages carry the seed to reproduce a failure."""
    seed = int.from_bytes(os.urandom(8), "little") >> 1
    return torch.Generator().manual_seed(seed), seed


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
@pytest.mark.parametrize("n", [1, 7, 8, 9, 37, 4099])
def test_native_pass_equals_torch(dtype, n, fresh_gen):
    gen, seed = fresh_gen
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
    assert same_bits(got, expected), (seed, (got - expected).abs().nan_to_num(1.0).max())
    differ = weight.ne(master.to(dtype))  # torch's count of the elements to take
    assert taken == int(differ.sum()), seed


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


def tie_masters(dtype: torch.dtype) -> torch.Tensor:
    """Values exactly halfway between two neighbours of ``dtype`` (round-to-nearest-even picks
    the even one), either side of them, in the normal and the subnormal range, at the overflow
    edge, fp32 subnormals, +-0, +-inf and NaNs with payloads."""
    finfo = torch.finfo(dtype)
    mant = 7 if dtype == torch.bfloat16 else 10
    vals = []
    for x in [1.0, 1.0 + 2.0 ** -mant, 3.0, -5.5, 1e-3, finfo.tiny, finfo.tiny * 2 ** -3,
              finfo.max / 2]:
        ulp = 2.0 ** (np.floor(np.log2(abs(x))) - mant) if abs(x) >= finfo.tiny \
            else finfo.tiny * 2.0 ** -mant
        for k in (-1.0, 0.0, 1.0):
            for d in (-1, 0, 1):  # the tie, and one fp32 ulp either side of it
                t = torch.tensor(x + k * ulp / 2, dtype=torch.float32)
                vals.append(float(torch.nextafter(t, torch.tensor(d * float("inf")))) if d else
                            float(t))
    vals += [finfo.max, float(finfo.max) * (1 + 2.0 ** -(mant + 1)),  # the overflow tie: inf
             float(finfo.max) * (1 + 2.0 ** -(mant + 2)), 1e-40, -1e-45, 0.0, -0.0,
             float("inf"), float("-inf")]
    m = torch.tensor(vals, dtype=torch.float32)
    nans = torch.tensor([0x7FC00000, 0x7F800001, 0x7FBFFFFF, -0x3EDCBA99, -1],
                        dtype=torch.int32).view(torch.float32)  # quiet, signalling, negative
    return torch.cat([m, -m, nans])


@pytest.mark.skipif(native.copy_back_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 15, 16, 17, 31, 33, 37, 4097, 4099])
def test_native_copy_back_equals_torch_cast(dtype, n, fresh_gen):
    """The native copy-back writes torch's cast bit for bit: ties to even, subnormals, overflow
    to inf, +-0, +-inf, at every offset of the 16-element vector step and in the tail. NaNs
    stay NaNs: for fp16 bit for bit too (the F16C conversion, as torch's); for bf16 the
    canonical 0x7fc0 of c10::BFloat16 (torch's vectorised CPU cast writes 0xffff instead:
    torch's own bf16 NaN bits depend on its code path)."""
    gen, seed = fresh_gen
    hard = torch.cat([tie_masters(dtype), hard_masters(max(n, 16), dtype, gen)])
    # every special value at every position: shuffled (fresh) into n slots
    master = hard[torch.randint(0, hard.numel(), (n,), generator=gen)].contiguous()
    if n >= 16:
        master[n - 16:] = hard[torch.randperm(hard.numel(), generator=gen)[:16]]
    weight = torch.full((n,), 7.0, dtype=dtype)
    assert native.copy_back_cpu([master.data_ptr()], [weight.data_ptr()], [n],
                                native.DTYPE_CODES[dtype]) is True
    expected = master.to(dtype)
    nan = expected.isnan()
    assert torch.equal(weight.isnan(), nan), seed
    got_bits, want_bits = weight.view(torch.int16), expected.view(torch.int16)
    assert torch.equal(got_bits[~nan], want_bits[~nan]), (
        seed, (got_bits != want_bits).nonzero()[:5].flatten().tolist())
    if dtype == torch.float16:
        assert torch.equal(got_bits, want_bits), seed
    else:
        assert bool((got_bits[nan] == 0x7FC0).all()), seed


@pytest.mark.skipif(native.copy_back_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_copy_back_several_pairs_bumps_versions(dtype, fresh_gen):
    """MasterWeights.copy_back on CPU params: one native call per dtype for the whole list,
    torch's cast for each, and every weight's version counter bumped (autograd sees the
    write)."""
    gen, seed = fresh_gen
    model = torch.nn.Sequential(torch.nn.Linear(37, 19), torch.nn.Linear(19, 3)).to(dtype)
    mw = masters_mod.MasterWeights(torch.optim.SGD(model.parameters(), lr=0.1), enabled=True)
    mw.retarget(list(model.parameters()))
    for p in model.parameters():
        m = mw.get(p)
        m.data = hard_masters(max(m.numel(), 16), dtype, gen)[:m.numel()].view(m.shape)
    versions = [p._version for p in model.parameters()]
    mw.copy_back()
    for p, v in zip(model.parameters(), versions):
        want = mw.get(p).detach().to(dtype)
        nan = want.isnan()
        assert torch.equal(p.detach().isnan(), nan), seed
        assert torch.equal(p.detach()[~nan].view(torch.int16), want[~nan].view(torch.int16)), seed
        assert p._version > v


def flip_mantissa_bit(weight: torch.Tensor, i: int, gen: torch.Generator) -> None:
    """Change element i of a finite 16-bit weight in place through a numpy view (no version
    counter sees it) to another finite value: flip one random mantissa bit."""
    mant = 7 if weight.dtype == torch.bfloat16 else 10
    bit = int(torch.randint(0, mant, (1,), generator=gen))
    words = weight.detach().view(torch.int16).numpy()
    words[i] ^= np.int16(1 << bit)


def block_positions(n: int) -> list[int]:
    """Every position of the first vector blocks (16 elements a step in the copy-back, 8 in the
    compare), around the middle, and the last blocks and the tail."""
    if n <= 80:
        return list(range(n))
    mid = (n // 2) // 16 * 16
    return sorted(set(range(48)) | set(range(mid - 16, mid + 16)) | set(range(n - 48, n)))


@pytest.mark.skipif(native.resync_masters_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [16, 37, 4097])
def test_every_position_of_a_vector_block_is_taken_in(dtype, n, fresh_gen):
    """One element changed behind the optimizer's back, at each position of the vector blocks
    and of the tail in turn: the master takes exactly that element (the native pass reports
    one), nothing else moves, and the next copy-back keeps the user's value."""
    gen, seed = fresh_gen
    p = torch.nn.Parameter((torch.randn(n, generator=gen) + 3.0).to(dtype))
    mw = masters_mod.MasterWeights(torch.optim.SGD([p], lr=0.1), enabled=True)
    mw.retarget([p])
    m = mw.get(p)
    m.data.add_(torch.randn(n, generator=gen) * 1e-3)  # a step moved the masters a little
    mw.copy_back()
    for i in block_positions(n):
        before = m.detach().clone()
        flip_mantissa_bit(p, i, gen)
        assert p.detach()[i].float() != before[i].to(dtype).float()
        mw.resync_changed()
        after = m.detach()
        assert after[i].item() == p.detach()[i].float().item(), (seed, i)
        others = torch.arange(n) != i
        assert torch.equal(after[others], before[others]), (seed, i)
        written = p.detach().clone()
        mw.copy_back()
        assert torch.equal(p.detach().view(torch.int16), written.view(torch.int16)), (seed, i)
        # the native pass alone, on a fresh pair: exactly one element reported
        one = before.clone()
        taken = native.resync_masters_cpu([one.data_ptr()], [written.data_ptr()], [n],
                                          native.DTYPE_CODES[dtype])
        assert taken == 1 and torch.equal(one, after), (seed, i, taken)


# -- the wrapper against a hand-kept fp32 master ---------------------------------------------

_SPREAD = 0x9E3779B9


def old_fingerprint(weight: torch.Tensor) -> tuple[int, int]:
    """The fingerprint the copy-back used to record (removed): two sums mod 2^32 over the
    weight's 32-bit words y_j = word_j ^ (j * 0x9e3779b9) of (y ^ y >> 15) * 0x85ebca6b and
    (y ^ y >> 13) * 0xc2b2ae35. Kept here only to craft the write it could not see."""
    w = weight.detach().reshape(-1).view(torch.int16).numpy().view(np.uint16).astype(np.uint64)
    if w.size % 2:
        w = np.append(w, np.uint64(0))
    words = w[0::2] | (w[1::2] << np.uint64(16))
    j = np.arange(words.size, dtype=np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    y = words ^ ((j * np.uint64(_SPREAD)) & mask)
    a = (((y ^ (y >> np.uint64(15))) * np.uint64(0x85EBCA6B)) & mask).sum() & mask
    b = (((y ^ (y >> np.uint64(13))) * np.uint64(0xC2B2AE35)) & mask).sum() & mask
    return int(a), int(b)


def crafted_swap(weight: torch.Tensor, gen: torch.Generator) -> tuple[int, int]:
    """Rewrite two 32-bit words j, k of the weight (through a numpy view) so that their mixed
    values y trade places: the old fingerprint's two sums stay the same, while up to four
    elements change to other finite values. Returns (j, k)."""
    halves = weight.detach().view(-1).view(torch.int16).numpy()
    words = halves[: halves.size - halves.size % 2].view(np.uint32)  # an odd last: left alone
    n_words = words.size
    for _ in range(10000):
        j, k = (int(x) for x in torch.randint(0, n_words, (2,), generator=gen))
        yj = int(words[j]) ^ (j * _SPREAD & 0xFFFFFFFF)
        yk = int(words[k]) ^ (k * _SPREAD & 0xFFFFFFFF)
        if j == k or yj == yk:
            continue
        new_j, new_k = yk ^ (j * _SPREAD & 0xFFFFFFFF), yj ^ (k * _SPREAD & 0xFFFFFFFF)
        trial = torch.tensor([new_j, new_k], dtype=torch.int64).to(torch.int32)
        if not bool(trial.view(weight.dtype).isfinite().all()):
            continue
        words[j], words[k] = np.uint32(new_j), np.uint32(new_k)
        return j, k
    raise AssertionError("no finite crafted swap found")


class Params(torch.nn.Module):
    """Params of several sizes (a vector tail each), the last one unused by the loss (no grad:
    the inner optimizer skips it, but its master is still re-synced and copied back)."""

    def __init__(self, dtype: torch.dtype, gen: torch.Generator):
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(shape, generator=gen).to(dtype))
            for shape in [(37,), (5, 16), (4097,), (2, 7, 3), (13,)])

    def loss(self, rs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * r).sum() for p, r in zip(self.ps[:-1], rs))  # grad of p: exactly r


# what the user writes before each step (none bumps a version counter); steps 1 and 5 only the
# crafted swap, which kept the old fingerprint: alone it is what a fingerprint check would miss
WRITES = {1: {"crafted"}, 2: {"data"}, 3: {"storage"}, 4: {"numpy", "crafted", "data", "storage"},
          5: {"crafted"}}


def user_writes(model: Params, kinds: set[str], gen: torch.Generator) -> None:
    dtype = model.ps[0].dtype
    for p in model.ps:
        n = p.numel()
        if "crafted" in kinds:  # numpy: two words rewritten, the old fingerprint kept
            before = old_fingerprint(p)
            crafted_swap(p, gen)
            assert old_fingerprint(p) == before
        if "data" in kinds:  # .data: a swap of two different elements, and a few new values
            i, j = (int(x) for x in torch.randperm(n, generator=gen)[:2])
            flat = p.data.view(-1)
            if flat[i] == flat[j]:
                flat[j] = flat[j] * 2 + 1
            flat[i], flat[j] = flat[j].clone(), flat[i].clone()
            k = torch.randint(0, n, (3,), generator=gen)
            flat[k] = (torch.randn(3, generator=gen) * 4).to(dtype)
        if "storage" in kinds:  # untyped_storage(): a changed clone copied over the storage
            clone = p.detach().clone().view(-1)
            k = torch.randint(0, n, (4,), generator=gen)
            clone[k] = (torch.randn(4, generator=gen) - 2).to(dtype)
            clone[n - 1] = clone[n - 1] * -3 + 1  # the tail's last element
            p.untyped_storage().copy_(clone.untyped_storage())
        if "numpy" in kinds:  # numpy: swap two elements' values, and two whole 16-blocks
            words = p.detach().view(-1).view(torch.int16).numpy()
            i, j = (int(x) for x in torch.randperm(n, generator=gen)[:2])
            words[[i, j]] = words[[j, i]]
            if n >= 64:
                words[0:16], words[32:48] = words[32:48].copy(), words[0:16].copy()


@pytest.mark.skipif(native.resync_masters_cpu is None, reason="needs the compiled module")
@pytest.mark.parametrize("mode", [True, "auto"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_wrapper_takes_in_every_user_write(dtype, mode, fresh_gen):
    """A bf16/fp16 model under AccumulatingOptimizer(SGD): between steps the user writes its
    weights through ``.data``, numpy views and ``untyped_storage()`` copies (none bumps the
    version counter), swaps elements, and rewrites two words so that the old fingerprint is
    unchanged. After every step the weights equal, bit for bit, a hand-kept fp32 master
    (master = float(weight) where weight != master rounded; SGD; cast): no write is reverted,
    none leaks elsewhere."""
    gen, seed = fresh_gen
    model = Params(dtype, gen)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), master_weights=mode)
    ref = [p.detach().float().clone() for p in model.ps]
    for step in range(6):
        if step:
            versions = [p._version for p in model.ps]
            user_writes(model, WRITES[step], gen)
            assert [p._version for p in model.ps] == versions  # no counter saw them
        for m, p in zip(ref, model.ps):  # the reference re-sync
            m.copy_(torch_resync(m, p.detach()))
        rs = [torch.randn(p.shape, generator=gen).to(dtype) for p in model.ps[:-1]]
        model.loss(rs).backward()
        opt.step()
        opt.zero_grad()
        for m, r in zip(ref, rs):
            m.add_(r.float(), alpha=-0.5)  # SGD: 0.5 * r is exact, one rounding as SGD's
        for idx, (m, p) in enumerate(zip(ref, model.ps)):
            want = m.to(dtype)
            assert torch.equal(p.detach().view(torch.int16), want.view(torch.int16)), (
                seed, step, idx, (p.detach() != want).nonzero()[:5].flatten().tolist())


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
    from accumkernels.ops.backends import triton as triton_backend

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
