"""Runs one single-process case of the conformance matrix and names where it departs.

``run_case(case, cid)`` drives the wrapper's side and the judge (the native loop) through the
same micro-batches; after every step it compares the params, the fp32 masters, the clip norm
and whether the step was skipped or raised; with ``reduction="sum"`` (and gradients moved in the
backward) it also compares what ``p.grad`` shows after every micro-batch. The first departure
raises ``Departure`` naming the case id, its axis values, the step and by how much.
"""

from __future__ import annotations

import torch
from _matrix_axes import describe
from _matrix_actions import last_layer, native_steps_after_add_param_group
from _matrix_ckpt import BOUNDARY, MID, START
from _matrix_loop import (ADD_AT, CKPT_AT, Ctx, Departure, WrapperSide, reference_finish,
                          reference_micro)
from _matrix_models import build, micro_batch
from _matrix_oracle import LOWP, Reference

RTOL = 1e-6
LOWP_PARAM_RTOL = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _tol(ctx: Ctx, name: str, dtype: torch.dtype, flipped: bool = False) -> float:
    """fp32 values (params, masters, norms): 1e-6 relative to the tensor's largest; a
    low-precision param: one unit in its last place (its master is compared at 1e-6); without
    masters, low-precision rounding spreads through the steps: 4 units. Bit-identical where
    native is deterministic: an fp32 model, reduction='sum', no clipping."""
    if ctx.exact:
        return 0.0
    if flipped:  # a low-precision weight rounded to the other neighbour of an fp32 value one
        # fp32 ulp apart (allowed above): its rounding reaches every value after, as without
        # masters
        return LOWP_PARAM_RTOL[ctx.dtype if ctx.dtype in LOWP else torch.bfloat16] * 4
    if dtype in LOWP:
        return LOWP_PARAM_RTOL[dtype] * (1 if ctx.masters == "auto" else 4)
    if ctx.masters != "auto" and (ctx.dtype in LOWP or ctx.params == "mixed"):
        # low-precision params stepped without masters: their rounding reaches every value
        return LOWP_PARAM_RTOL[ctx.dtype if ctx.dtype in LOWP else torch.bfloat16] * 4
    return RTOL


def diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, that relative to max |b|); NaN where exactly one side is NaN."""
    a64, b64 = a.detach().double(), b.detach().double()
    if not torch.equal(a64.isnan(), b64.isnan()):
        return float("nan"), float("nan")
    a64, b64 = a64.nan_to_num(0.0), b64.nan_to_num(0.0)
    d = (a64 - b64).abs().max().item() if a64.numel() else 0.0
    scale = b64.abs().max().item() if b64.numel() else 0.0
    return d, d / scale if scale else d


class Checker:
    def __init__(self, ctx: Ctx):
        self.ctx = ctx
        self.worst = 0.0  # the largest relative difference seen (reported on success)
        self.flipped = False  # a low-precision weight one unit in its last place from native

    def fail(self, where: str, what: str):
        ctx = self.ctx
        raise Departure(f"case {ctx.cid} [{describe(ctx.case)}] departs from native at {where}: "
                        f"{what}")

    def close(self, where: str, name: str, a, b) -> None:
        if a is None or b is None:
            if (a is None) != (b is None):
                self.fail(where, f"{name} is {'None' if a is None else 'set'}, native's is "
                          f"{'None' if b is None else 'set'}")
            return
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        if a.shape != b.shape:
            self.fail(where, f"{name} has shape {tuple(a.shape)}, native's {tuple(b.shape)}")
        d, rel = diff(a, b)
        tol = _tol(self.ctx, name, b.dtype if name.startswith("param") else torch.float32,
                   self.flipped)
        if not rel <= tol:
            self.fail(where, f"{name} differs by {d:.4g} (relative {rel:.3g} > {tol:.3g})")
        if name.startswith("param") and b.dtype in LOWP and d > 0:
            self.flipped = True  # (from the next comparison on)
        self.worst = max(self.worst, rel)

    def step(self, where: str, got: dict, want: dict, side: WrapperSide, judge: Reference):
        for key in ("raised", "skipped"):
            if bool(got[key]) != bool(want[key]):
                self.fail(where, f"the wrapper's step {'did' if got[key] else 'did not'} "
                          f"{key[:-1] if key == 'raised' else 'skip'}; native "
                          f"{'did' if want[key] else 'did not'}")
        self.close(where, "clip norm", got["norm"], want["norm"])
        mine, ref = side.observed(), judge.observed()
        if not all(bool(torch.isfinite(t).all()) for t in ref.values()):
            self.fail(where, "native's own run went non-finite (a case the table must exclude)")
        if set(mine) != set(ref):
            self.fail(where, f"observed {sorted(mine)}, native {sorted(ref)}")
        for name in ref:
            self.close(where, name, mine[name], ref[name])

    def grads(self, where: str, side: WrapperSide, judge: Reference) -> None:
        names = [n for n, _ in side.model.named_parameters()]
        for name, (_, g), q in zip(names, side.grads_now(), judge.params):
            self.close(where, f"p.grad[{name}]", g, judge.grad_view(q))


def run_case(case: dict, cid: str) -> float:
    """Run the case; raise Departure at its first departure; return the worst relative
    difference seen."""
    ctx = Ctx(case, cid)
    if ctx.loop.startswith("add_param_group") and \
            not native_steps_after_add_param_group(ctx.opt.cls):
        import pytest

        pytest.skip(f"torch {torch.__version__}'s own {ctx.opt.cls} cannot step a group added "
                    "by add_param_group (no native run to compare)")
    side = WrapperSide(ctx, build(ctx.params, ctx.dtype, ctx.seed))
    judge = Reference(ctx, build(ctx.params, ctx.dtype, ctx.seed))
    check = Checker(ctx)
    in_dtype = torch.float32 if ctx.params == "mixed" else ctx.dtype
    watch_grads = ctx.reduction.name == "sum" and ctx.in_backward
    step_no = 0
    _hook(START, ctx, side, "start")
    side.rewrite_state()
    for w, micro in enumerate(ctx.windows()):
        for i in range(micro):
            x, y, weight = micro_batch(ctx.seed, w, i, side.model.in_shape, in_dtype)
            last = i == micro - 1
            where = f"step {step_no} (window {w}, micro-batch {i})"
            try:
                side.micro(w, i, x, y, weight)
            except Exception as exc:  # noqa: BLE001 -- native trains on: a departure
                check.fail(where, f"the wrapper's side raised {type(exc).__name__}: {exc}")
            reference_micro(ctx, judge, w, i, x, y, weight)
            if ctx.loop == "add_param_group-mid" and (w, i) == ADD_AT and side.added:
                judge.add_group(last_layer(judge.model))
            if watch_grads and side.ref is None:
                check.grads(where, side, judge)
            try:
                got = side.finish(last)
            except Exception as exc:  # noqa: BLE001
                check.fail(where, f"the wrapper's step() raised {type(exc).__name__}: {exc}")
            want = reference_finish(ctx, judge, last)
            if last:
                check.step(where, got, want, side, judge)
                step_no += 1
            if (w, i) == CKPT_AT:
                _hook(MID, ctx, side, where)
        _hands(ctx, side.model, judge)
        if w == 0 and ctx.loop == "add_param_group-boundary":
            try:
                side.add_group()
            except Exception as exc:  # noqa: BLE001
                check.fail("the boundary after window 0", f"add_param_group raised "
                           f"{type(exc).__name__}: {exc}")
            judge.add_group(last_layer(judge.model))
        if w == 0:
            _hook(BOUNDARY, ctx, side, "the boundary after window 0")
            if ctx.checkpoint == "native-into-inner":
                judge.reload_like_native()
        try:
            side.rewrite_state()
        except Exception as exc:  # noqa: BLE001
            check.fail(f"the boundary after window {w}", f"opt.state[p] = dict(opt.state[p]) "
                       f"raised {type(exc).__name__}: {exc}")
    return check.worst


def _hook(table: dict, ctx: Ctx, side: WrapperSide, where: str) -> None:
    fn = table.get(ctx.checkpoint)
    if fn is None:
        return
    try:
        fn(side)
    except Departure as exc:
        raise Departure(f"case {ctx.cid} [{describe(ctx.case)}] at {where}: {exc}") from exc
    except Exception as exc:  # noqa: BLE001
        raise Departure(f"case {ctx.cid} [{describe(ctx.case)}] at {where}: checkpoint "
                        f"{ctx.checkpoint} raised {type(exc).__name__}: {exc}") from exc


def _hands(ctx: Ctx, model, judge: Reference) -> None:
    """The user's hands between windows, on both sides alike."""
    with torch.no_grad():
        for m in (model, judge.model):
            if ctx.hands == "data-write":
                p = next(m.parameters())
                p.data = p.data * 0.9
        if ctx.hands == "data-transpose":
            model.square.data = model.square.data.t()
            judge.transpose(judge.model.square)
