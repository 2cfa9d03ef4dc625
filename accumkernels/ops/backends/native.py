"""Loader for the compiled module ``accumkernels._C``: the ``cpu`` and ``cuda`` backends.

The extension does not link libtorch. It is reached two ways:

* the fast path (``run``, ``make_plan``): ``_C`` receives the tensors themselves and reads their
  metadata through torch's stable C shim (see csrc/torch_api.h), checks every rule, bumps version
  counters and launches, in one call. It is switched on at import if the shim is found and a
  self-test agrees with torch's own attributes (``READER``, ``READER_NOTE`` say how it went;
  ``ACCUMKERNELS_TENSOR_READER=python`` switches it off);
* the portable path (``accumulate``): tensors already checked in Python, passed as raw addresses,
  element counts and dtype codes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import accumkernels._C as _C
except ImportError as exc:  # not built: only the torch/triton backends are usable
    _C = None
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

# fp32 masters <- bf16/fp16 weights that differ from the rounded master (master_ops.py)
resync_masters_cpu = getattr(_C, "resync_masters_cpu", None)
copy_back_cpu = getattr(_C, "copy_back_cpu", None)  # masters -> weights (torch's cast)

# dtype -> the extension's source dtype code (exported by _C itself)
DTYPE_CODES: dict[torch.dtype, int] = {} if _C is None else {
    torch.float32: _C.DTYPE_FLOAT32, torch.bfloat16: _C.DTYPE_BFLOAT16,
    torch.float16: _C.DTYPE_FLOAT16}

# backend -> KernelKind of csrc/tensor_calls.h (0: check only); cuda_host: tests only
KERNELS = {"cpu": 1, "cuda": 2, "cuda_host": 3}


# device index -> why the CUDA kernels cannot run there (None: they can); probed once per device.
_CUDA_PROBLEMS: dict[int, str | None] = {}


def cuda_problem(device: torch.device) -> str | None:
    """Why the compiled CUDA kernels cannot run on ``device`` (None: they can).

    Asked once per device, the first time a backend is resolved for it: the extension links a
    static CUDA 13 runtime, which needs driver R580+, and torch may run on an older driver that
    its own runtime accepts. The probe also loads every kernel instantiation, so that none is
    first loaded inside a CUDA-graph capture (asked first inside one, it checks the driver only:
    loading there could break the capture; torch asks for a warm-up before capturing anyway). An
    unusable device is reported with one warning; ``auto`` then picks the next backend.
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    if index in _CUDA_PROBLEMS:
        return _CUDA_PROBLEMS[index]
    why = _C.cuda_prepare(index, not torch.cuda.is_current_stream_capturing()) or None
    _CUDA_PROBLEMS[index] = why
    if why is not None:
        warnings.warn(f"accumkernels: the compiled CUDA kernels cannot run on cuda:{index}: {why}; "
                      "backend='auto' uses the next one (triton, else torch)", RuntimeWarning,
                      stacklevel=2)
    return why


def is_available(device: torch.device) -> bool:
    if _C is None:
        return False
    if device.type == "cpu":
        return True
    return (device.type == "cuda" and _C.has_cuda() and torch.cuda.is_available()
            and cuda_problem(device) is None)


def _torch_libraries() -> list[str]:
    """Where the loaded libtorch that exports the C shim may be (tried in order)."""
    lib = Path(torch.__file__).parent / "lib"
    return [str(lib / name) for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "libtorch.so")]


class _Subclass(torch.Tensor):
    """Subclasses may report anything: the reader must leave them to Python."""


