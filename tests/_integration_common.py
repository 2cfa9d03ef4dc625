"""Shared pieces of the framework-integration tests (tests/test_integration_*.py).

Every integration test trains a tiny GPT-2 twice from the same seed and data: once the way the
framework does it natively (stock AdamW, fp32 model, PyTorch's own fp32 ``.grad`` accumulation)
and once with ``AccumulatingOptimizer(AdamW(...))`` dropped in, and compares the parameters.

Why the comparisons can be tight: with ``reduction="sum"`` the wrapper adds the very same fp32
micro-batch gradients in the very same order as autograd's AccumulateGrad does natively
(``g1`` written, then ``+= g2``, ``+= g3``, ...; the fused scale is 1.0, and ``x + 1.0*y`` rounds
exactly like ``x + y``, FMA or not), so the accumulated gradients, the clipping and the AdamW
steps are expected to be bit-for-bit those of the native run. ``ATOL`` is only a safety margin
far above what one rounding difference per step could cause (lr * steps * 2**-24 << 1e-5) and
far below a real error: a missed or doubled micro-batch, a wrong 1/N, or clipping that did not
take effect all move parameters by ~lr = 1e-2.
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

transformers = pytest.importorskip("transformers")

VOCAB = 96
SEQ = 16
LR = 1e-2  # large enough that every window's gradient norm exceeds MAX_GRAD_NORM (asserted)
MAX_GRAD_NORM = 0.5
N_ACCUM = 4
ATOL = 1e-5


def tiny_gpt2(seed: int = 0, dtype: torch.dtype = torch.float32):
    """GPT-2 with 2 layers, width 32, no dropout: deterministic forward, ~40k params."""
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()  # vocab 96 < the default bos/eos ids: harmless
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                        n_ctx=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(config).to(dtype)


def token_batches(n_samples: int, seed: int = 1, pad_fraction: float = 0.3) -> list[dict]:
    """Random samples ``{"input_ids", "labels"}``; a random share of label positions is -100.

    The masking gives every micro-batch a different number of predicted tokens, which is what
    makes loss normalisation across a window matter (HF's num_items_in_batch, "weighted").
    """
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n_samples, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(n_samples, SEQ, generator=g) < pad_fraction] = -100
    labels[:, 1] = ids[:, 1]  # at least one predicted token per sample (position 0 is unused)
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n_samples)]


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def loader(samples: list[dict], batch_size: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(TokenDataset(samples), batch_size=batch_size, shuffle=False)


def linear_decay(total_steps: int):
    """LambdaLR factor: linear decay, so a scheduler stepping at the wrong cadence shows up."""
    return lambda step: max(0.0, 1.0 - step / (2 * total_steps))


def max_abs_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p.detach().double() - q.detach().double()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


def assert_same_params(native: torch.nn.Module, ours: torch.nn.Module, atol: float = ATOL) -> None:
    names = [n for n, _ in native.named_parameters()]
    for name, p, q in zip(names, native.parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), atol=atol, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")


def assert_moved(model: torch.nn.Module, start: torch.nn.Module) -> None:
    """Training did something (guards against two runs that agree because neither stepped)."""
    assert max_abs_diff(model, start) > 100 * ATOL


@pytest.fixture
def fresh_accelerate_state():
    """Accelerate keeps process-wide singletons (AcceleratorState, GradientState); reset them
    around each test so one test's gradient_accumulation_steps never leaks into the next."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
