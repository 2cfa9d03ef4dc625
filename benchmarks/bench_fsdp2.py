"""FSDP2 on CPU/gloo: gradient memory, reduce-scatter bytes and time per window (issue 22).

    python -m benchmarks.bench_fsdp2 [--world 2 4] [--out PATH] [--dim 1024 --layers 4]

Spawns its own gloo ranks (a FileStore in a temporary directory, a deadline, a barrier before
``destroy_process_group``). Model: ``layers`` x (Linear(dim, dim), Tanh), fp32 params, each
Linear and the root under ``fully_shard`` with ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; AdamW; K micro-batches per window, every rank its own data. Rows (ROWS):
native FSDP2 syncing every micro-batch (torchtitan's default) or with
``set_requires_gradient_sync(False)`` for the first K-1; ``AccumulatingOptimizer(AdamW,
model=root)`` syncing every micro-batch, + ``fsdp2_wire.enable_bf16_reduce_scatter``, no-sync.

Memory (each row alone in its rank process, after a warm-up window): bytes of every distinct
tensor storage the garbage collector reaches (DTensors by their local shard), above one
baseline per rank: ``native_sync`` at a window boundary (after ``zero_grad()``, AdamW state
allocated) = params + optimizer state + the process. So the optimizer state is excluded and the
wrapper's persistent window included. ``grad_mid``: after a backward inside the window (the
largest); ``held``: at the boundary; ``peak``: held + the peak of the storages created during
the window's forwards and backwards (accumbench.tally.LiveTensorBytes, a dispatch mode):
activations, all-gathered params and reduce-scatter buffers included, not only gradients.
While memory is measured every collective returns only once gloo's worker thread has dropped its
tensors (``SettledCollectives``): what is counted does not depend on thread scheduling.

Wire (every window of the timed phase): collectives counted where they are called, in
``torch.distributed`` (wrapped functions: FSDP2's own code path unchanged), as the bytes one rank
sends: reduce-scatter and all-to-all (W-1)/W x input, all-gather (W-1) x input, all-reduce
2 (W-1)/W x input (ring). ``rs`` = reduce-scatter + all-to-all; ``expected`` = K (1 for no-sync)
x 4 (2 for the bf16 wire) x (W-1)/W x the padded param count. Time: wall clock of a window (K
forward/backward, step, zero_grad) after a barrier, the slowest rank's, rows interleaved window
by window. Agreement: max |param - native's| after the warm-up + timed windows.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import inspect
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROWS = {  # name -> (wrapper, no-sync, bf16 wire, label)
    "native_sync": (False, False, False, "native FSDP2, sync every micro-batch"),
    "native_nosync": (False, True, False, "native FSDP2, no-sync for K-1"),
    "accum_sync": (True, False, False, "accumkernels, sync every micro-batch"),
    "accum_bf16_wire": (True, False, True, "accumkernels + bf16 wire"),
    "accum_nosync": (True, True, False, "accumkernels + no-sync for K-1"),
}
TIME_NOTE = ("Loaded 2-core CPU shared with other jobs, gloo over loopback, 1 thread per rank "
             "(ranks share the cores): times are indicative only, not a performance claim.")


@dataclass(frozen=True)
class Config:
    dim: int = 1024
    layers: int = 4
    batch: int = 16  # samples per micro-batch and rank
    accum: int = 4  # K
    windows: int = 5  # timed windows per row
    warmup: int = 1
    lr: float = 1e-3

    def numel(self) -> int:
        return self.layers * (self.dim * self.dim + self.dim)

    def padded_numel(self, world: int) -> int:
        """Elements FSDP2 reduce-scatters: dim 0 of every param padded to a multiple of W."""
        rows = -(-self.dim // world) * world
        return self.layers * (rows * self.dim + rows)


# -- rank side -----------------------------------------------------------------------------------
class _PatchedCollectives:
    """Replaces the torch.distributed collectives FSDP2 and accumkernels call with
    ``self._wrap(name, fn)`` while entered; restores them on exit."""

    KINDS = {"reduce_scatter_single": "rs", "reduce_scatter_tensor": "rs",
             "all_to_all_single": "rs", "all_gather_single": "all_gather",
             "all_gather_into_tensor": "all_gather", "all_reduce": "all_reduce"}
    saved: dict

    def _wrap(self, name: str, fn):
        raise NotImplementedError

    def __enter__(self):
        for name in self.KINDS:
            if not hasattr(dist, name):  # reduce_scatter_single: newer than torch 2.11
                continue
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self.saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, fn in self.saved.items():
            setattr(dist, name, fn)


class WireCounter(_PatchedCollectives):
    """Counts the bytes one rank sends through the collectives, by kind."""

    def __init__(self):
        self.row: str | None = None  # counting while set
        self.bytes: dict[str, int] = {}
        self.saved: dict = {}

    def sent(self, name: str, tensor: torch.Tensor, world: int) -> int:
        size = tensor.numel() * tensor.element_size()
        if name.startswith("all_gather"):
            return size * (world - 1)
        return size * (world - 1) * (2 if name == "all_reduce" else 1) // world

    def _wrap(self, name: str, fn):
        sig = inspect.signature(fn)
        def counted(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            tensor = bound.get("tensor", bound.get("input", bound.get("input_tensor")))
            if self.row is not None and isinstance(tensor, torch.Tensor):
                kind, world = self.KINDS[name], dist.get_world_size(bound.get("group"))
                self.bytes[kind] = self.bytes.get(kind, 0) + self.sent(name, tensor, world)
            return fn(*args, **kwargs)
        return counted

class SettledCollectives(_PatchedCollectives):
    """Wraps the same collectives so that a synchronous one returns only once gloo has let go of
    its tensors. Gloo runs a collective on a worker thread that marks it complete (which wakes the
    caller) and only then drops its ``Work``, the last C++ reference to the output and input
    tensors. If FSDP2 frees such a buffer first (the all-gathered bf16 params of a layer, freed
    at that layer's copy-out in the backward), the tensor's Python object is kept alive, owned
    by the worker's reference, until that thread runs again: on a loaded machine that can be
    after the backward, so ``live_bytes`` counted one layer's all-gathered weight (8320 B in the
    test) in about one run in a dozen. Here the caller waits (GIL released) until the use count
    of each tensor argument is back to what it was before the call: the measurement no longer
    depends on when the worker thread is scheduled."""

    def __init__(self, timeout: float = 60.0):
        self.timeout = timeout
        self.saved: dict = {}

    def _wrap(self, name: str, fn):
        def settled(*args, **kwargs):
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            before = [t._use_count() for t in tensors]
            out = fn(*args, **kwargs)
            if out is None:  # synchronous: done, except for the worker's reference
                deadline = time.monotonic() + self.timeout
                while any(t._use_count() > n for t, n in zip(tensors, before)):
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{name}: gloo kept its tensors {self.timeout:g} s")
                    time.sleep(0.0002)
            return out
        return settled


def live_bytes() -> int:
    """Bytes of every distinct tensor storage the garbage collector reaches (local shards)."""
    from torch.distributed.tensor import DTensor

    gc.collect()
    seen: dict[int, int] = {}
    with warnings.catch_warnings():  # isinstance() on some objects warns (deprecated aliases)
        warnings.simplefilter("ignore")
        objects = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    for obj in objects:
        try:
            t = obj.to_local() if isinstance(obj, DTensor) else obj
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
    return sum(seen.values())


def build(cfg: Config, mesh, row: str):
    """The row's model and optimizer: the same init on every rank and in every row."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    import accumkernels
    from accumkernels.optim.fsdp2.wire import enable_bf16_reduce_scatter

    wrap, _, wire, _ = ROWS[row]
    torch.manual_seed(0)
    layers = []
    for _ in range(cfg.layers):
        layers += [torch.nn.Linear(cfg.dim, cfg.dim), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.01)
    if wrap:
        opt = accumkernels.AccumulatingOptimizer(opt, accumulation_steps=cfg.accum, model=model)
    comm = enable_bf16_reduce_scatter(model) if wire else None
    return model, opt, comm


