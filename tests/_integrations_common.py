"""Shared pieces of tests/test_integrations_*.py and their rank processes
(tests/_integrations_workers.py): the model, the data, the comparisons and the launcher.

Every framework scenario trains a tiny GPT-2 (built from a config, no download) twice from the
same seed and data, the framework's own script with and without the one line, and compares.

Why fp32 runs are compared bit for bit: with ``reduction="sum"`` the wrapper adds the very same
fp32 micro-batch gradients in the very same order as autograd's AccumulateGrad (``g1``, then
``+= g2``...; the fused scale is 1.0 and ``x + 1.0*y`` rounds as ``x + y``); under DDP the
comm hook divides the window by the world size and sums it over ranks, which is what DDP does
to its bucket (``a + b`` is the same on both ranks). Clipping reads the same ``p.grad`` values
and AdamW gets the same inputs. So parameters and logged gradient norms are expected to be
identical, and ``torch.equal`` is the check. A missed or doubled micro-batch, a wrong
normalisation or a missed reduction moves parameters by ~lr = 1e-2.

bf16: a bf16 model trained with the one line (fp32 window, fp32 master weights) against the
same framework script natively in bf16 and natively in float64 (the reference): the one line
must end closer to the reference than native bf16 does.
"""

from __future__ import annotations

import os

import torch

from _spawn import run_scenario, spawn_ranks

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

WORLD = 2
ACCUM = 4  # gradient_accumulation_steps / accumulate_grad_batches
MICRO = 2  # samples per micro-batch and rank
PER_EPOCH = 10  # micro-batches per epoch and rank: windows of 4, 4 and a short one of 2
EPOCHS = 2
STEPS = EPOCHS * 3  # optimizer steps (windows)
RESUME_AT = 2  # the checkpoint: after the second window (mid-epoch, a window boundary)
LR = 1e-2
CLIP = 0.25  # max_grad_norm: below every window's norm (the tests check it bites)
VOCAB = 64
SEQ = 12


def tiny_gpt2(dtype: torch.dtype = torch.float32):
    """GPT-2, 2 layers, width 32, no dropout (deterministic forward); ~35k params."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel

    transformers.logging.set_verbosity_error()
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                        eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config).to(dtype)


def token_samples(world: int, seed: int = 1) -> list[dict]:
    """``world * PER_EPOCH * MICRO`` random samples; labels are the inputs, a share masked."""
    n = world * PER_EPOCH * MICRO
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = ids.clone()
    labels[torch.rand(n, SEQ, generator=g) < 0.3] = -100
    labels[:, 1] = ids[:, 1]  # every sample predicts at least one token
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


class Samples(torch.utils.data.Dataset):
    def __init__(self, samples: list[dict]):
        self.samples = samples

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def linear_decay(step: int) -> float:
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


# -- the checks every framework shares ------------------------------------------------------------
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
    start = snapshot(tiny_gpt2())
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


# -- the launcher ---------------------------------------------------------------------------------
def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    """One rank of ``run_ranks`` (tests/_spawn.run_scenario), with torchrun's environment."""
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
