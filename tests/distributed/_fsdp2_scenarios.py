"""More FSDP2 scenarios for test_fsdp2.py (run by ``_fsdp2_workers.run_ranks``): memory,
refusals, the bf16 wire, a non-finite shard on one rank, DCP checkpoints mid-window."""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
from _fsdp2_workers import (ACCUM, CLIP, WINDOWS, build, live_bytes, make_inner, micro_batch,
                            train)


def scenario_memory(world: int) -> dict:
    """Live tensor bytes mid-window (2 of ACCUM micro-batches in), native vs wrapped."""
    from accumkernels import AccumulatingOptimizer

    out: dict = {}
    for wrap in (False, True):
        model = build((world,))
        opt = make_inner(model, "adamw")
        if wrap:
            opt = AccumulatingOptimizer(opt, accumulation_steps=ACCUM, model=model)
        for w in range(2):
            for i in range(ACCUM if w == 0 else 2):
                x, y = micro_batch(dist.get_rank(), w, i)
                torch.nn.functional.mse_loss(model(x, use_extra=True).float(), y).backward()
            if w == 0:
                opt.step()
                opt.zero_grad()
        out["ours" if wrap else "native"] = live_bytes()
        if wrap:
            out["window_bytes"] = sum(b.untyped_storage().nbytes()
                                      for b in opt._parts.window.storage.buffers.values())
            out["local_numel"] = [p.to_local().numel() for p in model.parameters()]
            out["numel"] = sum(p.numel() for p in model.parameters())
            out["grad_storages"] = {p.grad.to_local().untyped_storage().data_ptr()
                                    for p in model.parameters()}
            out["window_storages"] = {b.untyped_storage().data_ptr()
                                      for b in opt._parts.window.storage.buffers.values()}
            opt.remove_hooks()
        del model, opt
        gc.collect()
    return out


def scenario_refusals(world: int) -> dict:
    """What the wrapper refuses at construction, and that nothing was touched."""
    from accumkernels import AccumulatingOptimizer

    cases = {
        "no_model": lambda m, o: AccumulatingOptimizer(o),
        "skip_microbatch": lambda m, o: AccumulatingOptimizer(o, model=m,
                                                              nonfinite="skip_microbatch"),
        "process_group": lambda m, o: AccumulatingOptimizer(o, model=m,
                                                            process_group=dist.group.WORLD),
        "not_in_backward": lambda m, o: AccumulatingOptimizer(o, model=m,
                                                              accumulate_in_backward=False),
        "bf16": None,
    }
    out = {}
    for name, make in cases.items():
        model = build((world,), dtype=torch.bfloat16 if name == "bf16" else torch.float32)
        opt = make_inner(model, "adamw")
        try:
            if make is None:
                AccumulatingOptimizer(opt, model=model)
            else:
                make(model, opt)
            out[name] = None
        except (ValueError, TypeError) as exc:
            out[name] = f"{type(exc).__name__}: {exc}"
        out[name + "_hooks"] = sum(len(p._post_accumulate_grad_hooks or {})
                                   for p in model.parameters())
    return out


def scenario_wire_bound(world: int) -> dict:
    """The bf16-wire reduce-scatter alone vs gloo's fp32 one on bf16-exact random inputs:
    elementwise |difference| / (2 (world-1) 2**-24 sum|g|) (must be <= 1), and the same ratio
    for a bf16 running sum (the negative control, which the bound must reject)."""
    from accumkernels.optim.fsdp2.wire import Bf16WireReduceScatter

    n = 4097  # not a multiple of any vector width
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    values = torch.randn(world * n, generator=g) * torch.exp(3 * torch.randn(world * n,
                                                                                generator=g))
    grads = values.bfloat16().float()  # what FSDP2 copies in: bf16 values in fp32
    comm = Bf16WireReduceScatter()
    ours = torch.full((n,), float("nan"))
    comm(ours, grads.clone(), dist.group.WORLD, dist.ReduceOp.SUM)
    fp32 = torch.full((n,), float("nan"))
    dist.reduce_scatter_tensor(fp32, grads.clone(), op=dist.ReduceOp.SUM)
    everyone = [torch.empty_like(grads) for _ in range(world)]
    dist.all_gather(everyone, grads)
    rank = dist.get_rank()
    mine = torch.stack([e.view(world, n)[rank] for e in everyone]).double()
    bound = 2 * (world - 1) * 2.0**-24 * mine.abs().sum(0)
    control = torch.zeros(n, dtype=torch.bfloat16)
    for row in mine:
        control = (control.float() + row.float()).bfloat16()  # bf16 accumulation
    return {"ratio": ((ours.double() - fp32.double()).abs() / bound).max().item(),
            "control_ratio": ((control.double() - fp32.double()).abs() / bound).max().item(),
            "equal": torch.equal(ours, fp32), "bytes": comm.bytes_sent,
            "fp32_bytes": 4 * n * (world - 1)}


