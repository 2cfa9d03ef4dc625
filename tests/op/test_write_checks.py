"""The write rules answered by the C++ reader itself (no Python attribute per dst), and the
CPU kernel's split of a long mixed list over threads. Native torch is the judge: every kind of
dst is refused or written exactly as the rules derived from torch's own in-place ops say, the
version counters move as torch's in-place ops move them, and a MoE-shaped list on two threads
gives torch's sums.
"""

from __future__ import annotations

import pytest
import torch

import accumkernels
from accumkernels.ops.backends import native


def test_the_reader_answers_the_write_rules_itself():
    """On the torch this suite runs with, the reader needs no Python attribute per dst (else
    the tests below would only exercise the attribute path)."""
    if not native.READER:
        pytest.skip(f"C++ tensor reader is off: {native.READER_NOTE}")
    assert native.OWN_WRITE_CHECKS == {"requires_grad", "inference", "bump"}, native.READER_NOTE


def _kinds() -> dict:
    """Builders of every kind of fp32 dst the write rules tell apart (fresh each call)."""
    def inference(view: bool):
        def make():
            with torch.inference_mode():
                t = torch.randn(7)
                return t[1:] if view else t
        return make

    def view_of_leaf_without_grad_mode():
        leaf = torch.randn(7, requires_grad=True)
        with torch.no_grad():
            return leaf[1:]

    return {
        "plain": lambda: torch.randn(6),
        "leaf_requires_grad": lambda: torch.randn(6, requires_grad=True),
        "view_of_leaf": lambda: torch.randn(7, requires_grad=True)[1:],
        "view_of_leaf_made_without_grad_mode": view_of_leaf_without_grad_mode,
        "non_leaf_requires_grad": lambda: torch.randn(6, requires_grad=True) * 2,
        "detached": lambda: torch.randn(6, requires_grad=True).detach(),
        "parameter": lambda: torch.nn.Parameter(torch.randn(6)),
        "parameter_frozen": lambda: torch.nn.Parameter(torch.randn(6), requires_grad=False),
        "inference": inference(view=False),
        "inference_view": inference(view=True),
    }


MODES = ("grad", "no_grad", "inference_mode")


def _in_mode(mode: str, fn):
    if mode == "grad":
        return fn()
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        return fn()


def _torch_refuses(d: torch.Tensor, x: torch.Tensor, mode: str) -> bool:
    try:
        _in_mode(mode, lambda: d.add_(x))
    except RuntimeError:
        return True
    return False


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(_kinds()))
def test_every_kind_of_dst_is_refused_exactly_where_the_rules_say(reader, kind, mode):
    """Refused: where torch's in-place add refuses, and where torch would record autograd
    history (a dst that requires grad in grad mode); else written as torch writes it."""
    make = _kinds()[kind]
    torch.manual_seed(1)
    twin = make()
    torch.manual_seed(1)
    d = make()  # the same values (an inference tensor cannot be copied into outside its mode)
    x = torch.randn(d.shape)
    torch_refuses = _torch_refuses(twin, x, mode)
    rule_refuses = (mode == "grad" and d.requires_grad) or (
        mode != "inference_mode" and d.is_inference())
    assert torch_refuses <= rule_refuses  # what torch refuses, the op refuses too
    before, version = d.detach().clone(), None if d.is_inference() else d._version
    if rule_refuses:
        with pytest.raises(RuntimeError, match=r"dst\[1\]"):
            _in_mode(mode, lambda: accumkernels.accumulate_([torch.zeros(3), d],
                                                            [torch.ones(3), x], 1.0))
        assert torch.equal(d.detach(), before)
        assert version is None or d._version == version
        return
    _in_mode(mode, lambda: accumkernels.accumulate_([d], [x], 1.0))
    if torch_refuses:  # (never: the rules refuse all that torch does)
        pytest.fail("torch refused what the op wrote")
    with torch.no_grad():
        expected = before + x  # one rounding, as the op's fused multiply-add by 1.0
    assert torch.equal(d.detach(), expected)
    if version is not None:
        assert d._version == version + 1


def test_version_counters_move_as_torchs_in_place_ops(reader):
    """Each written dst bumps its counter once, as torch._foreach_add_ does: two views of one
    tensor share a counter, which moves twice."""
    def lists():
        base = torch.randn(10)
        return base, [base[:4], base[5:], torch.randn(3), torch.nn.Parameter(torch.randn(2),
                                                                              requires_grad=False)]

    (nbase, ndst), (base, dst) = lists(), lists()
    src = [torch.randn(t.shape) for t in dst]
    nbefore = [nbase._version] + [t._version for t in ndst]
    before = [base._version] + [t._version for t in dst]
    torch._foreach_add_(ndst, src)
    accumkernels.accumulate_(dst, src, 1.0)
    moved = [v - b for v, b in zip([base._version] + [t._version for t in dst], before)]
    nmoved = [v - b for v, b in zip([nbase._version] + [t._version for t in ndst], nbefore)]
    assert moved == nmoved


def test_a_moe_shaped_list_on_two_threads_is_torchs_sums(reader):
    """Thousands of small tensors and a few large ones (the kernel splits the list by elements
    over the threads): every element is torch's sum, norm_sq and found_inf as one thread's."""
    shapes = [(32,)] * 2000 + [(65539,)] * 3 + [(5,)] * 7
    gen = torch.Generator().manual_seed(0)
    dst = [torch.randn(s, generator=gen) for s in shapes]
    src = [torch.randn(s, generator=gen) for s in shapes]
    src[2001][12345] = float("inf")
    expected = [d + 0.125 * x for d, x in zip(dst, src)]  # 0.125 * x is exact: one rounding
    one = [d.clone() for d in dst]
    threads = torch.get_num_threads()
    norms, flags = [torch.zeros(len(shapes)) for _ in range(2)], [torch.zeros(1) for _ in range(2)]
    try:
        torch.set_num_threads(1)
        accumkernels.accumulate_(one, src, 0.125, found_inf=flags[0], norm_sq=norms[0])
        torch.set_num_threads(2)
        accumkernels.accumulate_(dst, src, 0.125, found_inf=flags[1], norm_sq=norms[1])
    finally:
        torch.set_num_threads(threads)
    for i, (d, e) in enumerate(zip(dst, expected)):
        assert torch.equal(d, e), f"dst[{i}]"
    assert flags[0].item() == flags[1].item() == 1.0
    finite = torch.tensor([i != 2001 for i in range(len(shapes))])
    assert torch.isinf(norms[1][2001])
    want = torch.stack([e.double().square().sum() for e in expected]).float()
    assert torch.allclose(norms[1][finite], want[finite], rtol=1e-5, atol=0)
    assert torch.allclose(norms[0][finite], norms[1][finite], rtol=1e-5, atol=0)
