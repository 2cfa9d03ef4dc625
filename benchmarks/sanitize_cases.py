"""Run the GPU kernel cases of tests/gpu_cases.py once each, for compute-sanitizer:

    compute-sanitizer --tool memcheck   python -m benchmarks.sanitize_cases
    compute-sanitizer --tool racecheck  python -m benchmarks.sanitize_cases
    compute-sanitizer --tool initcheck  python -m benchmarks.sanitize_cases
    compute-sanitizer --tool synccheck  python -m benchmarks.sanitize_cases
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck \\
        python -m benchmarks.sanitize_cases          # every tensor its own allocation

    compute-sanitizer --tool memcheck --kernel-name kns=master_step \
        python -m benchmarks.sanitize_cases --kernels master   # the fused master step's cases

Cases (--kernels accumulate): lists of 64/65/256/257/1000/1001 tensors, eager and captured in a
CUDA graph; unaligned views longer than a chunk; found_inf from the vector part; a scale tensor; overwrite; a
non-default stream; for the cuda and triton backends, each checked against the float64
reference. Small tensors by default (--full: the test suite's sizes). With PyTorch's caching
allocator switched off (PYTORCH_NO_CUDA_MEMORY_CACHING=1, so memcheck sees every tensor's own
bounds) graph capture is not possible: the captured cases are skipped and listed as such.
The fused master step's cases (--kernels master, benchmarks/sanitize_master.py): lists of
64/65/400/401/1000 tensors (its parameter tables, then one in device memory), eager and captured,
AdamW, AMSGrad, SGD-momentum, grad_scale, found_inf, a tensor lr, unaligned views.
Exit status 1 if any case fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import gpu_cases  # tests/ is put on the path just above

import accumkernels
from benchmarks import sanitize_master


def cases(backends: list[str], quick: bool, capture: bool, kernels=("accumulate",)):
    """(name, thunk) for every case to run: the accumulate kernels' and/or the master step's."""
    if "master" in kernels:
        yield from sanitize_master.cases(backends, quick, capture)
    if "accumulate" not in kernels:
        return
    dev = torch.device("cuda")  # the current device
    for backend in backends:
        for n in gpu_cases.TABLE_SIZES:
            yield f"{backend} table {n}", lambda b=backend, n=n: gpu_cases.table(b, dev, n, quick)
            if capture:
                yield (f"{backend} table {n} captured",
                       lambda b=backend, n=n: gpu_cases.table_captured(b, dev, n, quick))
        for name, (fn, _) in gpu_cases.CASES.items():
            yield f"{backend} {name}", lambda b=backend, fn=fn: fn(b, dev, quick)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="cuda,triton", help="comma-separated (default both)")
    p.add_argument("--full", action="store_true", help="the test suite's sizes (slower)")
    p.add_argument("--kernels", default="accumulate",
                   help="accumulate, master or both, comma-separated (default accumulate)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sanitize_cases: no GPU", file=sys.stderr)
        return 2
    backends = [b for b in args.backends.split(",") if b]
    missing = [b for b in backends if b not in accumkernels.available_backends("cuda")]
    if missing:
        print(f"sanitize_cases: backends not available: {missing}", file=sys.stderr)
        return 2
    capture = os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0")
    torch.manual_seed(0)
    failed: list[str] = []
    skipped = [] if capture else ["captured cases (caching allocator off)"]
    started = time.perf_counter()
    kernels = [k for k in args.kernels.split(",") if k]
    if not set(kernels) <= {"accumulate", "master"}:
        p.error(f"--kernels: accumulate and/or master, not {args.kernels!r}")
    for name, thunk in cases(backends, not args.full, capture, kernels):
        t0 = time.perf_counter()
        try:
            thunk()
            torch.cuda.synchronize()
            print(f"ok    {name} ({time.perf_counter() - t0:.1f} s)", flush=True)
        except Exception as exc:  # noqa: BLE001 - reported, the next case runs
            failed.append(name)
            print(f"FAIL  {name}: {type(exc).__name__}: {exc}", flush=True)
            traceback.print_exc()
    print(f"sanitize_cases: {len(failed)} failed, skipped: {skipped or 'none'}, "
          f"{time.perf_counter() - started:.1f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
