"""The conformance matrix's table: every axis the README claims, each value a small dataclass,
the constraints between them, and the covering array over them (``covertable``).

DEVELOPERS' convention: a new feature adds its value here (and, where the loop must do something
new, one branch in _matrix_loop.py / _matrix_ranks.py); its cross with every other value of every
other axis then comes for free from the covering array. A value that cannot meet another gets a
constraint below, with the reason.

Case ids are ``<part>-<index>`` in the generated order; the order depends only on the table, the
constraints and ``SALT`` (covertable's hash sorter is deterministic), so an id reproduces.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

SALT = "accumkernels-conformance-1"


@dataclass(frozen=True)
class Opt:
    """An inner optimizer: class name, constructor kwargs, implementation flag."""

    cls: str
    impl: str  # "forloop", "foreach", "fused"
    kwargs: tuple = ()

    def kwargs_with_impl(self) -> dict:
        kw = dict(self.kwargs)
        if self.impl != "forloop":
            kw[self.impl] = True
        else:
            kw["foreach"] = False
        return kw

    def build(self, params):
        return getattr(torch.optim, self.cls)(params, **self.kwargs_with_impl())


SGD_KW = (("lr", 0.1), ("momentum", 0.9), ("nesterov", True), ("weight_decay", 0.01))
ADAM_KW = (("lr", 0.02), ("weight_decay", 0.01))
OPTIMIZERS = {
    f"{c.lower()}-{impl}": Opt(c, impl, kw)
    for c, kw in (("SGD", SGD_KW), ("Adam", ADAM_KW), ("AdamW", ADAM_KW))
    for impl in ("forloop", "foreach", "fused")
}
OPTIMIZERS["rmsprop-foreach"] = Opt("RMSprop", "foreach", (("lr", 0.01), ("momentum", 0.5)))
OPTIMIZERS["adagrad-forloop"] = Opt("Adagrad", "forloop", (("lr", 0.1),))
# the rest of torch.optim (the surface gate, test_surface.py, enumerates the classes and flags:
# each is a value here or an exclusion there) and the flags that change the math
OPTIMIZERS.update({
    "adagrad-fused": Opt("Adagrad", "fused", (("lr", 0.1),)),
    "nadam-foreach": Opt("NAdam", "foreach", ADAM_KW),
    "radam-forloop": Opt("RAdam", "forloop", ADAM_KW + (("decoupled_weight_decay", True),)),
    "adamax-foreach": Opt("Adamax", "foreach", ADAM_KW),
    "asgd-forloop": Opt("ASGD", "forloop", (("lr", 0.05),)),
    "rprop-foreach": Opt("Rprop", "foreach", (("lr", 0.01),)),
    "adadelta-foreach": Opt("Adadelta", "foreach", (("lr", 0.5),)),
    "adafactor-forloop": Opt("Adafactor", "forloop", (("lr", 0.01),)),
    "adam-amsgrad-maximize-fused": Opt("Adam", "fused", ADAM_KW + (("amsgrad", True),
                                                                   ("maximize", True))),
})


@dataclass(frozen=True)
class Reduction:
    name: str  # the wrapper's reduction
    weight_after: bool = False  # weighted: add_weight after the micro-batch's backward


REDUCTIONS = {
    "sum": Reduction("sum"),
    "mean": Reduction("mean"),
    "weighted-before": Reduction("weighted"),
    "weighted-after": Reduction("weighted", weight_after=True),
}


@dataclass(frozen=True)
class Accum:
    """accumulation_steps and how the loop calls step()."""

    n: int | None  # accumulation_steps
    step_every_micro: bool  # step() after every micro-batch (no-ops until the window is full)
    short_last: bool = False  # the last window has fewer micro-batches


ACCUMS = {
    "N": Accum(3, True),
    "None": Accum(None, False),
    "N-short-last": Accum(3, False, short_last=True),
}


@dataclass(frozen=True)
class Nonfinite:
    policy: str
    nan: bool  # a NaN micro-batch in the second window


NONFINITES = {
    "none": Nonfinite("skip_step", False),
    "nan-skip_step": Nonfinite("skip_step", True),
    "nan-skip_microbatch": Nonfinite("skip_microbatch", True),
    "nan-raise": Nonfinite("raise", True),
}

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# What loops do to the model and the optimizer (_matrix_loop.LoopActions does them on both sides):
# opt-zero_grad: opt.zero_grad() after every step() call (the plain loop); model-zero_grad /
# grad-none: the same clear through model.zero_grad() / p.grad = None (the HF Trainer's way);
# model-zero_grad-every: model.zero_grad() after every micro-batch, step() called or not (with N
# it means opt.zero_grad(): a filling window is kept); no-zero_grad: never cleared (the next
# window adds to the last, as .grad does natively); reset_window: opt.reset_window() before the
# forward of window 1's micro-batch 2; add_param_group-boundary / -mid: the last layer frozen
# and left out of the optimizer at construction, unfrozen and added with add_param_group at the
# boundary after window 0 / after window 1's micro-batch 0 backward (before accumulate() moves
# it: accumulate_in_backward=False keeps it in .grad); freeze-between / freeze-before: the first
# layer's params
# requires_grad_(False) between the forward and the backward / before the forward of every
# odd micro-batch of windows 1 and 2, restored after its backward (GAN code).
LOOPS = ("opt-zero_grad", "model-zero_grad", "grad-none", "model-zero_grad-every",
         "no-zero_grad", "reset_window",
         "add_param_group-boundary", "add_param_group-mid", "freeze-between", "freeze-before")
# Hooks registered before wrapping: tensor-hook: p.register_hook(g * 0.5) on the first param;
# module-hook: a full backward pre-hook on the model halving grad_output; inner-pre-hook /
# inner-post-hook: the inner optimizer's own step hooks shrinking its params by 1 %
# (a projection; with masters they are the masters); wrapper-post-hook: the wrapper's
# register_step_post_hook doing the same to the model's params.
# Registered after wrapping (issue 61: the wrapper's own hooks come first): tensor-hook-after:
# p.register_hook(g * 0.5) on the first trainable param; post-hook-after: a
# register_post_accumulate_grad_hook on it halving p.grad in place (natively it sees the running
# sum with this micro-batch in it; the edit counts).
HOOKS = ("none", "tensor-hook", "module-hook", "inner-pre-hook", "inner-post-hook",
         "wrapper-post-hook", "tensor-hook-after", "post-hook-after")


@dataclass(frozen=True)
class Axis:
    name: str
    values: tuple
    doc: str = ""


# -- single-process axes ---------------------------------------------------------------------------
# (the params layouts are the model builders of _matrix_models.py, by these names)
SINGLE_AXES = (
    Axis("params", ("contiguous", "channels_last", "transposed", "tied", "frozen", "unused",
                    "mixed"), "param layouts (_matrix_models.MODELS)"),
    Axis("dtype", tuple(DTYPES), "model dtype; fp16 runs with loss_scale=1024"),
    Axis("optimizer", tuple(OPTIMIZERS), "inner optimizer class x implementation"),
    Axis("reduction", tuple(REDUCTIONS)),
    Axis("accum", tuple(ACCUMS)),
    Axis("clip", ("none", "max_grad_norm", "max_grad_norm-loose", "user"),
         "max_grad_norm=0.5 (acting), =1e3 (never acting), the user's clip_grad_norm_(0.5)"),
    Axis("nonfinite", tuple(NONFINITES)),
    Axis("grads", ("backward", "assigned", "wp-assign", "wp-mixed", "wp-nested", "wp-raise",
                   "raise"),
         "how gradients arrive on odd micro-batches (even ones: a plain backward); raise: a "
         "backward that raises half-way (a tensor hook the loop registers on the first "
         "trainable param after wrapping raises; the loop catches it and goes on)"),
    Axis("in_backward", (True, False), "accumulate_in_backward"),
    Axis("masters", ("auto", False), "master_weights"),
    Axis("hands", ("none", "zero_grad-keep", "grad-mul", "data-write", "data-transpose",
                   "state-rewrite"),
         "the user's hands between calls; state-rewrite: every opt.state[p] assigned a copy of "
         "itself before the first step and between windows (what device-moving tools do)"),
    Axis("checkpoint", ("none", "save-load", "dcp-flat", "deepcopy", "deepcopy-direct",
                        "pickle", "native-step0", "to-native", "native-into-inner"),
         "mid-window through torch.save/load(weights_only) / DCP flattened / load+deepcopy / "
         "copy.deepcopy or pickle of (model, opt) (copy.copy(opt) refused first); to and from "
         "native optimizers"),
    Axis("loop", LOOPS, "what the training loop does to the model and the optimizer "
         "(_matrix_loop.LoopActions)"),
    Axis("hooks", HOOKS, "hooks the user registers before wrapping"),
    Axis("autograd", ("eager", "compiled"), "every wrapper-side backward of a plain "
         "micro-batch eager, or under compiled autograd (compiled_autograd._enable(torch."
         "compile(backend='eager')), fullgraph=False); the judge's are eager"),
    Axis("construct", ("by-hand", "by-name", "subclass"), "AccumulatingOptimizer(inner, ...), "
         "the class a config names, accumkernels.optimizers.<Name>(params, **inner_kw, "
         "**options), or a subclass of AccumulatingOptimizer with its own __init__, attribute "
         "and step (_matrix_loop.MatrixSubclass)"),
)


def _f(name, op, value):
    if op == "in":
        return {"operator": "in", "left": name, "values": list(value)}
    return {"operator": op, "left": name, "value": value}


def _implies(cond, then):
    """cond -> then, as covertable's declarative condition."""
    return {"operator": "or", "conditions": [{"operator": "not", "condition": cond}, then]}


