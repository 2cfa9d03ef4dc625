"""Shared pieces of the tests that run a loop natively and wrapped side by side (the visibility
invariant and "No guessing from outside": tests/optim/test_native_equivalence.py,
tests/optim/test_two_trainings.py; tests/integrations/test_real_projects.py; the zero_grad,
master-weight and robustness tests of tests/optim/).

Every test runs the same loop twice -- once with the stock optimizer and PyTorch's own fp32
``.grad`` accumulation ("native"), once with ``AccumulatingOptimizer`` dropped in -- and compares
what the user can observe: ``p.grad`` between backwards, logged gradient norms, losses, params.

Precision argument for the tolerances (fp32 models): with ``reduction="sum"`` the wrapper adds the
very same fp32 micro-batch gradients in the same order as autograd's AccumulateGrad (``g1`` written,
then ``+ 1.0 * g2``, ...; ``x + 1.0*y`` rounds exactly like ``x + y``), so ``p.grad``, norms and
steps are expected bit-for-bit; ``REL = 1e-6`` (norm-wise, per tensor) is the contract's fp32 bound
for chains of <= 64 micro-batches and leaves room for a different but legitimate summation order
only. A missed, doubled or dropped micro-batch, a stale window or a clip that did not act moves
gradients by O(1) relative and params by ~lr: far outside. For bf16 params ``p.grad`` is compared
with the float64 sum of the bf16 micro-batch gradients under the fp32 recursive-summation bound
``|s_k - S_k| <= (k-1) u sum|g_i|`` (u = 2**-24), checked elementwise with a factor of 1.01 margin.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import math
import os
import sys
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from accumkernels import AccumulatingOptimizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REL = 1e-6
U32 = 2.0 ** -24
# ~0.001 MB = 262 fp32 elements: the MLPs below span several buckets.
SMALL_BUCKET = 0.001
D_IN, D_OUT = 12, 5
N_ACCUM = 4
CLIP = 0.05  # far below every window's gradient norm in these tests (asserted where it matters)


# -- models and data ------------------------------------------------------------------------------

def mlp(dtype=torch.float32, widths=(D_IN, 24, 16, D_OUT), seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1]).to(dtype)


def random_seed() -> int:
    """A seed drawn from the per-test generator (conftest seeds it from the test id)."""
    return int(torch.randint(0, 2**31 - 1, ()))


def mlp_batches(n: int, m: int = 4, dtype=torch.float32) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fresh random (never zero) regression micro-batches."""
    return [(torch.randn(m, D_IN).to(dtype), torch.randn(m, D_OUT).to(dtype)) for _ in range(n)]


