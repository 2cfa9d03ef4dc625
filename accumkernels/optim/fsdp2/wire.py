"""Opt-in FSDP2 reduce-scatter with bf16 on the wire and an exact fp32 sum.

With bf16 compute and ``reduce_dtype=torch.float32``, FSDP2 copies each micro-batch's bf16
gradients into an fp32 reduce-scatter input: every value in it is exactly representable in
bf16, so sending fp32 doubles the bytes for nothing. :class:`Bf16WireReduceScatter` (installed
on every FSDP module by :func:`enable_bf16_reduce_scatter`) sends bf16 instead (one
``all_to_all_single``: each rank receives the world's bf16 chunks of its own shard) and sums
them in fp32 with ``accumulate_`` (the first chunk overwrites, then one launch per further
chunk), in rank order. The result is the fp32 sum of the bf16 gradients; it differs from an
fp32 reduce-scatter only in the summation order: elementwise at most
``2 * (world - 1) * 2**-24 * sum(|g|)`` apart (bit-identical on 2 ranks, where the sum is one
rounding). An input that is not bf16-exact (FSDP2 sends the unsharded fp32 sum after
``set_requires_gradient_sync(False)`` windows) goes over the wire in fp32, as natively.

Gated behind this explicit call until it is measured with NCCL on GPUs: an all-to-all moves
half the bytes of an fp32 ring reduce-scatter, but across nodes all-to-all scales worse than a
ring (every rank talks to every rank), so the win is clearest within a node.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from accumkernels._torch_private import fsdp2_reduce_scatter_base
from accumkernels.ops.accumulate import accumulate_

__all__ = ["Bf16WireReduceScatter", "enable_bf16_reduce_scatter"]


class Bf16WireReduceScatter(fsdp2_reduce_scatter_base()):
    """FSDP2 ``ReduceScatter``: bf16 all-to-all, fp32 sum; counts what it sends."""

    def __init__(self, backend: str = "auto"):
        self.backend = backend
        self.bytes_sent = 0  # payload this rank handed to the wire (to other ranks)
        self.fp32_fallbacks = 0  # calls whose input was not bf16-exact

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @torch.no_grad()
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group,
                 op, async_op: bool = False):
        world = dist.get_world_size(group)
        n = output_tensor.numel()
        if input_tensor.dtype != torch.float32 or output_tensor.dtype != torch.float32:
            raise ValueError("Bf16WireReduceScatter needs reduce_dtype=torch.float32 "
                             f"(got {input_tensor.dtype} -> {output_tensor.dtype})")
        avg = op == dist.ReduceOp.AVG
        if not (avg or op == dist.ReduceOp.SUM):
            raise ValueError(f"Bf16WireReduceScatter: reduce op {op} is not supported; use "
                             "set_force_sum_reduction_for_comms(True) with a divide factor")
        wire = input_tensor.to(torch.bfloat16)
        if not _bf16_exact(wire, input_tensor):  # not bf16-exact: fp32, as natively
            self.fp32_fallbacks += 1
            self.bytes_sent += 4 * n * (world - 1)
            return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                              async_op=async_op)
        received = torch.empty_like(wire)
        dist.all_to_all_single(received, wire, group=group)
        self.bytes_sent += 2 * n * (world - 1)
        chunks = received.view(world, n)
        for k in range(world):  # rank order; the first write overwrites
            accumulate_([output_tensor], [chunks[k]], 1.0, overwrite=k == 0,
                        backend=self.backend)
        if avg:
            output_tensor.div_(world)
        return None


_CHECK_CHUNK = 1 << 20  # elements per exactness check: a bounded fp32 temporary


def _bf16_exact(wire: torch.Tensor, fp32: torch.Tensor) -> bool:
    """Whether ``fp32`` holds exactly ``wire``'s values (chunk by chunk: no fp32 copy of the
    whole input at the peak of the reduce-scatter)."""
    flat_w, flat_f = wire.reshape(-1), fp32.reshape(-1)
    return all(torch.equal(flat_w[i:i + _CHECK_CHUNK].float(), flat_f[i:i + _CHECK_CHUNK])
               for i in range(0, flat_w.numel(), _CHECK_CHUNK))


def enable_bf16_reduce_scatter(model: torch.nn.Module,
                               backend: str = "auto") -> Bf16WireReduceScatter:
    """Install one :class:`Bf16WireReduceScatter` on every FSDP module of ``model``."""
    from torch.distributed.fsdp import FSDPModule

    comm = Bf16WireReduceScatter(backend)
    modules = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not modules:
        raise ValueError("enable_bf16_reduce_scatter: model has no fully_shard module")
    for module in modules:
        module.set_custom_reduce_scatter(comm)
    return comm
