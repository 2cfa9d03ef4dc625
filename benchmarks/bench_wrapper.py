"""Per-micro-batch cost and peak memory of AccumulatingOptimizer vs native accumulation.

    python -m benchmarks.bench_wrapper [--device cuda] [--quick] [--out PATH]

Model: a stack of GPT-2 MLP blocks (Linear(d, 4d), GELU, Linear(4d, d)) in bf16. Each provider
runs windows of N micro-batches (forward + backward + moving the gradients; no optimizer step),
timed as wall time per micro-batch (host overhead included). Providers:

* ``native_bf16``: autograd accumulates into the bf16 ``.grad`` (PyTorch's default);
* ``main_grad_loop``: Megatron-style fp32 buffers, ``p.main_grad.add_(p.grad)`` per param after
  each backward, then ``p.grad = None``;
* ``accumkernels``: AccumulatingOptimizer with accumulate_in_backward=True (bucketed fused
  launches from the post-accumulate-grad hooks, bf16 grads freed per bucket).

Peak memory (GPU only) is counted above the model and the inputs; the contract's target is
peak <= native_bf16 + 4 B/param. Results go to benchmarks/results/ as JSON.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench.env import default_out_path, environment
from benchmarks.accumbench.workloads import mlp_stack

PROVIDERS = ("native_bf16", "main_grad_loop", "accumkernels")


def make_model(width: int, blocks: int, device: torch.device) -> torch.nn.Module:
    return mlp_stack(width, blocks, device)


class Native:
    def __init__(self, model):
        self.model = model

    def after_backward(self):
        pass

    def end_window(self):
        self.model.zero_grad(set_to_none=True)


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


def run_provider(name, model, inputs, windows, device):
    state = {"native_bf16": Native, "main_grad_loop": MainGradLoop, "accumkernels": Wrapper}[name](model)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times = []
    for w in range(windows + 1):  # window 0 warms up
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for x in inputs:
            model(x).float().square().mean().backward()
            state.after_backward()
        if cuda:
            torch.cuda.synchronize(device)
        if w:
            times.append((time.perf_counter() - t0) * 1e3 / len(inputs))
        state.end_window()
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    if hasattr(state, "close"):
        state.close()
    del state
    return {"provider": name, "ms_per_microbatch": statistics.median(times),
            "min_ms": min(times), "peak_bytes_above_model": peak}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="768 (GPT-2) on GPU, 256 on CPU")
    parser.add_argument("--layers", type=int, default=None, help="12 on GPU, 4 on CPU")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per micro-batch")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    width = args.width or (64 if args.quick else 768 if gpu else 256)
    layers = 2 if args.quick else args.layers or (12 if gpu else 4)
    tokens = args.tokens or (32 if args.quick else 4096 if gpu else 256)
    windows = 2 if args.quick else args.windows
    n_micro = 2 if args.quick else args.microbatches

    torch.manual_seed(0)
    model = make_model(width, layers, device)
    n_params = sum(p.numel() for p in model.parameters())
    inputs = [torch.randn(tokens, width, device=device, dtype=torch.bfloat16) for _ in range(n_micro)]
    rows = []
    for name in PROVIDERS:
        print(f"[bench_wrapper] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_provider(name, model, inputs, windows, device))
    native = rows[0]
    for r in rows:
        r["overhead_vs_native"] = r["ms_per_microbatch"] / native["ms_per_microbatch"] - 1
        if r["peak_bytes_above_model"] is not None:
            extra = r["peak_bytes_above_model"] - native["peak_bytes_above_model"]
            r["extra_bytes_per_param_vs_native"] = extra / n_params

    record = {"benchmark": "wrapper", "environment": environment(device),
              "date": datetime.date.today().isoformat(), "argv": sys.argv[1:],
              "config": {"width": width, "layers": layers, "tokens": tokens,
                         "microbatches": n_micro, "windows": windows, "params": n_params},
              "rows": rows}
    out = args.out or default_out_path("wrapper-" + record["environment"]["device_slug"],
                                       datetime.date.today(), False, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"MLP stack {layers}x(d={width}), {n_params / 1e6:.1f}M params, {tokens} tokens/micro-batch, "
          f"{n_micro} micro-batches, {record['environment']['device_name']}")
    print(f"{'provider':16} {'ms/micro-batch':>14} {'overhead':>9} {'peak MB':>9} {'extra B/param':>13}")
    for r in rows:
        peak = r["peak_bytes_above_model"]
        extra = r.get("extra_bytes_per_param_vs_native")
        print(f"{r['provider']:16} {r['ms_per_microbatch']:14.3f} {r['overhead_vs_native']:9.1%} "
              f"{peak / 2**20 if peak is not None else float('nan'):9.1f} "
              f"{extra if extra is not None else float('nan'):13.2f}")
    print(f"wrote {out}")
    return 0


def test_bench_wrapper_quick(tmp_path):
    """Smoke test (no timing assertions): every provider runs and the JSON is complete."""
    out = tmp_path / "wrapper.json"
    assert main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["provider"] for r in record["rows"]] == list(PROVIDERS)
    assert all(r["ms_per_microbatch"] > 0 for r in record["rows"])
    assert record["environment"]["torch"] == torch.__version__


if __name__ == "__main__":
    sys.exit(main())