def mse(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def capture_grads(model: nn.Module):
    """Record every gradient autograd hands each param (before accumulation): (caps, handles)."""
    caps = {name: [] for name, p in model.named_parameters() if p.requires_grad}
    handles = [p.register_hook(lambda g, name=name: caps[name].append(g.detach().clone()))
               for name, p in model.named_parameters() if p.requires_grad]
    return caps, handles


# -- comparisons ----------------------------------------------------------------------------------

def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Norm-wise relative error of ``a`` against ``ref`` in float64 (inf if only ref is 0)."""
    diff = (a.detach().double() - ref.detach().double()).norm().item()
    den = ref.detach().double().norm().item()
    if den == 0:
        return 0.0 if diff == 0 else math.inf
    return diff / den


def grad_is_window_view(p: torch.Tensor) -> str | None:
    """Why ``p.grad`` is not a zero-copy fp32 view of ``p.main_grad`` (None if it is)."""
    g = p.grad
    if g is None:
        return "p.grad is None"
    if g.dtype != torch.float32:
        return f"p.grad has dtype {g.dtype}, expected torch.float32"
    mg = getattr(p, "main_grad", None)
    if not isinstance(mg, torch.Tensor):
        return "p.main_grad is missing"
    if g.data_ptr() != mg.data_ptr() or g.shape != mg.shape or g.stride() != mg.stride():
        return "p.grad does not alias p.main_grad (same data_ptr, shape, strides)"
    return None


def assert_grads_match_native(model: nn.Module, native: nn.Module, where: str = "",
                              rel: float = REL) -> None:
    """Each of the wrapper model's ``p.grad`` is what native holds: None where native's is None,
    otherwise an fp32 view aliasing ``p.main_grad`` equal to native's ``.grad`` within ``rel``."""
    for (name, p), q in zip(model.named_parameters(), native.parameters()):
        if q.grad is None:
            assert p.grad is None, f"{where}{name}: native .grad is None, the wrapper's is not"
            continue
        why = grad_is_window_view(p)
        assert why is None, f"{where}{name}: {why} (native holds the running window)"
        assert torch.isfinite(p.grad).all() == torch.isfinite(q.grad).all(), f"{where}{name}"
        err = rel_err(p.grad, q.grad)
        assert err <= rel, f"{where}{name}: p.grad differs from native by {err:.3g} (relative)"


def grad_norm(params) -> float:
    """The 2-norm over every ``p.grad`` (None counts as no gradient), in float64."""
    grads = [p.grad.detach().double() for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item()


def assert_values_match(ours: list[float], native: list[float], what: str,
                        rel: float = REL) -> None:
    """Same length, same non-finite positions, finite values within ``rel``."""
    assert len(ours) == len(native), f"{what}: {len(ours)} values, reference has {len(native)}"
    for i, (a, b) in enumerate(zip(ours, native)):
        if not math.isfinite(b):
            assert not math.isfinite(a), f"{what}[{i}]: {a} but reference {b}"
            continue
        assert math.isfinite(a) and abs(a - b) <= rel * abs(b) + 1e-12, \
            f"{what}[{i}]: {a!r} vs reference {b!r}\n ours:      {ours}\n reference: {native}"


def assert_same_params(native: nn.Module, ours: nn.Module, *, rtol: float = REL,
                       atol: float = 1e-6) -> None:
    for (name, p), q in zip(native.named_parameters(), ours.parameters()):
        torch.testing.assert_close(q.detach(), p.detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def assert_moved(model: nn.Module, start: nn.Module, by: float = 1e-4) -> None:
    """Training did something (two runs that agree because neither stepped prove nothing)."""
    moved = max((p.detach().double() - q.detach().double()).abs().max().item()
                for p, q in zip(model.parameters(), start.parameters()))
    assert moved > by, f"params moved by only {moved}"


def sgd_pair(accumulation_steps=None, dtype=torch.float32, **kw):
    """(native model, its momentum SGD, wrapped model, AccumulatingOptimizer of the same SGD):
    the same seeded MLP twice, for loops run natively and wrapped side by side."""
    native = mlp(dtype)
    ours = copy.deepcopy(native)
    return (native, torch.optim.SGD(native.parameters(), lr=0.1, momentum=0.9),
            ours, AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9),
                                        accumulation_steps=accumulation_steps, **kw))


# -- counting fused launches ----------------------------------------------------------------------

# Where a fused launch can be entered, outermost first. Whichever of them a launch passes through
# first counts it (nested ones are the same launch): the buffer's accumulate, the public op (seen as
# the custom op accumkernels::accumulate_ by the dispatch mode below), a backend's entry points.
_LAUNCH_ENTRIES = (
    ("accumkernels.buffer", "MasterGradBuffer", "accumulate"),
    ("accumkernels.ops.backends.native", None, "accumulate"),
    ("accumkernels.ops.backends.native", None, "run"),
    ("accumkernels.ops.backends.native", None, "run_plan"),
    ("accumkernels.ops.backends.reference", None, "accumulate"),
    ("accumkernels.ops.backends.triton", None, "accumulate"),
)


class LaunchRecorder:
    """Sees every gradient move into the master buffer during a backward.

    * ``launches``: one entry per fused launch (``MasterGradBuffer.accumulate``, the op
      ``accumkernels.accumulate_`` or a backend's entry point, whichever it reaches first): the
      indices (in ``params``) of the params whose ``main_grad`` it writes (``None`` for a
      destination that is no param's ``main_grad``) and whether it overwrote.
    * ``stale``: params whose view, when its launch started, no longer held what it held when
      :meth:`arm` was called (something -- such as autograd's AccumulateGrad adding into a
      ``.grad`` that is the view -- wrote into it in between).
    * ``stray_writes``: ATen ops outside any launch that wrote into the master buffer's storage
      (a per-param ``add_`` into the view), seen through a TorchDispatchMode around backward.
    """

    def __init__(self, params):
        self.params = list(params)
        self.launches: list[tuple[list[int | None], bool]] = []
        self.stale: list[int] = []
        self.stray_writes: list[str] = []
        self._inside = 0
        self._snapshot: dict[int, torch.Tensor] = {}

    def arm(self) -> None:
        """Snapshot every view (call between backwards) and clear the records."""
        self.launches, self.stale, self.stray_writes = [], [], []
        self._by_id = {id(p): i for i, p in enumerate(self.params)}
        self._by_ptr = {p.main_grad.data_ptr(): i for i, p in enumerate(self.params)}
        self._storages = {p.main_grad.untyped_storage().data_ptr() for p in self.params}
        self._snapshot = {i: p.main_grad.detach().clone() for i, p in enumerate(self.params)}

    def _index(self, t) -> int | None:
        if not isinstance(t, torch.Tensor):
            return None
        if id(t) in self._by_id:  # a param (MasterGradBuffer.accumulate takes the params)
            return self._by_id[id(t)]
        return self._by_ptr.get(t.data_ptr())  # a destination view

    def _record(self, dst, overwrite: bool) -> None:
        idx = [self._index(t) for t in dst] if isinstance(dst, (list, tuple)) else [None]
        self.launches.append((idx, bool(overwrite)))
        for i in idx:
            if i is not None and not overwrite and not torch.equal(self.params[i].main_grad,
                                                                   self._snapshot[i]):
                self.stale.append(i)

    def _entry(self, original, method: bool):
        def entry(*args, **kwargs):
            if not self._inside:
                rest = args[1:] if method else args
                overwrite = kwargs.get("overwrite",
                                       rest[4] if len(rest) > 4 and isinstance(rest[4], bool)
                                       else False)
                self._record(rest[0] if rest else None, overwrite)
            self._inside += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._inside -= 1
        return entry

    @contextlib.contextmanager
    def backward(self):
        """Context for one ``loss.backward()``: watch the launch entry points and ATen writes."""
        import importlib

        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self
        patches = []
        for module_name, class_name, attr in _LAUNCH_ENTRIES:
            if module_name.endswith("triton") and module_name not in sys.modules:
                continue  # never imported: nothing can launch through it
            owner = importlib.import_module(module_name)
            if class_name is not None:
                owner = getattr(owner, class_name)
            original = vars(owner).get(attr)
            if original is None:
                continue
            patches.append((owner, attr, original))
            setattr(owner, attr, self._entry(original, method=class_name is not None))

        class WriteWatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "namespace", "") == "accumkernels":  # the public op: a launch
                    if not recorder._inside:
                        overwrite = args[4] if len(args) > 4 else kwargs.get("overwrite", False)
                        recorder._record(args[0] if args else kwargs.get("dst"), overwrite)
                    recorder._inside += 1
                    try:
                        return func(*args, **kwargs)
                    finally:
                        recorder._inside -= 1
                if not recorder._inside:
                    for i, arg in enumerate(func._schema.arguments):
                        if arg.alias_info is None or not arg.alias_info.is_write:
                            continue
                        value = kwargs.get(arg.name, args[i] if i < len(args) else None)
                        for t in value if isinstance(value, (list, tuple)) else [value]:
                            if (isinstance(t, torch.Tensor)
                                    and t.untyped_storage().data_ptr() in recorder._storages):
                                recorder.stray_writes.append(str(func))
                return func(*args, **kwargs)

        try:
            with WriteWatch():
                yield self
        finally:
            for owner, attr, original in reversed(patches):
                setattr(owner, attr, original)


