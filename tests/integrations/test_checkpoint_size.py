"""A checkpoint at a window boundary costs what native's costs, on every path (DESIGN:
"state_dict()/load_state_dict()"); a mid-window one carries the window and resumes exactly.

Paths, one process: ``torch.save(opt.state_dict())``; ``torch.distributed.checkpoint``'s
``get_state_dict`` with every ``StateDictOptions`` then ``dcp.save``; Accelerate's
``save_state``; the HF Trainer's checkpoint; Lightning's ``save_checkpoint``. (FSDP2 on 2 and 4
ranks: tests/distributed/test_fsdp2_checkpoint.py.) Judge: the same path with a native AdamW on
the same model after the same windows.

The rule at a boundary: no per-element cost at all (the landed version carried an empty fp32
window, 4 B per element, +50 % for an fp32 AdamW); fp32 models within 1 KB + 16 B per param
tensor of native's; bf16 models with masters: native fp32 AdamW's bytes plus the fp32 masters
(4 B per element, one tensor per param). ``torch.distributed.checkpoint`` writes every leaf
as its own small archive (about 1.6 KB with its metadata) and its flattened layout repeats every
group key for every param tensor: the bookkeeping string costs one such leaf (plain) or one per
param tensor (flattened).
"""

from __future__ import annotations

import copy
import io
import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import torch.distributed.checkpoint as dcp  # noqa: E402
from _dcp_options import STATE_DICT_OPTIONS  # noqa: E402
from _integrations_common import (  # noqa: E402
    fresh_accelerate_state,  # noqa: F401  (fixture)
    tiny_gpt2,
    token_batches,
)
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    get_state_dict,
    set_state_dict,
)

from accumkernels import AccumulatingOptimizer  # noqa: E402

pytestmark = [pytest.mark.usefixtures("fresh_accelerate_state"),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled")]

N, MICRO, LR = 4, 2, 1e-2
PER_LEAF = 1700  # one more leaf in a DCP checkpoint (its archive and metadata: measured 1.6 KB)
PER_TENSOR = {"dcp": 1900, "torch": 300}  # one more tensor (measured: 1.84 KB and 265 B)
DCP = STATE_DICT_OPTIONS
SAMPLES = token_batches(4 * N * MICRO)


def batch(k: int) -> dict:
    part = SAMPLES[k * MICRO:(k + 1) * MICRO]
    return {key: torch.stack([s[key] for s in part]) for key in part[0]}


def build(dtype: torch.dtype, wrap: bool, seed: int = 0):
    model = tiny_gpt2(seed, dtype)
    inner = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    return model, (AccumulatingOptimizer(inner, accumulation_steps=N, reduction="sum")
                   if wrap else inner)


def micro(model, opt, k: int, backward=None) -> None:
    loss = model(**batch(k)).loss
    (backward or torch.Tensor.backward)(loss)
    if isinstance(opt, AccumulatingOptimizer) or getattr(opt, "optimizer", None) is not None \
            and isinstance(opt.optimizer, AccumulatingOptimizer) or (k + 1) % N == 0:
        opt.step()
        opt.zero_grad()


def trained(dtype, wrap, upto: int):
    model, opt = build(dtype, wrap)
    for k in range(upto):
        micro(model, opt, k)
    return model, opt


def dir_bytes(path) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path)
               for f in files)


def torch_save_bytes(model, opt, tmp_path) -> int:
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    return len(buf.getvalue())


def dcp_bytes(option: str):
    def measure(model, opt, tmp_path) -> int:
        _, osd = get_state_dict(model, opt, options=DCP[option])
        dcp.save({"optim": osd}, checkpoint_id=str(tmp_path / "dcp"))
        return dir_bytes(tmp_path / "dcp")
    return measure


def accelerate_bytes(dtype, wrap, tmp_path) -> int:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model, opt = build(dtype, wrap)
    model, opt = accelerator.prepare(model, opt)
    for k in range(2 * N):
        micro(model, opt, k, accelerator.backward)
    accelerator.save_state(str(tmp_path / "acc"))
    return os.path.getsize(tmp_path / "acc" / "optimizer.bin")


def trainer_bytes(dtype, wrap, tmp_path) -> int:
    from _integrations_common import TokenDataset
    from transformers import Trainer, TrainingArguments

    model, opt = build(dtype, wrap)
    args = TrainingArguments(
        output_dir=str(tmp_path / "hf"), report_to=[], use_cpu=True, save_strategy="steps",
        save_steps=2, logging_steps=1, per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=N, max_steps=2, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=TokenDataset(SAMPLES),
            optimizers=(opt, None)).train()
    return os.path.getsize(tmp_path / "hf" / "checkpoint-2" / "optimizer.pt")