SINGLE_CONSTRAINTS = [
    # 'mixed' is an fp32 model with one bf16 layer; the square weight 'data-transpose' turns
    # lives in the MLP builders (not the conv net)
    _implies(_f("params", "eq", "mixed"), _f("dtype", "eq", "fp32")),
    _implies(_f("hands", "eq", "data-transpose"), _f("params", "ne", "channels_last")),
    # a user's clip_grad_norm_ before step() sees the normalised window only once the N-th
    # backward is in (README: "otherwise the step normalises"): not without N, not in a short
    # last window
    _implies(_f("clip", "eq", "user"), {"operator": "or", "conditions": [
        _f("reduction", "eq", "sum"), _f("accum", "eq", "N")]}),
    # an assigned .grad (outside weight_pass) replaces the param's gradient and is no
    # micro-batch of its own: only a sum without N counts alike natively; it holds the
    # unscaled gradient; it is no backward to drop alone; with in_backward=False .grad holds
    # unmoved gradients
    _implies(_f("grads", "eq", "assigned"), {"operator": "and", "conditions": [
        _f("reduction", "eq", "sum"), _f("accum", "eq", "None"), _f("dtype", "eq", "fp32"),
        _f("nonfinite", "ne", "nan-skip_microbatch"), _f("in_backward", "eq", True)]}),
    # how many micro-batches a nested block or one that raised counts is not specified:
    # sum without N, where the count does not matter
    _implies(_f("grads", "in", ["wp-nested", "wp-raise"]), {"operator": "and", "conditions": [
        _f("reduction", "eq", "sum"), _f("accum", "eq", "None")]}),
    # fp16 params stepped without masters by an optimizer with eps=1e-8 (0 in fp16) go NaN,
    # natively too: no training left to compare
    _implies({"operator": "and", "conditions": [_f("dtype", "eq", "fp16"),
                                                _f("masters", "eq", False)]},
             _f("optimizer", "in", ["sgd-forloop", "sgd-foreach", "sgd-fused"])),
    # torch's fused SGD (momentum) raises TypeError natively for a param whose first gradient
    # comes after its first step (the 'unused' layer)
    _implies(_f("optimizer", "eq", "sgd-fused"), _f("params", "ne", "unused")),
    # a native optimizer on low-precision params is no master-weight oracle
    _implies(_f("checkpoint", "in", ["native-step0", "to-native"]), _f("dtype", "eq", "fp32")),
    _implies(_f("checkpoint", "in", ["native-step0", "to-native"]),
             _f("params", "ne", "mixed")),
    # a checkpoint loaded to or from a native optimizer holds no window: at a boundary
    _implies(_f("checkpoint", "in", ["native-step0", "to-native", "native-into-inner"]),
             _f("nonfinite", "eq", "none")),
    # -- loop actions --
    # the clear's own argument is hands=zero_grad-keep (set_to_none=False); p.grad = None and
    # never clearing have none
    _implies(_f("loop", "in", ["grad-none", "no-zero_grad"]),
             _f("hands", "ne", "zero_grad-keep")),
    # model.zero_grad(set_to_none=False) zeroes p.grad in place, and p.grad is the window (a
    # zero-copy view): every micro-batch (N) it empties the filling window, as it empties a
    # natively accumulated .grad; only opt.zero_grad() knows to keep a filling window
    _implies({"operator": "and", "conditions": [_f("loop", "eq", "model-zero_grad"),
                                                _f("hands", "eq", "zero_grad-keep")]},
             _f("accum", "ne", "N")),
    # a window carried into the next one (no clear) is a sum natively: the divided or skipped
    # window of mean/weighted/a NaN has no native meaning to carry; the loop's own clip acts on
    # .grad in place and is carried (clip=user), the wrapper's max_grad_norm is a step option
    _implies(_f("loop", "eq", "no-zero_grad"), {"operator": "and", "conditions": [
        _f("reduction", "eq", "sum"), _f("clip", "in", ["none", "user"]),
        _f("nonfinite", "eq", "none"), _f("checkpoint", "eq", "none")]}),
    # torch's fused kernels pair a param and its .grad by memory offset: a .grad carried
    # across p.data = p.data.t() (no clear) keeps its old strides natively, and native's fused
    # step mixes elements (torch's own defect; the wrapper hands the window over in the
    # param's strides, as a fresh .grad has them)
    _implies({"operator": "and", "conditions": [_f("loop", "eq", "no-zero_grad"),
                                                _f("hands", "eq", "data-transpose")]},
             {"operator": "not", "condition": _f("optimizer", "in", [
                 k for k in OPTIMIZERS if k.endswith("fused")])}),
    # reset_window mid-window: with N the window's end moves (the loop would need to know);
    # without N every step() ends the window
    _implies(_f("loop", "eq", "reset_window"), _f("accum", "eq", "None")),
    # a clear every micro-batch keeps a filling window only with N; it zeroes it in place with
    # set_to_none=False (above)
    _implies(_f("loop", "eq", "model-zero_grad-every"), {"operator": "and", "conditions": [
        _f("accum", "ne", "None"), _f("hands", "ne", "zero_grad-keep")]}),
    # a layer added by add_param_group: a checkpoint path rebuilds its optimizer from the model
    # in one group, which a state dict of two groups does not load into
    _implies(_f("loop", "in", ["add_param_group-boundary", "add_param_group-mid"]),
             _f("checkpoint", "eq", "none")),
    # -- hooks --
    # a fresh model or optimizer built by a checkpoint path (native optimizers, deepcopy)
    # carries no hook of the user's
    _implies({"operator": "or", "conditions": [_f("hooks", "ne", "none"),
                                               _f("grads", "eq", "raise")]},
             _f("checkpoint", "in", ["none", "save-load", "dcp-flat"])),
    # by name, the inner optimizer is built inside: no hook of its own registered before
    # wrapping, no native optimizer handed in
    _implies(_f("construct", "eq", "by-name"), {"operator": "and", "conditions": [
        _f("hooks", "in", ["none", "tensor-hook", "module-hook", "wrapper-post-hook",
                           "tensor-hook-after", "post-hook-after"]),
        _f("checkpoint", "ne", "native-into-inner")]}),
    # a post-accumulate hook halving p.grad in place: natively it halves the param-dtype .grad
    # (the oracle's fp32 window is native's .grad only in fp32) after each AccumulateGrad (none
    # runs for an assigned gradient or a weight pass: their hook calls are the user's code's);
    # with accumulate_in_backward=False the oracle keeps .grad and the window apart (both
    # intakes: tests/optim/test_transaction.py); a dropped micro-batch has no native .grad
    _implies(_f("hooks", "eq", "post-hook-after"), {"operator": "and", "conditions": [
        _f("dtype", "eq", "fp32"), _f("params", "ne", "mixed"),
        _f("grads", "in", ["backward", "raise"]), _f("in_backward", "eq", True),
        _f("nonfinite", "ne", "nan-skip_microbatch")]}),
    # a raised backward: the raising hook sits on the first layer, which the freeze-* loops
    # freeze in the odd micro-batches (no hook runs: nothing raises)
    _implies(_f("grads", "eq", "raise"), {"operator": "not", "condition": _f(
        "loop", "in", ["freeze-between", "freeze-before"])}),
    # compiled autograd: loss_scale and skip_microbatch are refused (it adds the gradients
    # unscaled and unlooked-at: tests/optim/intake/test_compiled_autograd.py); bf16 without
    # masters, weight passes and a raising backward are not covered there; a fresh wrapper
    # mid-window (the checkpoint paths) would meet a bf16 window begun without it (a
    # documented torch limit); bf16/fp16 params show no fp32 view in .grad under it (their
    # window is in p.main_grad; against hand-kept masters there); each case compiles its
    # graphs anew (~4 s): a covering subset
    _implies(_f("autograd", "eq", "compiled"), {"operator": "and", "conditions": [
        _f("dtype", "eq", "fp32"), _f("params", "ne", "mixed"),
        _f("nonfinite", "ne", "nan-skip_microbatch"),
        _f("masters", "eq", "auto"), _f("grads", "in", ["backward", "assigned"]),
        _f("checkpoint", "eq", "none")]}),
    # the wrapper's own step hooks see the model's params: native hooks see the optimizer's,
    # which are the masters for a low-precision model
    _implies(_f("hooks", "eq", "wrapper-post-hook"), {"operator": "and", "conditions": [
        _f("dtype", "eq", "fp32"), _f("params", "ne", "mixed")]}),
]

