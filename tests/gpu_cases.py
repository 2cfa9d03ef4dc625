"""The GPU kernel cases, shared by tests/op/test_gpu_kernels.py, tests/op/test_cuda_host.py and
benchmarks/sanitize_cases.py (compute-sanitizer runs them once).

Each case runs ``accumulate_`` with one backend on fresh random data (never zeros) and checks
every element of every dst against the float64 reference (tests/reference.py); an
AssertionError names what differs. ``quick`` shrinks the tensors (sanitizers are 10-100x
slower) but keeps every size that matters: lists of 64/65/256/257/1000/1001 tensors (the CUDA
kernel's parameter-table capacities 64, 256, 1000, then a table in device memory or, captured,
groups of 1000) and tensors longer than one 8192-element chunk. The cases also run on the CPU
backends (``device="cpu"``), except those that need CUDA (graph capture, a side stream).
"""

from __future__ import annotations

import math

import torch
from reference import Reference

import accumkernels

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
TABLE_SIZES = (64, 65, 256, 257, 1000, 1001)
CHUNK = 8192  # elements per chunk of the CUDA kernel (kChunkElems)
NAN = float("nan")
U32 = 2.0**-24  # unit roundoff of float32
FLT_MAX = torch.finfo(torch.float32).max


def rand_src(numel: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Random gradients spread over several binades (never zeros)."""
    x = torch.randn(numel) * torch.exp2(torch.randint(-6, 6, (numel,)).float())
    return x.to(dtype).to(device)


def rand_dst(numel: int, device) -> torch.Tensor:
    return torch.randn(numel).to(device)


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _check(refs: list[Reference], dst: list[torch.Tensor], what: str) -> None:
    for i, (r, d) in enumerate(zip(refs, dst)):
        r.check(d, f"{what}: dst[{i}]")


def _expect(dst, src, scale: float, overwrite: bool = False) -> list[Reference]:
    refs = [Reference(d) for d in dst]
    for r, x in zip(refs, src):
        r.add(x, scale, overwrite=overwrite)
    return refs


def _table_list(n: int, device, quick: bool):
    """n tensors of mixed dtypes and sizes, two of them longer than a chunk."""
    high = 3000 if quick else 20000
    numels = torch.randint(1, high, (n,)).tolist()
    numels[0], numels[-1] = 2 * CHUNK + 3, CHUNK + 1
    dst = [rand_dst(k, device) for k in numels]
    src = [rand_src(k, DTYPES[i % 3], device) for i, k in enumerate(numels)]
    return dst, src


def table(backend: str, device, n: int, quick: bool = False) -> None:
    """A list of n tensors in one call, with a float scale, then with a scale tensor."""
    dst, src = _table_list(n, device, quick)
    refs = _expect(dst, src, 0.375)
    found_inf = torch.zeros(1, device=device)
    accumkernels.accumulate_(dst, src, 0.375, found_inf=found_inf, backend=backend)
    _check(refs, dst, f"{n} tensors")
    assert found_inf.item() == 0.0, f"{n} tensors: found_inf raised on finite data"
    scale = torch.tensor(-1.25, device=device)
    refs = _expect(dst, src, -1.25)
    accumkernels.accumulate_(dst, src, scale, backend=backend)
    _check(refs, dst, f"{n} tensors, scale tensor")


def table_captured(backend: str, device, n: int, quick: bool = False, replays: int = 2
                   ) -> torch.cuda.CUDAGraph:
    """The same list captured in a CUDA graph (after one eager call: Triton compiles there);
    every replay reads new src, dst and scale values; a NaN put in later raises found_inf.
    Then the list with norm_sq, in a graph of its own (_norm_sq_captured). Returns the first
    graph (callers check what it keeps alive)."""
    dst, src = _table_list(n, device, quick)
    scale = torch.tensor(0.5, device=device)
    found_inf = torch.zeros(1, device=device)
    accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accumkernels.accumulate_(dst, src, scale, found_inf=found_inf, backend=backend)
    for replay in range(replays):
        value = 0.25 * (replay + 1)
        for d, x in zip(dst, src):
            d.normal_()
            x.copy_(rand_src(x.numel(), x.dtype, device))
        scale.fill_(value)
        found_inf.zero_()
        refs = _expect(dst, src, value)
        graph.replay()
        _sync(device)
        _check(refs, dst, f"{n} tensors, replay {replay}")
        assert found_inf.item() == 0.0, f"{n} tensors, replay {replay}: found_inf raised"
    src[n // 2][-1] = NAN
    graph.replay()
    _sync(device)
    assert found_inf.item() == 1.0, f"{n} tensors: a NaN in a replay did not raise found_inf"
    _norm_sq_captured(backend, device, *_table_list(n, device, quick))
    return graph


def unaligned_views(backend: str, device, quick: bool = False) -> None:
    """Views longer than a chunk at every misalignment of dst and src (each alone and both),
    among aligned ones, per source dtype; then the same with overwrite. The memory between the
    views is never written."""
    n = CHUNK + 4096 + 5 if quick else 3 * CHUNK + 7
    # (dst shift, src shift) in elements; 16 fp32 / 8 bf16 elements keep 16-byte alignment.
    shifts = [(0, 0), (1, 0), (0, 3), (5, 7), (16, 8), (2, 1)]
    stride = (n + 32) // 16 * 16 + 16  # a multiple of 16 elements: view k starts aligned
    for dtype in DTYPES:
        for overwrite in (False, True):
            dst_store = rand_dst(len(shifts) * stride, device)
            src_store = rand_src(len(shifts) * stride, dtype, device)
            dst, src = [], []
            for k, (ds, ss) in enumerate(shifts):
                at = k * stride
                dst.append(dst_store[at + ds:at + ds + n])
                src.append(src_store[at + ss:at + ss + n])
            if overwrite:
                for d in dst:
                    d.fill_(NAN)
            outside = torch.ones(dst_store.numel(), dtype=torch.bool, device=device)
            for k, (ds, _) in enumerate(shifts):
                outside[k * stride + ds:k * stride + ds + n] = False
            before = dst_store[outside].clone()
            refs = _expect(dst, src, 0.625, overwrite)
            accumkernels.accumulate_(dst, src, 0.625, overwrite=overwrite, backend=backend)
            _check(refs, dst, f"unaligned views, {dtype}, overwrite={overwrite}")
            assert torch.equal(dst_store[outside].view(torch.int32), before.view(torch.int32)), \
                f"unaligned views, {dtype}, overwrite={overwrite}: memory between views written"


def found_inf_vector(backend: str, device, quick: bool = False) -> None:
    """found_inf is raised by one inf/NaN in the 16-byte vector part of an aligned tensor (first
    chunk, a later chunk) and in a tail, and a clean call never raises it."""
    sizes = (2 * CHUNK + 5, 5003, 3 * CHUNK)
    spots = [(0, 100, NAN), (2, CHUNK + 1024, float("inf")), (0, 2 * CHUNK + 4, float("-inf")),
             (1, 4999, NAN)]
    for dtype in DTYPES:
        for t, i, bad in spots:
            dst = [rand_dst(k, device) for k in sizes]
            src = [rand_src(k, dtype, device) for k in sizes]
            src[t][i] = bad
            refs = _expect(dst, src, 0.5)
            found_inf = torch.zeros(1, device=device)
            accumkernels.accumulate_(dst, src, 0.5, found_inf=found_inf, backend=backend)
            assert found_inf.item() == 1.0, f"{dtype}: {bad} at src[{t}][{i}] not flagged"
            _check(refs, dst, f"found_inf, {dtype}, src[{t}][{i}]")
            clean = [rand_src(k, dtype, device) for k in sizes]
            fresh = torch.zeros((), device=device)
            clean_dst = [rand_dst(k, device) for k in sizes]
            accumkernels.accumulate_(clean_dst, clean, 0.5, found_inf=fresh, backend=backend)
            assert fresh.item() == 0.0, f"{dtype}: found_inf raised on finite data"


def found_inf_overflow(backend: str, device, quick: bool = False) -> None:
    """Finite src, one fp32 sum past FLT_MAX (vector part, a later chunk, a tail): flagged; the
    same sums one binade lower: not flagged (the flag reports the written result)."""
    sizes = (2 * CHUNK + 5, 5003, 3 * CHUNK)
    big = torch.finfo(torch.float32).max
    for dtype in DTYPES:
        for t, i in ((0, 100), (2, CHUNK + 1024), (0, 2 * CHUNK + 4), (1, 4999)):
            flags = []
            for share in (0.25, 0.75):  # 2**127 + share * FLT_MAX overflows for 0.75 only
                dst = [rand_dst(k, device) for k in sizes]
                src = [rand_src(k, dtype, device) for k in sizes]
                src[t][i], dst[t][i] = 2.0 ** 12, big * share
                found_inf = torch.zeros(1, device=device)
                accumkernels.accumulate_(dst, src, 2.0 ** 115, found_inf=found_inf,
                                         backend=backend)
                flags.append(found_inf.item())
            assert flags == [0.0, 1.0], f"{dtype}: overflow at dst[{t}][{i}]: flags {flags}"


def scale_tensor(backend: str, device, quick: bool = False) -> None:
    """The scale read from device memory (0-dim and 1-element), on mixed dtypes and sizes."""
    sizes = (1, 3, 4097, 2 * CHUNK + 1)
    for shape in ((), (1,)):
        dst = [rand_dst(k, device) for k in sizes]
        src = [rand_src(k, DTYPES[i % 3], device) for i, k in enumerate(sizes)]
        scale = torch.full(shape, -0.7109375, device=device)
        refs = _expect(dst, src, -0.7109375)
        accumkernels.accumulate_(dst, src, scale, backend=backend)
        _check(refs, dst, f"scale tensor of shape {shape}")


def overwrite(backend: str, device, quick: bool = False) -> None:
    """overwrite=True never reads dst (poisoned with NaN), with a float and a tensor scale."""
    sizes = (1, 7, 4097, CHUNK, CHUNK + 1, 65538)
    for scale in (0.25, torch.tensor(0.25, device=device)):
        dst = [torch.full((k,), NAN, device=device) for k in sizes]
        src = [rand_src(k, DTYPES[i % 3], device) for i, k in enumerate(sizes)]
        refs = _expect(dst, src, 0.25, overwrite=True)
        found_inf = torch.zeros(1, device=device)
        accumkernels.accumulate_(dst, src, scale, overwrite=True, found_inf=found_inf,
                                 backend=backend)
        _check(refs, dst, f"overwrite, scale {type(scale).__name__}")
        assert found_inf.item() == 0.0


def check_norm_sq(norm_sq: torch.Tensor, dst: list[torch.Tensor], what: str = "") -> None:
    """norm_sq[i] against sum(dst[i]**2) in float64 over the fp32 values written. A sum of n
    non-negative fp32 terms, each a rounded (or fused) square, in any order or tree, is within
    gamma(n+1) = (n+1)u / (1-(n+1)u) of the exact value, relatively (Higham, recursive
    summation), plus half an ulp of the subnormals per square that underflows; inf/NaN patterns
    must match (a sum past FLT_MAX is inf)."""
    got = norm_sq.detach().to("cpu", torch.float64)
    assert got.shape == (len(dst),), f"{what}: norm_sq has shape {tuple(got.shape)}"
    for i, d in enumerate(dst):
        x = d.detach().to("cpu", torch.float64).reshape(-1)
        n, ref, g = x.numel(), float((x * x).sum()), float(got[i])
        where = f"{what}: norm_sq[{i}] ({n} elements) = {g!r}, float64 {ref!r}"
        if math.isnan(ref) or math.isinf(ref):
            assert (math.isnan(g) if math.isnan(ref) else g == ref), where
            continue
        k = (n + 1) * U32
        bound = k / (1 - k) * ref + n * 2.0**-150
        if ref > FLT_MAX * (1 - k) and g == float("inf"):  # the fp32 sum overflows (or may)
            continue
        assert abs(g - ref) <= bound, f"{where}: error {abs(g - ref):.3e} > bound {bound:.3e}"


def _norm_list(device, quick: bool):
    """_table_list's tensors plus an empty one and two unaligned views longer than a chunk."""
    dst, src = _table_list(65 if quick else 257, device, quick)
    dst.insert(3, torch.zeros(0, device=device))
    src.insert(3, torch.zeros(0, dtype=torch.bfloat16, device=device))
    store_d, store_s = rand_dst(2 * CHUNK + 64, device), rand_src(2 * CHUNK + 64, DTYPES[1], device)
    dst += [store_d[1:CHUNK + 6], store_d[CHUNK + 16:2 * CHUNK + 21]]
    src += [store_s[3:CHUNK + 8], store_s[CHUNK + 24:2 * CHUNK + 29]]
    return dst, src


def norm_sq(backend: str, device, quick: bool = False) -> None:
    """norm_sq (the squared L2 norm of each written dst) on a list of mixed dtypes and sizes (two
    longer than a chunk, one empty, two unaligned views): add with a float scale, then overwrite
    with a scale tensor, each into a vector poisoned with NaN (overwritten, not added to); dst
    still matches the reference."""
    dst, src = _norm_list(device, quick)
    for overwrite, scale in ((False, 0.375), (True, torch.tensor(-1.25, device=device))):
        value = float(scale)
        norm = torch.full((len(dst),), NAN, device=device)
        refs = _expect(dst, src, value, overwrite)
        accumkernels.accumulate_(dst, src, scale, overwrite=overwrite, norm_sq=norm,
                                 backend=backend)
        _sync(device)
        _check(refs, dst, f"norm_sq, overwrite={overwrite}")
        check_norm_sq(norm, dst, f"overwrite={overwrite}")


def _norm_sq_captured(backend: str, device, dst: list, src: list) -> None:
    """norm_sq inside a CUDA graph: every replay zeroes and recomputes the norms of its new dst
    (nothing is kept from the last replay), with found_inf alongside."""
    norm = torch.zeros(len(dst), device=device)
    found_inf = torch.zeros(1, device=device)
    accumkernels.accumulate_(dst, src, 0.5, found_inf=found_inf, norm_sq=norm, backend=backend)
    _sync(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        accumkernels.accumulate_(dst, src, 0.5, found_inf=found_inf, norm_sq=norm,
                                 backend=backend)
    for replay in range(2):
        for d, x in zip(dst, src):
            d.normal_()
            x.copy_(rand_src(x.numel(), x.dtype, device))
        norm.fill_(NAN)
        refs = _expect(dst, src, 0.5)
        graph.replay()
        _sync(device)
        _check(refs, dst, f"norm_sq captured, replay {replay}")
        check_norm_sq(norm, dst, f"captured, replay {replay}")
    assert found_inf.item() == 0.0


def side_stream(backend: str, device, quick: bool = False) -> None:
    """A call on a non-default stream runs on that stream: it sees src written there after a
    long sleep (on the default stream it would read the old values) and is done when that
    stream is."""
    sizes = (3, 4097, 2 * CHUNK + 3, 70001)
    dst = [rand_dst(k, device) for k in sizes]
    src = [rand_src(k, DTYPES[i % 3], device) for i, k in enumerate(sizes)]
    fresh = [rand_src(k, x.dtype, device) for k, x in zip(sizes, src)]
    refs = _expect(dst, fresh, 0.5)
    torch.cuda.synchronize(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        sleep = getattr(torch.cuda, "_sleep", None)
        if sleep is not None:
            sleep(50_000_000)  # ~25 ms of spinning on this stream before the writes
        for x, y in zip(src, fresh):
            x.copy_(y)
        accumkernels.accumulate_(dst, src, 0.5, backend=backend)
    stream.synchronize()
    _check(refs, dst, "side stream")


# name -> (case, needs CUDA)
CASES = {
    "unaligned_views": (unaligned_views, False),
    "found_inf_vector": (found_inf_vector, False),
    "found_inf_overflow": (found_inf_overflow, False),
    "scale_tensor": (scale_tensor, False),
    "overwrite": (overwrite, False),
    "side_stream": (side_stream, True),
    "norm_sq": (norm_sq, False),
}
