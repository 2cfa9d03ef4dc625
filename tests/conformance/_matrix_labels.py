"""Which known bugs (issues 37 and 38) a case's axis values reach: used to write and check the
KNOWN_BUGS table of _matrix_known.py (a failing case must be explained by one of these)."""

from __future__ import annotations

BUGS = {
    "37.1": "params whose memory is not row-major (channels_last, transposed, p.data.t())",
    "37.3a": "nested weight_pass",
    "37.3b": "an exception inside weight_pass",
    "37.3c": "a backward and an assigned grad in one weight_pass",
    "37.3d": "a weight pass after the window moved, accumulate_in_backward=False",
    "37.5a": "weighted x FSDP2+TP",
    "37.5b": "weighted x FSDP2/HSDP with the user's clip",
    "37.5c": "weighted x DDP with add_weight after the backward",
    "37.4": "the pipeline line forgotten",
    "38.2": "masters: the inner state keyed by the masters after a load (state_dict/deepcopy)",
    "38.3a": "a step-0 state dict into a native optimizer",
    "38.3b": "a never-stepped param's state into a native optimizer",
    "38.3c": "a native state dict into the inner optimizer after wrapping",
    "38.4": "a master that missed the user's write (read before the next real step)",
}


def labels(case: dict) -> list[str]:
    """The known bugs a single-process case's values reach."""
    out = []
    lowp_masters = case["masters"] == "auto" and (case["dtype"] != "fp32"
                                                  or case["params"] == "mixed")
    if case["params"] in ("channels_last", "transposed") or case["hands"] == "data-transpose":
        out.append("37.1")
    grads = case["grads"]
    out += {"wp-nested": ["37.3a"], "wp-raise": ["37.3b"], "wp-mixed": ["37.3c"]}.get(grads, [])
    if not case["in_backward"] and grads.startswith("wp"):
        out.append("37.3d")
    ckpt = case["checkpoint"]
    if lowp_masters and ckpt in ("save-load", "dcp-flat", "deepcopy"):
        out.append("38.2")
    if ckpt == "native-step0":
        out.append("38.3a")
    if ckpt == "to-native" and case["params"] == "unused":
        out.append("38.3b")
    if ckpt == "native-into-inner" and lowp_masters:
        out.append("38.3c")
    if case["hands"] == "data-write" and lowp_masters:
        out.append("38.4")
    if case.get("autograd") == "compiled" and case.get("hooks") == "post-hook-after":
        out.append("new-4")
    if (grads == "raise" and case["nonfinite"] == "nan-raise"
            and case["hands"] == "zero_grad-keep" and case["reduction"].startswith("weighted")):
        out.append("new-5")
    return out

# found by the matrix itself (not in issues 37/38): reported to the lead with a repro
BUGS["new-1"] = ("process_group: a user's clip_grad_norm_ before step() sees the window "
                 "before its average over the ranks (norm x world)")


BUGS["new-4"] = ("compiled autograd x a post-accumulate hook registered after wrapping: "
                 "what the hook sees and writes departs (a param frozen after the forward, a "
                 "kept-zero clear)")


BUGS["new-5"] = ("a backward that raised with a NaN in it, nonfinite='raise', then "
                 "zero_grad(set_to_none=False), weighted: the next window's first param departs")


def labels_multi(case: dict) -> list[str]:
    """The known bugs a multi-process case's values reach."""
    out = []
    layout, red, clip = case["layout"], case["reduction"], case["clip"]
    weighted = red.startswith("weighted")
    if layout == "fsdp2-tp" and weighted:
        out.append("37.5a")
    if layout in ("fsdp2", "hsdp", "fsdp2-tp") and weighted and clip == "user":
        out.append("37.5b")
    if layout == "ddp" and red == "weighted-after" and clip == "user":
        out.append("37.5c")
    if layout == "pipe-zbv-forgotten":
        out.append("37.4")
    if layout == "process_group" and clip == "user":
        out.append("new-1")
    return out


# -- the clean part -------------------------------------------------------------------------------
# The values (or value combinations) each known single-process bug needs, as covertable
# constraints that exclude them. The "clean" covering array (test_matrix.py, ids c...) covers
# every pair of the rest: cases that must pass today, so that a regression is not hidden behind a
# known bug's xfail. When a bug's fix merges, delete its line here (and its KNOWN_BUGS entries);
# once every line is gone the clean part equals the main one and can go.
def _f(name, op, value):
    if op == "in":
        return {"operator": "in", "left": name, "values": list(value)}
    return {"operator": op, "left": name, "value": value}


def _not(cond):
    return {"operator": "not", "condition": cond}