def scenario_wire_pair(world: int, **kwargs) -> dict:
    """Native FSDP2 (fp32 reduce-scatter) vs the wrapper with the bf16 wire."""
    return {"native": train((world,), wrap=False, **kwargs),
            "ours": train((world,), wrap=True, wire=True, **kwargs)}


def _window_items() -> list[tuple[int, int]]:
    return [(w, i) for w in range(WINDOWS) for i in range(ACCUM)]


CUT = ACCUM + 2  # a checkpoint in the middle of the second window


def _go(model, opt, items) -> None:
    """Micro-batches ``items`` (window, index) of the sync/AdamW/user-clip loop."""
    rank = dist.get_rank()
    for w, i in items:
        x, y = micro_batch(rank, w, i)
        pred = model(x, use_extra=(w + i) % 2 == 0).float()
        torch.nn.functional.mse_loss(pred, y).backward()
        if i == ACCUM - 1:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()


def _wrapped(world: int):
    from accumkernels import AccumulatingOptimizer

    model = build((world,))
    return model, AccumulatingOptimizer(make_inner(model, "adamw"), accumulation_steps=ACCUM,
                                        model=model)


def _params(model) -> list:
    return [p.detach().full_tensor().clone() for p in model.parameters()]


def _load_wrapped(world: int, ckpt: str):
    import torch.distributed.checkpoint as dcp

    model, opt = _wrapped(world)
    with opt.window_template():  # the checkpoint was taken mid-window: a template with windows
        sd = {"model": model.state_dict(), "optim": opt.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    return model, opt


def scenario_resume(world: int, ckpt: str) -> dict:
    """Uninterrupted vs saved mid-window with DCP, loaded into a fresh model and wrapper."""
    import torch.distributed.checkpoint as dcp

    model, opt = _wrapped(world)
    _go(model, opt, _window_items())
    straight = _params(model)
    opt.remove_hooks()
    model, opt = _wrapped(world)
    _go(model, opt, _window_items()[:CUT])
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=ckpt)
    opt.remove_hooks()
    model, opt = _load_wrapped(world, ckpt)
    micro_steps = opt.micro_steps
    _go(model, opt, _window_items()[CUT:])
    return {"straight": straight, "resumed": _params(model), "micro_steps": micro_steps}


def scenario_resume_other_world(world: int, ckpt: str) -> dict:
    """A checkpoint saved mid-window on 2 ranks, resumed here: the wrapper, and native FSDP2
    given the same params, AdamW state and the saved window as ``.grad``."""
    import torch.distributed.checkpoint as dcp

    from accumkernels.optim.fsdp2.checkpoint import init_inner_state

    model, opt = _load_wrapped(world, ckpt)
    micro_steps = opt.micro_steps
    _go(model, opt, _window_items()[CUT:])
    ours = _params(model)
    opt.remove_hooks()
    model = build((world,))
    native = make_inner(model, "adamw")
    init_inner_state(native)
    window = [torch.zeros_like(p) for p in model.parameters()]
    optim = native.state_dict()  # the wrapper saved each param's window shard in its state
    for i, w in enumerate(window):
        optim["state"][i] = {**optim["state"][i], "accumkernels_window": w}
    sd = {"model": model.state_dict(), "optim": optim}
    dcp.load(sd, checkpoint_id=ckpt)
    model.load_state_dict(sd["model"])
    native.load_state_dict({"param_groups": sd["optim"]["param_groups"], "state": {
        i: {k: v for k, v in st.items() if k != "accumkernels_window"}
        for i, st in sd["optim"]["state"].items()}})
    for p, g in zip(model.parameters(), window):
        p.grad = g
    _go(model, native, _window_items()[CUT:])
    return {"ours": ours, "native": _params(model), "micro_steps": micro_steps,
            "shard_rows": [tuple(g.to_local().shape) for g in window]}


def scenario_written_nonfinite(world: int) -> dict:
    """A NaN written by the user into rank 1's window shard after the last backward of window 1
    (``p.grad.to_local()[0, 0] = nan``, no kernel sees it): with ``skip_step`` every rank skips
    that window, with ``raise`` every rank raises; with and without clipping."""
    from accumkernels import AccumulatingOptimizer

    rank = dist.get_rank()
    out: dict = {}
    for policy in ("skip_step", "raise"):
        for clip in (None, CLIP):
            model = build((world,))
            opt = AccumulatingOptimizer(make_inner(model, "adamw"), accumulation_steps=ACCUM,
                                        model=model, max_grad_norm=clip, nonfinite=policy)
            params, raised = [], []
            for w in range(WINDOWS):
                for i in range(ACCUM):
                    x, y = micro_batch(rank, w, i)
                    torch.nn.functional.mse_loss(model(x, use_extra=True).float(), y).backward()
                if w == 1 and rank == 1:
                    local = model.l2.weight.grad.to_local()
                    local.view(-1)[0] = float("nan")
                try:
                    opt.step()
                except FloatingPointError as exc:
                    raised.append((w, str(exc)))
                    opt.reset_window()
                opt.zero_grad()
                params.append(_params(model))
            out[f"{policy}_{clip}"] = {"skipped": opt.skipped_steps, "params": params,
                                       "raised": raised}
            opt.remove_hooks()
    return out


