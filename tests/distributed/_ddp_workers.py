"""Rank processes for test_ddp.py: every scenario runs on 2 gloo ranks on 127.0.0.1.

``run_ranks`` starts one spawned process per rank and waits, with a deadline, for each to write
its result file; a process still alive after that is killed, so no test leaves one behind.

Why the ranks are robust (no port races, no hangs, no process left behind):

* the process group is initialised from a ``FileStore`` in the test's own ``tmp_path``
  (no port to pick, so nothing to race for); gloo then connects the ranks over 127.0.0.1
  with ports the OS assigns;
* a rank writes its result (or its exception) *before* teardown, so a teardown problem can
  never hide or change a result;
* teardown is a ``monitored_barrier`` with a timeout (every rank is done with every
  collective) and ``destroy_process_group``; then the process leaves through ``os._exit``,
  skipping the C++ static destructors whose race with gloo's threads is what aborts
  ("terminate called without an active exception") about once in 15 exits.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist

from _spawn import run_scenario, spawn_ranks

WORLD = 2
ACCUM = 4  # micro-batches per window
STEPS = 8  # optimizer steps of the plain DDP runs
LR = 1e-2
CLIP = 0.05  # below every window's gradient norm (checked): clipping always takes effect
MICRO = 6  # samples per micro-batch and rank
DDP_BUCKET_MB = 0.02  # several DDP buckets, cut elsewhere than the wrapper's (below)
WRAPPER_BUCKET_MB = 0.01


# -- the model and the data ---------------------------------------------------------------------
def mlp(dtype: torch.dtype = torch.float32, *, perturb: bool = False) -> torch.nn.Module:
    """~9k params in 8 tensors. ``perturb``: a different start (rank 1), which DDP must
    overwrite with rank 0's params when it is built."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
        torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    if perturb:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.5)
    return model.to(dtype)


class Reordered(torch.nn.Module):
    """Registered in another order than the forward uses its layers. DDP rebuilds its buckets
    in gradient-ready order after the first sync; with REORDERED_BUCKET_MB one of them then
    holds l3's params and l2's bias, which are not neighbours in the wrapper's buffer (reverse
    registration order): the hook's gather/scatter path, not the in-place range."""

    def __init__(self, perturb: bool):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = torch.nn.Linear(16, 64)
        self.l3 = torch.nn.Linear(64, 4)
        self.l2 = torch.nn.Linear(64, 64)
        if perturb:
            with torch.no_grad():
                for p in self.parameters():
                    p.add_(0.5)

    def forward(self, x):
        return self.l3(torch.tanh(self.l2(torch.tanh(self.l1(x)))))


class PartlyUsed(torch.nn.Module):
    """``only0`` gets gradients on rank 0 only, ``never`` on no rank (DDP's
    ``find_unused_parameters=True``): natively the first is averaged with rank 1's zeros and
    the second keeps ``.grad`` None, so AdamW leaves it alone (no weight decay either)."""

    def __init__(self, rank: int):
        super().__init__()
        torch.manual_seed(0)
        self.rank = rank
        self.a = torch.nn.Linear(16, 64)
        self.b = torch.nn.Linear(64, 4)
        self.only0 = torch.nn.Linear(64, 4)
        self.never = torch.nn.Linear(64, 4)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h) + self.only0(h) if self.rank == 0 else self.b(h)


# DDP closes a bucket once it reaches the cap: l3.b + l3.w = 1040 B < cap <= 1296 B (+ l2.b)
REORDERED_BUCKET_MB = 1200 / 2**20