def micro_batch(cfg: Config, model, rank: int, w: int, i: int, mode=None) -> None:
    """One forward and backward on this rank's data (freed on return: not in live bytes)."""
    g = torch.Generator().manual_seed(100_003 * rank + 101 * w + i)
    x, y = (torch.randn(cfg.batch, cfg.dim, generator=g) for _ in range(2))
    with mode if mode is not None else contextlib.nullcontext():
        torch.nn.functional.mse_loss(model(x).float(), y).backward()


def window(cfg: Config, model, opt, row: str, rank: int, w: int, after=None, mode=None) -> None:
    """K micro-batches, then step and zero_grad; ``after(i)`` after the i-th backward."""
    for i in range(cfg.accum):
        if ROWS[row][1]:  # no-sync rows: FSDP2 reduce-scatters on the last micro-batch only
            model.set_requires_gradient_sync(i == cfg.accum - 1)
        micro_batch(cfg, model, rank, w, i, mode)
        if after is not None:
            after(i)
    opt.step()
    opt.zero_grad()


def memory_row(cfg: Config, mesh, row: str, rank: int) -> dict:
    """Live bytes at the boundary, after each backward, and the window's peak; row alone."""
    from benchmarks.accumbench.tally import LiveTensorBytes

    model, opt, _ = build(cfg, mesh, row)
    window(cfg, model, opt, row, rank, 0)  # AdamW state exists from here on
    held = live_bytes()
    after: list[int] = []
    window(cfg, model, opt, row, rank, 1, after=lambda i: after.append(live_bytes()))
    mode = LiveTensorBytes()
    window(cfg, model, opt, row, rank, 2, mode=mode)
    del model, opt
    gc.collect()
    return {"held": held, "after_backward": after, "peak_new": mode.peak}


