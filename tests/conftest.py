"""Shared test setup: Triton runs through its interpreter on CPU-only machines.

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection.
"""

import os
import sys
import zlib

import torch

if not torch.cuda.is_available():
    assert "triton" not in sys.modules, "triton was imported before TRITON_INTERPRET was set"
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()

# (device, backend) pairs every op test runs on. CUDA ones skip without a GPU; Triton on the
# CPU exists only through the interpreter, which is switched on only on CPU-only machines.
DEVICE_BACKENDS = [
    pytest.param("cpu", "torch", id="cpu-torch"),
    pytest.param("cpu", "cpu", id="cpu-cpu"),
    pytest.param("cpu", "triton", id="cpu-triton",
                 marks=pytest.mark.skipif(HAS_CUDA, reason="triton interpreter only on CPU-only hosts")),
    pytest.param("cuda", "torch", id="cuda-torch", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
    pytest.param("cuda", "cuda", id="cuda-cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
    pytest.param("cuda", "triton", id="cuda-triton", marks=pytest.mark.skipif(not HAS_CUDA, reason="no GPU")),
]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """A different seed per test (derived from its id) so data is random but reproducible."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
