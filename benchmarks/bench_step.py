"""The optimizer step: AccumulatingOptimizer's against the inner optimizer's own (issue 20).

    python -m benchmarks.accumbench step [--device cuda] [--quick] [--note TEXT] [--out PATH]

The run is appended as a tagged row to benchmarks/results/step.jsonl (see
accumbench/results.py); its table and summary line go to stdout.

Rows, all on the same parameter list (a GPT-2-shaped one; each row owns its copy):

* ``adamw_fused`` / ``adamw_foreach``: ``torch.optim.AdamW(fused=True)`` / ``(foreach=True)``
  on fp32 params whose ``.grad`` a backward has just set (``adamw_fused`` is the 1.00x row);
* ``adamw_fused_grad_scale``: the same with a ``grad_scale`` (and a clear ``found_inf``), as the
  wrapper's fold hands it for clipping or ``mean``: AdamW divides the gradients in its own pass
  and writes them back into ``.grad`` (4 B per element more), which is what native
  ``clip_grad_norm_`` leaves in ``.grad`` too (not a floor: a reference);
* ``read_pass``: ``torch.nn.utils.get_total_norm`` over a window-shaped fp32 list (views of one
  flat buffer, as the wrapper's window), written before each timing as the wrapper rows'
  micro-batches write their window: the read pass every wrapper step needs (finiteness and the
  clip norm), timed in the same run;
* ``adamw_fused+copy_back``: the fair comparison for bf16 models: fused AdamW on fp32 masters,
  then one ``torch._foreach_copy_`` of the masters into the bf16 params;
* ``wrapper_<fp32|bf16>_<variant>``: ``AccumulatingOptimizer`` around the same fused AdamW on an
  fp32 model, or a bf16 model (fp32 master weights); variants ``sum`` (defaults), ``clip``
  (``max_grad_norm=1.0``), ``mean`` (``reduction="mean"``), ``dynamic``
  (``loss_scale="dynamic"``), and ``clip+mean+dynamic`` on request.

Each model is a probe whose params are the list and whose loss is ``sum(p * r)`` (so each
gradient is ``r``, a random tensor from one of two fixed sets, rotated); before each timed step
the wrapper's window is filled by ``--micro-batches`` backwards through its public path (hooks
during backward, ``scale_loss`` for the dynamic rows). Only ``step()`` is timed (the copy-back
included where a row has one), wall clock, synchronised on a GPU. Every repetition times one
step of every row, rows in rotating order (round-robin), after warm-up repetitions (the first
step allocates AdamW's state); the figure is the median. ``--clock thread`` times the thread's CPU
time (``time.thread_time``) instead of the wall clock: on a shared box it leaves out the time
the step waited for a core (both are recorded).

The floor of a wrapper row is what its step cannot avoid, measured in the same run: the read pass
plus the inner optimizer's own pass (fp32 model: ``read_pass + inner``; bf16 model, the fused
master step: ``read_pass + 32/28 x adamw_fused``, ``+ 24/20 x sgd_fused`` for SGD: its bytes over
the inner step's). ``x floor`` = median / floor. Then one more step per row runs under
``accumbench.tally.TrafficTally``: the bytes its aten ops move, their count (launches on a GPU)
and the host syncs. A row is ``ok`` when its inner optimizer took every step (none skipped).

Bytes per step (``model`` columns), per element of the list, fp32 window/masters, b = the model
dtype's size. The inner AdamW reads p, grad, exp_avg, exp_avg_sq and writes p, exp_avg,
exp_avg_sq: 28 B (the minimum; the foreach path makes several passes, see ``counted``). What the
wrapper's step adds, pass by pass, as its code did when this was written (stepping.py,
nonfinite.py, masters.py; update ``model_passes`` when the step changes):

* ``measure`` (finiteness and the clip norm, every wrapper row): read 4. The step measures the
  window as it is at ``step()`` (one read pass: with clipping the per-view norms of
  ``get_total_norm``, without it the sum of each flat buffer), since writes through ``.data``,
  numpy or the storage change it without a flag or a version bump; a window that overflows fp32
  squares (or its sum) is read once more (not in these rows);
* ``grad_scale`` (clipping, or ``mean`` when the step learns N, i.e. ``accumulation_steps=None``
  and more than one micro-batch): no pass of its own. The fused inner AdamW divides the
  gradients by its ``grad_scale`` (given 1 / (normalisation * clip coefficient)) in its own pass
  and writes them back: write 4. (A non-fused inner optimizer gets ``_foreach_mul_`` passes
  instead, 8 each: not in these rows.) With ``--declare-n`` the 1/N is fused into accumulation;
  the loss-scale's 1/S always is: 0 at the step;
* ``resync`` (bf16): on the CPU every (master, weight) pair is compared exactly by one native
  pass: read 4 + b (it writes only the elements a user changed: none in these rows). Elsewhere,
  until a device kernel exists, torch ops per param:
  ``m.to(bf16)`` 4 + b, ``p.ne(.)`` 2b + 1, ``p.float()`` b + 4, ``where(...)`` 13: 22 + 4b;
* ``copy_back`` (bf16, and the fair row): read the master, write the param: 4 + b (the
  wrapper's, on the CPU, a native pass; the native passes are outside aten, so ``counted``
  does not see them: ``uncounted_passes``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import accumkernels
from accumkernels.ops.backends import native
from benchmarks.accumbench import results, summary
from benchmarks.accumbench.env import environment
from benchmarks.accumbench.measure import quantiles
from benchmarks.accumbench.step_report import add_ratios, format_table
from benchmarks.accumbench.tally import TrafficTally
from benchmarks.accumbench.workloads import Shape, gpt2_124m_shapes, gpt2_shapes

LR = 1e-4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
VARIANTS = {"sum": {}, "clip": {"max_grad_norm": 1.0}, "mean": {"reduction": "mean"},
            "dynamic": {"loss_scale": "dynamic"},
            "clip+mean+dynamic": {"max_grad_norm": 1.0, "reduction": "mean",
                                  "loss_scale": "dynamic"}}
DEFAULT_VARIANTS = ("sum", "clip", "mean", "dynamic")
WORKLOADS = {  # name -> (label, shapes)
    "gpt2-24m": lambda: gpt2_shapes(vocab_size=8192, n_embd=384, n_positions=256),
    "gpt2-124m": gpt2_124m_shapes,
    "gpt2-tiny": lambda: gpt2_shapes(vocab_size=1000, n_embd=64, n_positions=128),
}
INNER_BYTES = 28  # AdamW per fp32 element: read p, grad, exp_avg, exp_avg_sq; write three
SGD_BYTES = 20  # SGD with momentum per fp32 element: read p, grad, buf; write p, buf
# the fused master step per element (bf16/fp16 weight of b bytes): read window, master, state,
# weight; write master, state, weight (the window is not written)
FUSED_MASTER_BYTES = {"adamw": lambda b: 4 + 4 + 8 + b + 4 + 8 + b,
                      "sgd": lambda b: 4 + 4 + 4 + b + 4 + 4 + b}
SGD_MOMENTUM = 0.9
SGD_VARIANTS = ("sum", "clip")


def _log(msg: str) -> None:
    print(f"[bench_step] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class RowSpec:
    """One row: what steps (``kind``: inner, inner+copy_back, wrapper) on which model dtype."""

    name: str
    kind: str
    dtype: str
    variant: str | None = None
    foreach: bool = False
    fair: str = "adamw_fused"  # the row this one must be compared with
    opt: str = "adamw"  # the inner optimizer: AdamW or SGD with momentum, fused=True
    separate: bool = False  # wrapper rows: the fused master step off (re-sync, step, copy-back)
    inner: str = "adamw_fused"  # the row of the inner optimizer alone on fp32 params (1.00x)
    grad_scale: bool = False  # inner rows: a grad_scale given, as the wrapper's fold gives it

    def floor_factor(self) -> float | None:
        """A wrapper row's floor is ``read_pass + factor x inner``: the fused master step's
        bytes over the inner step's for a bf16 model, 1 for an fp32 one (None: no floor)."""
        if self.kind != "wrapper":
            return None
        inner = SGD_BYTES if self.opt == "sgd" else INNER_BYTES
        b = DTYPES[self.dtype].itemsize
        return 1.0 if b == 4 else FUSED_MASTER_BYTES[self.opt](b) / inner

    @property
    def options(self) -> dict:
        return dict(VARIANTS[self.variant]) if self.variant else {}