def timed_rows(cfg: Config, mesh, rank: int, counter: WireCounter) -> dict:
    """Every row built at once; windows interleaved (rotating row order); times, wire, params."""
    built = {row: build(cfg, mesh, row) for row in ROWS}
    names = list(ROWS)
    init = [p.detach().to_local().clone() for p in built["native_sync"][0].parameters()]
    times: dict[str, list[float]] = {row: [] for row in names}
    wire: dict[str, list[dict]] = {row: [] for row in names}
    for w in range(cfg.warmup + cfg.windows):
        for row in names[w % len(names):] + names[:w % len(names)]:
            model, opt, _ = built[row]
            dist.barrier()
            counter.row, counter.bytes = row, {}
            start = time.perf_counter()
            window(cfg, model, opt, row, rank, w)
            elapsed = time.perf_counter() - start
            counter.row = None
            wire[row].append(counter.bytes)
            if w >= cfg.warmup:
                times[row].append(elapsed)
    ref = {row: [p.detach().to_local() for p in built[row][0].parameters()] for row in names}
    ref["init"] = init
    def diff(a: str, b: str) -> float:
        return max(float((x - y).abs().max()) if x.numel() else 0.0
                   for x, y in zip(ref[a], ref[b]))
    comm = built["accum_bf16_wire"][2]
    return {"times": times, "wire": wire,
            "diff_vs_native_sync": {row: diff(row, "native_sync") for row in names},
            "diff_vs_native_nosync": {row: diff(row, "native_nosync") for row in names},
            "update": {row: diff(row, "init") for row in names},  # the windows moved the params
            "bf16_comm": {"bytes_sent": comm.bytes_sent, "fp32_fallbacks": comm.fp32_fallbacks},
            "local_numel": sum(p.to_local().numel() for p in built["native_sync"][0].parameters())}


def _rank_main(rank: int, world: int, out_dir: str, cfg: Config) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    result: dict = {"error": None}
    try:
        from torch.distributed.device_mesh import init_device_mesh

        store = dist.FileStore(os.path.join(out_dir, "store"), world)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=120))
        mesh = init_device_mesh("cpu", (world,))
        with SettledCollectives():
            result["memory"] = {row: memory_row(cfg, mesh, row, rank) for row in ROWS}
        with WireCounter() as counter:
            result["timed"] = timed_rows(cfg, mesh, rank, counter)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent through the file
        result["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    path = os.path.join(out_dir, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)
    try:
        if dist.is_initialized():
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
            dist.destroy_process_group()
    finally:
        os._exit(0)  # gloo's threads can abort in static destructors at a normal exit


def spawn(cfg: Config, world: int, timeout: float) -> list[dict]:
    """Run the ranks; return each rank's result. Every process is gone when this returns."""
    ctx = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="bench_fsdp2_") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, tmp, cfg)) for r in range(world)]
        paths = [os.path.join(tmp, f"rank{r}.json") for r in range(world)]
        for p in procs:
            p.start()
        try:
            deadline = time.monotonic() + timeout
            while not all(os.path.exists(path) for path in paths):
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and not os.path.exists(paths[r])]
                if dead:
                    raise RuntimeError(f"W={world}: rank {dead[0]} died (exit code "
                                       f"{procs[dead[0]].exitcode}) without a result")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"W={world}: no result from every rank in {timeout:g} s")
                time.sleep(0.05)
            for p in procs:
                p.join(max(1.0, deadline + 60 - time.monotonic()))
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join(10)
        results = [json.loads(Path(path).read_text()) for path in paths]
    for rank, r in enumerate(results):
        if r["error"] is not None:
            raise RuntimeError(f"W={world}: rank {rank} failed: {r['error']}")
    return results


