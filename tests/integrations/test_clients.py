"""The real entry points of config-driven stacks, with the optimizer named in their config:
``litgpt pretrain`` (Fabric underneath) and torchtune's ``tune run full_finetune_single_device``,
each run as its command line does, on a tiny model with a tokenizer, data and checkpoint made here
(no downloads), natively (``torch.optim.AdamW``) and by name (``accumkernels.optimizers.AdamW``):

* fp32: the final weights bit for bit the same;
* bf16 (``bf16-true`` / ``dtype: bf16``): the wrapper's final weights closer to the fp32 run than
  native bf16's (relative L2 error; the figures are printed).

They run in ``make clients`` (a venv with litgpt 0.5.13 and torchtune 0.6.1, torch pinned), one
thread and ``TORCHDYNAMO_DISABLE=1``: litgpt compiles its model, compiled CPU runs depend on
the thread count, natively too (README: training stacks), and a compiled run took up to 5.5
minutes here. The tokenizer-free litgpt run reads ``_client_data.RandomTokens``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
REPO = HERE.parent.parent


def _env() -> dict:
    return dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]))


def _run(argv: list[str], cwd: Path) -> None:
    env = dict(_env(), HF_DATASETS_CACHE=str(cwd / "hf-datasets"))
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, f"{argv} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


def _relative_l2(params: dict, reference: dict) -> float:
    num = sum(float((params[k].double() - reference[k].double()).square().sum())
              for k in reference)
    return (num / sum(float(r.double().square().sum()) for r in reference.values())) ** 0.5


def _compare(runs: dict, what: str) -> None:
    native, ours = runs["fp32_native"], runs["fp32_ours"]
    assert native.keys() == ours.keys()
    for k in native:
        assert torch.equal(native[k], ours[k]), f"{what} fp32: {k} differs"
    start = runs.get("start")
    if start is not None:
        assert any(not torch.equal(native[k], start[k].to(native[k].dtype)) for k in native)
    ours_bf16 = _relative_l2(runs["bf16_ours"], native)
    native_bf16 = _relative_l2(runs["bf16_native"], native)
    print(f"[bf16 vs fp32] {what}: wrapper {ours_bf16:.3g}, native bf16 {native_bf16:.3g}")
    assert ours_bf16 < native_bf16, what


# -- litgpt pretrain --------------------------------------------------------------------------------
LITGPT_CONFIG = """\
model_name: tiny
model_config:
  name: tiny
  block_size: 16
  vocab_size: 64
  padded_vocab_size: 64
  n_layer: 2
  n_head: 2
  n_embd: 32
  rotary_percentage: 1.0
  parallel_residual: false
  bias: false
  norm_class_name: RMSNorm
  mlp_class_name: LLaMAMLP
  intermediate_size: 64
out_dir: {out}
precision: {precision}
data:
  class_path: _client_data.RandomTokens
train:
  global_batch_size: 8
  micro_batch_size: 2
  max_tokens: 1024
  max_seq_length: 16
  lr_warmup_steps: 1
  max_norm: 0.5
  min_lr: 1.0e-4
  save_interval: null
  log_interval: 1
  tie_embeddings: false
eval:
  interval: 1000
  max_iters: 1
  initial_validation: false
  final_validation: false
optimizer:
  class_path: {optimizer}
  init_args:
    lr: 0.002
    weight_decay: 0.1
devices: 1
logger_name: csv
seed: 42
"""


def test_litgpt_pretrain_optimizer_by_name(tmp_path):
    """``litgpt pretrain --config``: 8 optimizer steps of 4 micro-batches (``global_batch_size``
    8, ``micro_batch_size`` 2), clipping at 0.5, ``optimizer.class_path`` naming the wrapper."""
    pytest.importorskip("litgpt")
    pytest.importorskip("_client_data")
    litgpt = Path(sys.executable).with_name("litgpt")
    runs = {}
    for precision in ("32-true", "bf16-true"):
        for label, optimizer in (("native", "torch.optim.AdamW"),
                                 ("ours", "accumkernels.optimizers.AdamW")):
            out = tmp_path / f"{precision}-{label}"
            config = tmp_path / f"{precision}-{label}.yaml"
            config.write_text(LITGPT_CONFIG.format(out=out, precision=precision,
                                                   optimizer=optimizer))
            _run([str(litgpt), "pretrain", "--config", str(config)], tmp_path)
            state = torch.load(out / "final" / "lit_model.pth", weights_only=False)
            if label == "ours":
                assert type(state["optimizer"]) is dict  # the wrapper's state dict was saved
            key = f"{'fp32' if precision == '32-true' else 'bf16'}_{label}"
            runs[key] = {k: v.float() for k, v in state["model"].items()}
    _compare(runs, "litgpt pretrain")


# -- torchtune full_finetune_single_device ---------------------------------------------------------
TUNE_CONFIG = """\
output_dir: {out}
tokenizer:
  _component_: torchtune.models.llama2.llama2_tokenizer
  path: {tokenizer}
  max_seq_len: 24
  prompt_template: null
