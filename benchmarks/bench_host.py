"""Host time the wrapper adds per micro-batch and per step, against native PyTorch.

    python -m benchmarks.accumbench host [--device cpu|cuda] [--reps 15] [--micro-batches 4]
        [--model probe|gpt2-tiny|moe-probe|both|all] [--clock wall|thread] [--threads 1] [--quick]
        [--out PATH]

Models of many tiny param tensors, where the kernels cost next to nothing and what is left is
host work per param (hooks, checks, launches, Python):

* ``probe``: 148 params of GPT-2's shapes scaled tiny (4 to 64 elements each), loss
  ``sum(p * x_p)`` with fixed random ``x_p``: every param used once, the harshest case for a
  per-param cost;
* ``gpt2-tiny``: a real GPT-2 module (``bench_train.make_model``: 12 layers, n_embd 16, 2 heads,
  vocab 64, sequence 16; 148 tensors), cross-entropy on fixed random tokens;
* ``moe-probe``: a mixture-of-experts-shaped probe, 2,058 params (an embedding, then per layer a
  norm, a router and 256 experts of two 32-element matrices), the same ``sum(p * x_p)`` loss:
  the per-param cost of a model with thousands of small tensors.

``--model all`` (the default) runs the three, ``both`` the first two.

Rows, each with its own copy of the model (the same initial values) and its own optimizer, all
on the same data; AdamW(lr=1e-3, fused=True) everywhere:

* ``native``: plain torch on the fp32 model (AccumulateGrad sums the micro-batches in ``.grad``);
  its step is fused AdamW alone (the 1.00x step reference of the fp32 rows);
* ``native_bf16``: plain torch on the bf16 model (bf16 ``.grad``); its step is fused AdamW on
  fp32 master copies (their ``.grad`` set to the fp32 of the accumulated gradient, untimed),
  then one ``torch._foreach_copy_`` of the masters into the bf16 params: the fair reference
  of a bf16 model with fp32 masters;
* ``native_clip``: as ``native``, the step preceded by ``clip_grad_norm_(params, 1.0)``;
* ``floor``: as ``native`` plus one no-op ``register_post_accumulate_grad_hook`` per param, the
  floor of any per-param-hook design (its backward only);
* ``floor_pre_post``: as ``native`` plus a no-op tensor pre-hook (``register_hook``) and a
  no-op post-accumulate-grad hook per param: the floor of a design with both, as the wrapper's
  intake (which must hide the window before AccumulateGrad and take the gradient after it);
* ``wrapper_fp32``, ``wrapper_fp32_clip`` (``max_grad_norm=1.0``), ``wrapper_bf16`` (the bf16
  model; fp32 master weights by default): ``AccumulatingOptimizer`` around fused AdamW,
  ``accumulation_steps=None`` (``step()`` ends the window).

One repetition runs every row (rows in rotating order, round-robin): ``--micro-batches``
forwards (untimed) and backwards (each timed), the step (timed), ``zero_grad`` (untimed).
Warm-up repetitions come first (AdamW allocates its state at its first step). A row's figures
are the median over all its timed backwards and the median over its steps; ratios and the added
µs per param tensor compare each row with its reference (the native row of its dtype).

Timer: the wall clock (``time.perf_counter``) from the call to its return, or with ``--clock
thread`` the thread's CPU time (``time.thread_time``: leaves out waits for a core on a shared
box; CPU only, since on a GPU the backward runs on autograd's device thread). Both are recorded.
On a GPU the device is synchronised before each timed call and after it, outside the timing, so
the figure is host time; CUDA events around the call give the device time beside it.

After the timing the params are compared: ``wrapper_fp32`` and the floors with ``native``,
exactly (the same fp32 sums in the same order, the same fused AdamW). ``wrapper_fp32_clip`` and
``native_clip`` apply the clip coefficient differently (AdamW's ``grad_scale`` divides by its
inverse; ``clip_grad_norm_`` multiplies): an ulp apart per step, a gap that training on fixed
data amplifies step after step, so they are compared within 1e-6 after one window on fresh
copies, and the gap after the timing is recorded. The bf16 row's difference from
``native_bf16`` is recorded only (native sums in bf16).

On a GPU a second table times GPT-2-124M in bf16 (batch 1 and 8, sequence 1024), ``native_bf16``
against ``wrapper_bf16``: the host time of the backward and the step (the call to its return,
not synchronised) and the device time (CUDA events just before and after the call), and says
which bounds it (the critical path). Without a GPU it says "pending: no GPU". The run is
appended as a tagged row to benchmarks/results/host.jsonl (``--out``: its record as JSON too).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import accumkernels
from benchmarks.accumbench import host_report, results, summary
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.workloads import gpt2_shapes
from benchmarks.bench_step import Probe
from benchmarks.bench_train import make_model

LR = 1e-3
MAX_NORM = 1.0
ATOL = 1e-6  # the "close" check: torch.allclose(rtol=0, atol=ATOL) after one window
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODELS = ("probe", "gpt2-tiny", "moe-probe")
MOE_PROBE = {"layers": 4, "experts": 256, "width": 8, "expert_width": 4, "vocab": 64}
TINY = {"n_layer": 12, "n_embd": 16, "n_head": 2, "vocab": 64, "seq": 16}
TINY_BATCH = 2
GPT2_124M = {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab": 50257, "seq": 1024}
CRITICAL_BATCHES = (1, 8)
CRITICAL_ROWS = ("native_bf16", "wrapper_bf16")
CLOCKS = ("wall", "thread", "device")


def _log(msg: str) -> None:
    print(f"[bench_host] {msg}", file=sys.stderr, flush=True)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


@dataclass(frozen=True)
class RowSpec:
    """One row: how its model is trained (``kind``), in which dtype, and what it is compared
    with (names of other rows; None where the row has no such column)."""

    name: str
    kind: str  # native | masters (native bf16 + fp32 masters) | clip | floor | floor_pre_post
    # | wrapper
    dtype: str
    backward_ref: str | None
    step_ref: str | None
    options: dict = field(default_factory=dict)  # the wrapper's keyword arguments
    step_also_ref: str | None = None  # a second step reference shown below the table
    verify_ref: str | None = None  # the row whose params this row's are compared with
    check: str = "exact"  # vs verify_ref's: "exact", "close" (ATOL, one window), "record"


ROW_SPECS = (
    RowSpec("native", "native", "fp32", "native", "native"),
    RowSpec("native_bf16", "masters", "bf16", "native_bf16", "native_bf16"),
    RowSpec("native_clip", "clip", "fp32", None, "native"),
    RowSpec("floor", "floor", "fp32", "native", None, verify_ref="native"),
    RowSpec("floor_pre_post", "floor_pre_post", "fp32", "native", None, verify_ref="native"),
    RowSpec("wrapper_fp32", "wrapper", "fp32", "native", "native", verify_ref="native"),
    RowSpec("wrapper_fp32_clip", "wrapper", "fp32", "native", "native",
            {"max_grad_norm": MAX_NORM}, step_also_ref="native_clip", verify_ref="native_clip",
            check="close"),
    RowSpec("wrapper_bf16", "wrapper", "bf16", "native_bf16", "native_bf16",
            verify_ref="native_bf16", check="record"),
)
SPECS = {s.name: s for s in ROW_SPECS}


@dataclass
class Workload:
    """A model and its data: ``make(dtype)`` builds a fresh copy of the same initial model,
    ``loss(model, dtype, j)`` runs the forward of micro-batch ``j``."""

    name: str
    make: Callable[[str], torch.nn.Module]
    loss: Callable[[torch.nn.Module, str, int], torch.Tensor]


def moe_probe_shapes(layers: int, experts: int, width: int, expert_width: int,
                     vocab: int) -> list[tuple[int, ...]]:
    """An embedding, then per layer a norm, a router and ``experts`` pairs of small matrices."""
    shapes = [(vocab, width)]
    for _ in range(layers):
        shapes += [(width,), (experts, width)]
        shapes += [(expert_width, width), (width, expert_width)] * experts
    return shapes + [(width,)]


def probe_workload(device: torch.device, seed: int, name: str = "probe") -> Workload:
    """``probe``: 148 params of GPT-2's shapes scaled tiny (4..64 elements); ``moe-probe``: the
    MoE-shaped list (:data:`MOE_PROBE`); loss ``sum(p * x_p)``."""
    shapes = (moe_probe_shapes(**MOE_PROBE) if name == "moe-probe" else
              [s for _, s in gpt2_shapes(vocab_size=16, n_embd=4, n_positions=4)])
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen).to(device) for s in shapes]
    xs = [torch.randn(s, generator=gen).to(device) for s in shapes]
    data = {name: [x.to(dtype) for x in xs] for name, dtype in DTYPES.items()}
    return Workload(name, lambda dtype: Probe(init, DTYPES[dtype]),
                    lambda model, dtype, j: model(data[dtype]))


def gpt2_workload(name: str, config: dict, batch: int, micro_batches: int,
                  device: torch.device, seed: int) -> Workload:
    """``make_model("gpt2", ...)`` once; each row gets a deep copy; one fixed batch of random
    tokens per micro-batch; loss = the LM's cross-entropy."""
    torch.manual_seed(seed)
    base = make_model("gpt2", **config)
    gen = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(config["vocab"], (batch, config["seq"]), generator=gen).to(device)
              for _ in range(micro_batches)]
    return Workload(name, lambda dtype: copy.deepcopy(base).to(device, DTYPES[dtype]),
                    lambda model, dtype, j: model(input_ids=tokens[j], labels=tokens[j]).loss)


