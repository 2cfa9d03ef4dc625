"""The master-weight ops (accumkernels.ops.master_passes): ``resync_masters_`` and ``copy_back_`` refuse
bad lists with a TypeError/ValueError naming the pair, before writing anything, and compute
torch's definition on every path (native pass, torch ops; strided, neg-bit, empty pairs)."""

from __future__ import annotations

import pytest
import torch

from accumkernels.ops.backends import native
from accumkernels.ops.master_passes import copy_back_, resync_masters_

# Once per SIMD level of the CPU kernels (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("cpu_simd")

OPS = [pytest.param(resync_masters_, id="resync"), pytest.param(copy_back_, id="copy_back")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float16, id="fp16")]


def torch_resync(master: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.where(weight.ne(master.to(weight.dtype)), weight.float(), master)


@pytest.fixture(params=["native", "torch"])
def kernel_path(request, monkeypatch) -> str:
    """Run the test on the native CPU pass, or on torch ops with the native pass taken away."""
    if request.param == "torch":
        monkeypatch.setattr(native, "resync_masters_cpu", None)
        monkeypatch.setattr(native, "copy_back_cpu", None)
    elif native.resync_masters_cpu is None or native.copy_back_cpu is None:
        pytest.skip("needs the compiled module")
    return request.param


def pair(n: int = 5, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """A master and a weight that differs from it in some elements."""
    master = torch.randn(n)
    weight = (master + torch.randn(n) * (torch.rand(n) < 0.5)).to(dtype)
    return master, weight


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("masters, weights, kind, message", [
    (torch.zeros(3), [torch.zeros(3, dtype=torch.bfloat16)], TypeError,
     "masters must be a list or tuple of tensors, got Tensor"),
    ([torch.zeros(3)], 7, TypeError, "weights must be a list or tuple of tensors, got int"),
    ([torch.zeros(3)], [], ValueError, "1 masters but 0 weights"),
    ([torch.zeros(3), "x"], [torch.zeros(3, dtype=torch.bfloat16)] * 2, TypeError,
     r"masters\[1\] must be a torch.Tensor, got str"),
    ([torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3, dtype=torch.bfloat16)], TypeError,
     r"masters\[0\] has dtype torch.bfloat16; expected torch.float32"),
    ([torch.zeros(3)], [torch.zeros(3)], TypeError,
     r"weights\[0\] has dtype torch.float32; expected torch.bfloat16 or torch.float16"),
    ([torch.zeros(3)], [torch.zeros(4, dtype=torch.float16)], ValueError,
     r"masters\[0\] has shape \(3,\) but weights\[0\] has shape \(4,\)"),
    ([torch.zeros(3)], [torch.zeros(3, dtype=torch.bfloat16, device="meta")], ValueError,
     r"masters\[0\] is on cpu but weights\[0\] is on meta; a pair must be on one device"),
    ([torch.zeros(3).to_sparse()], [torch.zeros(3, dtype=torch.bfloat16)], TypeError,
     r"masters\[0\] is torch.sparse_coo; only dense \(strided\) tensors"),
])
def test_bad_lists_are_refused(op, masters, weights, kind, message):
    name = op.__name__
    with pytest.raises(kind, match=f"^{name}: {message}"):
        op(masters, weights)


@pytest.mark.parametrize("op", OPS)
def test_nothing_is_written_before_a_bad_pair(op):
    """Every pair is checked before the first is written: a good pair ahead of a bad one keeps
    its values."""
    master, weight = pair(64)
    before_m, before_w = master.clone(), weight.clone()
    with pytest.raises(TypeError, match=r"weights\[1\] has dtype torch.float32"):
        op([master, torch.zeros(2)], [weight, torch.zeros(2)])
    assert torch.equal(master, before_m) and torch.equal(weight, before_w)


@pytest.mark.parametrize("dtype", DTYPES)
def test_resync_on_every_path_equals_torch(dtype, kernel_path):
    """Contiguous, transposed (strided) and neg-bit weights, an empty pair, in one call."""
    plain = pair(37, dtype)
    m2 = torch.randn(6, 4)
    strided = (m2.t(), (m2.t() + (torch.rand(4, 6) < 0.5)).to(dtype))
    neg = (torch.randn(9), torch._neg_view(torch.randn(9).to(dtype)))
    empty = (torch.zeros(0), torch.zeros(0, dtype=dtype))
    masters, weights = zip(plain, strided, neg, empty)
    expected = [torch_resync(m, w) for m, w in zip(masters, weights)]
    resync_masters_(list(masters), tuple(weights))
    for got, want in zip(masters, expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_back_on_every_path_equals_torch_cast(dtype, kernel_path):
    """The weight is the master rounded (torch's cast), its version counter bumped."""
    masters = [torch.randn(37) * 1e3, torch.randn(6, 4).t(), torch.zeros(0)]
    weights = [torch.zeros(37, dtype=dtype), torch.zeros(6, 4, dtype=dtype).t(),
               torch.zeros(0, dtype=dtype)]
    versions = [w._version for w in weights]
    copy_back_(masters, weights)
    for m, w, v in zip(masters, weights, versions):
        assert torch.equal(w, m.to(dtype))
        assert w._version > v or w.numel() == 0


@pytest.mark.parametrize("op", OPS)
def test_empty_lists_and_grad_mode(op, kernel_path):
    """No pairs: nothing to do. Leaf params that require grad are written with grad mode on
    (the ops run outside autograd, as an optimizer step does); after either, the weight is the
    master rounded."""
    op([], ())
    master = torch.nn.Parameter(torch.randn(8))
    weight = torch.nn.Parameter(torch.randn(8).to(torch.bfloat16))
    op([master], [weight])
    with torch.no_grad():
        assert torch.equal(weight, master.to(weight.dtype))
