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

import datetime
import multiprocessing
import os
import time
import traceback

import torch

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
    return ours, native


def check_ranks_agree(results: list[dict], key: str, what: str) -> None:
    for rank, r in enumerate(results[1:], start=1):
        diff = first_difference(r[key]["params"], results[0][key]["params"])
        assert diff is None, f"{what}: rank {rank} differs from rank 0: {diff}"


# -- the launcher ---------------------------------------------------------------------------------
def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    """One rank: a gloo group from a FileStore in the test's own directory (no port to race
    for), the scenario, its result written before teardown, a barrier, then ``os._exit``
    (gloo's threads can abort in C++ static destructors at a normal exit)."""
    os.environ.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", RANK=str(rank),
                      WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      NODE_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    import _integrations_workers

    import torch.distributed as dist

    result: dict = {"error": None}
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=WORLD, timeout=datetime.timedelta(seconds=60))
        result["result"] = _integrations_workers.SCENARIOS[scenario](
            os.path.join(out_dir, "work"), WORLD, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)  # the parent never reads a half-written file
    try:
        if dist.is_initialized():
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=30))
            dist.destroy_process_group()
    finally:
        os._exit(0)


def run_ranks(tmp_path, scenario: str, timeout: float = 150.0, **kwargs) -> list[dict]:
    """Run ``scenario`` on WORLD spawned ranks; return each rank's result.

    AssertionError with the rank's traceback if a rank failed, TimeoutError if a rank wrote
    nothing within ``timeout`` seconds. Every process is gone when this returns.
    """
    out_dir = str(tmp_path)
    os.makedirs(os.path.join(out_dir, "work"), exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, out_dir, scenario, kwargs))
             for rank in range(WORLD)]
    paths = [os.path.join(out_dir, f"rank{rank}.pt") for rank in range(WORLD)]
    for p in procs:
        p.start()
    try:
        deadline = time.monotonic() + timeout
        while not all(os.path.exists(path) for path in paths):
            dead = [r for r, p in enumerate(procs)
                    if not p.is_alive() and not os.path.exists(paths[r])]
            if dead:
                raise AssertionError(f"{scenario}: rank {dead[0]} died (exit code "
                                     f"{procs[dead[0]].exitcode}) without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{scenario}: no result from every rank within {timeout:g} s")
            time.sleep(0.05)
        for p in procs:  # results are in; teardown gets a grace period, then is cut short
            p.join(max(1.0, deadline + 30 - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)
    results = [torch.load(path, weights_only=False) for path in paths]
    for rank, r in enumerate(results):
        if r["error"] is not None:
            raise AssertionError(f"{scenario}: rank {rank} failed: {r['error']}\n{r['traceback']}")
    return [r["result"] for r in results]