# -- Accelerate state -----------------------------------------------------------------------------

def reset_accelerate() -> None:
    """Fresh Accelerate singletons (for the TEST's bookkeeping; the wrapper must not need it)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def accelerate_state_reset_after():
    """A test that uses Accelerate decides itself when the singletons are fresh (reset_accelerate);
    whatever happens, it leaves them fresh for the next test."""
    yield
    reset_accelerate()


# -- framework runs on a tiny GPT-2 ---------------------------------------------------------------
# Each returns a Run: what a user would log. micro_norms: the norm of the model's p.grad after
# every micro-batch's backward (the running window: native accumulates it in p.grad); clip_norms:
# the pre-clip norm each window end's clip returned; losses: every micro-batch's loss.

MICRO_BATCH = 2
GPT_LR = 1e-2
GPT_CLIP = 0.05  # below every window's norm (asserted by the tests)


@dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer | None = None
    micro_norms: list[float] = field(default_factory=list)
    clip_norms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def assert_runs_match(ours: Run, ref: Run, what: str, *, rel: float = REL,
                      atol: float = 1e-5) -> None:
    """Same logs and params. atol for params: the integration tests' margin (see
    _integrations_common: lr * steps * 2**-24 << 1e-5 << lr)."""
    assert_values_match(ours.losses, ref.losses, f"{what} losses", rel)
    assert_values_match(ours.micro_norms, ref.micro_norms, f"{what} per-micro-batch grad norms",
                        rel)
    assert_values_match(ours.clip_norms, ref.clip_norms, f"{what} pre-clip norms", rel)
    assert_same_params(ref.model, ours.model, rtol=0, atol=atol)


def wrap_adamw(model, wrap: bool, accumulation_steps: int | None, **kw):
    opt = torch.optim.AdamW(model.parameters(), lr=GPT_LR)
    if wrap:
        opt = AccumulatingOptimizer(opt, accumulation_steps=accumulation_steps, reduction="sum",
                                    **kw)
    return opt


def _decay(step: int) -> float:
    return max(0.0, 1.0 - step / 16)


def run_accelerate(start: nn.Module, samples, *, wrap: bool, accumulation_steps: int | None = None,
                   epochs: int = 2) -> Run:
    """Accelerate's gradient-accumulation guide, prepared optimizer and scheduler, clipping."""
    from _integrations_common import loader
    from accelerate import Accelerator

    run = Run(copy.deepcopy(start))
    accelerator = Accelerator(gradient_accumulation_steps=N_ACCUM, cpu=True)
    opt = wrap_adamw(run.model, wrap, accumulation_steps)
    run.opt = opt
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, _decay)
    model, prepared, dataloader, scheduler = accelerator.prepare(
        run.model, opt, loader(samples, MICRO_BATCH), scheduler)
    model.train()
    for _ in range(epochs):
        for batch in dataloader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                run.losses.append(loss.item())
                accelerator.backward(loss)
                run.micro_norms.append(grad_norm(model.parameters()))
                if accelerator.sync_gradients:
                    run.clip_norms.append(
                        accelerator.clip_grad_norm_(model.parameters(), GPT_CLIP).item())
                prepared.step()
                scheduler.step()
                prepared.zero_grad()
    return run