def micro_batch(rank: int, step: int, i: int, dtype: torch.dtype = torch.float32):
    """Rank- and step-specific data: the ranks' gradients differ, so reducing them matters."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * i + rank)
    return (torch.randn(MICRO, 16, generator=g).to(dtype),
            torch.randn(MICRO, 4, generator=g).to(dtype))


def dataset(n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Samples for the framework runs (the frameworks shard them across the ranks)."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n_batches * MICRO, 16, generator=g)
    y = torch.randn(n_batches * MICRO, 4, generator=g)
    return list(zip(x, y))


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(out.float(), y.float())


def snapshot(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().double().clone() for p in model.parameters()]


# -- counting collectives -----------------------------------------------------------------------
_COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "broadcast", "all_gather",
                "all_gather_into_tensor", "reduce_scatter_tensor", "reduce", "all_to_all_single")


class CollectiveLog:
    """Records, for every collective issued through ``torch.distributed``'s functions, the phase
    the training loop was in (e.g. ``"micro1"``)."""

    def __init__(self):
        self.phase = "setup"
        self.calls: list[str] = []
        self._saved = {}

    def __enter__(self):
        for name in _COLLECTIVES:
            real = getattr(dist, name, None)
            if real is None:
                continue
            self._saved[name] = real

            def counted(*args, _real=real, _name=name, **kwargs):
                self.calls.append(f"{self.phase}:{_name}")
                return _real(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(dist, name, real)


# -- scenarios ----------------------------------------------------------------------------------
def _train_plain_ddp(rank: int, variant: str, wrap: bool) -> dict:
    """One DDP training: STEPS windows of ACCUM micro-batches, DDP's ``no_sync`` on all but the
    window's last, ``clip_grad_norm_`` on the sync step (what it returns is recorded)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import accumkernels
    from accumkernels import AccumulatingOptimizer

    dtype = torch.bfloat16 if variant == "bf16_public_hook" else torch.float32
    if variant == "reordered":
        model = Reordered(rank == 1)
    elif variant == "unused_params":
        model = PartlyUsed(rank)
    else:
        model = mlp(dtype, perturb=rank == 1)
    inner = torch.optim.AdamW(model.parameters(), lr=LR)
    opt = inner
    public_hook = variant in ("public_hook", "bf16_public_hook")
    if wrap and public_hook:  # built before DDP, the order Accelerate and the HF Trainer use
        opt = AccumulatingOptimizer(inner, bucket_size_mb=WRAPPER_BUCKET_MB)
    cap = REORDERED_BUCKET_MB if variant == "reordered" else DDP_BUCKET_MB
    ddp = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=variant == "public_hook",
              find_unused_parameters=variant == "unused_params",
              static_graph=variant == "static_graph")
    if wrap and public_hook:
        ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)
    elif wrap:
        # "mean": the wrapper divides by the micro-batches, the loop does not (native does)
        reduction = "mean" if variant == "mean" else "sum"
        opt = AccumulatingOptimizer(inner, model=ddp, bucket_size_mb=WRAPPER_BUCKET_MB,
                                    reduction=reduction)
    divide = ACCUM if not (wrap and variant == "mean") else 1
    # static_graph: DDP cannot skip the sync in its first iteration (torch raises natively)
    sync_every = variant in ("sync_every_microbatch", "static_graph")
    norms, no_grad = [], []  # no_grad: which params' .grad is None on the sync step
    with CollectiveLog() as log:
        for step in range(STEPS):
            for i in range(ACCUM):
                log.phase = f"micro{i}"
                last = i == ACCUM - 1
                ctx = contextlib.nullcontext() if last or sync_every else ddp.no_sync()
                x, y = micro_batch(rank, step, i, dtype)
                with ctx:
                    (loss_fn(ddp(x), y) / divide).backward()
            log.phase = "clip"
            no_grad.append([p.grad is None for p in model.parameters()])
            norms.append(float(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)))
            log.phase = "step"
            opt.step()
            opt.zero_grad()
            log.phase = "between"
    return {"params": snapshot(model), "norms": norms, "collectives": log.calls,
            "no_grad": no_grad}


def _bf16_reference(rank: int) -> dict:
    """What the wrapper is meant to compute for a bf16 model under DDP, written out without
    DDP or the wrapper: bf16 forward/backward, each micro-batch's bf16 gradient summed into an
    fp32 window, the window averaged over ranks in fp32 (divide, then sum: DDP's order),
    clipped, AdamW on fp32 master weights, copied back to the bf16 params."""
    model = mlp(torch.bfloat16, perturb=rank == 1)
    params = list(model.parameters())
    with torch.no_grad():
        for p in params:
            dist.broadcast(p, src=0)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in params]
    opt = torch.optim.AdamW(masters, lr=LR)
    norms = []
    for step in range(STEPS):
        window = [torch.zeros_like(m) for m in masters]
        for i in range(ACCUM):
            x, y = micro_batch(rank, step, i, torch.bfloat16)
            grads = torch.autograd.grad(loss_fn(model(x), y) / ACCUM, params)
            for w, g in zip(window, grads):
                w.add_(g.float())
        for w in window:
            w.div_(WORLD)
            dist.all_reduce(w)
        for m, w in zip(masters, window):
            m.grad = w
        norms.append(float(torch.nn.utils.clip_grad_norm_(masters, CLIP)))
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
    return {"params": snapshot(model), "norms": norms}


