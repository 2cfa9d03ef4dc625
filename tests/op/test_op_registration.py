"""accumulate_ is a proper torch.library custom op: opcheck and torch.compile work on it."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE_BACKENDS
from reference import Reference

import accumkernels

OP = torch.ops.accumkernels.accumulate_.default


def _args(device, backend, scale_tensor, found_inf):
    dst = [torch.randn(37, device=device), torch.randn(4, 5, device=device)]
    src = [torch.randn(37, device=device).bfloat16(), torch.randn(4, 5, device=device)]
    st = torch.tensor([0.5], device=device) if scale_tensor else None
    fi = torch.zeros(1, device=device) if found_inf else None
    return (dst, src, 0.25, st, False, fi, backend, None, None)


@pytest.mark.parametrize("device,backend", DEVICE_BACKENDS)
@pytest.mark.parametrize("scale_tensor", [False, True], ids=["float_scale", "tensor_scale"])
@pytest.mark.parametrize("found_inf", [False, True], ids=["no_flag", "flag"])
def test_opcheck(device, backend, scale_tensor, found_inf):
    torch.library.opcheck(OP, _args(device, backend, scale_tensor, found_inf))


def test_schema_declares_mutation():
    schema = str(OP._schema)
    assert "Tensor(a0!)[] dst" in schema and "Tensor(a5!)? found_inf" in schema, schema


def test_no_argument_has_a_default():
    """torch 2.11's ADInplaceOrView kernel of a custom op finds the mutated arguments by schema
    index in the args the dispatcher passes, which leave out trailing arguments at their
    default: a defaulted ``norm_sq=None`` made every dispatcher call raise IndexError there."""
    defaulted = [a.name for a in OP._schema.arguments if a.has_default_value()]
    assert not defaulted, f"{defaulted} have defaults: {OP._schema}"
    with pytest.raises(RuntimeError, match="norm_sq"):  # all nine, on every torch
        OP(*_args("cpu", "cpu", False, False)[:7])


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph(compile_backend):
    """Compiled with fullgraph=True (no graph break), and the mutation is visible after."""

    def step(dst, src, scale, found_inf):
        accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend="cpu")
        return found_inf * 2

    compiled = torch.compile(step, backend=compile_backend, fullgraph=True)
    dst = [torch.randn(4097), torch.randn(3, 3)]
    for k in range(2):  # the second call reuses the compiled graph
        src = [torch.randn(4097).bfloat16(), torch.randn(3, 3).half()]
        src[1][1, 1] = float("inf") if k else 1.0
        refs = [Reference(d) for d in dst]
        for r, x in zip(refs, src):
            r.add(x, 0.5)
        found_inf = torch.zeros(1)
        out = compiled(dst, src, torch.tensor(0.5), found_inf)
        for r, d in zip(refs, dst):
            r.check(d)
        assert found_inf.item() == float(k) and out.item() == 2.0 * k