def _no_op(p: torch.Tensor) -> None:
    return None


class Row:
    """One row's model and optimizer; ``samples[phase][clock]`` holds its timings in µs."""

    def __init__(self, spec: RowSpec, workload: Workload):
        self.spec = spec
        self.samples = {phase: {clock: [] for clock in CLOCKS} for phase in ("backward", "step")}
        self.error: str | None = None
        self.handles: list = []
        self.masters: list[torch.Tensor] = []
        self.opt = None
        self.model = workload.make(spec.dtype)
        self.params = list(self.model.parameters())
        try:
            if spec.kind == "masters":
                self.masters = [p.detach().float() for p in self.params]
                self.low = [p.detach() for p in self.params]  # the bf16 params, written in place
                self.opt = torch.optim.AdamW(self.masters, lr=LR, fused=True)
            else:
                inner = torch.optim.AdamW(self.params, lr=LR, fused=True)
                self.opt = (accumkernels.AccumulatingOptimizer(inner, **spec.options)
                            if spec.kind == "wrapper" else inner)
            if spec.kind in ("floor", "floor_pre_post"):
                self.handles = [p.register_post_accumulate_grad_hook(_no_op)
                                for p in self.params]
            if spec.kind == "floor_pre_post":
                self.handles += [p.register_hook(_no_op) for p in self.params]
        except Exception as exc:  # noqa: BLE001 - recorded in the row, the others go on
            self.error = _error(exc)

    def before_step(self) -> None:
        """Untimed: the fp32 masters' gradients from the bf16 ``.grad`` (native_bf16 only)."""
        if not self.masters:
            return
        for m, p in zip(self.masters, self.params, strict=True):
            m.grad = None if p.grad is None else p.grad.float()

    def step(self) -> None:
        """The timed step: the row's whole step (clip, inner step, copy-back)."""
        if self.spec.kind == "clip":
            torch.nn.utils.clip_grad_norm_(self.params, MAX_NORM)
        self.opt.step()
        if self.masters:
            torch._foreach_copy_(self.low, self.masters)

    def zero_grad(self) -> None:
        self.opt.zero_grad()
        if self.masters:
            self.model.zero_grad(set_to_none=True)

    def add(self, phase: str, sample: dict[str, float | None]) -> None:
        for clock, value in sample.items():
            if value is not None:
                self.samples[phase][clock].append(value)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        if isinstance(self.opt, accumkernels.AccumulatingOptimizer):
            self.opt.remove_hooks()