def scenario_nonfinite(world: int) -> dict:
    """An inf written into one element of rank 1's shard of one param (a hook that runs before
    the wrapper's, in window 1): the only non-finite value is on rank 1, yet every rank must
    skip that step; windows 0 and 2 step."""
    from accumkernels import AccumulatingOptimizer

    model = build((world,))
    rank = dist.get_rank()
    target = model.l2.weight
    state = {"window": 0}

    def poison(p):
        if rank == 1 and state["window"] == 1:
            p.grad.to_local()[0, 0] = float("inf")
    target.register_post_accumulate_grad_hook(poison)
    opt = AccumulatingOptimizer(make_inner(model, "adamw"), accumulation_steps=ACCUM,
                                model=model, max_grad_norm=CLIP)
    params = []
    for w in range(WINDOWS):
        state["window"] = w
        for i in range(ACCUM):
            x, y = micro_batch(rank, w, i)
            torch.nn.functional.mse_loss(model(x, use_extra=True).float(), y).backward()
        opt.step()
        opt.zero_grad()
        params.append(_params(model))
    return {"skipped": opt.skipped_steps, "params": params}


def scenario_weight_faults(world: int) -> dict:
    """``reduction="weighted"``, one window: rank 1 skips its ``add_weight`` for micro-batch 1
    (after or before the backwards), or reports a negative weight. What each rank raises (a
    collective timeout of 20 s: a hang fails fast)."""
    from accumkernels import AccumulatingOptimizer

    rank = dist.get_rank()
    out = {}
    for fault, first in (("skip_after", False), ("skip_before", True), ("negative", False)):
        model = build((world,))
        opt = AccumulatingOptimizer(make_inner(model, "sgd"), accumulation_steps=ACCUM,
                                    model=model, reduction="weighted")
        opt.collective_timeout = 20.0
        try:
            for i in range(ACCUM):
                value = -1.0 if fault == "negative" else None
                value = value if rank == 1 and i == 1 else 4.0 + i
                if first and value is not None:
                    opt.add_weight(value)
                x, y = micro_batch(rank, 0, i)
                torch.nn.functional.mse_loss(model(x, use_extra=True).float(), y,
                                             reduction="sum").backward()
                if not first and value is not None:
                    opt.add_weight(value)
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            out[fault] = None
        except Exception as exc:  # noqa: BLE001 - the test reads the type and the message
            out[fault] = f"{type(exc).__name__}: {exc}"
        opt.remove_hooks()
        dist.barrier()
    return out


def scenario_extra_step(world: int) -> dict:
    """``accumulation_steps=None`` (every ``step()`` ends the window): first every rank steps
    after each of 2 windows of ACCUM micro-batches (no error; the same full params on every
    rank), then rank 1 alone calls ``step()`` once more, after micro-batch 1 of 3. What each
    rank raises, and where (a collective timeout of 20 s: a hang fails fast)."""
    from accumkernels import AccumulatingOptimizer

    rank = dist.get_rank()
    out = {}
    for case in ("together", "alone"):
        model = build((world,))
        opt = AccumulatingOptimizer(make_inner(model, "sgd"), accumulation_steps=None,
                                    model=model)
        opt.collective_timeout = 20.0
        where = "start"
        try:
            for w in range(2):
                for i in range(ACCUM):
                    x, y = micro_batch(rank, w, i)
                    where = f"forward {w}.{i}"
                    loss = torch.nn.functional.mse_loss(model(x, use_extra=True).float(), y)
                    where = f"backward {w}.{i}"
                    loss.backward()
                    if case == "alone" and rank == 1 and (w, i) == (0, 1):
                        where = f"step {w}.{i}"
                        opt.step()
                where = f"step {w}"
                opt.step()
                opt.zero_grad()
            out[case] = {"error": None, "params": [p.detach().full_tensor()
                                                   for p in model.parameters()]}
        except Exception as exc:  # noqa: BLE001 - the test reads the type, message and place
            out[case] = {"error": f"{type(exc).__name__}: {exc}", "where": where}
        opt.remove_hooks()
        dist.barrier()
    return out
