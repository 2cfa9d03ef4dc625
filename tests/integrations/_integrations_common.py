"""Shared pieces of the framework-integration tests (tests/integrations/, and the framework runs
of tests/optim/) and of their rank processes (_integrations_workers.py): the tiny GPT-2 (built
from a config, no download), the data, the comparisons and the launcher.

Two kinds of test train a tiny GPT-2 twice from the same seed and data and compare:

* recipes, one process: the framework's own loop natively (stock AdamW, PyTorch's own fp32
  ``.grad`` accumulation) and with ``AccumulatingOptimizer(AdamW(...))`` dropped in by hand
  (``optimizers=``, ``accelerator.prepare(opt)``, ``configure_optimizers``, a plain loop);
* the one line (``AccumulatingTrainer``, ``AccumulatingAccelerator``, ``FP32Accumulation``): the
  framework's script with its defaults, with and without the one line, on 1 process or on
  ``WORLD`` spawned gloo ranks under the DDP the framework builds.

Why fp32 runs can be compared this tightly: with ``reduction="sum"`` the wrapper adds the very
same fp32 micro-batch gradients in the very same order as autograd's AccumulateGrad (``g1``
written, then ``+= g2``...; the fused scale is 1.0 and ``x + 1.0*y`` rounds exactly like
``x + y``, FMA or not); under DDP the comm hook divides the window by the world size and sums it
over ranks, which is what DDP does to its bucket (``a + b`` is the same on both ranks). Clipping
reads the same ``p.grad`` values and AdamW gets the same inputs. So the one-line runs'
parameters and logged gradient norms are checked with ``torch.equal``; the recipes' ``ATOL`` is
only a safety margin far above what one rounding difference per step could cause
(lr * steps * 2**-24 << 1e-5). A missed or doubled micro-batch, a wrong 1/N or normalisation, a
missed reduction or a clip that did not take effect all move parameters by ~lr = 1e-2.

bf16: a bf16 model trained with the one line (fp32 window, fp32 master weights) against the same
framework script natively in bf16 and natively in float64 (the reference): the one line must end
closer to the reference than native bf16 does.
"""

from __future__ import annotations

import os

import pytest
import torch
from _spawn import run_scenario, spawn_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

transformers = pytest.importorskip("transformers")

LR = 1e-2  # large enough that every window's gradient norm exceeds the clip norms (asserted)


