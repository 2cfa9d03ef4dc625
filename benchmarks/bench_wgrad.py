"""Fused weight-gradient accumulation (fuse_wgrad_accumulation) vs the unfused wrapper.

    python -m benchmarks.bench_wgrad [--device cuda] [--quick] [--out PATH]

Model: GPT-2 MLP block(s) (Linear(d, 4d), GELU, Linear(4d, d); d=768 on GPU) in bf16, 4096
tokens per micro-batch on GPU. Each provider runs windows of N micro-batches (forward + backward
+ moving the gradients; no optimizer step), timed as wall time per micro-batch:

* ``native_bf16``: plain autograd, bf16 ``.grad`` accumulation (PyTorch's default);
* ``unfused``: AccumulatingOptimizer (accumulate_in_backward=True, master_weights=False): the
  bf16 weight gradient is computed, then moved into the fp32 buffer by a bucketed launch;
* ``fused``: the same wrapper + ``fuse_wgrad_accumulation``: one fp32-output GEMM per weight
  accumulates straight into the buffer; only the biases take the bucketed launch.

Reported per provider: ms per micro-batch (median over windows) and its overhead vs native;
peak memory above the model and inputs (GPU; the wrapper's fp32 buffer, 4 B/param, is included)
and the difference to native in bytes per param (fused should be ~2 B/param below unfused: no
bf16 weight gradient); and, from one extra window run under ``torch.profiler`` (device time on
GPU, CPU time on CPU), the share of the micro-batch spent in the wrapper's grad-ready work, its
bucketed accumulate launches included (``accumulate_share``: ranges that torch hooks on each
param open and close around the wrapper's hooks) and, for ``fused``, in the fused
weight-gradient writes, GEMM and finiteness check included (``wgrad_gemm_share``: wgrad's
``accumkernels::wgrad_gemm`` range; this GEMM replaces autograd's own weight-gradient GEMM, so
it is not all extra work). Public API only: neither the wrapper nor wgrad is patched. Results
go to benchmarks/results/ as JSON (``wgrad-<device-slug>-<date>[-quick].json``).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import accumkernels
from accumkernels import wgrad
from benchmarks.accumbench.env import default_out_path, environment
from benchmarks.accumbench.workloads import mlp_stack

PROVIDERS = ("native_bf16", "unfused", "fused")


def make_model(width: int, blocks: int, device: torch.device) -> torch.nn.Module:
    return mlp_stack(width, blocks, device)


ACCUMULATE_RANGE = "bench_wgrad::grad_ready"  # the wrapper's per-param grad-ready work


class _GradReadyRanges:
    """Profiler ranges around each param's gradient arrival, hooks included: opened by a tensor
    hook (autograd runs those before accumulating into .grad), closed by a post-accumulate-grad
    hook registered after the wrapper's, so the range holds the wrapper's bookkeeping and its
    bucketed accumulate launches. Public torch hooks only; installed for one window."""

    def __init__(self, params):
        self._open: dict[int, torch.profiler.record_function] = {}
        self._handles = []
        for p in params:
            self._handles.append(p.register_hook(lambda g, p=p: self._enter(p)))
            self._handles.append(p.register_post_accumulate_grad_hook(self._exit))

    def _enter(self, p) -> None:
        r = torch.profiler.record_function(ACCUMULATE_RANGE)
        r.__enter__()
        self._open[id(p)] = r

    def _exit(self, p) -> None:
        r = self._open.pop(id(p), None)
        if r is not None:
            r.__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def _profiled_ms(events, name: str, cuda: bool) -> float:
    """Total time in the outermost profiler events called ``name``: device time on CUDA (the
    kernels launched inside), else CPU time; in ms."""
    total_us = 0.0
    for e in events:
        if e.name != name or e.device_type != torch.autograd.DeviceType.CPU:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name != name:
            parent = parent.cpu_parent
        if parent is None:
            device_us = getattr(e, "device_time_total", None)
            if device_us is None:  # older torch
                device_us = e.cuda_time_total
            total_us += device_us if cuda else e.cpu_time_total
    return total_us / 1e3


class Native:
    labels: dict[str, str] = {}  # share name -> profiler event to sum

    def __init__(self, model, device):
        self.model = model

    def instrument(self):
        """Hooks for the profiled window; returns what to remove afterwards (or None)."""
        return None

    def end_window(self):
        self.model.zero_grad(set_to_none=True)

    def close(self):
        pass


class Unfused(Native):
    fuse = False
    labels = {"accumulate": ACCUMULATE_RANGE}

    def __init__(self, model, device):
        super().__init__(model, device)
        inner = torch.optim.SGD(model.parameters(), lr=0.0)
        self.opt = accumkernels.AccumulatingOptimizer(inner, master_weights=False)
        self.handle = wgrad.fuse_wgrad_accumulation(model, self.opt) if self.fuse else None

    def instrument(self):
        return _GradReadyRanges(self.model.parameters())

    def end_window(self):
        self.opt.reset_window()

    def close(self):
        if self.handle is not None:
            self.handle.remove()
        self.opt.remove_hooks()


class Fused(Unfused):
    fuse = True
    labels = {**Unfused.labels, "wgrad_gemm": wgrad.PROFILE_LABEL}


def _window(model, inputs, sync):
    sync()
    t0 = time.perf_counter()
    for x in inputs:
        model(x).float().square().mean().backward()
    sync()
    return (time.perf_counter() - t0) * 1e3 / len(inputs)


def run_provider(name, base_model, inputs, windows, device) -> dict:
    cuda = device.type == "cuda"

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    model = copy.deepcopy(base_model)
    sync()
    base = torch.cuda.memory_allocated(device) if cuda else None
    state = {"native_bf16": Native, "unfused": Unfused, "fused": Fused}[name](model, device)
    _window(model, inputs, sync)  # warm-up
    state.end_window()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(windows):
        times.append(_window(model, inputs, sync))
        state.end_window()
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    # One more window under torch.profiler: the share of the micro-batch spent in the wrapper's
    # accumulate launches and in the fused writes (the profiler slows the window a little).
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    hooks = state.instrument()
    with torch.profiler.profile(activities=activities) as prof:
        window_ms = _window(model, inputs, sync)
    if hooks is not None:
        hooks.remove()
    events = prof.events()
    shares = {f"{k}_share": _profiled_ms(events, label, cuda) / len(inputs) / window_ms
              for k, label in state.labels.items()}
    state.end_window()
    gemms = state.handle.gemm_backends if getattr(state, "handle", None) else None
    state.close()
    del state, model
    return {"provider": name, "ms_per_microbatch": statistics.median(times),
            "min_ms": min(times), "peak_bytes_above_model": peak,
            "accumulate_share": shares.get("accumulate_share"),
            "wgrad_gemm_share": shares.get("wgrad_gemm_share"), "gemm_backends": gemms}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--width", type=int, default=None, help="768 (GPT-2) on GPU, 256 on CPU")
    parser.add_argument("--blocks", type=int, default=1, help="MLP blocks")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per micro-batch: 4096 on GPU, 256 on CPU")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--windows", type=int, default=None, help="5 on GPU, 3 on CPU")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    width = 64 if args.quick else args.width or (768 if gpu else 256)
    blocks = 1 if args.quick else args.blocks
    tokens = 32 if args.quick else args.tokens or (4096 if gpu else 256)
    windows = 2 if args.quick else args.windows or (5 if gpu else 3)
    n_micro = 2 if args.quick else args.microbatches

    torch.manual_seed(0)
    model = make_model(width, blocks, device)
    n_params = sum(p.numel() for p in model.parameters())
    n_weight = sum(m.weight.numel() for m in model if isinstance(m, torch.nn.Linear))
    inputs = [torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
              for _ in range(n_micro)]
    # Global warm-up: cuBLAS workspaces and kernels exist before any provider is measured.
    run_provider("native_bf16", model, inputs[:1], 1, device)
    rows = []
    for name in PROVIDERS:
        print(f"[bench_wgrad] {name} ...", file=sys.stderr, flush=True)
        rows.append(run_provider(name, model, inputs, windows, device))
    native = rows[0]
    for r in rows:
        r["overhead_vs_native"] = r["ms_per_microbatch"] / native["ms_per_microbatch"] - 1
        if r["peak_bytes_above_model"] is not None:
            extra = r["peak_bytes_above_model"] - native["peak_bytes_above_model"]
            r["extra_bytes_per_param_vs_native"] = extra / n_params
    by_name = {r["provider"]: r for r in rows}
    fused, unfused = by_name["fused"], by_name["unfused"]
    summary = {"fused_speedup_vs_unfused": unfused["ms_per_microbatch"] / fused["ms_per_microbatch"]}
    if fused["peak_bytes_above_model"] is not None:
        summary["fused_minus_unfused_bytes_per_weight_param"] = (
            fused["peak_bytes_above_model"] - unfused["peak_bytes_above_model"]) / n_weight

    record = {"benchmark": "wgrad", "environment": environment(device),
              "date": datetime.date.today().isoformat(), "argv": sys.argv[1:] if argv is None
              else list(argv),
              "config": {"width": width, "blocks": blocks, "tokens": tokens,
                         "microbatches": n_micro, "windows": windows, "params": n_params,
                         "weight_params": n_weight, "dtype": "bfloat16"},
              "rows": rows, "summary": summary}
    out = args.out or default_out_path("wgrad-" + record["environment"]["device_slug"],
                                       datetime.date.today(), False, args.quick)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"GPT-2 MLP x{blocks} (d={width}), {n_params / 1e6:.2f}M params, {tokens} tokens/"
          f"micro-batch, {n_micro} micro-batches, {record['environment']['device_name']}; "
          f"fused GEMM: {fused['gemm_backends']}")
    print(f"{'provider':12} {'ms/micro-batch':>14} {'vs native':>9} {'peak MB':>8} "
          f"{'extra B/param':>13} {'accum share':>11} {'wgrad share':>11}")
    nan = float("nan")
    for r in rows:
        peak = r["peak_bytes_above_model"]
        print(f"{r['provider']:12} {r['ms_per_microbatch']:14.3f} {r['overhead_vs_native']:9.1%} "
              f"{peak / 2**20 if peak is not None else nan:8.1f} "
              f"{r.get('extra_bytes_per_param_vs_native', nan):13.2f} "
              f"{r['accumulate_share'] if r['accumulate_share'] is not None else nan:11.2%} "
              f"{r['wgrad_gemm_share'] if r['wgrad_gemm_share'] is not None else nan:11.2%}")
    print(f"fused vs unfused: {summary['fused_speedup_vs_unfused']:.3f}x"
          + (f", {summary['fused_minus_unfused_bytes_per_weight_param']:+.2f} B/weight param peak"
             if "fused_minus_unfused_bytes_per_weight_param" in summary else ""))
    print(f"wrote {out}")
    return 0


def test_bench_wgrad_quick(tmp_path):
    """Smoke test (no timing assertions): every provider runs and the JSON is complete."""
    out = tmp_path / "wgrad.json"
    assert main(["--quick", "--device", "cpu", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert [r["provider"] for r in record["rows"]] == list(PROVIDERS)
    assert all(r["ms_per_microbatch"] > 0 for r in record["rows"])
    rows = {r["provider"]: r for r in record["rows"]}
    assert rows["fused"]["gemm_backends"] == {"cpu bfloat16": "fp32"}
    assert rows["fused"]["wgrad_gemm_share"] > 0
    assert rows["unfused"]["accumulate_share"] > 0 and rows["unfused"]["wgrad_gemm_share"] is None
    assert record["environment"]["torch"] == torch.__version__


if __name__ == "__main__":
    sys.exit(main())