# -- parent side ---------------------------------------------------------------------------------
def summarize(cfg: Config, world: int, ranks: list[dict]) -> dict:
    """Per-row figures for one world size: per rank lists, and the table's values (worst rank)."""
    numel, padded = cfg.numel(), cfg.padded_numel(world)
    base = [r["memory"]["native_sync"]["held"] for r in ranks]
    rows = []
    for row, (wrap, nosync, wire, label) in ROWS.items():
        mem = [r["memory"][row] for r in ranks]
        mid = [max(m["after_backward"][:-1]) - b for m, b in zip(mem, base)]
        held = [m["held"] - b for m, b in zip(mem, base)]
        peak = [m["held"] + m["peak_new"] - b for m, b in zip(mem, base)]
        wire_bytes = {kind: [[w.get(kind, 0) for w in r["timed"]["wire"][row]] for r in ranks]
                      for kind in ("rs", "all_reduce", "all_gather")}  # [rank][window]
        rs = wire_bytes["rs"]
        expected = ((1 if nosync else cfg.accum) * (2 if wire else 4)
                    * (world - 1) * padded // world)
        slowest = [max(ts) for ts in zip(*(r["timed"]["times"][row] for r in ranks))]
        rows.append({
            "row": row, "label": label, "wrapper": wrap, "no_sync": nosync, "bf16_wire": wire,
            "grad_mid_bytes": mid, "grad_mid_b_per_param": max(mid) / numel,
            "grad_before_step_bytes": [m["after_backward"][-1] - b for m, b in zip(mem, base)],
            "held_bytes": held, "held_b_per_param": max(held) / numel,
            "peak_bytes": peak, "peak_b_per_param": max(peak) / numel,
            "rs_bytes_per_window": rs, "rs_b_per_param": max(map(max, rs)) / numel,
            "rs_expected_bytes": expected,
            "rs_matches_expected": all(n == expected for ns in rs for n in ns),
            "all_reduce_bytes_per_window": wire_bytes["all_reduce"],
            "all_gather_bytes_per_window": wire_bytes["all_gather"],
            "window_s": slowest, "window_ms_median": 1e3 * statistics.median(slowest),
            "window_ms_min": 1e3 * min(slowest),
            **{f"max_abs_{key}": max(r["timed"][key][row] for r in ranks)
               for key in ("diff_vs_native_sync", "diff_vs_native_nosync", "update")},
        })
    own = [r["timed"]["bf16_comm"] for r in ranks]  # the bf16 comm's own count, all windows
    wire_rs = next(r["rs_bytes_per_window"] for r in rows if r["bf16_wire"])
    return {"world": world, "baseline_bytes": base, "numel": numel, "padded_numel": padded,
            "local_numel": [r["timed"]["local_numel"] for r in ranks], "bf16_comm_self_count": own,
            "bf16_self_count_matches": all(o["bytes_sent"] == sum(n) for o, n in zip(own, wire_rs)),
            "rows": rows}


def format_table(record: dict) -> str:
    """The markdown tables (per rank, the worst rank), one per world size, and their legend."""
    cfg, env = record["config"], record["environment"]
    lines = [f"FSDP2 on CPU/gloo ({env['cpu_name']}, {env['cpu_count']} cores): "
             f"{cfg['layers']} x Linear({cfg['dim']}, {cfg['dim']}) ({cfg['numel']:,} params), "
             f"fp32 shards, bf16 compute, fp32 reduce, AdamW, K = {cfg['accum']} micro-batches "
             f"of {cfg['batch']} per rank and window; torch {env['torch']}, commit "
             f"{env['git_commit']}.", "",
             "Bytes per param per rank. Memory is live tensor storage above one baseline (params "
             "+ AdamW state + the process: native FSDP2 at a window boundary): *grad mid* after "
             "a backward inside the window, *held* at the window boundary, *peak* during the "
             "window's forwards and backwards (activations, all-gathered params and "
             "reduce-scatter buffers included). *RS wire*: reduce-scatter (and all-to-all) bytes "
             "one rank sends per window, counted. *diff*: max |param| difference from row 1 / "
             f"row 2 after {cfg['warmup'] + cfg['windows']} windows. *time*: median window of the "
             f"slowest rank over {cfg['windows']}. " + TIME_NOTE, ""]
    for res in record["results"]:
        base = max(res["baseline_bytes"]) / res["numel"]
        extra = max(max(map(max, r["all_reduce_bytes_per_window"])) for r in res["rows"])
        lines += [f"W = {res['world']} ranks ({res['local_numel'][0]:,} params per rank; "
                  f"baseline {base:.2f} B/param; the wrapper also all-reduces {extra} B per "
                  "window of bookkeeping)", "",
                  "| # | recipe | grad mid | held | peak | RS wire | time (ms) | diff vs 1 "
                  "| diff vs 2 |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for i, r in enumerate(res["rows"], 1):
            lines.append(f"| {i} | {r['label']} | {r['grad_mid_b_per_param']:.2f} | "
                         f"{r['held_b_per_param']:.2f} | {r['peak_b_per_param']:.2f} | "
                         f"{r['rs_b_per_param']:.2f} | {r['window_ms_median']:.0f} | "
                         f"{r['max_abs_diff_vs_native_sync']:.3g} | "
                         f"{r['max_abs_diff_vs_native_nosync']:.3g} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    for name in ("dim", "layers", "batch", "accum", "windows", "warmup"):
        parser.add_argument(f"--{name}", type=int, default=getattr(Config, name))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per world size")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write this run's record as JSON here (the .md table beside "
                             "it)")
    from benchmarks.accumbench import results as suite_files
    suite_files.add_arguments(parser, "fsdp2")
    args = parser.parse_args(argv)
    if args.accum < 2 or args.windows < 1 or args.warmup < 0 or min(args.world) < 2:
        parser.error("need --accum >= 2, --windows >= 1, --warmup >= 0, --world >= 2")
    from benchmarks.accumbench.env import environment

    cfg = Config(**{k: getattr(args, k) for k in ("dim", "layers", "batch", "accum",
                                                  "windows", "warmup")})
    started = time.monotonic()
    now = datetime.datetime.now(datetime.timezone.utc)
    results = []
    for world in args.world:
        print(f"[bench_fsdp2] W={world} ...", file=sys.stderr, flush=True)
        results.append(summarize(cfg, world, spawn(cfg, world, args.timeout)))
    env = environment(torch.device("cpu"))
    env["torch_threads"] = 1  # per rank process
    record = {"benchmark": "fsdp2", "schema_version": 1, "date": now.isoformat(timespec="seconds"),
              "argv": list(sys.argv[1:] if argv is None else argv), "environment": env,
              "backend": "gloo (loopback), FileStore", "time_note": TIME_NOTE,
              "config": {**asdict(cfg), "numel": cfg.numel(), "worlds": args.world,
                         "optimizer": f"AdamW(lr={cfg.lr}, weight_decay=0.01)",
                         "mp_policy": "param_dtype=bf16, reduce_dtype=fp32",
                         "params": "fp32 (sharded, the master weights)"},
              "definitions": (__doc__ or "").split("\n\n", 2)[2],
              "results": results, "elapsed_s": time.monotonic() - started}
    table = format_table(record)
    print(table)
    saved = suite_files.save("fsdp2", record, args)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(table + "\n")
    print("[bench_fsdp2] " + (f"appended a row to {saved}" if saved else "no row appended")
          + (f"; wrote {args.out} and {args.out.with_suffix('.md').name}" if args.out else ""),
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