def row_specs(variants: list[str]) -> list[RowSpec]:
    """The rows in table order: inner optimizers, fp32 wrappers, bf16 baseline, bf16 wrappers
    (the fused master step, then the separate passes it replaces), then the same for SGD with
    momentum (sum and clip)."""
    fair16 = "adamw_fused+copy_back"
    sgd16 = "sgd_fused+copy_back"
    sgd = {"opt": "sgd", "inner": "sgd_fused"}
    return ([RowSpec("adamw_fused", "inner", "fp32"),
             RowSpec("adamw_fused_grad_scale", "inner", "fp32", grad_scale=True),
             RowSpec("read_pass", "read", "fp32", fair="read_pass"),
             RowSpec("adamw_foreach", "inner", "fp32", foreach=True)]
            + [RowSpec(f"wrapper_fp32_{v}", "wrapper", "fp32", v) for v in variants]
            + [RowSpec(fair16, "inner+copy_back", "bf16", fair=fair16)]
            + [RowSpec(f"wrapper_bf16_{v}", "wrapper", "bf16", v, fair=fair16)
               for v in variants]
            + [RowSpec(f"wrapper_bf16_{v}_separate", "wrapper", "bf16", v, fair=fair16,
                       separate=True) for v in variants if v in SGD_VARIANTS]
            + [RowSpec("sgd_fused", "inner", "fp32", fair="sgd_fused", **sgd),
               RowSpec(sgd16, "inner+copy_back", "bf16", fair=sgd16, **sgd)]
            + [RowSpec(f"wrapper_bf16_sgd_{v}{tail}", "wrapper", "bf16", v, fair=sgd16,
                       separate=bool(tail), **sgd)
               for tail in ("", "_separate") for v in SGD_VARIANTS])