# -- multi-process axes ----------------------------------------------------------------------------
# pipe-zbv-forgotten: ZBV without accumulate_weight_passes(stages): a clear error is expected;
# on torch 2.11 the pipe-zbv layouts run InterleavedZeroBubble (_matrix_ranks.zbv_schedule)
LAYOUTS = ("ddp", "process_group", "fsdp2", "hsdp", "fsdp2-tp", "pipe-gpipe", "pipe-zbv",
           "pipe-zbv-forgotten")
PIPES = ["pipe-gpipe", "pipe-zbv", "pipe-zbv-forgotten"]
# engine: the options jobs set on DDP / FSDP2 (both sides build the same engine);
# ranks: what one rank does differently (_matrix_ranks.RANKS says what each means)
ENGINES = ("default", "ddp-bucket-view", "ddp-static-graph", "ddp-small-buckets",
           "ddp-find-unused", "fsdp2-no-reshard", "fsdp2-mp")
RANK_ACTS = ("none", "zero-weight", "missing-weight", "extra-step", "no_sync-all")
MULTI_AXES = (
    Axis("layout", LAYOUTS),
    Axis("reduction", tuple(REDUCTIONS)),
    Axis("clip", ("none", "max_grad_norm", "user")),
    Axis("accum", ("N", "None")),
    Axis("optimizer", ("sgd-foreach", "adamw-fused", "adamw-forloop")),
    Axis("nonfinite", ("none", "nan-skip_step")),
    Axis("engine", ENGINES, "DDP: gradient_as_bucket_view, static_graph, bucket_cap_mb=1e-4, "
         "find_unused_parameters; FSDP2: reshard_after_forward=False, MixedPrecisionPolicy("
         "param_dtype=bf16, reduce_dtype=fp32)"),
    Axis("ranks", RANK_ACTS, "one rank's own action (_matrix_ranks.RANKS)"),
)
MULTI_CONSTRAINTS = [
    _implies(_f("clip", "eq", "user"), {"operator": "or", "conditions": [
        _f("reduction", "eq", "sum"), _f("accum", "ne", "None")]}),
    # a pipeline's backwards run inside schedule.step(): weights are reported before it; its
    # optimizer is AdamW (fused or not), clipped across the stages (clip_across_stages)
    _implies(_f("layout", "in", PIPES), {"operator": "and", "conditions": [
        _f("reduction", "ne", "weighted-after"), _f("clip", "ne", "user"),
        _f("optimizer", "ne", "sgd-foreach")]}),
    # the forgotten line is one check (a clear error expected), not crossed with the rest
    _implies(_f("layout", "eq", "pipe-zbv-forgotten"), {"operator": "and", "conditions": [
        _f("reduction", "eq", "sum"), _f("clip", "eq", "none"), _f("accum", "eq", "N"),
        _f("optimizer", "eq", "adamw-fused"), _f("nonfinite", "eq", "none")]}),
    # an engine option belongs to its engine
    _implies(_f("engine", "in", [e for e in ENGINES if e.startswith("ddp")]),
             _f("layout", "eq", "ddp")),
    _implies(_f("engine", "in", [e for e in ENGINES if e.startswith("fsdp2")]),
             _f("layout", "in", ["fsdp2", "hsdp", "fsdp2-tp"])),
    # one rank's own action: the data-parallel layouts of 2 ranks
    _implies(_f("ranks", "ne", "none"), _f("layout", "in", ["ddp", "process_group", "fsdp2"])),
    # a fully masked micro-batch (weight 0, no tokens) exists only for a loss summed over its
    # tokens; natively a mean over no tokens is NaN
    _implies(_f("ranks", "eq", "zero-weight"), _f("reduction", "in", ["weighted-before",
                                                                     "weighted-after"])),
    # a rank that disagrees: an error on every rank or the ranks in lockstep is expected (no
    # native run to compare): one check per layout, on the plainest options
    _implies(_f("ranks", "in", ["missing-weight", "extra-step"]), {
        "operator": "and", "conditions": [
            _f("clip", "eq", "none"), _f("nonfinite", "eq", "none"),
            _f("engine", "eq", "default"), _f("optimizer", "eq", "sgd-foreach")]}),
    _implies(_f("ranks", "eq", "missing-weight"), _f("reduction", "in", ["weighted-before",
                                                                        "weighted-after"])),
    # step() on one rank only ends that rank's window only without N (with N it is a no-op)
    _implies(_f("ranks", "eq", "extra-step"), _f("accum", "eq", "None")),
    # no_sync() on every micro-batch is DDP's (N given: the window's last backward is known);
    # static_graph refuses no_sync natively; a user's clip before step() then measures each
    # rank's own window, as natively (the README: the wrapper averages at step() and warns)
    _implies(_f("ranks", "eq", "no_sync-all"), {"operator": "and", "conditions": [
        _f("layout", "eq", "ddp"), _f("accum", "eq", "N"), _f("clip", "ne", "user"),
        _f("engine", "ne", "ddp-static-graph")]}),
]


