"""Every bad input raises a clear error naming the index, before any dst is written."""

from __future__ import annotations

import pytest
import torch

import accumkernels


def make_inputs(n=4, numel=33):
    dst = [torch.randn(numel) for _ in range(n)]
    src = [torch.randn(numel).to(torch.bfloat16) for _ in range(n)]
    return dst, src


def _sparse(dst, src):
    src[2] = src[2].float().to_sparse()


def _transposed(t):
    return torch.randn(t.numel() // 3, 3, dtype=t.dtype).t()


CASES = {
    # name: (mutate(dst, src) -> kwargs or None, error type, message fragment)
    "length": (lambda d, s: s.pop(), ValueError, "dst has 4 tensors but src has 3"),
    "shape": (lambda d, s: s.__setitem__(2, s[2].reshape(3, 11)), ValueError, "src[2] has shape"),
    "numel": (lambda d, s: s.__setitem__(3, s[3][:-1]), ValueError, "src[3] has shape"),
    "dst_dtype": (lambda d, s: d.__setitem__(1, d[1].double()), TypeError, "dst[1] has dtype"),
    "dst_bf16": (lambda d, s: d.__setitem__(1, d[1].bfloat16()), TypeError, "dst[1] has dtype"),
    "src_int": (lambda d, s: s.__setitem__(2, s[2].int()), TypeError, "src[2] has dtype"),
    "src_fp64": (lambda d, s: s.__setitem__(2, s[2].double()), TypeError, "src[2] has dtype"),
    "src_layout": (
        lambda d, s: (d.__setitem__(3, torch.randn(3, 11)), s.__setitem__(3, _transposed(s[3]))),
        ValueError, "src[3] has strides"),
    "dst_layout": (
        lambda d, s: (d.__setitem__(2, _transposed(d[2])), s.__setitem__(2, s[2].reshape(3, 11))),
        ValueError, "src[2] has strides"),
    "dst_gaps": (
        lambda d, s: (d.__setitem__(2, torch.zeros(3, 22)[:, ::2]),
                      s.__setitem__(2, s[2].reshape(3, 11))),
        ValueError, "dst[2] is not dense"),
    "src_gaps": (
        lambda d, s: (d.__setitem__(3, torch.randn(3, 11)),
                      s.__setitem__(3, torch.randn(3, 22, dtype=s[3].dtype)[:, ::2])),
        ValueError, "src[3] is not dense"),
    "src_sparse": (_sparse, TypeError, "src[2] is sparse"),
    "src_device": (lambda d, s: s.__setitem__(1, s[1].to("meta")), ValueError, "src[1] is on meta"),
    "dst_device": (
        lambda d, s: (d.__setitem__(2, d[2].to("meta")), s.__setitem__(2, s[2].to("meta"))),
        ValueError, "dst[2] is on meta"),
    "dst_alias_same": (lambda d, s: d.__setitem__(3, d[1]), ValueError, "dst[3] overlaps dst[1]"),
    "dst_alias_overlap": (
        lambda d, s: (d.__setitem__(0, torch.randn(60)), d.__setitem__(2, d[0][10:43]),
                      d.__setitem__(0, d[0][:33])),
        ValueError, "dst[2] overlaps dst[0]"),
    "src_not_tensor": (lambda d, s: s.__setitem__(1, [1.0] * 33), TypeError, "src[1] must be a torch.Tensor"),
    "unknown_backend": (lambda d, s: {"backend": "cudnn"}, ValueError, "unknown backend 'cudnn'"),
    "backend_not_str": (lambda d, s: {"backend": None}, TypeError, "backend must be a string"),
    "unavailable_backend": (lambda d, s: {"backend": "cuda"}, ValueError,
                            "backend 'cuda' is not available on device cpu"),
    "scale_str": (lambda d, s: {"scale": "0.5"}, TypeError, "scale must be a float"),
    "scale_bool": (lambda d, s: {"scale": True}, TypeError, "scale must be a float"),
    "scale_nan": (lambda d, s: {"scale": float("nan")}, ValueError, "scale must be finite"),
    "scale_inf": (lambda d, s: {"scale": float("inf")}, ValueError, "scale must be finite"),
    "scale_fp64": (lambda d, s: {"scale": torch.tensor(0.5, dtype=torch.float64)}, TypeError,
                   "scale must be a 1-element float32"),
    "scale_2elem": (lambda d, s: {"scale": torch.ones(2)}, TypeError, "scale must be a 1-element"),
    "scale_device": (lambda d, s: {"scale": torch.ones(1, device="meta")}, ValueError, "scale is on meta"),
    "found_inf_dtype": (lambda d, s: {"found_inf": torch.zeros(1, dtype=torch.int32)}, TypeError,
                        "found_inf must be a 1-element float32"),
    "found_inf_size": (lambda d, s: {"found_inf": torch.zeros(3)}, TypeError, "found_inf must be a 1-element"),
    "found_inf_type": (lambda d, s: {"found_inf": 0.0}, TypeError, "found_inf must be a tensor"),
    "overwrite_type": (lambda d, s: {"overwrite": 1}, TypeError, "overwrite must be a bool"),
}


@pytest.mark.parametrize("backend", ["auto", "torch", "cpu", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_raises_and_writes_nothing(case, backend):
    mutate, error, fragment = CASES[case]
    dst, src = make_inputs()
    kwargs = {"scale": 0.5, "backend": backend}
    extra = mutate(dst, src)
    if isinstance(extra, dict):
        kwargs.update(extra)
    found_inf = kwargs.get("found_inf")
    before = [d.clone() for d in dst if d.device.type == "cpu" and not d.is_sparse]
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        accumkernels.accumulate_(dst, src, **kwargs)
    after = [d for d in dst if d.device.type == "cpu" and not d.is_sparse]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "dst was written before the error"
    if isinstance(found_inf, torch.Tensor):
        assert not found_inf.any()


@pytest.mark.parametrize("what", ["dst", "src"])
def test_a_tensor_instead_of_a_list(what):
    dst, src = make_inputs(1)
    args = {"dst": dst, "src": src}
    args[what] = args[what][0]
    with pytest.raises(TypeError, match=f"{what} must be a list or tuple of tensors"):
        accumkernels.accumulate_(args["dst"], args["src"])


def test_tuples_and_disjoint_views_are_fine():
    """Views of one flat buffer (how MasterGradBuffer hands them out) are not aliases."""
    flat = torch.randn(100)
    dst = (flat[:40], flat[40:41], flat[41:98].view(3, 19))
    src = tuple(torch.randn(d.shape).half() for d in dst)
    expected = flat.clone()
    expected[:98] += torch.cat([s.float().flatten() for s in src]) * 2.0
    accumkernels.accumulate_(dst, src, 2.0, backend="torch")
    torch.testing.assert_close(flat, expected, rtol=2**-23, atol=0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_python_rules_raise_the_same_errors(case, monkeypatch):
    """The portable path (the rules in Python, used where the C++ reader cannot look) raises
    what the C++ checks raise, before writing anything."""
    from accumkernels.ops.backends import native

    monkeypatch.setattr(native, "READER", False)
    test_bad_input_raises_and_writes_nothing(case, "cpu")


def test_tensor_subclass_takes_the_python_path():
    """A tensor subclass may report anything: the C++ reader leaves it to the Python rules."""

    class Marked(torch.Tensor):
        pass

    dst, src = make_inputs()
    dst[2] = dst[2].as_subclass(Marked)
    expected = [d.clone() for d in dst]
    for e, s in zip(expected, src):
        e += s.float() * 0.5
    accumkernels.accumulate_(dst, src, 0.5, backend="cpu")
    assert all(torch.equal(d, e) for d, e in zip(dst, expected))
    src[1] = src[1][:-1].as_subclass(Marked)
    with pytest.raises(ValueError, match=r"src\[1\] has shape"):
        accumkernels.accumulate_(dst, src, 0.5, backend="cpu")
