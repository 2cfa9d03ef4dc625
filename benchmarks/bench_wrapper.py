"""Per-micro-batch cost and peak memory of AccumulatingOptimizer vs native accumulation.

    python -m benchmarks.accumbench wrapper [--device cuda] [--quick] [--note TEXT] [--out PATH]

Model: a stack of GPT-2 MLP blocks (Linear(d, 4d), GELU, Linear(4d, d)) in bf16. Each provider
runs windows of N micro-batches (forward + backward + moving the gradients; no optimizer step),
timed as wall time per micro-batch (host overhead included). Providers, each on its own copy of
the model, one window each per repetition in rotating order (round-robin), after one warm-up
window:

* ``native_bf16``: autograd accumulates into the bf16 ``.grad`` (PyTorch's default);
* ``main_grad_loop``: Megatron-style fp32 buffers, ``p.main_grad.add_(p.grad)`` per param after
  each backward, then ``p.grad = None``;
* ``accumkernels``: AccumulatingOptimizer (``master_weights=False``: the fp32 window only),
  bucketed fused launches from the post-accumulate-grad hooks, bf16 grads freed per bucket.

Peak memory, in a pass of its own per provider (two windows), above the model and the inputs:
on a GPU ``torch.cuda.max_memory_allocated`` - ``memory_allocated`` before the provider's state;
on the CPU the peak RSS growth of a fresh process per provider (accumbench/peakmem.py). The
contract's target is peak <= native_bf16 + 4 B/param (``extra B/param``). The run is appended as
a tagged row to benchmarks/results/wrapper.jsonl.
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
from benchmarks.accumbench import peakmem, results, summary
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.workloads import mlp_stack

PROVIDERS = ("native_bf16", "main_grad_loop", "accumkernels")
GOAL_EXTRA_BYTES = 4.0  # per param over native bf16: the fp32 window


def make_model(width: int, blocks: int, device: torch.device) -> torch.nn.Module:
    return mlp_stack(width, blocks, device)


class Native:
    def __init__(self, model):
        self.model = model

    def after_backward(self):
        pass

    def end_window(self):
        self.model.zero_grad(set_to_none=True)

    def close(self):
        pass


class MainGradLoop(Native):
    def __init__(self, model):
        super().__init__(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.main_grads = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    def after_backward(self):
        for p, g in zip(self.params, self.main_grads):
            g.add_(p.grad)
            p.grad = None

    def end_window(self):
        for g in self.main_grads:
            g.zero_()


class Wrapper(Native):
    def __init__(self, model):
        super().__init__(model)
        inner = torch.optim.SGD(model.parameters(), lr=0.0)
        self.opt = accumkernels.AccumulatingOptimizer(inner, master_weights=False)

    def end_window(self):
        self.opt.reset_window()

    def close(self):
        self.opt.remove_hooks()


STATES = {"native_bf16": Native, "main_grad_loop": MainGradLoop, "accumkernels": Wrapper}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_window(state, inputs, device) -> float:
    """One window of ``inputs``; ms per micro-batch."""
    _sync(device)
    t0 = time.perf_counter()
    for x in inputs:
        state.model(x).float().square().mean().backward()
        state.after_backward()
    _sync(device)
    ms = (time.perf_counter() - t0) * 1e3 / len(inputs)
    state.end_window()
    return ms


def time_providers(names, model, inputs, windows, device) -> dict[str, list[float]]:
    """Round-robin over the providers, each on its own copy of ``model``; window 0 warms up."""
    states = {n: STATES[n](copy.deepcopy(model)) for n in names}
    times: dict[str, list[float]] = {n: [] for n in names}
    for w in range(windows + 1):
        k = w % len(names)
        for n in names[k:] + names[:k]:
            ms = run_window(states[n], inputs, device)
            if w:
                times[n].append(ms)
    for s in states.values():
        s.close()
    return times


def build(cfg: dict, device: torch.device) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    torch.manual_seed(cfg["seed"])
    model = make_model(cfg["width"], cfg["layers"], device)
    inputs = [torch.randn(cfg["tokens"], cfg["width"], device=device, dtype=torch.bfloat16)
              for _ in range(cfg["microbatches"])]
    return model, inputs


def peak_gpu(name: str, cfg: dict, device: torch.device) -> tuple[int, str]:
    model, inputs = build(cfg, device)
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    state = STATES[name](model)
    for _ in range(2):
        run_window(state, inputs, device)
    peak = torch.cuda.max_memory_allocated(device) - base
    state.close()
    return peak, "torch.cuda.max_memory_allocated - memory_allocated before the provider's state"


def peak_child(name: str, cfg: dict) -> None:
    """In the fresh process: the model and inputs, the mark, two windows, the growth."""
    torch.set_num_threads(cfg["threads"])
    model, inputs = build(cfg, torch.device("cpu"))
    gc.collect()
    m = peakmem.mark()
    state = STATES[name](model)
    for _ in range(2):
        run_window(state, inputs, torch.device("cpu"))
    peak, method = peakmem.growth(m)
    peakmem.emit({"peak_bytes": peak, "method": method})


def peak_bytes(name: str, cfg: dict, device: torch.device) -> tuple[int, str]:
    if device.type == "cuda":
        return peak_gpu(name, cfg, device)
    got = peakmem.run_child("benchmarks.bench_wrapper", ["--peak-child", name,
                                                         "--config", json.dumps(cfg)])
    return got["peak_bytes"], got["method"]


def format_table(record: dict) -> str:
    c = record["config"]
    lines = [(f"MLP stack {c['layers']}x(d={c['width']}), {c['params'] / 1e6:.1f}M params, "
              f"{c['tokens']} tokens/micro-batch, {c['microbatches']} micro-batches, "
              f"{record['environment']['device_name']}; median of {c['windows']} interleaved "
              "windows") + (f"; {c['note']}" if c.get("note") else ""),
             (f"{'provider':16} {'ms/micro-batch':>14} {'overhead':>9} {'peak MB':>9} "
              f"{'extra B/param':>13}")]
    for r in record["rows"]:
        peak, extra = r["peak_bytes_above_model"], r.get("extra_bytes_per_param_vs_native")
        lines.append(f"{r['provider']:16} {r['ms_per_microbatch']:14.3f} "
                     f"{r['overhead_vs_native']:9.1%} "
                     + (f"{peak / 1e6:9.2f}" if peak is not None else f"{'-':>9}") + " "
                     + (f"{extra:13.2f}" if extra is not None else f"{'-':>13}"))
    lines.append(f"peak MB (1e6 bytes) above the model and inputs: {c['peak_method']}; extra "
                 f"B/param: vs native_bf16 (goal <= {GOAL_EXTRA_BYTES:g})")
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.accumbench wrapper",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="768 (GPT-2) on GPU, 256 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="12 on GPU, 4 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--threads", type=int,
                        help="torch.set_num_threads (default 1 on CPU, torch's on GPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write this run's record as JSON here")
    parser.add_argument("--peak-child", choices=PROVIDERS, help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    results.add_arguments(parser, "wrapper")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.peak_child:
        peak_child(args.peak_child, json.loads(args.config))
        return 0
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    threads = args.threads or (torch.get_num_threads() if gpu else 1)
    torch.set_num_threads(threads)
    cfg = {"width": args.width or (64 if args.quick else 768 if gpu else 256),
           "layers": 2 if args.quick else args.layers or (12 if gpu else 4),
           "tokens": args.tokens or (32 if args.quick else 4096 if gpu else 256),
           "microbatches": 2 if args.quick else args.microbatches, "seed": args.seed,
           "threads": threads}
    windows = 2 if args.quick else args.windows
    model, inputs = build(cfg, device)
    n_params = sum(p.numel() for p in model.parameters())
    print("[bench_wrapper] timing, interleaved ...", file=sys.stderr, flush=True)
    times = time_providers(list(PROVIDERS), model, inputs, windows, device)
    del model, inputs
    rows, method = [], None
    for name in PROVIDERS:
        print(f"[bench_wrapper] {name}: peak memory ...", file=sys.stderr, flush=True)
        peak, method = peak_bytes(name, cfg, device)
        rows.append({"provider": name, "ms_per_microbatch": statistics.median(times[name]),
                     "min_ms": min(times[name]), "times_ms": times[name],
                     "peak_bytes_above_model": peak})
    native = rows[0]
    for r in rows:
        r["overhead_vs_native"] = r["ms_per_microbatch"] / native["ms_per_microbatch"] - 1
        r["extra_bytes_per_param_vs_native"] = (
            (r["peak_bytes_above_model"] - native["peak_bytes_above_model"]) / n_params)
    record = {"benchmark": "wrapper", "schema_version": 2, "environment": environment(device),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv),
              "config": {**cfg, "windows": windows, "params": n_params, "quick": args.quick,
                         "peak_method": method, "note": args.note,
                         "timing": "providers interleaved, one window each per repetition"},
              "rows": rows}
    saved = results.save("wrapper", record, args)
    print(format_table(record))
    print("\n" + summary.format_summary({"wrapper": record}), flush=True)
    print((f"appended a row to {saved}" if saved else "no row appended (--quick/--no-results)")
          + (f"; wrote {args.out}" if args.out else ""), file=sys.stderr)
    return 0


def test_bench_wrapper_quick(tmp_path):
    """Smoke test (no timing assertions): every provider runs and the JSON is complete."""
    out = tmp_path / "wrapper.json"
    assert main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["provider"] for r in record["rows"]] == list(PROVIDERS)
    assert all(r["ms_per_microbatch"] > 0 for r in record["rows"])
    assert all(r["peak_bytes_above_model"] is not None for r in record["rows"])
    assert record["environment"]["torch"] == torch.__version__


if __name__ == "__main__":
    sys.exit(main())