def time_call(fn: Callable[[], object], device: torch.device) -> dict[str, float | None]:
    """µs of one call by each clock: ``wall`` (call to return), ``thread`` (the thread's CPU
    time), ``device`` (CUDA events recorded just before and after the call; None on the CPU).
    On a GPU the device is synchronised before the call and after it, outside the host timing."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    dev = None
    if cuda:
        end.record()
        torch.cuda.synchronize(device)
        dev = start.elapsed_time(end) * 1e3
    return {"wall": wall * 1e6, "thread": cpu * 1e6, "device": dev}


def repetition(row: Row, workload: Workload, micro_batches: int, device: torch.device,
               keep: bool) -> None:
    """One window of one row: the micro-batches (each backward timed), the step (timed)."""
    for j in range(micro_batches):
        loss = workload.loss(row.model, row.spec.dtype, j)
        sample = time_call(loss.backward, device)
        if keep:
            row.add("backward", sample)
    row.before_step()
    sample = time_call(row.step, device)
    if keep:
        row.add("step", sample)
    row.zero_grad()


def time_rows(rows: list[Row], workload: Workload, micro_batches: int, device: torch.device,
              warmup: int, reps: int) -> None:
    """Round-robin: each repetition runs one window of every row, starting one row later."""
    for rep in range(warmup + reps):
        live = [r for r in rows if r.error is None]
        k = rep % max(len(live), 1)
        for row in live[k:] + live[:k]:
            try:
                repetition(row, workload, micro_batches, device, keep=rep >= warmup)
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the others go on
                row.error = _error(exc)
        _log(f"{workload.name}: repetition {rep + 1}/{warmup + reps}"
             + (" (warm-up)" if rep < warmup else ""))


def max_abs_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest |a - b| over two param lists of the same shapes (in float64)."""
    return max(float((x.detach().double() - y.detach().double()).abs().max())
               for x, y in zip(a, b, strict=True))