dataset:
  _component_: torchtune.datasets.text_completion_dataset
  source: text
  data_files: {data}
  column: text
  split: train
seed: 0
shuffle: False
model:
  _component_: torchtune.models.llama2.llama2
  vocab_size: 96
  num_layers: 2
  num_heads: 2
  num_kv_heads: 2
  embed_dim: 32
  max_seq_len: 32
  intermediate_dim: 64
checkpointer:
  _component_: torchtune.training.FullModelMetaCheckpointer
  checkpoint_dir: {checkpoint}
  checkpoint_files: [model.pth]
  recipe_checkpoint: null
  output_dir: {out}
  model_type: LLAMA2
resume_from_checkpoint: False
batch_size: 2
epochs: 1
max_steps_per_epoch: 4
gradient_accumulation_steps: 4
optimizer:
  _component_: {optimizer}
  lr: 2.0e-3
optimizer_in_bwd: False
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
clip_grad_norm: 1.0
compile: False
device: cpu
dtype: {dtype}
enable_activation_checkpointing: False
enable_activation_offloading: False
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: {out}/logs
log_every_n_steps: 1
log_peak_memory_stats: False
profiler:
  _component_: torchtune.training.setup_torch_profiler
  enabled: False
"""


def _tune_inputs(work: Path) -> dict:
    """A SentencePiece tokenizer trained on the made-up text, the text (one sample a line) and a
    random tiny llama2 checkpoint in Meta's format."""
    import random

    import sentencepiece
    from torchtune.models.convert_weights import tune_to_meta
    from torchtune.models.llama2 import llama2

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 6)))
             for _ in range(60)]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 14))) for _ in range(64)]
    data = work / "text.txt"
    data.write_text("\n".join(lines) + "\n")
    prefix = work / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        input=str(data), model_prefix=str(prefix), vocab_size=96, model_type="bpe",
        hard_vocab_limit=False, minloglevel=2)
    checkpoint = work / "checkpoint"
    checkpoint.mkdir()
    torch.manual_seed(0)
    model = llama2(vocab_size=96, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=32,
                   max_seq_len=32, intermediate_dim=64)
    torch.save(tune_to_meta(model.state_dict()), checkpoint / "model.pth")
    return {"tokenizer": f"{prefix}.model", "data": data, "checkpoint": checkpoint}


def test_torchtune_full_finetune_single_device_optimizer_by_name(tmp_path):
    """``tune run full_finetune_single_device --config``: 4 steps of 4 micro-batches
    (``gradient_accumulation_steps: 4``; the recipe sums token-weighted losses and scales
    ``p.grad`` by 1/tokens before clipping at 1.0), ``optimizer._component_`` naming the wrapper."""
    pytest.importorskip("torchtune")
    pytest.importorskip("sentencepiece")
    inputs = _tune_inputs(tmp_path)
    tune = Path(sys.executable).with_name("tune")
    runs = {"start": torch.load(inputs["checkpoint"] / "model.pth")}
    for dtype in ("fp32", "bf16"):
        for label, optimizer in (("native", "torch.optim.AdamW"),
                                 ("ours", "accumkernels.optimizers.AdamW")):
            out = tmp_path / f"{dtype}-{label}"
            config = tmp_path / f"{dtype}-{label}.yaml"
            config.write_text(TUNE_CONFIG.format(out=out, optimizer=optimizer, dtype=dtype,
                                                 **inputs))
            _run([str(tune), "run", "full_finetune_single_device", "--config", str(config)],
                 tmp_path)
            saved = sorted((out / "epoch_0").glob("*.pt*")) + sorted((out / "epoch_0").glob(
                "*.bin"))
            assert saved, f"no checkpoint in {out / 'epoch_0'}"
            state = torch.load(saved[0], weights_only=False)
            runs[f"{dtype}_{label}"] = {k: v.float() for k, v in state.items()}
    _compare(runs, "torchtune full_finetune_single_device")