def run_lightning(start: nn.Module, samples, *, wrap: bool, accumulation_steps: int | None = None,
                  epochs: int = 2) -> Run:
    """Lightning automatic optimization, accumulate_grad_batches=4, gradient_clip_val."""
    import lightning as L
    from _integrations_common import loader

    run = Run(copy.deepcopy(start))

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = run.model

        def training_step(self, batch, batch_idx):
            loss = self.model(**batch).loss
            run.losses.append(loss.item())
            return loss

        def on_after_backward(self):
            run.micro_norms.append(grad_norm(self.model.parameters()))

        def on_before_optimizer_step(self, optimizer):  # before Lightning's clip
            run.clip_norms.append(grad_norm(self.model.parameters()))

        def configure_optimizers(self):
            run.opt = wrap_adamw(self.model, wrap, accumulation_steps)
            scheduler = torch.optim.lr_scheduler.LambdaLR(run.opt, _decay)
            return {"optimizer": run.opt,
                    "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    trainer = L.Trainer(
        accumulate_grad_batches=N_ACCUM, accelerator="cpu", devices=1, max_epochs=epochs,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, gradient_clip_val=GPT_CLIP, num_sanity_val_steps=0)
    trainer.fit(Module(), loader(samples, MICRO_BATCH))
    return run


def run_trainer(start: nn.Module, samples, output_dir, *, wrap: bool,
                accumulation_steps: int | None = None, epochs: int = 2) -> Run:
    """HF Trainer, gradient_accumulation_steps=4, max_grad_norm, the optimizer passed in."""
    from _integrations_common import TokenDataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    run = Run(copy.deepcopy(start))
    run.opt = wrap_adamw(run.model, wrap, accumulation_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(run.opt, _decay)

    class Record(TrainerCallback):
        def on_substep_end(self, args, state, control, **kwargs):  # non-final micro-batches
            run.micro_norms.append(grad_norm(run.model.parameters()))

    args = TrainingArguments(
        output_dir=str(output_dir), report_to=[], use_cpu=True, save_strategy="no",
        logging_steps=1, per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=N_ACCUM, max_grad_norm=GPT_CLIP, num_train_epochs=epochs,
        seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=run.model, args=args, train_dataset=TokenDataset(samples),
                      optimizers=(run.opt, scheduler), callbacks=[Record()])
    trainer.train()
    logs = [h for h in trainer.state.log_history if "grad_norm" in h]
    run.clip_norms = [h["grad_norm"] for h in logs]  # Trainer's pre-clip norm of p.grad
    run.losses = [h["loss"] for h in logs]
    return run


def run_plain(start: nn.Module, samples, *, wrap: bool, accumulation_steps: int = N_ACCUM,
              epochs: int = 2) -> Run:
    """The textbook loop (loss / N, clip + step + zero_grad every N and at the end of the data).
    With the wrapper, Accelerate-style: step() and zero_grad() every micro-batch (no-ops
    mid-window), clip where ``opt.sync_step`` says, flush() the short window at the end."""
    from _integrations_common import loader

    run = Run(copy.deepcopy(start))
    model = run.model
    run.opt = opt = wrap_adamw(model, wrap, accumulation_steps)
    batches = list(loader(samples, MICRO_BATCH))
    for _ in range(epochs):
        for i, batch in enumerate(batches):
            loss = model(**batch).loss
            run.losses.append(loss.item())
            (loss / N_ACCUM).backward()
            run.micro_norms.append(grad_norm(model.parameters()))
            last = i == len(batches) - 1
            if wrap:
                if opt.sync_step or last:
                    run.clip_norms.append(
                        torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_CLIP).item())
                opt.flush() if last else opt.step()
                opt.zero_grad()
            elif (i + 1) % N_ACCUM == 0 or last:
                run.clip_norms.append(
                    torch.nn.utils.clip_grad_norm_(model.parameters(), GPT_CLIP).item())
                opt.step()
                opt.zero_grad()
    return run