def _self_test() -> str | None:
    """Compare what the reader sees with torch's attributes on varied tensors; None if all agree."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    samples = [base, base.t(), base[1:3], base.bfloat16().t()[1:], base.half()[2],
               torch.nn.Parameter(base.clone()), torch.empty(0, 3), torch.tensor(1.5)]
    codes = DTYPE_CODES
    devices = set()
    samples += [torch._neg_view(base), torch.tensor([1 + 2j]).conj().imag, base.t()[1:].detach()]
    for t in samples:
        meta = _C.tensor_meta(t)
        want = (t.data_ptr(), tuple(t.shape), t.numel(), codes.get(t.dtype, -1), t.is_contiguous(),
                t.is_neg())
        if meta is None or (meta[0], tuple(meta[1]), meta[2], meta[3], meta[6], meta[7]) != want \
                or meta[5] != -1:
            return f"reader saw {meta} for a tensor with {want}"
        devices.add(meta[4])
    if len(devices) != 1:
        return "device types disagree"
    if _C.tensor_meta(base.to_sparse()) is not None or _C.tensor_meta(3.0) is not None:
        return "reader accepted a sparse tensor or a non-tensor"
    if _C.tensor_meta(base.as_subclass(_Subclass)) is not None:
        return "reader accepted a tensor subclass"
    meta = _C.tensor_meta(base.double())
    if meta is None or meta[3] != -1:
        return f"reader saw {meta} for a float64 tensor"
    dst, src = [torch.zeros(3)], [torch.full((3,), 2.0, dtype=torch.bfloat16)]
    failed = _C.accumulate_tensors(dst, src, 0.25, None, False, None, 0, KERNELS["cpu"], 1, 0, -1)
    if failed is not None or dst[0].tolist() != [0.5, 0.5, 0.5]:
        return f"a sample call gave {failed}, {dst[0].tolist()}"
    return None


def _find_neg_bit() -> str | None:
    """Teach the reader where a TensorImpl keeps its neg bit (the C shim cannot say); None if
    found. Samples with different key sets (plain, neg, inference, requires_grad, conj,
    Parameter) leave one offset that holds each one's own key set."""
    keys = torch._C._dispatch_keys
    plain = torch.zeros(3)
    neg_bits = keys(torch._neg_view(plain)).raw_repr() & ~keys(plain).raw_repr()
    if neg_bits == 0 or neg_bits & (neg_bits - 1):
        return f"the neg bit is not one key-set bit ({neg_bits:#x})"
    with torch.inference_mode():
        inference = torch.ones(2)
    samples = [plain, torch._neg_view(plain), inference, torch.ones(2, requires_grad=True),
               torch.ones(2, dtype=torch.complex64).conj(), torch.nn.Parameter(torch.ones(3)),
               torch.tensor([1 + 2j]).conj().imag, torch.empty(0, dtype=torch.float16)]
    if not _C.find_keyset_offset(samples, [keys(t).raw_repr() for t in samples], neg_bits):
        return "no TensorImpl offset holds the key set of every sample"
    return None


def _write_samples() -> list[torch.Tensor]:
    """Tensors of every kind the write checks meet: inference or not, requiring grad or not
    (leaf, view, non-leaf, Parameter), detached, low precision, neg and conj bits."""
    with torch.inference_mode():
        inference = torch.ones(4)
        inference_bf16 = torch.ones(2, dtype=torch.bfloat16)
        inference_view = inference[1:]
    leaf = torch.ones(3, requires_grad=True)
    samples = [torch.zeros(3), inference, inference_bf16, inference_view, leaf, leaf[1:],
               leaf * 2, leaf.detach(), torch.nn.Parameter(torch.ones(2)),
               torch.nn.Parameter(torch.ones(2), requires_grad=False),
               torch.ones(2, dtype=torch.bfloat16), torch._neg_view(torch.ones(2)),
               torch.ones(2, dtype=torch.complex64).conj(), torch.empty(0, dtype=torch.float16)]
    with torch.no_grad():
        samples.append(leaf[:2])  # a view made without grad mode: still requires grad
    return samples


def _start_fast_writes() -> str:
    """Switch on the reader's own write checks (requires_grad, inference-ness) and version bump
    where they agree with torch on samples; says which are on."""
    keys = torch._C._dispatch_keys
    with torch.inference_mode():
        inference = torch.ones(2)
    # The bits a normal tensor has and an inference one lacks: ADInplaceOrView and Autograd.
    mask = keys(torch.zeros(2)).raw_repr() & ~keys(inference).raw_repr()
    samples = _write_samples()
    return _C.enable_fast_writes(samples, [t.is_inference() for t in samples],
                                 [t.requires_grad for t in samples], mask)


def _start_reader() -> tuple[bool, str]:
    if _C is None:
        return False, f"accumkernels._C is not built ({IMPORT_ERROR})"
    if os.environ.get("ACCUMKERNELS_TENSOR_READER", "").lower() == "python":
        return False, "switched off by ACCUMKERNELS_TENSOR_READER=python"
    why = "no libtorch found"
    for path in _torch_libraries():
        ok, why = _C.init_torch_api(torch.Tensor, torch.nn.Parameter, path,
                                    torch._C._increment_version)
        if ok:
            base = torch.zeros(4)
            _C.find_impl_offset([base, base[1:], torch.ones(2, 3).t(), torch.nn.Parameter(base),
                                 torch.empty(0, dtype=torch.bfloat16), torch.tensor(1.0)])
            problem = _find_neg_bit()
            if problem is None:
                problem = _self_test()
            if problem is None:
                on = _start_fast_writes()
                return True, f"torch C shim in {path}" + (f" (own {on})" if on else "")
            _C.disable_torch_api()
            return False, f"self-test failed: {problem}"
    return False, why


