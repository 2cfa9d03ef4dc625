"""End-to-end training: one large batch vs gradient accumulation (the single-GPU table).

    python -m benchmarks.accumbench train [--device cuda] [--model gpt2|llama] [--quick] [--note T]

Reproduces the table of Hugging Face's efficient-training guide (batch 4 vs batch 1 x 4
accumulation steps: time, samples/second, peak GPU memory) with a plain loop that means what
the Trainer's rows mean: forward + backward of each micro-batch with the loss divided by N, one
AdamW step per window. Model: GPT-2 small from ``GPT2Config`` (no download; ``--model llama``:
a Llama of similar size, whose nn.Linear layers ``fuse_wgrad_accumulation`` can patch), in
bf16, dropout off, on random tokens made here. Rows:

* ``large_batch``: batch B, one backward per step; AdamW on the bf16 params;
* ``native_bf16``: B/N x N, autograd accumulates into the bf16 ``.grad``; AdamW on bf16 params;
* ``main_grad_fp32``: B/N x N, hand-written Megatron-style loop: after each backward
  ``main_grad.add_(p.grad); p.grad = None`` per param; AdamW on fp32 master weights;
* ``accumkernels``: B/N x N with ``AccumulatingOptimizer(AdamW, accumulation_steps=N)``
  (fp32 window filled during backward, fp32 master weights);
* ``accumkernels+fused_wgrad``: the same plus ``accumkernels.fuse_wgrad_accumulation`` (only
  where the package has it).

Timing: the rows and the reference (a fwd+bwd that accumulates nothing: ``.grad`` set to None
before every backward, so autograd stores each gradient without adding), each with its own
model copy, run one window each per repetition in rotating order (round-robin), every
micro-batch timed; load on a shared machine then falls on all of them alike.

Extra columns. ``accum share``: what accumulation adds to a micro-batch, as a share of the
row's: (median ms per micro-batch of the row - the reference's) / the row's, reported only when
the difference exceeds its noise bound (2 standard errors of the difference of the two medians,
sigma from each sample's interquartile range: ``accumulation_share``); within the bound the
cell says "below noise", and a row faster than the reference beyond it (fused weight-gradient
GEMMs never materialise the gradient) says "< reference". It is never negative. ``rel err``:
for a few params, ||accumulated - Σ gᵢ|| / ||Σ gᵢ||, with Σ gᵢ the float64 sum of the
per-micro-batch gradients, measured in a separate verification pass: captured with tensor hooks
from the very backward passes the row accumulates, or (large batch; weights whose gradient a
fused layer never materialises) recomputed with ``torch.autograd.grad`` on the same weights and
batches. ``peak MB`` (and per param): in a pass of its own, two windows of the row alone; on a
GPU ``torch.cuda.max_memory_allocated`` above what was allocated before the row's model copy;
on the CPU, which has no allocator statistics, the peak of live tensor bytes (see
``peak_live_bytes``). Both include the model copy and the optimizer state. The run is appended
as a tagged row to benchmarks/results/train.jsonl (``--out``: its record as JSON too).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import math
import statistics
import sys
import time
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench import results, summary
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.measure import quantiles
from benchmarks.accumbench.tally import LiveTensorBytes

FOOTNOTE = ("err hooks: vs the float64 sum of the bf16 gradients the row itself accumulated; "
            "err recomp: vs recomputed bf16 gradients\n(large batch: a different computation; "
            "fused weights: the fused GEMM never rounds a micro-batch's gradient to bf16, the "
            "reference does)")
ROWS = ("large_batch", "native_bf16", "main_grad_fp32", "accumkernels",
        "accumkernels+fused_wgrad")
LR = 1e-4
PEAK_METHOD = {True: "torch.cuda.max_memory_allocated over two windows of the row alone (own "
                     "pass), above what was allocated before its model copy",
               False: "peak live tensor bytes over two windows (LiveTensorBytes, own pass)"}
SHARE_NOTE = ("accum share: (median ms/micro of the row - the reference's) / the row's, both "
              "over interleaved repetitions; ±: the noise bound (2 standard errors of the "
              "difference of medians, sigma from the IQR); 'below noise' when the difference "
              "is within it, '< reference' when the row is faster than the reference beyond it")


def _log(msg: str) -> None:
    print(f"[bench_train] {msg}", file=sys.stderr, flush=True)


# --- model and data -----------------------------------------------------------------------------

def make_model(kind: str, n_layer: int, n_embd: int, n_head: int, vocab: int, seq: int
               ) -> torch.nn.Module:
    """A randomly initialised causal LM in bf16 (on the CPU), dropout off (deterministic grads)."""
    if kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=n_embd, n_layer=n_layer,
                         n_head=n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0, use_cache=False)
        model = GPT2LMHeadModel(cfg)
    elif kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=vocab, hidden_size=n_embd, num_hidden_layers=n_layer,
                          intermediate_size=(8 * n_embd // 3 + 63) // 64 * 64,
                          num_attention_heads=n_head, num_key_value_heads=n_head,
                          max_position_embeddings=seq, bos_token_id=0, eos_token_id=0,
                          pad_token_id=None, use_cache=False, tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {kind!r}")
    return model.to(torch.bfloat16).train()


def verified_param_names(model: torch.nn.Module, kind: str) -> list[str]:
    """A few params spread over the model (first/last layer, an embedding, a norm)."""
    last = model.config.num_hidden_layers - 1
    if kind == "gpt2":
        names = ["transformer.h.0.attn.c_attn.weight", f"transformer.h.{last}.mlp.c_proj.weight",
                 "transformer.wpe.weight", "transformer.ln_f.weight"]
    else:
        names = ["model.layers.0.self_attn.q_proj.weight",
                 f"model.layers.{last}.mlp.down_proj.weight",
                 "model.layers.0.input_layernorm.weight", "model.norm.weight"]
    have = dict(model.named_parameters())
    return [n for n in names if n in have]


def loss_of(model: torch.nn.Module, tokens: torch.Tensor, n: int) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss / n


# --- the rows -------------------------------------------------------------------------------------

class LargeBatch:
    """AdamW on the bf16 params; autograd's bf16 ``.grad`` (one backward per step here)."""

    def __init__(self, model: torch.nn.Module, n: int):
        self.model = model
        self.opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def after_backward(self) -> None:
        pass

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def accumulated(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad

    def close(self) -> None:
        pass


class NativeBf16(LargeBatch):
    """N backwards into the same bf16 ``.grad``: PyTorch's default accumulation."""


class MainGradFp32(LargeBatch):
    """Megatron-style, by hand: fp32 main_grad per param, fp32 master weights for AdamW."""

    def __init__(self, model: torch.nn.Module, n: int):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        self.masters = [p.detach().float() for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, lr=LR)

    def after_backward(self) -> None:
        for p, m in zip(self.params, self.main):
            m.add_(p.grad)
            p.grad = None

    def step(self) -> None:
        for w, m in zip(self.masters, self.main):
            w.grad = m
        self.opt.step()
        with torch.no_grad():
            torch._foreach_copy_(self.params, self.masters)
        torch._foreach_zero_(self.main)

    def accumulated(self, p: torch.Tensor) -> torch.Tensor | None:
        return self.main[next(i for i, q in enumerate(self.params) if q is p)]


class Accumkernels(LargeBatch):
    """AccumulatingOptimizer: the fp32 window is filled bucket by bucket during backward."""

    def __init__(self, model: torch.nn.Module, n: int):
        self.model = model
        inner = torch.optim.AdamW(model.parameters(), lr=LR)
        self.opt = accumkernels.AccumulatingOptimizer(inner, accumulation_steps=n)

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad()

    def accumulated(self, p: torch.Tensor) -> torch.Tensor | None:
        return p.grad if p.grad is not None else getattr(p, "main_grad", None)

    def close(self) -> None:
        self.opt.remove_hooks()


class AccumkernelsFused(Accumkernels):
    """... plus weight gradients of nn.Linear layers computed straight into the window."""

    def __init__(self, model: torch.nn.Module, n: int):
        super().__init__(model, n)
        self.handle = accumkernels.fuse_wgrad_accumulation(model, self.opt)

    def close(self) -> None:
        self.handle.remove()
        super().close()


SETUPS = {"large_batch": LargeBatch, "native_bf16": NativeBf16, "main_grad_fp32": MainGradFp32,
          "accumkernels": Accumkernels, "accumkernels+fused_wgrad": AccumkernelsFused}


def available_rows() -> list[str]:
    """The fused row only where the package has ``fuse_wgrad_accumulation``."""
    return [r for r in ROWS if r != "accumkernels+fused_wgrad"
            or hasattr(accumkernels, "fuse_wgrad_accumulation")]


# --- measuring ------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fresh(base: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return copy.deepcopy(base).to(device)


def _splits(window: torch.Tensor, n: int) -> list[torch.Tensor]:
    return list(window.chunk(n)) if n > 1 else [window]


class Entry:
    """One timed column: a row's model copy and state (``row`` None: the reference, a fwd+bwd
    that accumulates nothing) and its timings in ms (``micro``: every timed micro-batch)."""

    def __init__(self, row: str | None, base: torch.nn.Module, n: int, device: torch.device):
        self.row, self.n = row, n
        self.micro: list[float] = []
        self.step: list[float] = []
        self.window: list[float] = []
        self.error: str | None = None
        self.model = _fresh(base, device)
        self.state = None
        try:
            self.state = SETUPS[row](self.model, n) if row else None
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the others go on
            self.error = f"{type(exc).__name__}: {str(exc)[:300]}"

    def run_window(self, window: torch.Tensor, device: torch.device, keep: bool) -> None:
        """One window: each micro-batch's fwd+bwd (+ moving its gradients) timed, then the
        step."""
        micro = []
        _sync(device)
        t0 = time.perf_counter()
        for x in _splits(window, self.n):
            ta = time.perf_counter()
            if self.state is None:
                self.model.zero_grad(set_to_none=True)  # autograd stores the gradient, no add
            loss_of(self.model, x, self.n).backward()
            if self.state is not None:
                self.state.after_backward()
            _sync(device)
            micro.append((time.perf_counter() - ta) * 1e3)
        t1 = time.perf_counter()
        if self.state is not None:
            self.state.step()
        _sync(device)
        t2 = time.perf_counter()
        if keep:
            self.micro += micro
            self.step.append((t2 - t1) * 1e3)
            self.window.append((t2 - t0) * 1e3)

    def timing(self, batch: int) -> dict:
        total_s = sum(self.window) / 1e3
        return {"ms_per_microbatch": statistics.median(self.micro), "microbatch_ms": self.micro,
                "step_ms": statistics.median(self.step),
                "ms_per_window": statistics.median(self.window), "window_ms": self.window,
                "time_s": total_s, "samples_per_s": batch * len(self.window) / total_s}

    def close(self) -> None:
        if self.state is not None:
            self.state.close()
        self.state = self.model = None


def time_interleaved(rows: list[str], base: torch.nn.Module, data: list[torch.Tensor], n: int,
                     warmup: int, device: torch.device) -> tuple[Entry, list[Entry]]:
    """Every row and the reference, each with its own model copy, one window each per
    repetition in rotating order (round-robin), so that load on a shared machine falls on all
    of them alike; the first ``warmup`` windows are not kept."""
    reference = Entry(None, base, n, device)
    entries = [Entry(r, base, 1 if r == "large_batch" else n, device) for r in rows]
    for rep, window in enumerate(data):
        live = [e for e in [reference, *entries] if e.error is None]
        k = rep % max(len(live), 1)
        for e in live[k:] + live[:k]:
            try:
                e.run_window(window, device, keep=rep >= warmup)
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the others go on
                e.error = f"{type(exc).__name__}: {str(exc)[:300]}"
        _log(f"repetition {rep + 1}/{len(data)}" + (" (warm-up)" if rep < warmup else ""))
    for e in [reference, *entries]:
        e.close()
    return reference, entries


NOISE_Z = 2.0  # the noise bound in standard errors of the difference (about 95 %)


def median_se(xs: list[float]) -> float:
    """The standard error of a sample's median: 1.2533 sigma / sqrt(n), sigma from the
    interquartile range (robust to the outliers a loaded machine adds); inf below 2 samples."""
    if len(xs) < 2:
        return math.inf
    p25, p75 = quantiles(xs, (0.25, 0.75))
    return 1.2533 * (p75 - p25) / 1.349 / math.sqrt(len(xs))


def accumulation_share(row_ms: list[float], ref_ms: list[float], z: float = NOISE_Z) -> dict:
    """What accumulation adds to a micro-batch: the difference of the medians of the row's and
    the reference's micro-batch times (interleaved), against a noise bound of ``z`` standard
    errors of that difference. The share is reported only when the difference exceeds the
    bound (``accum_verdict`` "measured"); within it the verdict is "below noise", and a row
    faster than the reference by more than it (fused weight gradients) is "below reference":
    the share is then None, never negative."""
    mine, ref = statistics.median(row_ms), statistics.median(ref_ms)
    diff = mine - ref
    noise = z * math.sqrt(median_se(row_ms) ** 2 + median_se(ref_ms) ** 2)
    verdict = ("measured" if diff > noise else
               "below reference" if diff < -noise else "below noise")
    return {"accum_ms": diff, "noise_ms": noise,
            "accum_share": diff / mine if verdict == "measured" else None,
            "noise_share": noise / mine if mine > 0 else None, "accum_verdict": verdict}


def peak_gpu_bytes(row: str, base: torch.nn.Module, data: list[torch.Tensor], n: int,
                   device: torch.device) -> int:
    """GPU: ``max_memory_allocated`` over two windows of the row alone (the first step
    allocates the optimizer state), above what was allocated before its model copy."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    entry = Entry(row, base, n, device)
    if entry.error:
        raise RuntimeError(entry.error)
    for window in data[:2]:
        entry.run_window(window, device, keep=False)
    entry.close()
    return torch.cuda.max_memory_allocated(device) - before


def peak_live_bytes(row: str, base: torch.nn.Module, data: list[torch.Tensor], n: int
                    ) -> int:
    """CPU: peak live tensor bytes over (up to) two windows of the row, model copy included.

    Measured as live tensor bytes (accumbench.tally.LiveTensorBytes) rather than as the peak RSS
    of a subprocess per row above a baseline process: it counts exactly what the GPU column
    counts (tensors, not the interpreter, libraries or malloc's free lists), it is exact for
    models whose whole footprint is a few MB (the CPU default), where RSS noise would swamp
    the differences between rows, and it costs no process start per row. What it cannot see
    (memory an op's kernel uses internally) is transient and small for these models. The mode
    slows every op down, hence a pass of its own, outside the timing.
    """
    gc.collect()
    with LiveTensorBytes() as live:
        model = copy.deepcopy(base)
        state = SETUPS[row](model, n)
        for window in data[:2]:  # the first step allocates the optimizer state
            for x in _splits(window, n):
                loss_of(model, x, n).backward()
                state.after_backward()
            state.step()
        state.close()
        del state, model
    return live.peak


def verify_row(row: str, base: torch.nn.Module, window: torch.Tensor, n: int, kind: str,
               device: torch.device) -> dict:
    """Relative error of the row's accumulated gradient vs the float64 sum of micro-batch grads."""
    model = _fresh(base, device)
    named = dict(model.named_parameters())
    names = verified_param_names(model, kind)
    micro = _splits(window, n)
    # recomputed reference: the same weights and micro-batches, no row state attached yet
    recomputed = {name: torch.zeros(named[name].shape, dtype=torch.float64, device=device)
                  for name in names}
    for x in micro:
        grads = torch.autograd.grad(loss_of(model, x, n), [named[m] for m in names])
        for name, g in zip(names, grads):
            recomputed[name] += g.double()
    captured: dict[str, list[torch.Tensor]] = {name: [] for name in names}

    def capture(name: str, g: torch.Tensor | None) -> None:
        if g is not None:  # a fused layer's weight may see None: it has no gradient to show
            captured[name].append(g.double())

    hooks = [named[name].register_hook(lambda g, name=name: capture(name, g)) for name in names]
    state = SETUPS[row](model, 1 if row == "large_batch" else n)
    if row == "large_batch":
        loss_of(model, window, 1).backward()
    else:
        for x in micro:
            loss_of(model, x, n).backward()
            state.after_backward()
    errors, reference = {}, {}
    for name in names:
        got = state.accumulated(named[name])
        hooked = row != "large_batch" and len(captured[name]) == n
        ref = torch.stack(captured[name]).sum(0) if hooked else recomputed[name]
        reference[name] = "hooks" if hooked else "recomputed"
        errors[name] = None if got is None else float(
            (got.double() - ref).norm() / ref.norm().clamp_min(1e-300))
    for h in hooks:
        h.remove()
    state.close()
    def worst(kind: str | None) -> float | None:
        known = [e for n, e in errors.items() if e is not None and kind in (None, reference[n])]
        return max(known) if known else None

    return {"rel_err": worst(None), "rel_err_hooks": worst("hooks"),
            "rel_err_recomputed": worst("recomputed"), "rel_err_by_param": errors,
            "reference_by_param": reference,
            "fused_layers": getattr(getattr(state, "handle", None), "num_layers", None)}


# --- command line ---------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    p.add_argument("--n-layer", type=int, help="12 on GPU (GPT-2 small), 2 on CPU")
    p.add_argument("--n-embd", type=int, help="768 on GPU, 64 on CPU")
    p.add_argument("--n-head", type=int, help="12 on GPU, 4 on CPU")
    p.add_argument("--vocab", type=int, help="50257 (gpt2) / 32000 (llama) on GPU, 256 on CPU")
    p.add_argument("--seq", type=int, help="tokens per sample: 1024 on GPU, 32 on CPU")
    p.add_argument("--batch-size", type=int, help="B, the large batch: 16 on GPU, 8 on CPU")
    p.add_argument("--accumulation-steps", type=int, default=4, help="N (default 4)")
    p.add_argument("--steps", type=int,
                   help="timed optimizer steps (windows) per row: 20 GPU, 8 CPU (2 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed steps first: 2 GPU, 1 CPU")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads (default 1 on CPU, where a tiny model's ops wait "
                        "for a second core's wake-up on a shared box; torch's on GPU; 0 = torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run: a smoke test")
    p.add_argument("--out", type=Path, help="also write this run's record as JSON here")
    results.add_arguments(p, "train")
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda" and not args.quick
    defaults = {"n_layer": (12, 2), "n_embd": (768, 64), "n_head": (12, 4), "seq": (1024, 32),
                "batch_size": (16, 8), "steps": (20, 2 if args.quick else 8), "warmup": (2, 1),
                "vocab": (50257 if args.model == "gpt2" else 32000, 256)}
    for key, (on_gpu, small) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else small)
    if args.threads is None:
        args.threads = 0 if torch.device(args.device).type == "cuda" else 1
    n = args.accumulation_steps
    if n < 1 or args.batch_size % n:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of "
                f"--accumulation-steps {n}")
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.rows:
        if r not in ROWS:
            p.error(f"unknown row {r!r} (choose from {', '.join(ROWS)})")
    return args


def finish_row(entry: Entry, reference: Entry, base, data, args, device) -> dict:
    """A row's record: its interleaved timing, its accumulation share against the reference,
    then (own passes) its peak memory and the gradient check."""
    row, n = entry.row, entry.n
    out = {"row": row, "micro_batch_size": args.batch_size // n, "accumulation_steps": n,
           "status": "ok", "error": entry.error}
    try:
        if entry.error:
            raise RuntimeError(entry.error)
        out.update(entry.timing(args.batch_size))
        if n > 1:  # the large batch accumulates nothing: no share
            out.update(accumulation_share(entry.micro, reference.micro))
        out["peak_mem_bytes"] = (peak_gpu_bytes(row, base, data, n, device)
                                 if device.type == "cuda" else
                                 peak_live_bytes(row, base, data, n))
        out.update(verify_row(row, base, data[0], args.accumulation_steps, args.model, device))
    except Exception as exc:  # noqa: BLE001 - recorded, the next row runs
        out.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return out


def _share_cell(r: dict) -> str:
    verdict = r.get("accum_verdict")
    if verdict == "measured":
        return f"{r['accum_share']:.1%}±{r['noise_share']:.1%}"
    return {"below noise": "below noise", "below reference": "< reference"}.get(verdict, "-")


def format_table(record: dict) -> str:
    c = record["config"]
    head = (f"{c['model']} ({c['n_layer']} layers, d={c['n_embd']}, {c['params'] / 1e6:.1f}M "
            f"params), bf16, seq {c['seq']}, batch {c['batch_size']} (accumulation: "
            f"{c['batch_size'] // c['accumulation_steps']} x {c['accumulation_steps']}), "
            f"{c['steps']} timed steps, rows and reference interleaved, "
            f"{record['environment']['device_name']}" + (f"; {c['note']}" if c.get("note") else ""))
    ref = record["reference"]["ms_per_microbatch"]
    lines = [head, (f"fwd+bwd without accumulation (the reference): {ref:.2f} ms per "
                    "micro-batch (median)"), "",
             (f"{'row':<26} {'time s':>8} {'samples/s':>10} {'peak MB':>9} {'B/param':>8} "
              f"{'ms/micro':>9} {'step ms':>8} {'accum share':>13} {'err hooks':>9} "
              f"{'err recomp':>10}")]
    for r in record["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['row']:<26} {r['status']}: {r['error']}")
            continue
        peak = r.get("peak_mem_bytes")
        per = f"{peak / c['params']:8.1f}" if peak is not None else "-"
        peak = f"{peak / 1e6:9.1f}" if peak is not None else "-"
        hooks, recomp = (f"{r[k]:.2e}" if r[k] is not None else "-"
                         for k in ("rel_err_hooks", "rel_err_recomputed"))
        lines.append(f"{r['row']:<26} {r['time_s']:8.2f} {r['samples_per_s']:10.1f} {peak:>9} "
                     f"{per:>8} {r['ms_per_microbatch']:9.2f} {r['step_ms']:8.2f} "
                     f"{_share_cell(r):>13} {hooks:>9} {recomp:>10}")
    method = c.get("peak_mem_method") or "torch.cuda.max_memory_allocated"
    lines += ["", FOOTNOTE, f"peak MB (1e6 bytes): {method}", SHARE_NOTE]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    base = make_model(args.model, args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    data = [torch.randint(args.vocab, (args.batch_size, args.seq), generator=gen).to(device)
            for _ in range(args.warmup + args.steps)]
    rows_wanted = [r for r in args.rows if r in available_rows()]
    _log(f"timing {len(rows_wanted)} rows and the reference, interleaved ...")
    ref, entries = time_interleaved(rows_wanted, base, data, args.accumulation_steps,
                                    args.warmup, device)
    if ref.error:
        _log(f"error: the reference failed: {ref.error}")
        return 1
    rows = []
    for entry in entries:
        _log(f"{entry.row}: peak memory and the gradient check ...")
        rows.append(finish_row(entry, ref, base, data, args, device))
    env = environment(device)
    record = {"benchmark": "train", "schema_version": 2, "environment": env,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv),
              "config": {"model": args.model, "n_layer": args.n_layer, "n_embd": args.n_embd,
                         "n_head": args.n_head, "vocab": args.vocab, "seq": args.seq,
                         "batch_size": args.batch_size,
                         "accumulation_steps": args.accumulation_steps, "steps": args.steps,
                         "warmup": args.warmup, "params": n_params, "dtype": "bf16",
                         "optimizer": f"AdamW(lr={LR})", "seed": args.seed, "quick": args.quick,
                         "verified_params": verified_param_names(base, args.model),
                         "peak_mem_method": PEAK_METHOD[device.type == "cuda"],
                         "timing": "rows and the reference interleaved, one window each per "
                                   "repetition in rotating order; every micro-batch timed",
                         "noise_z": NOISE_Z, "threads": torch.get_num_threads(),
                         "note": args.note},
              "reference": ref.timing(args.batch_size), "rows": rows,
              "elapsed_s": time.perf_counter() - started}
    saved = results.save("train", record, args)
    print(format_table(record))
    print("\n" + summary.format_summary({"train": record}), flush=True)
    _log((f"appended a row to {saved}" if saved else "no row appended (--quick/--no-results)")
         + (f"; wrote {args.out}" if args.out else "") + f" ({record['elapsed_s']:.1f} s)")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
