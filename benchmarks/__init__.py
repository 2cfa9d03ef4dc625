"""accumkernels' benchmarks: one package at the repository root, outside the installed library.

Run every benchmark as a module from the repository root, ``python -m benchmarks.<name>``
(``make bench`` runs ``python -m benchmarks.accumbench``, ``... step`` and ``... train``);
every module imports its siblings absolutely, ``from benchmarks.accumbench.env import ...``.

accumbench/        the shared helpers (workloads, providers, timers, reports) and the CLI
bench_accumulate   pytest-benchmark suite of ``accumulate_`` (collected by pytest)
bench_step         the optimizer step against the inner optimizer's own (``accumbench step``)
bench_train        end-to-end training: large batch vs accumulation (``accumbench train``)
bench_wrapper      the wrapper's cost per micro-batch and its peak memory
bench_wgrad        fused weight-gradient accumulation against the unfused wrapper
bench_fsdp2        FSDP2 on CPU/gloo: gradient memory, reduce-scatter bytes, time per window
find_batch         find_micro_batch_size up to a real out-of-memory
tune_kernels       the kernels' knobs (Triton grid, CUDA vector store) timed
sass_check         what the kernels compile to (SASS), no GPU needed
sanitize_cases     the GPU cases compute-sanitizer runs
targets            a record next to the design's performance targets
"""