def model_passes(spec: RowSpec, numel: int, micro_batches: int, declare_n: bool,
                 native_resync: bool = True) -> dict[str, int]:
    """Bytes per step by pass, by the model in the module docstring."""
    b = DTYPES[spec.dtype].itemsize
    if spec.kind == "read":
        return {"read": 4 * numel}
    inner = SGD_BYTES if spec.opt == "sgd" else INNER_BYTES
    passes = {"inner": inner * numel}
    if spec.grad_scale:
        passes["grad_scale"] = 4 * numel  # it writes the divided gradient back
    if spec.kind == "inner+copy_back":
        passes["copy_back"] = (4 + b) * numel
    if spec.kind != "wrapper":
        return passes
    opts = spec.options
    passes["measure"] = 4 * numel  # finiteness and the clip norm: one read of the window
    if b < 4 and not spec.separate:  # the fused master step: one pass, the window not written
        del passes["inner"]
        passes["fused_master"] = FUSED_MASTER_BYTES[spec.opt](b) * numel
        return passes
    normalise = opts.get("reduction") == "mean" and not declare_n and micro_batches > 1
    if normalise or "max_grad_norm" in opts:
        passes["grad_scale"] = 4 * numel  # fused AdamW writes the divided gradient back
    if b < 4:
        passes["resync"] = (4 + b) * numel if native_resync else (22 + 4 * b) * numel
        passes["copy_back"] = (4 + b) * numel
    return passes


@contextlib.contextmanager
def separate_passes(on: bool):
    """The wrapper's step without the fused master step (today's three passes), for a row."""
    if not on:
        yield
        return
    from accumkernels.optim.step import fused_master
    applies = fused_master.applies
    fused_master.applies = lambda *args: False
    try:
        yield
    finally:
        fused_master.applies = applies


class Probe(torch.nn.Module):
    """Params of the list's shapes; ``forward(rs) = sum(p * r)``, so each gradient is ``r``."""

    def __init__(self, init: list[torch.Tensor], dtype: torch.dtype):
        super().__init__()
        self.params = torch.nn.ParameterList(torch.nn.Parameter(t.to(dtype, copy=True))
                                             for t in init)

    def forward(self, rs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * r).sum() for p, r in zip(self.params, rs, strict=True))


class ReadRow:
    """The read pass alone: ``get_total_norm`` over views of one flat fp32 buffer shaped as the
    window (``step`` is timed). ``prepare`` writes the buffer as the wrapper rows' micro-batches
    write their window just before their step (the first copies its gradients in, the others
    add theirs), so the pass reads memory in the state the step's read pass finds it in
    (freshly written lines), as the inner rows' ``.grad`` a backward has just written."""

    model_dtype = "fp32"
    opt = None

    def __init__(self, spec: RowSpec, init: list[torch.Tensor], micro_batches: int = 1):
        self.spec = spec
        self.micro = micro_batches
        self.times: list[float] = []
        self.other_times: list[float] = []
        self.error: str | None = None
        flat = torch.empty(sum(t.numel() for t in init), device=init[0].device)
        self.views = [v.view_as(t) for v, t in
                      zip(flat.split([t.numel() for t in init]), init, strict=True)]

    def prepare(self, rsets, rep: int) -> None:
        for j in range(self.micro):
            rs = rsets[(rep * self.micro + j) % len(rsets)]
            (torch._foreach_add_ if j else torch._foreach_copy_)(self.views, rs)

    def step(self) -> None:
        if not bool(torch.isfinite(torch.nn.utils.get_total_norm(self.views, 2.0))):
            raise FloatingPointError("read_pass: non-finite norm")

    def inner_steps(self) -> int:
        return 0

    def close(self) -> None:
        pass