READER, READER_NOTE = _start_reader()
# Which write checks the reader answers itself (requires_grad, inference, bump), not through
# Python attributes: a subset of those three names, empty without the reader.
OWN_WRITE_CHECKS = frozenset(READER_NOTE.partition("(own ")[2].rstrip(")").split(",")) - {""}

def _stream(device: torch.device) -> int:
    try:
        return torch._C._cuda_getCurrentRawStream(device.index)
    except AttributeError:  # older torch: the same handle through the Stream object
        return torch.cuda.current_stream(device).cuda_stream


_num_threads = torch.get_num_threads


def _launch_args(backend: str, device: torch.device) -> tuple[int, int, int, int]:
    """(kernel, num_threads, stream, device index) for the fast path."""
    kernel = KERNELS.get(backend, 0)
    if kernel == 1:
        return kernel, _num_threads(), 0, -1
    if kernel == 2:
        return kernel, 0, _stream(device), device.index
    return kernel, 0, 0, -1


def run(dst, src, scale: float, scale_tensor, overwrite: bool, found_inf, flags: int,
        backend: str, device: torch.device, norm_sq=None) -> tuple | None:
    """The fast path: check, bump versions, launch (``backend`` "cpu"/"cuda"; any other: check
    and bump only). None on success, else (code, i, j) with nothing written."""
    if backend == "cpu":
        return _C.accumulate_tensors(dst, src, scale, scale_tensor, overwrite, found_inf, flags,
                                     1, _num_threads(), 0, -1, norm_sq)
    return _C.accumulate_tensors(dst, src, scale, scale_tensor, overwrite, found_inf, flags,
                                 *_launch_args(backend, device), norm_sq)


def run_cpu(dst, src, scale: float, scale_tensor, overwrite: bool, found_inf,
            flags: int, norm_sq=None) -> tuple | None:
    """``run`` for the cpu backend (the common call, kept short)."""
    return _C.accumulate_tensors(dst, src, scale, scale_tensor, overwrite, found_inf, flags, 1,
                                 _num_threads(), 0, -1, norm_sq)


def make_plan(dst, keys, owner, inference: bool, norm_slots=None, norm_len: int = -1):
    """A ``_C.Plan`` for a fixed dst list, or (code, i, j) when the list breaks a rule. A
    launch's norm_sq has ``norm_len`` elements, dst i's at ``norm_slots[i]`` (None: i)."""
    return _C.Plan.create(dst, keys, owner, inference, norm_slots, norm_len)


def run_plan(plan, keys, src, scale: float, scale_tensor, overwrite: bool, found_inf, flags: int,
             backend: str, device: torch.device, norm_sq=None) -> tuple | None:
    return plan.run(keys, src, scale, scale_tensor, overwrite, found_inf, flags,
                    *_launch_args(backend, device), norm_sq)


def accumulate(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
    norm_sq: torch.Tensor | None = None,
    norm_slots: list[int] | None = None,
) -> None:
    """The portable path: already-checked, non-empty lists as raw addresses and sizes (dst i's
    squared norm into ``norm_sq[norm_slots[i]]``)."""
    codes = DTYPE_CODES
    norm = (norm_sq.data_ptr(), norm_slots) if norm_sq is not None else (0, None)
    args = (
        [d.data_ptr() for d in dst],
        [x.data_ptr() for x in src],
        [d.numel() for d in dst],
        [codes[x.dtype] for x in src],
        float(scale),
        scale_tensor.data_ptr() if scale_tensor is not None else 0,
        bool(overwrite),
        found_inf.data_ptr() if found_inf is not None else 0,
    )
    device = dst[0].device
    if device.type == "cpu":
        _C.accumulate_cpu(*args, torch.get_num_threads(), *norm)
    else:
        _C.accumulate_cuda(*args, _stream(device), device.index, *norm)


def cpu_parallel_threshold(elements: int | None = None) -> int | None:
    """Elements per call from which the CPU kernel splits the work over threads (None: no
    extension). With ``elements``, set it (benchmarks measure the crossover) and return the
    previous value."""
    if _C is None:
        return None
    if elements is None:
        return _C.cpu_parallel_threshold()
    return _C.set_cpu_parallel_threshold(elements)


def prepared_launch(dst: list[torch.Tensor], src: list[torch.Tensor], scale: float,
                    overwrite: bool) -> Callable[[], None]:
    """The portable path's launch with its arguments marshalled once (for benchmarks)."""
    args = ([d.data_ptr() for d in dst], [x.data_ptr() for x in src], [d.numel() for d in dst],
            [DTYPE_CODES[x.dtype] for x in src], float(scale), 0, bool(overwrite), 0)
    device = dst[0].device
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return lambda: _C.accumulate_cpu(*args, threads)
    stream = _stream(device)
    return lambda: _C.accumulate_cuda(*args, stream, device.index)
