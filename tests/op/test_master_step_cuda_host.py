"""The fused master step's CUDA kernel source, played on the CPU ("cuda_host"), against an exact
model of the arithmetic csrc/master_step_kernel.h documents: bit for bit.

The model (``step_spec``) is written here with numpy, independently of the kernel: fp32 +, -, *,
/, sqrt are numpy's float32 operations (IEEE, correctly rounded); fp64 ones numpy's float64; a
fused multiply-add is computed exactly (``fma32``: TwoSum in float64 and a tie fix-up, proof in
its docstring; ``fma64``: rational arithmetic); pow is the correctly rounded power of the beta to
the (integer) step, which is what the host emulation computes on these values, not a model of
nvcc's powf: what these tests prove is every operation but pow (see ``pow32``). NaN results of
arithmetic are the GPU's canonical 0x7fffffff.

Every tensor sits between NaN guard bytes that must stay untouched (out-of-bounds writes). The
launch side is covered too: parameter tables, groups of them for long lists (captured or
not), one launch per weight dtype, the grid-stride loop (SM count varied).
"""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from accumkernels.ops.backends import master_step_cuda as msc
from accumkernels.ops.backends import native

pytestmark = pytest.mark.skipif(not msc.host_available(), reason="accumkernels._C is not built")

GUARD = 64  # bytes each side: keeps the 16-byte alignment of a fresh allocation
CANON32 = np.uint32(0x7FFFFFFF)

# ---- exact arithmetic -----------------------------------------------------------------------


def canon(x: np.ndarray) -> np.ndarray:
    """NaN -> the canonical NaN of the GPU's arithmetic (fp32 0x7fffffff, fp64 0x7fff...f)."""
    x = np.array(x, copy=True)
    bits = x.view(np.uint32 if x.dtype == np.float32 else np.uint64)
    bits[np.isnan(x)] = 0x7FFFFFFF if x.dtype == np.float32 else 0x7FFFFFFFFFFFFFFF
    return x


def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def add32(a, b):
    return canon(f32(a) + f32(b))


def sub32(a, b):
    return canon(f32(a) - f32(b))


def mul32(a, b):
    return canon(f32(a) * f32(b))


def div32(a, b):
    with np.errstate(all="ignore"):
        return canon(f32(a) / f32(b))


def sqrt32(a):
    with np.errstate(all="ignore"):
        return canon(np.sqrt(f32(a)))


def neg32(a):
    a = np.array(f32(a), copy=True)
    a.view(np.uint32)[...] ^= np.uint32(0x80000000)
    return a


def fma32(a, b, c) -> np.ndarray:
    """Correctly rounded fp32 a*b+c, vectorised.

    p = a*b is exact in float64 (24+24 <= 53 significant bits, no overflow or underflow for fp32
    operands). TwoSum gives s = RN64(p + c) and e with s + e = p + c exactly. Claim: when s is not
    the midpoint of two neighbouring fp32 values, RN32(s + e) = RN32(s). Every fp32 midpoint is a
    float64 (subnormal ones included); |e| is at most half the float64 spacing at
    s in e's direction, so no float64 other than s lies strictly between s and s + e, nor equals
    s + e (e != 0 and |e| < the spacing): no midpoint separates s from s + e. When s IS a midpoint,
    e decides: e > 0 rounds up, e < 0 down, e == 0 ties to even (numpy's RN32(s)). (A sum at the
    overflow threshold 2^128 - 2^103 is left to numpy: the tests stay far from it.)
    """
    a, b, c = np.broadcast_arrays(f32(a), f32(b), f32(c))
    with np.errstate(all="ignore"):
        p = a.astype(np.float64) * b.astype(np.float64)
        cd = c.astype(np.float64)
        s = p + cd
        bb = s - p
        e = (p - (s - bb)) + (cd - bb)  # TwoSum: s + e == p + c exactly (finite s)
        r = s.astype(np.float32)
        finite = np.isfinite(s) & np.isfinite(r)
        r64 = r.astype(np.float64)
        toward = np.where(s > r64, np.float32(np.inf), np.float32(-np.inf))
        other = np.nextafter(r, toward.astype(np.float32))
        midpoint = finite & (s != r64) & ((r64 + other.astype(np.float64)) / 2 == s)
        # s is a tie RN32 broke toward r: the exact sum is past it (other's side) when e points
        # away from r; when e points back, or is 0 (a true tie, to even), r stands.
        away = midpoint & (e != 0) & (np.sign(e) == np.sign(s - r64))
        r = np.where(away, other, r)
    return canon(r)


