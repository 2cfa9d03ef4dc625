"""The fused master step's cases for compute-sanitizer (``sanitize_cases.py --kernels master``).

Each case runs ``master_adam_step_`` / ``master_sgd_step_`` with one backend ("cuda" or
"triton") on fresh random data and compares masters, weights, state and grads with the same step
by the reference backend ("torch") on clones, within rounding (``_compare``: this looks for
memory errors and garbage; tests/op/test_master_step_gpu.py is the bit-for-bit judge). Sizes
cross the CUDA kernel's table capacities (64 and 400 entries in the kernel parameters, then a
table in device memory; captured: parameter-table groups) and its 8192-element chunks, with
unaligned views (every third tensor one element into a larger buffer), bf16 and fp16 weights in
one call, grad_scale, found_inf and a tensor lr read on the device. ``quick`` keeps every list
length and shrinks the tensors. The cases run on the CPU too (backend "triton" under the
interpreter), which is how tests/test_gpu_session_tools.py checks them without a GPU.
"""

from __future__ import annotations

import torch

from accumkernels import master_adam_step_, master_sgd_step_

LIST_SIZES = (64, 65, 400, 401, 1000)
CHUNK = 8192


def _lists(n: int, device, quick: bool, kind: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    top = 40 if quick else 3000
    sizes = torch.randint(1, top, (n,), generator=g).tolist()
    sizes[0] = CHUNK + 5 if not quick or n <= 65 else 300  # one over a chunk
    out: dict = {k: [] for k in ("masters", "weights", "grads", "s0", "s1", "s2", "steps")}
    for i, numel in enumerate(sizes):
        def t(scale: float = 1.0, positive: bool = False, i=i, numel=numel) -> torch.Tensor:
            x = torch.randn(numel + 1, generator=g) * scale
            x = (x.abs() + 1e-6 if positive else x).to(device)
            return x[1:] if i % 3 == 2 else x[:numel]  # every third: one element in
        m = t()
        out["masters"].append(m)
        w_dtype = torch.bfloat16 if i % 2 else torch.float16
        w = m.to(w_dtype)
        if numel > 2:
            w[numel // 2] = w[numel // 2] * 2 + 1  # a written weight
        out["weights"].append(w)
        out["grads"].append(t(0.1))
        out["s0"].append(t(0.01))
        out["s1"].append(t(0.001, positive=True))
        out["s2"].append(t(0.001, positive=True))
        out["steps"].append(torch.tensor(float(1 + i % 7), device=device))
    return out


def _clone(s: dict) -> dict:
    return {k: [x.clone() for x in v] for k, v in s.items()}


def _step(s: dict, kind: str, backend: str, *, scale=None, found_inf=None, lr=2e-3) -> None:
    common = dict(grad_scale=scale, found_inf=found_inf, backend=backend)
    if kind == "sgd":
        master_sgd_step_(s["masters"], s["weights"], s["grads"], s["s0"], lr=lr, momentum=0.9,
                         dampening=0.0, weight_decay=0.01, nesterov=True, **common)
    else:
        amsgrad = kind == "adam_amsgrad"
        master_adam_step_(s["masters"], s["weights"], s["grads"], s["s0"], s["s1"],
                          s["s2"] if amsgrad else None,
                          s["steps"], lr=lr, beta1=0.9, beta2=0.999, weight_decay=0.01,
                          eps=1e-8, amsgrad=amsgrad, adamw=kind == "adamw", **common)


def _compare(got: dict, want: dict, what: str) -> None:
    """Garbage, not ulps: within 1e-5 relative (+1e-6), weights within one bf16 ulp (a master one
    ulp off can round the other way). Bit identity is tests/op/test_master_step_gpu.py's job."""
    for key in ("masters", "weights", "grads", "s0", "s1", "s2"):
        rtol = 2.0**-7 if key == "weights" else 1e-5
        for i, (a, b) in enumerate(zip(got[key], want[key])):
            close = torch.isclose(a.float(), b.float(), rtol=rtol, atol=1e-6, equal_nan=True)
            if not bool(close.all()):
                raise AssertionError(f"{what}: {key}[{i}] ({a.numel()} elements): "
                                     f"{int((~close).sum())} differ from the reference backend")


def step_case(backend: str, device, n: int, kind: str, quick: bool = True, *,
              extras: bool = False, captured: bool = False) -> None:
    """One step of ``kind`` ("adamw", "adam_amsgrad", "sgd") on a list of ``n`` tensors."""
    s = _lists(n, device, quick, kind, seed=n * 7 + len(kind))
    want = _clone(s)
    kw: dict = {}
    if extras:  # grad_scale, found_inf (zero: the step runs) and a tensor lr, all on the device
        kw = dict(scale=torch.tensor(4.0, device=device),
                  found_inf=torch.zeros((), device=device),
                  lr=torch.tensor(2e-3, device=device))
    if captured:
        _step(_clone(s), kind, backend, **kw)  # warm-up outside the capture (compiles, loads)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            _step(s, kind, backend, **kw)
        graph.replay()
    else:
        _step(s, kind, backend, **kw)
    ref_kw = {k: (v.cpu() if isinstance(v, torch.Tensor) and k == "lr" else v)
              for k, v in kw.items()}
    _step(want, kind, "torch", **ref_kw)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    _compare(s, want, f"{backend} {kind} {n} tensors")


def found_inf_writes_nothing(backend: str, device, quick: bool = True) -> None:
    s = _lists(65, device, quick, "adamw", seed=3)
    before = _clone(s)
    _step(s, "adamw", backend, scale=torch.tensor(2.0, device=device),
          found_inf=torch.ones((), device=device))
    for key, tensors in s.items():
        for a, b in zip(tensors, before[key]):
            assert torch.equal(a, b), f"{backend} found_inf: {key} written"


def cases(backends: list[str], quick: bool, capture: bool):
    """(name, thunk) for every master-step case (device: the current CUDA device)."""
    dev = torch.device("cuda")
    for backend in backends:
        for n in LIST_SIZES:
            for kind in ("adamw", "sgd"):
                yield (f"master {backend} {kind} {n}",
                       lambda b=backend, n=n, k=kind: step_case(b, dev, n, k, quick))
            if capture:
                yield (f"master {backend} adamw {n} captured",
                       lambda b=backend, n=n: step_case(b, dev, n, "adamw", quick,
                                                        captured=True))
        yield (f"master {backend} adam_amsgrad extras",
               lambda b=backend: step_case(b, dev, 257, "adam_amsgrad", quick, extras=True))
        yield (f"master {backend} sgd extras",
               lambda b=backend: step_case(b, dev, 65, "sgd", quick, extras=True))
        yield (f"master {backend} found_inf", lambda b=backend: found_inf_writes_nothing(b, dev,
                                                                                        quick))
