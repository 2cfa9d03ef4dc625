"""Benchmark helpers for ``accumulate_``: workloads, providers, checks, timers.

The CLI built from them is ``python -m benchmarks.accumbench`` (see cli.py); the pytest-benchmark
suite in benchmarks/bench_accumulate.py reuses them. Performance is reported as effective
bandwidth (bytes read + written per second) next to a device-to-device ``copy_``.

Modules: workloads (parameter lists), providers (what is timed), measure (buffers, the float64
check, timers), overhead (host time per call), layers (the library's call layers it times),
report (table, plot), env (run metadata), tally (bytes moved by aten ops), step_report, cli,
suites (``step``/``train`` on the command line).
"""

from benchmarks.accumbench.measure import (
    check_provider,
    measure_copy,
    num_buffer_sets,
    quantiles,
    random_tensors,
    sample_indices,
    time_calls,
)
from benchmarks.accumbench.providers import (
    BASELINE_CODE,
    BASELINES,
    NativeGradDtype,
    Provider,
    accumkernels_backends,
    foreach,
    loop_add,
    loop_literal,
    make_providers,
    native_grad_dtype,
    provider_code,
    provider_scale,
    select_providers,
)
from benchmarks.accumbench.workloads import (
    DTYPES,
    LLAMA7B,
    LLAMA7B_NUMEL,
    QUICK_FLAT_NUMEL,
    REL_TOL,
    SCALE,
    WORKLOADS,
    Shape,
    Workload,
    bytes_per_element,
    fit_llama_layers,
    format_count,
    gpt2_124m_shapes,
    gpt2_shapes,
    llama7b_shapes,
    llama_layers_that_fit,
    llama_shapes,
    llama_workload,
    make_workload,
    parse_count,
)

__all__ = [
    "BASELINES", "BASELINE_CODE", "DTYPES", "LLAMA7B", "LLAMA7B_NUMEL", "QUICK_FLAT_NUMEL",
    "REL_TOL", "SCALE", "WORKLOADS", "NativeGradDtype", "Provider", "Shape", "Workload",
    "accumkernels_backends", "bytes_per_element", "check_provider", "fit_llama_layers",
    "foreach", "format_count", "gpt2_124m_shapes", "gpt2_shapes", "llama7b_shapes",
    "llama_layers_that_fit", "llama_shapes", "llama_workload", "loop_add", "loop_literal",
    "make_providers", "make_workload", "measure_copy", "native_grad_dtype", "num_buffer_sets",
    "parse_count", "provider_code", "provider_scale", "quantiles", "random_tensors",
    "sample_indices", "select_providers", "time_calls",
]