def lightning_bytes(dtype, wrap, tmp_path) -> int:
    import lightning as L

    model, opt = build(dtype, wrap)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, b, i):
            return self.model(**b).loss

        def configure_optimizers(self):
            return opt

    trainer = L.Trainer(accumulate_grad_batches=N, accelerator="cpu", devices=1, max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader([dict(s) for s in SAMPLES], batch_size=MICRO)
    trainer.fit(Module(), loader)
    path = tmp_path / "lightning.ckpt"
    trainer.save_checkpoint(str(path))
    optim = torch.load(path, weights_only=False)["optimizer_states"][0]
    buf = io.BytesIO()
    torch.save(optim, buf)  # the optimizer's part of the checkpoint (the model's differs by dtype)
    return len(buf.getvalue())


MANUAL = {"torch_save": torch_save_bytes, **{f"dcp_{k}": dcp_bytes(k) for k in DCP}}
FRAMEWORKS = {"accelerate": accelerate_bytes, "trainer": trainer_bytes,
              "lightning": lightning_bytes}


def allowance(path: str, tensors: int) -> int:
    if path.startswith("dcp_flatten"):
        return 1024 + PER_LEAF * tensors
    if path.startswith("dcp_"):
        return 1024 + PER_LEAF
    return 1024 + 16 * tensors


_MEASURED: dict = {}


def measured(tmp_path_factory, path: str, dtype: torch.dtype, wrap: bool) -> int:
    """Bytes of ``path``'s checkpoint after two windows (cached: the DCP paths and torch.save
    share one trained model per run)."""
    key = (path, dtype, wrap)
    if key not in _MEASURED:
        where = tmp_path_factory.mktemp("size")
        if path in FRAMEWORKS:
            _MEASURED[key] = FRAMEWORKS[path](dtype, wrap, where)
        else:
            model, opt = trained(dtype, wrap, 2 * N)
            for name, fn in MANUAL.items():
                (where / name).mkdir()
                _MEASURED[(name, dtype, wrap)] = fn(model, opt, where / name)
    return _MEASURED[key]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("path", sorted(MANUAL) + sorted(FRAMEWORKS))
def test_a_boundary_checkpoint_costs_natives_bytes(tmp_path_factory, path, dtype):
    native = measured(tmp_path_factory, path, torch.float32, False)
    ours = measured(tmp_path_factory, path, dtype, True)
    params = list(tiny_gpt2().parameters())
    numel, tensors = sum(p.numel() for p in params), len(params)
    # a bf16 model's masters: 4 B per element, in one more tensor per param
    per_tensor = PER_TENSOR["dcp" if path.startswith("dcp_") else "torch"]
    masters = 4 * numel + per_tensor * tensors if dtype == torch.bfloat16 else 0
    assert ours - native - masters <= allowance(path, tensors), (ours, native, masters)


def resume(save, load, dtype) -> None:
    """Save ``N + 2`` micro-batches in (mid-window), load into a fresh model and wrapper,
    finish: bit-identical to the run that never stopped."""
    model, opt = trained(dtype, True, N + 2)
    saved = save(model, opt)
    opt.remove_hooks()
    model2, opt2 = build(dtype, True, seed=1)
    load(model2, opt2, saved)
    assert opt2.micro_steps == 2
    for k in range(N + 2, 3 * N):
        micro(model2, opt2, k)
    if dtype not in _STRAIGHT:
        straight, opt3 = trained(dtype, True, 3 * N)
        opt3.remove_hooks()
        _STRAIGHT[dtype] = [p.detach().clone() for p in straight.parameters()]
    for a, b in zip(model2.parameters(), _STRAIGHT[dtype], strict=True):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max().item()


_STRAIGHT: dict = {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", ["default", "flatten_cpu", "full_cpu", "torch"])
def test_a_mid_window_checkpoint_carries_the_window(tmp_path, option, dtype):
    """The mid-window half of the rule (every DCP option through get/set_state_dict:
    tests/optim/checkpoint/test_checkpoint_dcp.py; Accelerate's ``save_state``:
    test_accelerate_checkpoint.py). The template for ``dcp.load`` is built inside
    ``opt.window_template()`` (README: checkpoints)."""
    def save(model, opt):
        if option == "torch":
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
            return buf.getvalue()
        msd, osd = get_state_dict(model, opt, options=DCP[option])
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))

    def load(model, opt, saved):
        if option == "torch":
            sd = torch.load(io.BytesIO(saved), weights_only=True)
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])
            return
        with opt.window_template():
            msd, osd = get_state_dict(model, opt, options=DCP[option])
        state = {"model": msd, "optim": copy.copy(osd)}
        dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=DCP[option])

    resume(save, load, dtype)