class TokenDataset(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


# -- recipes: the framework's loop with the wrapper given by hand, one process ---------------------

VOCAB = 96
SEQ = 16
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


# -- the one line: the framework's script with its defaults, 1 process or WORLD ranks --------------

WORLD = 2
ACCUM = 4  # gradient_accumulation_steps / accumulate_grad_batches
MICRO = 2  # samples per micro-batch and rank
PER_EPOCH = 10  # micro-batches per epoch and rank: windows of 4, 4 and a short one of 2
EPOCHS = 2
STEPS = EPOCHS * 3  # optimizer steps (windows)
RESUME_AT = 2  # the checkpoint: after the second window (mid-epoch, a window boundary)
CLIP = 0.25  # max_grad_norm: below every window's norm (the tests check it bites)
ONELINE_VOCAB = 64
ONELINE_SEQ = 12


def oneline_gpt2(dtype: torch.dtype = torch.float32):
    """GPT-2, 2 layers, width 32, no dropout (deterministic forward); ~35k params."""
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=ONELINE_VOCAB,
                        n_positions=ONELINE_SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def token_samples(world: int, seed: int = 1) -> list[dict]:
    """``world * PER_EPOCH * MICRO`` random samples; labels are the inputs, a share masked."""
    n = world * PER_EPOCH * MICRO
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ONELINE_VOCAB, (n, ONELINE_SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(n, ONELINE_SEQ, generator=g) < 0.3] = -100
    labels[:, 1] = ids[:, 1]  # every sample predicts at least one token
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def oneline_decay(step: int) -> float:
    """LambdaLR factor: a scheduler stepped at the wrong cadence changes every later step."""
    return max(0.05, 1.0 - step / (2 * STEPS))


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def distance(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """L2 distance of all parameters, in float64."""
    return sum(float((p.double() - r.double()).square().sum())
               for p, r in zip(params, reference)) ** 0.5


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    """None if the lists are bit-identical; else where they first differ and by how much."""
    if len(a) != len(b):
        return f"{len(a)} tensors against {len(b)}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x.dtype != y.dtype or x.shape != y.shape:
            return f"tensor {i}: {x.dtype}{tuple(x.shape)} against {y.dtype}{tuple(y.shape)}"
        if not torch.equal(x, y):
            return f"tensor {i}: max |diff| {(x.double() - y.double()).abs().max().item():.3g}"
    return None


# -- the one line: the checks every framework shares -----------------------------------------------
def check_fp32(res: dict, what: str, resumed_norms: slice = slice(None)) -> None:
    """The one line against the same script without it (fp32): clipping bit on every window,
    the short last window stepped, logged norms and parameters identical; the run resumed from
    the checkpoint at a window boundary ends identical too."""
    native, ours, resumed = res["native"], res["oneline"], res["resumed"]
    assert ours["wrapped"] == resumed["wrapped"] == "AccumulatingOptimizer", what
    assert native["wrapped"] != "AccumulatingOptimizer", what
    assert len(native["norms"]) == STEPS, f"{what}: {len(native['norms'])} windows"
    assert all(n > CLIP for n in native["norms"]), f"{what}: clip idle {native['norms']}"
    assert ours["norms"] == native["norms"], f"{what}: grad norms differ"
    assert resumed["norms"] == native["norms"][resumed_norms], f"{what}: resumed grad norms"
    start = snapshot(oneline_gpt2())
    assert distance(native["params"], start) > 1e-2, f"{what}: native did not train"
    for name, run in (("one line", ours), ("resumed", resumed)):
        diff = first_difference(run["params"], native["params"])
        assert diff is None, f"{what}, {name} vs native: {diff}"


def check_bf16(res: dict, what: str) -> tuple[float, float]:
    """bf16 model: the one line ends closer to the float64 run than native bf16 does."""
    reference = res["f64_native"]["params"]
    ours = distance(res["bf16_oneline"]["params"], reference)
    native = distance(res["bf16_native"]["params"], reference)
    assert all(p.dtype == torch.bfloat16 for p in res["bf16_oneline"]["params"]), what
    assert ours < native, f"{what}: distance to float64 {ours:.3g} (one line) >= {native:.3g}"
    print(f"[bf16 vs float64] {what}: one line {ours:.4g}, native bf16 {native:.4g}")
    return ours, native


def check_ranks_agree(results: list[dict], key: str, what: str) -> None:
    for rank, r in enumerate(results[1:], start=1):
        diff = first_difference(r[key]["params"], results[0][key]["params"])
        assert diff is None, f"{what}: rank {rank} differs from rank 0: {diff}"


# -- the one line: the launcher --------------------------------------------------------------------
def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    """One rank of ``run_ranks`` (tests/distributed/_spawn.py's ``run_scenario``), with torchrun's
    environment."""
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    import _integrations_workers

    run_scenario(rank, out_dir, WORLD, lambda: _integrations_workers.SCENARIOS[scenario](
        os.path.join(out_dir, "work"), WORLD, **kwargs))


def run_ranks(tmp_path, scenario: str, timeout: float = 150.0, **kwargs) -> list[dict]:
    """Run ``scenario`` on WORLD spawned ranks; return each rank's result.

    AssertionError with the rank's traceback if a rank failed, TimeoutError if a rank wrote
    nothing within ``timeout`` seconds. Every process is gone when this returns.
    """
    os.makedirs(os.path.join(str(tmp_path), "work"), exist_ok=True)
    return spawn_ranks(_rank_main, str(tmp_path), scenario, kwargs, WORLD, timeout)
