"""A misspelt keyword of ``AccumulatingOptimizer(...)`` (DESIGN.md, "Mistakes users make"): a
TypeError that names it and suggests the option meant (``did you mean``), raised before anything
changes; ``inspect.signature`` and ``help()`` still show the named options.
"""

from __future__ import annotations

import copy
import inspect
import pydoc

import pytest
import torch
from _optim_common import batches, make_model, mse

from accumkernels import _util
from accumkernels.optim import AccumulatingOptimizer

OPTIONS = ["accumulation_steps", "reduction", "master_weights", "accumulate_in_backward",
           "max_grad_norm", "nonfinite", "loss_scale", "process_group", "bucket_size_mb",
           "backend", "model", "independent_ranks"]


def _same(model, ref):
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


@pytest.mark.parametrize("wrong,meant", [
    ("reducton", "reduction"), ("accumulation_step", "accumulation_steps"),
    ("gradient_accumulation_steps", "accumulation_steps"), ("max_grad_nrom", "max_grad_norm"),
    ("non_finite", "nonfinite"), ("master_weight", "master_weights"), ("lossscale", "loss_scale"),
])
def test_misspelt_keyword_suggests_the_option(wrong, meant):
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{wrong}' "
                                        f"\\(did you mean '{meant}'\\?\\)") as info:
        AccumulatingOptimizer(inner, **{wrong: 4})
    assert "AccumulatingOptimizer()" in str(info.value)


def test_unknown_keyword_lists_the_options():
    inner = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'zzz'; its options are "
                                        "accumulation_steps, reduction") as info:
        AccumulatingOptimizer(inner, zzz=1)
    assert "did you mean" not in str(info.value)
    assert all(o in str(info.value) for o in OPTIONS)
    with pytest.raises(TypeError, match="did you mean 'optimizer'"):
        AccumulatingOptimizer(optimiser=inner)


def _observable(inner, model):
    """What a refused construction must leave as it was: the inner optimizer's attributes and
    groups' keys, the params' attributes and hooks, and the module's."""
    return (sorted(vars(inner)), [sorted(g) for g in inner.param_groups],
            [(sorted(vars(p)), p._post_accumulate_grad_hooks, p._backward_hooks, p.grad)
             for p in model.parameters()], sorted(vars(model)), dict(inner.state))


def test_refused_before_anything_changes():
    model = make_model()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = _observable(inner, model)
    with pytest.raises(TypeError, match="did you mean 'reduction'"):
        AccumulatingOptimizer(inner, accumulation_steps=2, reducton="mean", model=model)
    assert _observable(inner, model) == before
    # the inner optimizer is not taken: a correct wrapper is built on it and trains natively
    ref = copy.deepcopy(model)
    opt = AccumulatingOptimizer(inner, accumulation_steps=2, reduction="mean")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    for x, y in batches(2, 4):
        mse(model, x, y).backward()
        (mse(ref, x, y) / 2).backward()
        opt.step()
    ref_opt.step()
    _same(model, ref)


def test_signature_and_help_show_the_options():
    params = inspect.signature(AccumulatingOptimizer).parameters
    assert list(params) == ["optimizer"] + OPTIONS
    assert all(params[o].kind is inspect.Parameter.KEYWORD_ONLY for o in OPTIONS)
    assert params["accumulation_steps"].default is None and params["reduction"].default == "sum"
    text = pydoc.render_doc(AccumulatingOptimizer, renderer=pydoc.plaintext)
    assert "accumulation_steps=None" in text and "**" not in text.split("Args:")[0]


def test_subclass_keywords_and_its_name():
    class Mine(AccumulatingOptimizer):
        def __init__(self, optimizer, *, note="", **kwargs):
            self.note = note
            super().__init__(optimizer, **kwargs)

    inner = torch.optim.SGD(make_model().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"Mine\(\) got an unexpected keyword argument "
                                        r"'reductio' \(did you mean 'reduction'\?\)"):
        Mine(inner, note="x", reductio="mean")
    opt = Mine(inner, note="x", reduction="mean", accumulation_steps=2)
    assert (opt.note, opt.reduction, opt.accumulation_steps) == ("x", "mean", 2)


def test_one_rule_for_did_you_mean():
    assert _util.did_you_mean("reducton", OPTIONS) == " (did you mean 'reduction'?)"
    assert _util.did_you_mean("qqqq", OPTIONS) == ""