class StepRow:
    """A row's model and optimizer: ``prepare`` fills the gradients, ``step`` is timed."""

    def __init__(self, spec: RowSpec, init: list[torch.Tensor], micro_batches: int,
                 declare_n: bool):
        self.spec = spec
        self.times: list[float] = []
        self.other_times: list[float] = []  # by the clock not chosen (--clock)
        self.error: str | None = None
        master = spec.kind == "inner+copy_back"
        self.model_dtype = "fp32" if master else spec.dtype  # of the probe's params
        self.micro = micro_batches if spec.kind == "wrapper" else 1
        self.low: list[torch.Tensor] = []
        self.inner = self.opt = None
        try:
            self.model = Probe(init, DTYPES[self.model_dtype])
            params = list(self.model.parameters())
            self.inner_device = params[0].device
            if master:
                self.low = [p.detach().to(torch.bfloat16) for p in params]
            if spec.opt == "sgd":
                self.inner = torch.optim.SGD(params, lr=LR, momentum=SGD_MOMENTUM, fused=True)
            else:
                self.inner = torch.optim.AdamW(params, lr=LR, fused=not spec.foreach,
                                               foreach=spec.foreach or None)
            self.opt = self.inner
            self.steps = 0
            if spec.kind == "wrapper":
                self.opt = accumkernels.AccumulatingOptimizer(
                    self.inner, accumulation_steps=micro_batches if declare_n else None,
                    **spec.options)
            # counted on the optimizer the row calls (the wrapper's hooks fire once per real
            # step): a hook on the inner optimizer would take the fused master step off, which
            # runs torch's own step between the inner's hooks
            self.opt.register_step_post_hook(lambda *_: self._count())
        except Exception as exc:  # noqa: BLE001 - e.g. no fused AdamW on this device
            self.error = _error(exc)

    def prepare(self, rsets: list[list[torch.Tensor]], rep: int) -> None:
        """Fresh gradients: zero_grad, then ``micro`` backwards (untimed)."""
        self.opt.zero_grad(set_to_none=True)
        for j in range(self.micro):
            loss = self.model(rsets[(rep * self.micro + j) % len(rsets)])
            if self.spec.kind == "wrapper":
                loss = self.opt.scale_loss(loss)
            loss.backward()

    def _count(self) -> None:
        self.steps += 1

    def step(self) -> None:
        if self.spec.grad_scale:  # what the wrapper's fold hands a fused AdamW: 1 / 0.5
            self.inner.grad_scale = torch.tensor(2.0, device=self.inner_device)
            self.inner.found_inf = torch.zeros((), device=self.inner_device)
            try:
                self.opt.step()
            finally:
                del self.inner.grad_scale, self.inner.found_inf
            return
        with separate_passes(self.spec.separate):
            self.opt.step()
        if self.low:
            torch._foreach_copy_(self.low, list(self.model.parameters()))

    def inner_steps(self) -> int:
        """Real steps the row took (a step post-hook's count)."""
        return self.steps if self.inner is not None else 0

    def close(self) -> None:
        if isinstance(self.opt, accumkernels.AccumulatingOptimizer):
            self.opt.remove_hooks()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:300]}"


def time_rows(rows: list[StepRow], rsets: dict[str, list], warmup: int, reps: int,
              device: torch.device, clock: str = "wall") -> None:
    """Interleaved: each repetition times one step of every row, starting one row later.
    ``clock``: "wall" (perf_counter) or "thread" (the thread's CPU time) fills ``times``; the
    other fills ``other_times``."""
    for rep in range(warmup + reps):
        live = [r for r in rows if r.error is None]
        k = rep % max(len(live), 1)
        for row in live[k:] + live[:k]:
            try:
                row.prepare(rsets[row.model_dtype], rep)
                _sync(device)
                t0, c0 = time.perf_counter(), time.thread_time()
                row.step()
                _sync(device)
                wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            except Exception as exc:  # noqa: BLE001 - recorded in the row, the others go on
                row.error = _error(exc)
                continue
            if rep >= warmup:
                chosen, other = (cpu, wall) if clock == "thread" else (wall, cpu)
                row.times.append(chosen * 1e3)
                row.other_times.append(other * 1e3)
        _log(f"repetition {rep + 1}/{warmup + reps}" + (" (warm-up)" if rep < warmup else ""))