def scenario_plain_ddp(rank: int, variants: list[str]) -> dict:
    out = {}
    for variant in variants:
        native = (_bf16_reference(rank) if variant.startswith("bf16")
                  else _train_plain_ddp(rank, variant, wrap=False))
        out[variant] = {"native": native, "wrapper": _train_plain_ddp(rank, variant, wrap=True)}
    return out


def scenario_accelerate(rank: int) -> dict:
    """Accelerate's ``accumulate()`` loop, Accelerate-prepared model/optimizer/loader, then the
    one line that tells DDP to reduce the wrapper's fp32 window."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1")
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import accumkernels
    from accumkernels import AccumulatingOptimizer

    # 2 ranks x 30 micro-batches: 7 windows of 4 and a short last one of 2 (end of the loader).
    data = dataset(2 * 30)
    out = {}
    for wrap in (False, True):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
        model = mlp(perturb=rank == 1)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        if wrap:
            opt = AccumulatingOptimizer(opt, bucket_size_mb=WRAPPER_BUCKET_MB)
        loader = torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False)
        model, opt, loader = accelerator.prepare(model, opt, loader)
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model)
        if wrap:
            model.register_comm_hook(None, accumkernels.ddp_comm_hook)
        norms, micro = [], 0
        for x, y in loader:
            with accelerator.accumulate(model):
                accelerator.backward(loss_fn(model(x), y))
                micro += 1
                if accelerator.sync_gradients:
                    norms.append(float(accelerator.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad()
        out["wrapper" if wrap else "native"] = {
            "params": snapshot(accelerator.unwrap_model(model)), "norms": norms, "micro": micro}
    return out


def scenario_hf_trainer(rank: int, out_dir: str) -> dict:
    """The HF Trainer on 2 processes, ``gradient_accumulation_steps=4``, ``max_grad_norm``:
    it builds the DDP module inside ``train()``; a callback registers the comm hook on it
    (``trainer.model_wrapped``) at ``on_train_begin``, before the first backward."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    import transformers
    from accelerate.state import AcceleratorState, GradientState

    import accumkernels
    from accumkernels import AccumulatingOptimizer

    class Regression(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp(perturb=rank == 1)

        def forward(self, x, labels):
            return {"loss": loss_fn(self.net(x), labels)}

    class ReduceTheWindow(transformers.TrainerCallback):
        trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            ddp = self.trainer.model_wrapped
            assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel), type(ddp)
            ddp.register_comm_hook(None, accumkernels.ddp_comm_hook)

    transformers.logging.set_verbosity_error()
    # 2 ranks x 30 micro-batches: 7 windows of 4 and a short last one of 2 (end of the epoch)
    data = [{"x": x, "labels": y} for x, y in dataset(2 * 30)]
    out = {}
    for wrap in (False, True):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        model = Regression()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        callbacks = []
        if wrap:
            opt = AccumulatingOptimizer(opt, bucket_size_mb=WRAPPER_BUCKET_MB)
            callbacks = [ReduceTheWindow()]
        args = transformers.TrainingArguments(
            output_dir=os.path.join(out_dir, f"hf{rank}{wrap}"), use_cpu=True,
            per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
            max_grad_norm=CLIP, learning_rate=LR, lr_scheduler_type="constant",
            num_train_epochs=1, report_to=[], save_strategy="no", logging_strategy="no",
            disable_tqdm=True, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                       optimizers=(opt, None), callbacks=callbacks)
        for cb in callbacks:
            cb.trainer = trainer
        trainer.train()
        out["wrapper" if wrap else "native"] = {"params": snapshot(model.net),
                                                "steps": trainer.state.global_step}
    return out