def _all(*conds):
    return {"operator": "and", "conditions": list(conds)}


def _any(*conds):
    return {"operator": "or", "conditions": list(conds)}


_LOWP_MASTERS = _all(_f("masters", "eq", "auto"),
                     _any(_f("dtype", "ne", "fp32"), _f("params", "eq", "mixed")))
_WP = ["wp-assign", "wp-mixed", "wp-nested", "wp-raise"]
KNOWN_EXCLUSIONS = {
    "37.1": [_f("params", "ne", "channels_last"), _f("params", "ne", "transposed"),
             _f("hands", "ne", "data-transpose")],
    "37.3a": [_f("grads", "ne", "wp-nested")],
    "37.3b": [_f("grads", "ne", "wp-raise")],
    "37.3c": [_f("grads", "ne", "wp-mixed")],
    "37.3d": [_not(_all(_f("in_backward", "eq", False), _f("grads", "in", _WP)))],
    "38.2": [_not(_all(_LOWP_MASTERS, _f("checkpoint", "in", ["save-load", "dcp-flat",
                                                                "deepcopy"])))],
    "38.3a": [_f("checkpoint", "ne", "native-step0")],
    "38.3b": [_not(_all(_f("checkpoint", "eq", "to-native"), _f("params", "eq", "unused")))],
    "38.3c": [_not(_all(_f("checkpoint", "eq", "native-into-inner"), _LOWP_MASTERS))],
    "38.4": [_not(_all(_f("hands", "eq", "data-write"), _LOWP_MASTERS))],
}


# -- witnesses ------------------------------------------------------------------------------------
# The first rows of each covering array (covertable presets): one per known bug, its values on the
# plainest base, so that each bug has a case id of its own that nothing else makes fail. They
# stay as regression cases once the bug is fixed.
_BASE = dict(params="contiguous", dtype="fp32", optimizer="adamw-forloop", reduction="sum",
             accum="N", clip="none", nonfinite="none", grads="backward", in_backward=True,
             masters="auto", hands="none", checkpoint="none", loop="opt-zero_grad",
             hooks="none", autograd="eager", construct="by-hand")
SINGLE_WITNESSES = [dict(_BASE, **kw) for kw in (
    {"params": "channels_last", "optimizer": "sgd-forloop"},  # 37.1 channels_last fp32
    {"params": "transposed"},  # 37.1 a transposed param
    {"hands": "data-transpose"},  # 37.1 p.data = p.data.t()
    {"grads": "wp-nested", "accum": "None"},  # 37.3a
    {"grads": "wp-raise", "accum": "None"},  # 37.3b
    {"grads": "wp-mixed", "reduction": "mean"},  # 37.3c
    {"grads": "wp-assign", "in_backward": False, "reduction": "mean",
     "accum": "N-short-last"},  # 37.3d (steps at boundaries: the block moves with a backward)
    {"dtype": "bf16", "checkpoint": "save-load"},  # 38.2 masters: load, then state_dict()
    {"dtype": "bf16", "checkpoint": "deepcopy"},  # 38.2 masters: load, then deepcopy
    {"checkpoint": "native-step0"},  # 38.3a a step-0 state dict into native AdamW
    {"params": "unused", "checkpoint": "to-native", "optimizer": "adam-forloop"},  # 38.3b
    {"dtype": "bf16", "checkpoint": "native-into-inner"},  # 38.3c
)]
_MBASE = dict(layout="ddp", reduction="sum", clip="none", accum="N", optimizer="sgd-foreach",
              nonfinite="none", engine="default", ranks="none")
MULTI_WITNESSES = [dict(_MBASE, **kw) for kw in (
    {"layout": "fsdp2-tp", "reduction": "weighted-before"},  # 37.5a
    {"layout": "fsdp2", "reduction": "weighted-before", "clip": "user"},  # 37.5b FSDP2
    {"layout": "hsdp", "reduction": "weighted-after", "clip": "user"},  # 37.5b HSDP
    {"layout": "ddp", "reduction": "weighted-after", "clip": "user"},  # 37.5c
    {"layout": "pipe-zbv-forgotten", "optimizer": "adamw-fused"},  # 37.4
    {"layout": "process_group", "clip": "user"},  # new-1
    # (issue 61.7) a zero-weight rank where nothing cancels a wrong weight total: no clip that
    # acts, no AdamW (both undo a global gradient scale)
    {"layout": "fsdp2", "reduction": "weighted-before", "ranks": "zero-weight"},
    {"layout": "ddp", "reduction": "weighted-after", "ranks": "zero-weight"},
)]