def fma64(a, b, c) -> np.ndarray:
    """Correctly rounded fp64 a*b+c, elementwise with rationals (non-finite: IEEE float64)."""
    a, b, c = np.broadcast_arrays(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                  np.asarray(c, np.float64))
    out = np.empty(a.shape, np.float64)
    fa, fb, fc, fo = a.ravel(), b.ravel(), c.ravel(), out.reshape(-1)
    for i in range(fa.size):
        x, y, z = float(fa[i]), float(fb[i]), float(fc[i])
        if math.isfinite(x) and math.isfinite(y) and math.isfinite(z):
            fo[i] = float(Fraction(x) * Fraction(y) + Fraction(z))  # int/int: correctly rounded
        else:
            with np.errstate(all="ignore"):
                fo[i] = np.float64(x) * np.float64(y) + np.float64(z)
    return canon(out)


def f64op(fn, *args) -> np.ndarray:
    with np.errstate(all="ignore"):
        return canon(fn(*[np.asarray(a, np.float64) for a in args]))


def to32(x) -> np.ndarray:
    return np.asarray(x, np.float64).astype(np.float32)


def round_fraction_f32(q: Fraction) -> np.float32:
    """The fp32 nearest to the rational q (ties to even), exactly."""
    if q == 0:
        return np.float32(0.0)
    sign = -1 if q < 0 else 1
    q = abs(q)
    e = q.numerator.bit_length() - q.denominator.bit_length()  # 2^e <= q < 2^(e+2)
    if Fraction(2) ** e > q:
        e -= 1
    e = max(e, -126)  # subnormals share the quantum 2^-149
    quantum = Fraction(2) ** (e - 23)
    m = q / quantum
    n = m.numerator // m.denominator
    rest = m - n
    if rest > Fraction(1, 2) or (rest == Fraction(1, 2) and n % 2):
        n += 1
    value = n * quantum
    if value >= Fraction(2) ** 128:
        return np.float32(sign * np.inf)
    return np.float32(sign * float(value))


def pow32(b: np.float32, s: np.float32) -> np.float32:
    """Correctly rounded fp32 b**s for an integer-valued step s. Not nvcc's powf (libdevice's
    polynomial, not correctly rounded in general): the host emulation computes RN32(double pow),
    which equals this on the tests' betas and steps, so these tests prove every operation of the
    step but pow; the GPU tests compare the device's powf (csrc/master_step_kernel.h, "pow")."""
    assert float(s).is_integer() and s >= 0
    return round_fraction_f32(Fraction(float(b)) ** int(s))


def pow64(b: float, s: float) -> float:
    assert float(s).is_integer() and s >= 0
    return float(Fraction(b) ** int(s))


# ---- the weight dtypes --------------------------------------------------------------------------