def scenario_lightning(rank: int) -> dict:
    """Lightning ``strategy="ddp"``, ``devices=2``, ``accumulate_grad_batches=4``, gradient
    clipping; the wrapper gets the DDP module Lightning built (``trainer.strategy.model``)."""
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")  # the group exists already
    import lightning as L

    from accumkernels import AccumulatingOptimizer

    class Module(L.LightningModule):
        def __init__(self, wrap: bool):
            super().__init__()
            self.net = mlp(perturb=rank == 1)
            self.wrap = wrap
            self.norms: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_fn(self.net(x), y)

        def on_before_optimizer_step(self, optimizer):
            self.norms.append(float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(p.grad) for p in self.parameters()]))))

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=LR)
            if self.wrap:
                opt = AccumulatingOptimizer(opt, model=self.trainer.strategy.model,
                                            bucket_size_mb=WRAPPER_BUCKET_MB)
            return opt

    data = dataset(2 * 30)  # 30 micro-batches per rank: 7 windows of 4 and a short one of 2
    out = {}
    for wrap in (False, True):
        module = Module(wrap)
        trainer = L.Trainer(
            accelerator="cpu", devices=WORLD, strategy="ddp", accumulate_grad_batches=ACCUM,
            gradient_clip_val=CLIP, max_epochs=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=MICRO, shuffle=False))
        out["wrapper" if wrap else "native"] = {"params": snapshot(module.net),
                                                "norms": module.norms}
    return out


def scenario_nanogpt(rank: int) -> dict:
    """nanoGPT's train.py: the model in DDP, ``require_backward_grad_sync`` toggled by hand on
    the last micro-batch, clip, step; the optimizer knows nothing about DDP (no ``model=``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    out = {}
    for wrap in (False, True):
        model = mlp(perturb=rank == 1)
        ddp = DDP(model, bucket_cap_mb=DDP_BUCKET_MB)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        norms = []
        try:
            if wrap:
                opt = AccumulatingOptimizer(opt)
            for step in range(3):
                for i in range(ACCUM):
                    ddp.require_backward_grad_sync = i == ACCUM - 1
                    x, y = micro_batch(rank, step, i)
                    (loss_fn(ddp(x), y) / ACCUM).backward()
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
                opt.step()
                opt.zero_grad(set_to_none=True)
            error = None
        except Exception as exc:  # the refusal this scenario accepts (checked by the test)
            error = f"{type(exc).__name__}: {exc}"
        out["wrapper" if wrap else "native"] = {"params": snapshot(model), "norms": norms,
                                                "error": error}
    return out


def scenario_no_ddp(rank: int) -> dict:
    """Two ranks, no DDP, no process_group: stepping on rank-local gradients must be refused;
    ``independent_ranks=True`` says it is meant (each rank trains its own model)."""
    from accumkernels import AccumulatingOptimizer

    out = {}
    for opt_out in (False, True):
        model = mlp()
        reference = mlp()  # the same training without the wrapper, rank-local
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=LR)
        error = None
        try:
            kwargs = {"independent_ranks": True} if opt_out else {}
            opt = AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=LR), **kwargs)
            for step in range(2):
                for i in range(ACCUM):
                    x, y = micro_batch(rank, step, i)
                    (loss_fn(model(x), y) / ACCUM).backward()
                    (loss_fn(reference(x), y) / ACCUM).backward()
                opt.step()
                opt.zero_grad()
                ref_opt.step()
                ref_opt.zero_grad()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        out["opt_out" if opt_out else "default"] = {
            "error": error, "params": snapshot(model), "reference": snapshot(reference)}
    return out


def scenario_fsdp2(rank: int) -> dict:
    """FSDP2 (``fully_shard``, DTensor params): the wrapper refuses it when it is built, or it
    works: the fp32 window per local shard, equal to native FSDP2 accumulating in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from accumkernels import AccumulatingOptimizer

    def sharded():
        model = mlp()
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        return model

    out = {}
    for wrap in (False, True):
        model = sharded()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        if wrap:
            try:
                opt = AccumulatingOptimizer(opt)
            except (ValueError, TypeError) as exc:
                out["refused"] = f"{type(exc).__name__}: {exc}"
                return out
        for step in range(3):
            for i in range(ACCUM):
                model.set_requires_gradient_sync(i == ACCUM - 1)
                x, y = micro_batch(rank, step, i)
                (loss_fn(model(x), y) / ACCUM).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            opt.zero_grad()
        out["wrapper" if wrap else "native"] = [p.full_tensor().detach().double().clone()
                                                for p in model.parameters()]
    return out


