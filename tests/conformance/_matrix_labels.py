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
    return out

# found by the matrix itself (not in issues 37/38): reported to the lead with a repro
BUGS["new-1"] = ("process_group: a user's clip_grad_norm_ before step() sees the window "
                 "before its average over the ranks (norm x world)")


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
    if layout == "process_group" and clip == "user":
        out.append("new-1")
    return out