def tally_rows(rows: list[StepRow], rsets: dict[str, list], rep: int) -> dict[str, dict]:
    """One more step per row under TrafficTally: bytes, ops and syncs as issued."""
    out = {}
    for row in rows:
        if row.error is not None:
            continue
        try:
            row.prepare(rsets[row.model_dtype], rep)
            with TrafficTally() as tally:
                row.step()
            out[row.spec.name] = tally.summary()
        except Exception as exc:  # noqa: BLE001
            row.error = _error(exc)
    return out


# --- the record ---------------------------------------------------------------------------------

def row_record(row: StepRow, numel: int, args: argparse.Namespace, expected_steps: int,
               tally: dict | None) -> dict:
    """One row of the record (timing, ratios filled in later, byte model, tally, status)."""
    spec = row.spec
    native_resync = (torch.device(args.device).type == "cpu"
                     and native.resync_masters_cpu is not None)
    passes = model_passes(spec, numel, args.micro_batches, args.declare_n, native_resync)
    skipped = getattr(row.opt, "skipped_steps", 0)
    steps = row.inner_steps()
    if spec.kind == "read":
        expected_steps = 0
    status = "error" if row.error else (
        "ok" if steps == expected_steps and not skipped else "MISMATCH")
    med, p20, p80 = quantiles(row.times) if row.times else (None, None, None)
    model_bytes = sum(passes.values())
    return {"row": spec.name, "kind": spec.kind, "model_dtype": spec.dtype,
            "variant": spec.variant, "options": spec.options, "fair_baseline": spec.fair,
            "micro_batches": row.micro, "status": status, "error": row.error,
            "inner_steps": steps, "expected_steps": expected_steps, "skipped_steps": skipped,
            "median_ms": med, "p20_ms": p20, "p80_ms": p80, "times_ms": row.times,
            "other_clock_times_ms": row.other_times,
            "other_clock_median_ms": quantiles(row.other_times)[0] if row.other_times else None,
            "floor_factor": spec.floor_factor(), "floor_ms": None, "ratio_vs_floor": None,
            "inner_baseline": spec.inner, "ratio_vs_adamw_fused": None, "ratio_vs_fair": None,
            "ratio_vs_inner": None,
            "model_bytes": model_bytes, "model_bytes_by_pass": passes,
            # passes outside aten (a native call): TrafficTally's "counted" cannot see them
            "uncounted_passes": ["resync", "copy_back"] if native_resync and "resync" in passes
                                else [],
            "model_gbps": model_bytes / med / 1e6 if med else None,
            "counted": tally}


# --- command line -------------------------------------------------------------------------------

def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.accumbench step",
                                description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--workload", choices=tuple(WORKLOADS),
                   help="the param list: gpt2-24m (12 layers, d=384, vocab 8192, 148 tensors, "
                        "24.5M; CPU default), gpt2-124m (GPU default), gpt2-tiny (--quick)")
    p.add_argument("--variants", type=_csv, default=list(DEFAULT_VARIANTS),
                   help=f"wrapper variants, of {', '.join(VARIANTS)} "
                        f"(default: {','.join(DEFAULT_VARIANTS)})")
    p.add_argument("--micro-batches", type=int, default=2,
                   help="backwards that fill each wrapper window (default 2)")
    p.add_argument("--declare-n", action="store_true",
                   help="pass accumulation_steps=--micro-batches (default: None, step() ends "
                        "the window, as the HF Trainer, Accelerate and Lightning recipes do)")
    p.add_argument("--reps", type=int, help="timed steps per row: 7 CPU, 20 GPU, 3 --quick")
    p.add_argument("--warmup", type=int, help="untimed steps per row first: 1 CPU, 3 GPU")
    p.add_argument("--threads", type=int,
                   help="torch.set_num_threads (default 1 on CPU, torch's on GPU; 0 = torch's)")
    p.add_argument("--tally", action=argparse.BooleanOptionalAction, default=True,
                   help="count one step's bytes, ops and syncs per row (default: on)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="what times a step: the wall clock (default) or the thread's CPU time "
                        "(time.thread_time: leaves out waits for a core on a shared box)")
    p.add_argument("--note", default="",
                   help="a line about the conditions (e.g. 'shared box'), kept in the record")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny list, 3 reps: a smoke test")
    p.add_argument("--out", type=Path, help="also write this run's record as JSON here")
    results.add_arguments(p, "step", note=False)
    args = p.parse_args(argv)
    gpu = torch.device(args.device).type == "cuda"
    if args.workload is None:
        args.workload = "gpt2-tiny" if args.quick else ("gpt2-124m" if gpu else "gpt2-24m")
    if args.reps is None:
        args.reps = 3 if args.quick else (20 if gpu else 7)
    if args.warmup is None:
        args.warmup = 3 if gpu and not args.quick else 1
    if args.threads is None:
        args.threads = 0 if gpu else 1
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r} (choose from {', '.join(VARIANTS)})")
    if args.micro_batches < 1 or args.reps < 1 or args.warmup < 0 or args.threads < 0:
        p.error("--micro-batches and --reps must be >= 1, --warmup and --threads >= 0")
    return args


