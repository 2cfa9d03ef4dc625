"""End-to-end training: one large batch vs gradient accumulation (the classic single-GPU table).

    python -m benchmarks.bench_train [--device cuda] [--model gpt2|llama] [--quick] [--out PATH]

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

Extra columns. ``accum share``: (ms per micro-batch of the row - ms per micro-batch of a
fwd+bwd that accumulates nothing) / ms per micro-batch of the row; the reference sets ``.grad``
to None before every backward, so autograd stores each gradient without adding. It is a
difference of two medians: small values are within noise, and a negative one means the row's
backward is cheaper than the plain one (fused weight-gradient GEMMs). ``rel err``: for a few
params, ||accumulated - Σ gᵢ|| / ||Σ gᵢ||, with Σ gᵢ the float64 sum of the per-micro-batch
gradients, measured in a separate verification pass: captured with tensor hooks from the very
backward passes the row accumulates, or (large batch; weights whose gradient a fused layer
never materialises) recomputed with ``torch.autograd.grad`` on the same weights and batches.
``peak MB``: on a GPU ``torch.cuda.max_memory_allocated`` over the timed windows; on the CPU,
which has no allocator statistics, the peak of live tensor bytes over two windows of the row
run in a separate pass (see ``peak_live_bytes``). Both include the model copy and the optimizer
state. JSON goes to benchmarks/results/train-<device-slug>-<date>[-quick].json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench.env import default_out_path, environment
from benchmarks.accumbench.report import json_safe
from benchmarks.accumbench.tally import LiveTensorBytes

FOOTNOTE = ("err hooks: vs the float64 sum of the bf16 gradients the row itself accumulated; "
            "err recomp: vs recomputed bf16 gradients\n(large batch: a different computation; "
            "fused weights: the fused GEMM never rounds a micro-batch's gradient to bf16, the "
            "reference does)")
ROWS = ("large_batch", "native_bf16", "main_grad_fp32", "accumkernels",
        "accumkernels+fused_wgrad")
LR = 1e-4
PEAK_METHOD = {True: "torch.cuda.max_memory_allocated over the timed windows",
               False: "peak live tensor bytes over two windows (LiveTensorBytes, own pass)"}


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


def time_row(row: str | None, base: torch.nn.Module, data: list[torch.Tensor], n: int,
             warmup: int, device: torch.device) -> dict:
    """Timed windows of one row (``None``: the no-accumulation fwd+bwd reference, no step)."""
    model = _fresh(base, device)
    state = SETUPS[row](model, n) if row else None
    micro_ms, step_ms, window_ms = [], [], []
    for w, window in enumerate(data):
        _sync(device)
        t0 = time.perf_counter()
        for x in _splits(window, n):
            if state is None:
                model.zero_grad(set_to_none=True)  # autograd stores the gradient, adds nothing
            loss_of(model, x, n).backward()
            if state is not None:
                state.after_backward()
        _sync(device)
        t1 = time.perf_counter()
        if state is not None:
            state.step()
        _sync(device)
        t2 = time.perf_counter()
        if w >= warmup:
            micro_ms.append((t1 - t0) * 1e3 / n)
            step_ms.append((t2 - t1) * 1e3)
            window_ms.append((t2 - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    if state is not None:
        state.close()
    del state, model
    batch = data[0].shape[0]
    total_s = sum(window_ms) / 1e3
    return {"ms_per_microbatch": statistics.median(micro_ms), "step_ms": statistics.median(step_ms),
            "ms_per_window": statistics.median(window_ms), "time_s": total_s,
            "samples_per_s": batch * len(window_ms) / total_s, "peak_mem_bytes": peak}


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
                   help="timed optimizer steps per row: 20 GPU, 3 CPU (1 with --quick)")
    p.add_argument("--warmup", type=int, help="untimed steps first: 2 GPU, 1 CPU")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny CPU-sized run: a smoke test")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda" and not args.quick
    defaults = {"n_layer": (12, 2), "n_embd": (768, 64), "n_head": (12, 4), "seq": (1024, 32),
                "batch_size": (16, 8), "steps": (20, 1 if args.quick else 3), "warmup": (2, 1),
                "vocab": (50257 if args.model == "gpt2" else 32000, 256)}
    for key, (on_gpu, small) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, on_gpu if gpu else small)
    n = args.accumulation_steps
    if n < 1 or args.batch_size % n:
        p.error(f"--batch-size {args.batch_size} must be a positive multiple of "
                f"--accumulation-steps {n}")
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.rows:
        if r not in ROWS:
            p.error(f"unknown row {r!r} (choose from {', '.join(ROWS)})")
    return args


def run_row(row, base, data, args, device) -> dict:
    n = 1 if row == "large_batch" else args.accumulation_steps
    out = {"row": row, "micro_batch_size": args.batch_size // n, "accumulation_steps": n,
           "status": "ok", "error": None}
    try:
        out.update(time_row(row, base, data, n, args.warmup, device))
        if device.type == "cpu":
            out["peak_mem_bytes"] = peak_live_bytes(row, base, data, n)
        out.update(verify_row(row, base, data[0], args.accumulation_steps, args.model, device))
    except Exception as exc:  # noqa: BLE001 - recorded, the next row runs
        out.update(status="error", error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return out


def format_table(record: dict) -> str:
    c = record["config"]
    head = (f"{c['model']} ({c['n_layer']} layers, d={c['n_embd']}, {c['params'] / 1e6:.1f}M "
            f"params), bf16, seq {c['seq']}, batch {c['batch_size']} (accumulation: "
            f"{c['batch_size'] // c['accumulation_steps']} x {c['accumulation_steps']}), "
            f"{c['steps']} timed steps, {record['environment']['device_name']}")
    ref = record["reference"]["ms_per_microbatch"]
    lines = [head, f"fwd+bwd without accumulation: {ref:.2f} ms per micro-batch", "",
             f"{'row':<26} {'time s':>8} {'samples/s':>10} {'peak MB':>9} {'ms/micro':>9} "
             + f"{'step ms':>8} {'accum share':>11} {'err hooks':>9} {'err recomp':>10}"]
    for r in record["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['row']:<26} {r['status']}: {r['error']}")
            continue
        peak = f"{r['peak_mem_bytes'] / 1e6:9.1f}" if r["peak_mem_bytes"] is not None else "-"
        share = f"{r['accum_share']:11.1%}" if r.get("accum_share") is not None else "-"
        hooks, recomp = (f"{r[k]:.2e}" if r[k] is not None else "-"
                         for k in ("rel_err_hooks", "rel_err_recomputed"))
        lines.append(f"{r['row']:<26} {r['time_s']:8.2f} {r['samples_per_s']:10.1f} {peak:>9} "
                     f"{r['ms_per_microbatch']:9.2f} {r['step_ms']:8.2f} {share:>11} "
                     f"{hooks:>9} {recomp:>10}")
    method = c.get("peak_mem_method") or "torch.cuda.max_memory_allocated"
    lines += ["", FOOTNOTE, f"peak MB (1e6 bytes): {method}"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    base = make_model(args.model, args.n_layer, args.n_embd, args.n_head, args.vocab, args.seq)
    n_params = sum(p.numel() for p in base.parameters())
    gen = torch.Generator().manual_seed(args.seed)
    data = [torch.randint(args.vocab, (args.batch_size, args.seq), generator=gen).to(device)
            for _ in range(args.warmup + args.steps)]
    rows_wanted = [r for r in args.rows if r in available_rows()]
    _log("reference: fwd+bwd without accumulation ...")
    reference = time_row(None, base, data, args.accumulation_steps, args.warmup, device)
    rows = []
    for row in rows_wanted:
        _log(f"{row} ...")
        r = run_row(row, base, data, args, device)
        if r["status"] == "ok" and r["accumulation_steps"] > 1:
            r["accum_ms"] = r["ms_per_microbatch"] - reference["ms_per_microbatch"]
            r["accum_share"] = r["accum_ms"] / r["ms_per_microbatch"]
        rows.append(r)
    env = environment(device)
    record = {"benchmark": "train", "schema_version": 1, "environment": env,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv),
              "config": {"model": args.model, "n_layer": args.n_layer, "n_embd": args.n_embd,
                         "n_head": args.n_head, "vocab": args.vocab, "seq": args.seq,
                         "batch_size": args.batch_size,
                         "accumulation_steps": args.accumulation_steps, "steps": args.steps,
                         "warmup": args.warmup, "params": n_params, "dtype": "bf16",
                         "optimizer": f"AdamW(lr={LR})", "seed": args.seed, "quick": args.quick,
                         "verified_params": verified_param_names(base, args.model),
                         "peak_mem_method": PEAK_METHOD[device.type == "cuda"]},
              "reference": reference, "rows": rows}
    out = args.out or default_out_path("train-" + env["device_slug"], datetime.date.today(),
                                       False, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(record), indent=1) + "\n")
    print(format_table(record))
    _log(f"wrote {out}")
    return 1 if any(r["status"] != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