def scenario_written_nonfinite(rank: int) -> dict:
    """A NaN the user writes into rank 1's ``p.grad`` after the window was reduced (DDP's sync
    backward, or ``process_group`` before ``step()``): every rank must skip that window
    (``skip_step``) or raise (``raise``), never step apart. Window 1 of 3 is poisoned."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    out: dict = {}
    for mode in ("ddp", "process_group", "process_group_n"):
        for policy in ("skip_step", "raise"):
            model = mlp()
            inner = torch.optim.AdamW(model.parameters(), lr=LR)
            if mode == "ddp":
                net = DDP(model, bucket_cap_mb=DDP_BUCKET_MB)
                opt = AccumulatingOptimizer(inner, model=net, nonfinite=policy, max_grad_norm=CLIP)
            else:
                net = model
                # process_group_n: N given, the window's buckets are summed during its last
                # backward, before the NaN is written
                n = ACCUM if mode == "process_group_n" else None
                opt = AccumulatingOptimizer(inner, process_group=dist.group.WORLD,
                                            nonfinite=policy, max_grad_norm=CLIP,
                                            accumulation_steps=n)
            params, raised = [], []
            for step in range(3):
                for i in range(ACCUM):
                    ctx = ddp_ctx(net, i == ACCUM - 1)
                    x, y = micro_batch(rank, step, i)
                    with ctx:
                        loss_fn(net(x), y).backward()
                if step == 1 and rank == 1:
                    model[0].weight.grad[0, 0] = float("nan")
                try:
                    opt.step()
                except FloatingPointError:
                    raised.append(step)
                    opt.reset_window()
                opt.zero_grad()
                params.append(snapshot(model))
            out[f"{mode}_{policy}"] = {"skipped": opt.skipped_steps, "params": params,
                                       "raised": raised}
            opt.remove_hooks()
    return out


def scenario_no_sync_forgotten(rank: int) -> dict:
    """``no_sync()`` on every micro-batch, the window's last one included, ``model=ddp``, a
    user's clip before ``step()``; two windows. Native's loop: the same, then the clipped
    ``.grad`` averaged over the ranks by hand (what the wrapper does at ``step()``)."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from accumkernels import AccumulatingOptimizer

    out: dict = {}
    for wrap in (False, True):
        ddp = DDP(mlp())
        opt = torch.optim.SGD(ddp.parameters(), lr=LR)
        if wrap:
            opt = AccumulatingOptimizer(opt, accumulation_steps=ACCUM, model=ddp)
        grads, norms = [], []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(2):
                for i in range(ACCUM):
                    x, y = micro_batch(rank, step, i)
                    with ddp.no_sync():
                        loss_fn(ddp(x), y).backward()
                grads.append([p.grad.detach().clone() for p in ddp.parameters()])
                norms.append(torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP))
                if not wrap:
                    for p in ddp.parameters():
                        p.grad.div_(dist.get_world_size())
                        dist.all_reduce(p.grad)
                opt.step()
                opt.zero_grad()
        out["ours" if wrap else "native"] = {
            "grads": grads, "norms": norms, "params": snapshot(ddp.module),
            "warned": [str(w.message) for w in caught if "no_sync" in str(w.message)]}
    return out


def ddp_ctx(net, sync: bool):
    """DDP's ``no_sync`` on all but the window's last micro-batch (no-op without DDP)."""
    if sync or not hasattr(net, "no_sync"):
        return contextlib.nullcontext()
    return net.no_sync()


SCENARIOS = {
    "written_nonfinite": scenario_written_nonfinite,
    "plain_ddp": scenario_plain_ddp,
    "accelerate": scenario_accelerate,
    "lightning": scenario_lightning,
    "hf_trainer": scenario_hf_trainer,
    "nanogpt": scenario_nanogpt,
    "no_ddp": scenario_no_ddp,
    "fsdp2": scenario_fsdp2,
    "no_sync_forgotten": scenario_no_sync_forgotten,
}


# -- process management -------------------------------------------------------------------------
def _rank_main(rank: int, out_dir: str, scenario: str, kwargs: dict) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)  # 2 ranks on a 2-core machine
    run_scenario(rank, out_dir, WORLD, lambda: SCENARIOS[scenario](rank, **kwargs))


def run_ranks(tmp_path, scenario: str, timeout: float = 90.0, **kwargs) -> list[dict]:
    """Run ``scenario`` on WORLD spawned ranks; return each rank's ``result`` dict.

    Raises AssertionError with the rank's traceback if a rank failed, TimeoutError if a rank
    wrote no result within ``timeout`` seconds. Every process is gone when this returns.
    """
    return spawn_ranks(_rank_main, str(tmp_path), scenario, kwargs, WORLD, timeout)