def build_rows(specs: list[RowSpec], shapes: list[Shape], args: argparse.Namespace,
               device: torch.device) -> tuple[list[StepRow], dict[str, list]]:
    """Every row's model (the same initial values) and the two rotating gradient sets."""
    gen = torch.Generator().manual_seed(args.seed)
    init = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    rsets = {}
    for name, dtype in DTYPES.items():
        rsets[name] = [[torch.randn(s, generator=gen).to(device, dtype) for s in shapes]
                       for _ in range(2)]
    return [ReadRow(spec, init, args.micro_batches) if spec.kind == "read" else
            StepRow(spec, init, args.micro_batches, args.declare_n) for spec in specs], rsets


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    shapes = [s for _, s in WORKLOADS[args.workload]()]
    numel = sum(math.prod(s) for s in shapes)
    specs = row_specs(args.variants)
    started = time.perf_counter()
    _log(f"{args.workload}: {len(shapes)} tensors, {numel / 1e6:.2f}M params, "
         f"{len(specs)} rows on {device}")
    rows, rsets = build_rows(specs, shapes, args, device)
    time_rows(rows, rsets, args.warmup, args.reps, device, args.clock)
    tallies = tally_rows(rows, rsets, args.warmup + args.reps) if args.tally else {}
    expected = args.warmup + args.reps + (1 if args.tally else 0)
    records = [row_record(r, numel, args, expected, tallies.get(r.spec.name)) for r in rows]
    add_ratios(records)
    for r in rows:
        r.close()
    env = environment(device)
    now = datetime.datetime.now(datetime.timezone.utc)
    record = {
        "benchmark": "step", "schema_version": 1, "date": now.isoformat(timespec="seconds"),
        "argv": list(sys.argv[1:] if argv is None else argv), "environment": env,
        "config": {"workload": args.workload, "n_tensors": len(shapes), "numel": numel,
                   "variants": args.variants, "micro_batches": args.micro_batches,
                   "declare_n": args.declare_n, "reps": args.reps, "warmup": args.warmup,
                   "threads": args.threads or None, "tally": args.tally, "seed": args.seed,
                   "quick": args.quick, "optimizer": f"AdamW(lr={LR}, fused=True); SGD rows: "
                                                     f"SGD(lr={LR}, momentum={SGD_MOMENTUM}, "
                                                     "fused=True)",
                   "timer": ("time.thread_time (the thread's CPU time)" if args.clock == "thread"
                             else "time.perf_counter") + " around step()"
                            + (", synchronised" if device.type == "cuda" else ""),
                   "clock": args.clock, "note": args.note,
                   "inner_bytes_per_element": INNER_BYTES, "sgd_bytes_per_element": SGD_BYTES,
                   "lr": LR},
        "rows": records, "elapsed_s": time.perf_counter() - started,
    }
    saved = results.save("step", record, args)
    print(format_table(record), flush=True)
    print("\n" + summary.format_summary({"step": record}), flush=True)
    _log((f"appended a row to {saved}" if saved else "no row appended (--quick/--no-results)")
         + (f"; wrote {args.out}" if args.out else "") + f" ({record['elapsed_s']:.1f} s)")
    return 0 if all(r["status"] == "ok" for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