def one_window_diff(spec: RowSpec, ref: RowSpec, workload: Workload, micro_batches: int,
                    device: torch.device) -> float:
    """Fresh copies of two rows, one window each (untimed): their largest param difference."""
    pair = [Row(s, workload) for s in (spec, ref)]
    try:
        for row in pair:
            if row.error:
                raise RuntimeError(row.error)
            repetition(row, workload, micro_batches, device, keep=False)
        return max_abs_diff(pair[0].params, pair[1].params)
    finally:
        for row in pair:
            row.close()


def verify(row: Row, by_name: dict[str, Row], workload: Workload | None = None,
           micro_batches: int = 1, device: torch.device | None = None) -> dict:
    """This row's params against its ``verify_ref`` row's, by the spec's ``check``: "exact"
    after the timing, "close" (within ATOL) after one window on fresh copies (``workload``),
    "record": the difference only."""
    ref = by_name.get(row.spec.verify_ref)
    if ref is None:
        return {"verify_ref": None, "criterion": None, "max_abs_diff": None,
                "max_abs_diff_after_timing": None, "verified": None}
    after = max_abs_diff(row.params, ref.params)
    diff, criterion, ok = after, None, None
    if row.spec.check == "exact":
        criterion, ok = "exact, after the timing", after == 0.0
    elif row.spec.check == "close":
        diff = one_window_diff(row.spec, ref.spec, workload, micro_batches, device)
        criterion, ok = f"allclose(rtol=0, atol={ATOL:g}), one window on fresh copies", \
            diff <= ATOL
    if row.error or ref.error:
        ok = None if ok is None else False
    return {"verify_ref": ref.spec.name, "criterion": criterion, "max_abs_diff": diff,
            "max_abs_diff_after_timing": after, "verified": ok}