def widen(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype == torch.bfloat16:
        return (bits.astype(np.uint32) << 16).view(np.float32)
    return bits.view(np.float16).astype(np.float32)


def round_bits(x: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """fp32 -> bf16/fp16 bits: nearest even, NaN -> 0x7fff (cvt.rn on sm_80+)."""
    x = f32(x)
    nan = np.isnan(x)
    if dtype == torch.bfloat16:
        u = x.view(np.uint32).astype(np.uint64)
        out = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    else:
        with np.errstate(all="ignore"):
            out = x.astype(np.float16).view(np.uint16).copy()
    out[nan] = 0x7FFF
    return out


# ---- the model of one step ----------------------------------------------------------------------


def step_spec(algo: str, t: dict, o: dict) -> dict:
    """The kernel's documented arithmetic on one tensor's numpy arrays (copies returned).

    algo: "sgd", "adam_f64" (torch <= 2.10) or "adam_f32" (torch >= 2.11). t: p, w (bits),
    g, s0, s1, s2, step, dtype. o: the options (see the backend's keywords).
    """
    p, g = f32(t["p"]).copy(), f32(t["g"]).copy()
    s0, s1, s2 = (None if t[k] is None else f32(t[k]).copy() for k in ("s0", "s1", "s2"))
    dtype = t["dtype"]
    w = widen(t["w"], dtype)
    p = np.where(w != widen(round_bits(p, dtype), dtype), w, p)  # resync (NaN differs)
    scale = o["grad_scale"]
    if scale is not None:
        g = div32(g, np.float32(scale))
    g_store = g.copy()
    if o["maximize"]:
        g = neg32(g)
    lr = float(np.float32(o["lr"])) if o.get("tensor_lr") else o["lr"]  # a tensor lr is fp32
    if algo == "sgd":
        wd, mom, damp = o["weight_decay"], o["momentum"], o["dampening"]
        if wd != 0:
            g = to32(fma64(p, wd, g))
        if s0 is not None:
            if o["is_first_step"]:
                b = g.astype(np.float64)
            else:
                b = fma64(f64op(np.subtract, 1.0, damp), g, f64op(np.multiply, mom, s0))
            s0 = to32(b)
            g = to32(fma64(b, mom, g)) if o["nesterov"] else to32(b)
        p = to32(fma64(-lr, g, p))
    elif algo == "adam_f64":
        b1, b2, wd, eps = o["beta1"], o["beta2"], o["weight_decay"], o["eps"]
        step = float(t["step"])
        bc1 = np.float32(to32(1.0 - pow64(b1, step)))
        bc2s = np.float32(to32(math.sqrt(1.0 - pow64(b2, step))))
        ss = np.float32(to32(lr / float(bc1)))
        if wd != 0:
            if o["adamw"]:
                p = to32(fma64(-(lr * wd), p, p))
            else:
                g = to32(fma64(p, wd, g))
        s0 = to32(fma64(b1, s0, f64op(np.multiply, 1.0 - b1, g)))
        s1 = to32(fma64(b2, s1, f64op(np.multiply, f64op(np.multiply, 1.0 - b2, g), g)))
        u = s1
        if o["amsgrad"]:
            s2 = u = np.where(s2 < s1, s1, s2)
        d = to32(f64op(np.add, div32(sqrt32(u), bc2s), eps))
        p = sub32(p, div32(mul32(ss, s0), d))
    else:  # adam_f32
        lr32, b1, b2 = np.float32(lr), np.float32(o["beta1"]), np.float32(o["beta2"])
        wd, eps = np.float32(o["weight_decay"]), np.float32(o["eps"])
        step = np.float32(t["step"])
        bc1 = sub32(np.float32(1), pow32(b1, step))
        bc2s = sqrt32(sub32(np.float32(1), pow32(b2, step)))
        ss = div32(lr32, bc1)
        if wd != 0:
            if o["adamw"]:
                p = fma32(neg32(mul32(lr32, wd)), p, p)
            else:
                g = fma32(p, wd, g)
        s0 = fma32(b1, s0, fma32(neg32(b1), g, g))
        g2 = mul32(g, g)
        s1 = fma32(b2, s1, fma32(neg32(b2), g2, g2))
        u = s1
        if o["amsgrad"]:
            s2 = u = np.where(s2 < s1, s1, s2)
        d = add32(div32(sqrt32(u), bc2s), eps)
        p = sub32(p, div32(mul32(ss, s0), d))
    out = {"p": f32(p), "w": round_bits(p, dtype), "s0": s0, "s1": s1, "s2": s2}
    out["g"] = g_store if scale is not None and o["write_grad"] else f32(t["g"])
    return out


# ---- test data --------------------------------------------------------------------------------


class Guards:
    """Tensors in the middle of NaN-poisoned buffers; check() asserts the poison is intact."""

    POISON = {torch.float32: (torch.int32, 0x7FA5A5A5), torch.bfloat16: (torch.int16, 0x7FA5),
              torch.float16: (torch.int16, 0x7E5A)}

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, int, int]] = []

    def wrap(self, t: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """A guarded copy of t; ``offset`` elements in (misaligned: the kernel's scalar path)."""
        itype, bits = self.POISON[t.dtype]
        g = GUARD // t.element_size() + offset
        n = t.numel()
        buf = torch.empty(n + 2 * g, dtype=t.dtype)
        buf.view(itype).fill_(bits)
        inner = buf[g:g + n]
        inner.copy_(t.reshape(-1))
        self.buffers.append((buf, g, n))
        return inner

    def check(self) -> None:
        for k, (buf, g, n) in enumerate(self.buffers):
            itype, bits = self.POISON[buf.dtype]
            raw = buf.view(itype)
            assert bool((raw[:g] == bits).all()) and bool((raw[g + n:] == bits).all()), \
                f"guard bytes around tensor {k} ({buf.dtype}, {n} elements) were written"


def rand32(n: int, lo: int = -8, hi: int = 4, positive: bool = False) -> torch.Tensor:
    x = torch.randn(n) * torch.exp2(torch.randint(lo, hi, (n,)).float())
    return x.abs() if positive else x


def bits16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def make_case(sizes, dtypes, algo: str, *, amsgrad=False, momentum=True, misalign=0,
              written=True, nonfinite=False, guards: Guards | None = None) -> dict:
    """One list of parameters. Weights are the rounded masters, except (``written``) where the
    test writes them: at every position of a 4-lane vector and in the tail of each tensor."""
    guards = guards or Guards()
    lists: dict[str, list] = {k: [] for k in ("p", "w", "g", "s0", "s1", "s2", "step")}
    for i, n in enumerate(sizes):
        dtype = dtypes[i % len(dtypes)]
        p = rand32(n)
        w = p.to(dtype)
        if written and n:
            for pos in {0, 1, 2, 3, n - 1, n // 2, max(0, n - 3)}:
                if pos < n:
                    w[pos] = (p[pos] * 1.5 + 0.25).to(dtype)
        g = rand32(n)
        if nonfinite and n >= 4:
            g[1], g[2], w[3] = float("nan"), float("inf"), float("nan")
        off = misalign if i % 2 else 0
        lists["p"].append(guards.wrap(p, off))
        lists["w"].append(guards.wrap(w, off))
        lists["g"].append(guards.wrap(g, off))
        if algo != "sgd":
            lists["s0"].append(guards.wrap(rand32(n, -10, 0), off))
            lists["s1"].append(guards.wrap(rand32(n, -20, -6, positive=True), off))
            s2 = rand32(n, -20, -6, positive=True)
            if nonfinite and n >= 4:
                s2[0] = float("nan")  # a NaN maximum stays (std::max keeps its first operand)
            lists["s2"].append(guards.wrap(s2, off) if amsgrad else None)
            lists["step"].append(torch.tensor(float(random.randint(1, 40))))
        elif momentum:
            lists["s0"].append(guards.wrap(rand32(n, -10, 0), off))
    return {"lists": lists, "guards": guards}


def snapshot(case: dict) -> list[dict]:
    """Each tensor's arrays (copies) in the model's terms."""
    L = case["lists"]
    out = []
    for i in range(len(L["p"])):
        def arr(k):
            return L[k][i].numpy().copy() if L[k] and L[k][i] is not None else None
        out.append({"p": arr("p"), "w": bits16(L["w"][i]).copy(), "g": arr("g"), "s0": arr("s0"),
                    "s1": arr("s1"), "s2": arr("s2"),
                    "step": float(L["step"][i]) if L["step"] else 0.0,
                    "dtype": L["w"][i].dtype})
    return out


def run_host(algo: str, case: dict, o: dict) -> None:
    L = case["lists"]
    common = dict(grad_scale=None if o["grad_scale"] is None else torch.tensor([o["grad_scale"]]),
                  found_inf=o.get("found_inf_tensor"), write_grad=o["write_grad"])
    lr = torch.tensor(o["lr"]) if o.get("tensor_lr") else o["lr"]
    if algo == "sgd":
        msc.sgd_host(L["p"], L["w"], L["g"], L["s0"] or None, lr=lr, momentum=o["momentum"],
                     dampening=o["dampening"], weight_decay=o["weight_decay"],
                     nesterov=o["nesterov"], maximize=o["maximize"],
                     is_first_step=o["is_first_step"], **common)
    else:
        msc.adam_host(L["p"], L["w"], L["g"], L["s0"], L["s1"],
                      L["s2"] if o["amsgrad"] else None, L["step"], lr=lr, beta1=o["beta1"],
                      beta2=o["beta2"], weight_decay=o["weight_decay"], eps=o["eps"],
                      amsgrad=o["amsgrad"], maximize=o["maximize"], adamw=o["adamw"],
                      arithmetic="fp32" if algo == "adam_f32" else "fp64", **common)


def options(**kw) -> dict:
    o = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False,
             maximize=False, adamw=True, momentum=0.9, dampening=0.0, nesterov=False,
             is_first_step=False, grad_scale=None, write_grad=True)
    o.update(kw)
    return o


def assert_bits(name: str, i: int, got: np.ndarray, want: np.ndarray) -> None:
    view = np.uint16 if got.dtype == np.uint16 else np.uint32
    g, w = got.view(view), np.asarray(want).view(view)
    bad = np.flatnonzero(g != w)
    assert bad.size == 0, (f"tensor {i} {name}: {bad.size}/{g.size} elements differ, first at "
                           f"{bad[0]}: got {g[bad[0]]:#x}, model {w[bad[0]]:#x}")


def check_against_spec(algo: str, case: dict, o: dict) -> None:
    before = snapshot(case)
    run_host(algo, case, o)
    after = snapshot(case)
    case["guards"].check()
    for i, (t0, t1) in enumerate(zip(before, after)):
        want = step_spec(algo, t0, o)
        assert_bits("master", i, t1["p"], want["p"])
        assert_bits("weight", i, t1["w"], want["w"])
        assert_bits("grad", i, t1["g"], want["g"])
        for k in ("s0", "s1", "s2"):
            if t0[k] is not None and want[k] is not None:
                assert_bits(k, i, t1[k], want[k])


SIZES = [1, 3, 4, 5, 7, 33, 4097]  # odd sizes and tails of every length
ADAM_CASES = [  # (adamw, amsgrad, maximize, weight_decay, eps): eps near sqrt(v) in some
    (True, False, False, 0.01, 1e-8), (False, False, False, 0.01, 3e-4),
    (True, True, False, 0.0, 1e-3), (False, True, True, 0.1, 1e-8),
    (True, False, True, 0.0, 1e-8), (False, False, False, 0.0, 1e-4),
]


@pytest.mark.parametrize("algo", ["adam_f32", "adam_f64"])
@pytest.mark.parametrize("adamw,amsgrad,maximize,wd,eps", ADAM_CASES,
                         ids=[f"{'adamw' if a else 'adam'}{'-ams' if m else ''}"
                              f"{'-max' if x else ''}-wd{w}-eps{e}"
                              for a, m, x, w, e in ADAM_CASES])
def test_adam_matches_model(algo, adamw, amsgrad, maximize, wd, eps):
    """Adam/AdamW in both of torch's arithmetic forms, bf16 and fp16 weights (one launch each),
    odd sizes, aligned and misaligned tensors, written weights at every vector position."""
    case = make_case(SIZES, [torch.bfloat16, torch.float16], algo, amsgrad=amsgrad, misalign=1)
    check_against_spec(algo, case, options(adamw=adamw, amsgrad=amsgrad, maximize=maximize,
                                           weight_decay=wd, eps=eps, lr=3e-3, beta1=0.85,
                                           beta2=0.995))


SGD_CASES = [  # (momentum, dampening, nesterov, first, maximize, weight_decay)
    (0.0, 0.0, False, False, False, 0.0), (0.0, 0.0, False, False, True, 0.01),
    (0.9, 0.0, False, True, False, 0.0), (0.9, 0.1, False, False, False, 0.01),
    (0.9, 0.0, True, False, True, 0.05), (0.8, 0.0, True, True, False, 0.01),
]


@pytest.mark.parametrize("mom,damp,nesterov,first,maximize,wd", SGD_CASES,
                         ids=[f"mom{m}-d{d}{'-nest' if n else ''}{'-first' if f else ''}"
                              f"{'-max' if x else ''}-wd{w}" for m, d, n, f, x, w in SGD_CASES])
def test_sgd_matches_model(mom, damp, nesterov, first, maximize, wd):
    """SGD with and without a momentum buffer, dampening, nesterov, its first step, maximize,
    weight decay."""
    case = make_case(SIZES, [torch.float16, torch.bfloat16], "sgd", momentum=mom != 0,
                     misalign=1)
    check_against_spec("sgd", case, options(momentum=mom, dampening=damp, nesterov=nesterov,
                                            is_first_step=first, maximize=maximize,
                                            weight_decay=wd, lr=0.05))


@pytest.mark.parametrize("algo", ["adam_f32", "adam_f64", "sgd"])
@pytest.mark.parametrize("write_grad", [True, False], ids=["write_grad", "keep_grad"])
def test_grad_scale_and_tensor_lr(algo, write_grad):
    """The gradient divided by a grad_scale tensor (stored back only with write_grad), the lr read
    from a tensor."""
    case = make_case([5, 4096 + 9], [torch.bfloat16], algo)
    check_against_spec(algo, case, options(grad_scale=1024.0, write_grad=write_grad,
                                           tensor_lr=True, lr=2e-3, weight_decay=0.01))


@pytest.mark.parametrize("algo", ["adam_f32", "adam_f64", "sgd"])
def test_nonfinite_values(algo):
    """NaN and inf gradients and a NaN weight (resynced into the master): the canonical NaN the
    GPU's arithmetic returns, 0x7fff when rounded to bf16/fp16."""
    case = make_case([8, 13], [torch.bfloat16, torch.float16], algo, amsgrad=True,
                     nonfinite=True)
    check_against_spec(algo, case, options(amsgrad=algo != "sgd", grad_scale=4.0,
                                           weight_decay=0.01))


def test_large_tensors_and_chunks():
    """Tensors over one chunk (8192) and several: 8191, 8192, 8193, 65538 elements, aligned and
    one element off."""
    case = make_case([8191, 8192, 8193, 65537 + 1], [torch.bfloat16, torch.float16], "adam_f32",
                     amsgrad=True, misalign=1)
    check_against_spec("adam_f32", case, options(amsgrad=True, weight_decay=0.01))
    case = make_case([8193, 65538], [torch.float16], "sgd", misalign=1)
    check_against_spec("sgd", case, options(weight_decay=0.01, nesterov=True))


@pytest.mark.parametrize("capturing", [False, True], ids=["not-captured", "captured"])
def test_many_tensors(capturing):
    """1200 small tensors (over the 400-entry parameter table) and mixed dtypes: parameter-table
    groups per dtype whether or not the stream is captured, never a table copied from pageable
    host memory (which may stall the host on every step of a long list)."""
    sizes = [random.randint(0, 21) for _ in range(1200)]
    case = make_case(sizes, [torch.bfloat16, torch.float16], "adam_f32")
    msc.configure_host(sm_count=3, capturing=capturing)
    try:
        check_against_spec("adam_f32", case, options(weight_decay=0.01))
        launches = msc.host_launches()
    finally:
        msc.configure_host()
    expected = []
    for k, dtype in enumerate(("bf16", "fp16")):  # tensors alternate bf16, fp16; empty ones skipped
        n = sum(1 for size in sizes[k::2] if size)
        for first in range(0, n, 400):
            group = min(400, n - first)
            expected.append((dtype, "param64" if group <= 64 else "param400", group))
    got = [(line.split()[0], line.split()[1], int(line.rsplit("tensors=", 1)[1]))
           for line in launches]
    assert got == expected, launches
    assert all("grid=9" in line for line in launches), launches  # 3 SMs x 3 blocks


def test_grid_stride_and_empty_tensors():
    """Fewer blocks than chunks (every block strides), empty tensors skipped, one dtype alone."""
    msc.configure_host(sm_count=1, capturing=False)
    try:
        case = make_case([0, 20000, 0, 9000, 1], [torch.float16], "adam_f64")
        check_against_spec("adam_f64", case, options())
        launches = msc.host_launches()
    finally:
        msc.configure_host()
    assert launches == ["fp16 param64 grid=3 chunks=6 tensors=3"]


@pytest.mark.parametrize("flag", [1.0, 2.0])
@pytest.mark.parametrize("algo", ["adam_f32", "sgd"])
def test_found_inf_writes_nothing(algo, flag):
    """found_inf nonzero: masters, weights (even written ones), grads, state: all unchanged.
    found_inf zero: the step runs. 2.0 (GradScaler's sum over two devices) skips too, where
    torch's fused kernels, which skip only on exactly 1.0, would update with non-finite grads."""
    case = make_case([6, 4099], [torch.bfloat16, torch.float16], algo, amsgrad=True)
    before = snapshot(case)
    run_host(algo, case, options(amsgrad=algo != "sgd", grad_scale=8.0,
                                 found_inf_tensor=torch.tensor([flag])))
    after = snapshot(case)
    for t0, t1 in zip(before, after):
        for k in ("p", "w", "g", "s0", "s1", "s2"):
            if t0[k] is not None:
                assert t0[k].tobytes() == t1[k].tobytes(), k
    check_against_spec(algo, case, options(amsgrad=algo != "sgd", grad_scale=8.0,
                                           found_inf_tensor=torch.tensor([0.0])))


def test_written_weights_are_taken_at_every_vector_position():
    """With lr = 0 the step leaves the master as the resync made it: the written weights taken
    exactly (every lane of a 4-element vector, the tail), every other master unchanged."""
    for dtype in (torch.bfloat16, torch.float16):
        n = 4 * 8 + 3
        p = rand32(n)
        w = p.to(dtype)
        p0 = p.clone()
        written = [0, 1, 2, 3, 5, 10, 15, n - 3, n - 2, n - 1]
        for pos in written:
            w[pos] = (p[pos] * -2 + 1).to(dtype)
        g = rand32(n)
        msc.sgd_host([p], [w], [g], None, lr=0.0, momentum=0.0, dampening=0.0,
                     weight_decay=0.0, nesterov=False, maximize=False, is_first_step=False,
                     grad_scale=None, found_inf=None, write_grad=False)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[written] = True
        assert torch.equal(p[mask], w[mask].float())
        # untouched lanes: p - 0*g, bit-identical (no -0.0 issue: p is not 0)
        assert torch.equal(p[~mask], p0[~mask])


def test_arithmetic_forms_differ_and_fma_matters():
    """The comparison has teeth: torch's two Adam forms give different bits on ordinary data, and
    an unfused a*b+c differs from fma32 on a share of it."""
    case = make_case([4097], [torch.bfloat16], "adam_f32", written=False)
    t = snapshot(case)[0]
    o = options(weight_decay=0.01)
    a, b = step_spec("adam_f32", t, o), step_spec("adam_f64", t, o)
    assert (a["p"].view(np.uint32) != b["p"].view(np.uint32)).mean() > 0.05
    x, y, z = rand32(100000).numpy(), rand32(100000).numpy(), rand32(100000).numpy()
    assert (fma32(x, y, z).view(np.uint32) != add32(mul32(x, y), z).view(np.uint32)).mean() > 0.01


def test_fma32_model_is_exact():
    """fma32 (TwoSum + tie fix-up) against rational arithmetic, on random operands and on
    constructed ties: a*b+c exactly halfway between two fp32 values, nudged by a tiny c."""
    rng = np.random.default_rng(0)
    a = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    b = (rng.standard_normal(3000) * 2.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    c = (rng.standard_normal(3000) * 2.0 ** rng.integers(-60, 60, 3000)).astype(np.float32)
    # ties: (1 + 2^-23) * 1.5 = 1.5 + 2^-23 + 2^-24 is exactly halfway between two fp32 values;
    # c = +-2^-60 moves the exact sum off the tie by less than float64 can hold (TwoSum's e
    # decides), c = +-2^-40 by a float64-visible amount, c = 0 leaves the tie (to even)
    ta = np.full(6, 1 + 2.0 ** -23, np.float32)
    tb = np.full(6, 1.5, np.float32)
    tc = np.array([0, 2.0 ** -60, -(2.0 ** -60), 2.0 ** -40, -(2.0 ** -40), -1.5], np.float32)
    a, b, c = np.concatenate([a, ta]), np.concatenate([b, tb]), np.concatenate([c, tc])
    got = fma32(a, b, c)
    for i in range(a.size):
        want = round_fraction_f32(Fraction(float(a[i])) * Fraction(float(b[i]))
                                  + Fraction(float(c[i])))
        assert got[i].view(np.uint32) == np.float32(want).view(np.uint32), i


def test_invalid_calls_are_refused():
    """The kernel's own guards: unknown algorithm, null pointers, a weight that is not bf16/fp16
    (std::invalid_argument -> ValueError)."""
    c = native._C
    p, g, w = torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16)
    rows = [[p.data_ptr()], [w.data_ptr()], [g.data_ptr()], [], [], [], []]
    args = ([4], [native.DTYPE_CODES[torch.bfloat16]], [0.1, 0, 0, 0, 0, 0, 0], 0, 0, 0)
    with pytest.raises(ValueError, match="unknown algorithm"):
        c.master_step_cuda_host(7, 0, rows, *args)
    with pytest.raises(ValueError, match="null data pointer"):  # momentum without a buffer
        c.master_step_cuda_host(c.MASTER_STEP_SGD, c.MASTER_STEP_FLAGS["momentum"], rows, *args)
    with pytest.raises(ValueError, match="bf16 or fp16"):
        c.master_step_cuda_host(c.MASTER_STEP_SGD, 0, rows, [4], [native.DTYPE_CODES[
            torch.float32]], *args[2:])
    with pytest.raises(ValueError, match="7 address rows"):
        c.master_step_cuda_host(c.MASTER_STEP_SGD, 0, rows[:3], *args)


def test_cuda_launch_binding_exists_when_built_with_cuda():
    """A CUDA build binds the real launch (and its kernel loader); a CPU-only build does not.
    Compiles nothing, needs no GPU."""
    c = native._C
    has = c.build_info()["cuda"]
    assert hasattr(c, "master_step_cuda") == has
    assert hasattr(c, "master_step_cuda_load") == has
    assert msc.is_available(torch.device("cpu")) is False


def test_arithmetic_follows_the_torch_version():
    assert msc.adam_arithmetic("2.10.1+cu128") == "fp64"
    assert msc.adam_arithmetic("2.11.0+cu130") == "fp32"
    assert msc.adam_arithmetic("2.13.0+cpu") == "fp32"