@dataclass(eq=False)
class Plan:
    part: str
    axes: tuple
    constraints: list
    triples: list = field(default_factory=list)  # axis names covered 3-way
    presets: list = field(default_factory=list)  # rows that come first (the witnesses)


def _witnesses(name: str) -> list:
    import _matrix_labels

    return getattr(_matrix_labels, name)


SINGLE = Plan("s", SINGLE_AXES, SINGLE_CONSTRAINTS,
              [("dtype", "reduction", "checkpoint")], _witnesses("SINGLE_WITNESSES"))


def _clean() -> Plan:
    from _matrix_labels import KNOWN_EXCLUSIONS

    extra = [c for conds in KNOWN_EXCLUSIONS.values() for c in conds]
    return Plan("c", SINGLE_AXES, SINGLE_CONSTRAINTS + extra,
                [("dtype", "reduction", "checkpoint")])


CLEAN = _clean()  # the single-process table without the values known bugs need
MULTI = Plan("m", MULTI_AXES, MULTI_CONSTRAINTS, [("layout", "reduction", "clip")],
             _witnesses("MULTI_WITNESSES"))


def full_mode() -> bool:
    """The exhaustive run: ACCUMKERNELS_CONFORMANCE=full or pytest --conformance=full."""
    return os.environ.get("ACCUMKERNELS_CONFORMANCE", "") == "full"


def generate(plan: Plan, strength: int = 2) -> tuple[list[dict], dict]:
    """The covering array (every pair, every triple of ``plan.triples``) and the generator's
    stats. With ``strength`` > 2 (full mode) every ``strength``-tuple of every axis."""
    from covertable.main import Controller

    factors = {a.name: list(a.values) for a in plan.axes}
    subs = [{"fields": list(t), "strength": 3} for t in plan.triples] if strength == 2 else []
    ctrl = Controller(factors, strength=strength, salt=SALT, constraints=plan.constraints,
                      sub_models=subs, presets=[dict(p) for p in plan.presets])
    rows = ctrl.make()
    order = [a.name for a in plan.axes]
    cases = [{k: row[k] for k in order} for row in rows]
    assert cases[:len(plan.presets)] == plan.presets, "a witness row was not kept as given"
    return cases, dict(ctrl.stats)


def case_id(plan: Plan, index: int) -> str:
    return f"{plan.part}{index:03d}"


def describe(case: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in case.items())