def row_record(row: Row, clock: str, check: dict) -> dict:
    """One row of the record: its timings (µs, every clock), medians by ``clock``, the check."""
    s = row.spec
    chosen = {phase: row.samples[phase][clock] for phase in ("backward", "step")}
    return {"row": s.name, "kind": s.kind, "dtype": s.dtype, "options": s.options,
            "backward_ref": s.backward_ref, "step_ref": s.step_ref,
            "step_also_ref": s.step_also_ref, "error": row.error,
            "backward_us": chosen["backward"], "step_us": chosen["step"],
            "backward_median_us": host_report.median(chosen["backward"]),
            "step_median_us": host_report.median(chosen["step"]),
            "samples_us": row.samples, **check}


def run_table(workload: Workload, args: argparse.Namespace, device: torch.device) -> dict:
    """Every row of ROW_SPECS on one workload: timed, checked, derived."""
    rows = [Row(spec, workload) for spec in ROW_SPECS]
    n_params = len(rows[0].params)
    numel = sum(p.numel() for p in rows[0].params)
    _log(f"{workload.name}: {n_params} param tensors, {numel} elements, {len(rows)} rows")
    time_rows(rows, workload, args.micro_batches, device, args.warmup, args.reps)
    by_name = {r.spec.name: r for r in rows}
    records = [row_record(r, args.clock, verify(r, by_name, workload, args.micro_batches,
                                                 device)) for r in rows]
    for r in rows:
        r.close()
    derived = host_report.derive(records, n_params)
    return {"model": workload.name, "n_params": n_params, "numel": numel,
            "micro_batches": args.micro_batches, "reps": args.reps, "warmup": args.warmup,
            "rows": records, "derived": derived, "goals": host_report.goals(derived)}


def measure_critical_path(args: argparse.Namespace, device: torch.device) -> dict:
    """GPT-2-124M in bf16 on the GPU: host vs device time of the backward and of the step."""
    if device.type != "cuda":
        return {"status": "pending: no GPU"}
    entries = []
    for batch in CRITICAL_BATCHES:
        try:
            workload = gpt2_workload(f"gpt2-124m-batch{batch}", GPT2_124M, batch,
                                     args.micro_batches, device, args.seed)
            rows = [Row(SPECS[name], workload) for name in CRITICAL_ROWS]
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory: recorded, the rest goes on
            entries.append({"batch": batch, "row": "-", "phase": "-", "host_us": None,
                            "device_us": None, "critical_path": None, "error": _error(exc)})
            continue
        time_rows(rows, workload, args.micro_batches, device, args.cp_warmup, args.cp_reps)
        for row in rows:
            for phase in ("backward", "step"):
                host = host_report.median(row.samples[phase]["wall"])
                dev = host_report.median(row.samples[phase]["device"])
                entries.append({"batch": batch, "row": row.spec.name, "phase": phase,
                                "host_us": host, "device_us": dev,
                                # the calling thread's CPU time (the backward's engine work
                                # runs on autograd's device thread: not in it)
                                "host_thread_us": host_report.median(
                                    row.samples[phase]["thread"]),
                                "critical_path": host_report.critical_path(host, dev),
                                "host_samples_us": row.samples[phase]["wall"],
                                "device_samples_us": row.samples[phase]["device"],
                                "error": row.error})
            row.close()
        del rows, workload
        torch.cuda.empty_cache()
    return {"status": "measured", "model": "gpt2-124m", "config": GPT2_124M, "dtype": "bf16",
            "micro_batches": args.micro_batches, "reps": args.cp_reps, "warmup": args.cp_warmup,
            "entries": entries}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench host",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", choices=(*MODELS, "both", "all"), default="all",
                   help="one model, both (probe and gpt2-tiny) or all (default: the three)")
    p.add_argument("--micro-batches", type=int, default=4, help="backwards per step (4)")
    p.add_argument("--reps", type=int, help="timed repetitions (windows) per row: 15, 3 --quick")
    p.add_argument("--warmup", type=int, help="untimed repetitions first: 2, 1 --quick")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="the wall clock (default) or the thread's CPU time (CPU only)")
    p.add_argument("--cp-reps", type=int, help="GPU critical-path table: timed repetitions "
                                               "(10, 2 --quick)")
    p.add_argument("--cp-warmup", type=int, default=1)
    p.add_argument("--note", default="", help="a line about the conditions, kept in the record")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="3 repetitions: a smoke test")
    p.add_argument("--out", type=Path, help="also write this run's record as JSON here")
    results.add_arguments(p, "host", note=False)
    args = p.parse_args(argv)
    if args.reps is None:
        args.reps = 3 if args.quick else 15
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.cp_reps is None:
        args.cp_reps = 2 if args.quick else 10
    if min(args.micro_batches, args.reps, args.threads, args.cp_reps) < 1 \
            or min(args.warmup, args.cp_warmup) < 0:
        p.error("--micro-batches, --reps, --threads and --cp-reps must be >= 1, "
                "--warmup and --cp-warmup >= 0")
    if args.clock == "thread" and torch.device(args.device).type == "cuda":
        p.error("--clock thread times only the calling thread: on a GPU autograd runs the "
                "backward on its device thread (use --clock wall)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    models = {"all": MODELS, "both": MODELS[:2]}.get(args.model, (args.model,))
    tables = {}
    for name in models:
        workload = (probe_workload(device, args.seed, name) if name != "gpt2-tiny" else
                    gpt2_workload(name, TINY, TINY_BATCH, args.micro_batches, device, args.seed))
        tables[name] = run_table(workload, args, device)
    cp = measure_critical_path(args, device)
    env = environment(device)
    env.update(threads=args.threads, clock=args.clock)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "host-time", "schema_version": 1, "date": now.isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv), "environment": env,
        "config": {"models": list(models), "micro_batches": args.micro_batches,
                   "reps": args.reps, "warmup": args.warmup, "threads": args.threads,
                   "clock": args.clock, "seed": args.seed, "quick": args.quick,
                   "note": args.note, "lr": LR, "max_grad_norm": MAX_NORM,
                   "optimizer": f"AdamW(lr={LR}, fused=True)", "gpt2_tiny": TINY,
                   "gpt2_tiny_batch": TINY_BATCH,
                   "timer": ("time.thread_time" if args.clock == "thread"
                             else "time.perf_counter") + " from the call to its return"
                            + ("; synchronised before and after, outside the timing; CUDA "
                               "events beside it" if device.type == "cuda" else "")},
        "tables": tables, "critical_path": cp, "elapsed_s": time.perf_counter() - started,
    }
    saved = results.save("host", record, args)
    commit = env["git_commit"] or "unknown"
    print(f"host-time: {env['device_name']} ({env['device']}), torch {env['torch']}, triton "
          f"{env['triton']}, {env['torch_threads']} thread(s), clock {args.clock}, commit "
          f"{commit[:10]}{' (dirty)' if env['git_dirty'] else ''}"
          + (f"; {args.note}" if args.note else ""))
    for table in tables.values():
        print("\n" + host_report.format_table(table))
    print("\n" + host_report.format_critical_path(cp), flush=True)
    print("\n" + summary.format_summary({"host": record}), flush=True)
    _log((f"appended a row to {saved}" if saved else "no row appended (--quick/--no-results)")
         + (f"; wrote {args.out}" if args.out else "") + f" ({record['elapsed_s']:.1f} s)")
    ok = all(r["error"] is None and r["verified"] is not False
             for t in tables.values() for r in t["rows"])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
