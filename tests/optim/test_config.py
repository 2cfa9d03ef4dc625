"""Every argument checked once, at construction (optim.config): bad constructor arguments,
something that is no optimizer, meta/duplicated/complex params, optimizers that stay refused, a
backend unusable on the params, the same optimizer wrapped twice, ``add_weight``'s argument; a
refused construction leaves the params as they were. And the guards (DESIGN: "Guards"):
``check_model`` and the wrapper given ``model=`` warn for BatchNorm in training mode.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from _optim_common import (
    SMALL_BUCKET,
    assert_params_close,
    batches,
    count_hooks,
    make_model,
    mse,
    params_of,
    wrap_sgd,
)
from torch import nn

from accumkernels import AccumulatingOptimizer, check_model


def bn_model():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


# -- check_model ------------------------------------------------------------------------------

def test_check_model_warns_for_batchnorm_in_train_mode_only():
    model = bn_model()
    with pytest.warns(UserWarning, match="BatchNorm"):
        assert check_model(model) == ["1"]
    with pytest.raises(ValueError, match="BatchNorm"):
        check_model(model, raise_error=True)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_model(model) == []
        assert check_model(make_model()) == []
    with pytest.raises(TypeError, match="nn.Module"):
        check_model([model])


def test_wrapper_checks_the_model_it_is_given():
    model = bn_model()
    with pytest.warns(UserWarning, match="BatchNorm"):
        AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)
    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model=model)


# -- the wrapper's bad arguments -------------------------------------------------------------------

NAN, INF = math.nan, math.inf
BAD_KWARGS = [
    ("accumulation_steps", 0, ValueError, "accumulation_steps must be positive"),
    ("accumulation_steps", -2, ValueError, "accumulation_steps must be positive"),
    ("accumulation_steps", 2.0, TypeError, "accumulation_steps must be an int"),
    ("accumulation_steps", True, TypeError, "accumulation_steps must be an int"),
    ("accumulation_steps", "4", TypeError, "accumulation_steps must be an int"),
    ("reduction", "avg", ValueError, "reduction must be one of"),
    ("nonfinite", "ignore", ValueError, "nonfinite must be one of"),
    ("backend", "cudnn", ValueError, "backend must be one of"),
    ("master_weights", "yes", ValueError, "master_weights must be 'auto', True or False"),
    ("master_weights", None, ValueError, "master_weights must be 'auto', True or False"),
    ("loss_scale", 0.0, ValueError, "loss_scale must be a finite positive"),
    ("loss_scale", -8.0, ValueError, "loss_scale must be a finite positive"),
    ("loss_scale", NAN, ValueError, "loss_scale must be a finite positive"),
    ("loss_scale", INF, ValueError, "loss_scale must be a finite positive"),
    ("loss_scale", "static", TypeError, "loss_scale must be None, a float or 'dynamic'"),
    ("loss_scale", True, TypeError, "loss_scale must be None, a float or 'dynamic'"),
    ("max_grad_norm", 0.0, ValueError, "max_grad_norm must be a finite positive"),
    ("max_grad_norm", -1.0, ValueError, "max_grad_norm must be a finite positive"),
    ("max_grad_norm", NAN, ValueError, "max_grad_norm must be a finite positive"),
    ("max_grad_norm", INF, ValueError, "max_grad_norm must be a finite positive"),
    ("max_grad_norm", "1", TypeError, "max_grad_norm must be a float"),
    ("accumulate_in_backward", 1, TypeError, "accumulate_in_backward must be a bool"),
    ("bucket_size_mb", 0, ValueError, "bucket_size_mb must be > 0"),
    ("bucket_size_mb", -1.0, ValueError, "bucket_size_mb must be > 0"),
    ("model", "net", TypeError, "model must be an nn.Module"),
]


@pytest.mark.parametrize("name,value,error,message", BAD_KWARGS,
                         ids=[f"{n}={v!r}" for n, v, _, _ in BAD_KWARGS])
def test_bad_constructor_argument(name, value, error, message):
    model = make_model()
    with pytest.raises(error, match=message):
        AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), **{name: value})
    for p in model.parameters():  # nothing was attached to the params
        assert not hasattr(p, "main_grad")


@pytest.mark.parametrize("value", [1, 0])
def test_master_weights_rejects_ints(value):
    with pytest.raises((TypeError, ValueError), match="master_weights"):
        AccumulatingOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1),
                              master_weights=value)


def test_backend_unavailable_for_the_params_is_rejected_up_front():
    model = make_model()
    try:
        opt = wrap_sgd(model, backend="cuda")  # CPU params
    except ValueError as e:
        assert "backend" in str(e)
        return
    mse(model, *batches(1, 4)[0]).backward()  # would raise here, mid-backward
    opt.step()
    pytest.fail("an unavailable backend was accepted")


@pytest.mark.parametrize("not_an_optimizer", ["model", "params", "wrapper"])
def test_wrapping_something_that_is_not_an_optimizer(not_an_optimizer):
    model = make_model()
    target = {"model": lambda: model, "params": lambda: list(model.parameters()),
              "wrapper": lambda: wrap_sgd(model)}[not_an_optimizer]()
    with pytest.raises(TypeError, match="optimizer"):
        AccumulatingOptimizer(target)


def test_meta_and_duplicated_params_are_rejected():
    with torch.device("meta"):
        meta = make_model()
    with pytest.raises(ValueError, match="meta device"):
        AccumulatingOptimizer(torch.optim.SGD(meta.parameters(), lr=0.1))
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    inner.param_groups[0]["params"].append(model[0].weight)
    with pytest.raises(ValueError, match="more than once"):
        AccumulatingOptimizer(inner)


@pytest.mark.parametrize("weight,error,message", [
    (NAN, ValueError, "weight must be finite and not negative"),
    (INF, ValueError, "weight must be finite and not negative"),
    (-3.0, ValueError, "weight must be finite and not negative"),
    (torch.tensor(-1.0), ValueError, "weight must be finite and not negative"),
    (True, TypeError, "weight must be a number"),
    ("3", TypeError, "weight must be a number"),
    (None, TypeError, "weight must be a number"),
])
def test_bad_weight(weight, error, message):
    opt = wrap_sgd(make_model(), reduction="weighted")
    with pytest.raises(error, match=message):
        opt.add_weight(weight)


def test_a_micro_batch_of_weight_zero_contributes_nothing():
    """A micro-batch without tokens (weight 0, a zero loss-sum gradient) is accepted: the
    step is Σ g / Σ w over the others, as natively."""
    model = make_model()
    native = [torch.zeros_like(p) for p in model.parameters()]
    (x, y), = batches(1, 4)
    mse(model, x, y).backward()
    torch._foreach_add_(native, [p.grad / 4.0 for p in model.parameters()])
    model.zero_grad()
    opt = wrap_sgd(model, reduction="weighted", accumulation_steps=2)
    (mse(model, x, y) * 0).backward()
    opt.add_weight(0)
    mse(model, x, y).backward()
    opt.add_weight(torch.tensor(4.0))
    for p, g in zip(model.parameters(), native):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=0)


def test_weight_needs_weighted_reduction_and_weighted_needs_weights():
    with pytest.raises(ValueError, match="reduction='weighted'"):
        wrap_sgd(make_model(), reduction="mean").add_weight(4)
    model = make_model()
    opt = wrap_sgd(model, reduction="weighted")
    mse(model, *batches(1, 4)[0]).backward()
    with pytest.raises(ValueError, match="add_weight"):
        opt.step()


# -- refused at construction, nothing changed ------------------------------------------------------


def test_refusals_at_construction_change_nothing():
    with pytest.raises(ValueError, match="complex"):
        AccumulatingOptimizer(torch.optim.SGD([nn.Parameter(torch.randn(2, dtype=torch.cfloat))],
                                              lr=0.1))
    with pytest.raises(ValueError, match="SparseAdam"):
        AccumulatingOptimizer(torch.optim.SparseAdam([nn.Parameter(torch.randn(2))]))
    with pytest.raises(ValueError, match="differentiable"):
        AccumulatingOptimizer(torch.optim.SGD([nn.Parameter(torch.randn(2))], lr=0.1,
                                              differentiable=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_wrapping_the_same_optimizer_twice_is_refused(dtype):
    N, lr = 2, 0.1
    model = make_model(dtype)
    native = copy.deepcopy(model)
    inner = torch.optim.SGD(model.parameters(), lr=lr)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    hooks = count_hooks(model)
    views = [p.main_grad.data_ptr() for p in model.parameters()]
    with pytest.raises((ValueError, RuntimeError)):
        AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    # The refused construction left the first wrapper's hooks and buffer views alone.
    assert count_hooks(model) == hooks
    assert [p.main_grad.data_ptr() for p in model.parameters()] == views
    native_opt = torch.optim.SGD(native.parameters(), lr=lr)
    start = params_of(model)
    for x, y in batches(N, 4, dtype):
        mse(model, x, y).backward()
        opt.step()
        mse(native, x, y).backward()
    native_opt.step()
    assert all(torch.isfinite(p).all() and not torch.equal(p, s)
               for p, s in zip(model.parameters(), start))
    if dtype == torch.float32:
        assert_params_close(model, native)


def test_failed_construction_leaves_the_params_untouched():
    """A wrapper whose construction fails (a backend unusable on the params' device) leaves no
    trace on the params: no main_grad, no slot, no hooks."""
    model = make_model()
    with pytest.raises((ValueError, RuntimeError)):
        wrap_sgd(model, accumulation_steps=2, backend="cuda")  # CPU params
    for name, p in model.named_parameters():
        assert not hasattr(p, "main_grad"), f"{name}.main_grad set by a failed construction"
        assert not hasattr(p, "accumkernels_slot"), f"{name} slot set by a failed construction"
    assert count_hooks(model) == 0


@pytest.mark.parametrize("dtype, want", [(torch.bfloat16, True), (torch.float16, True),
                                         (torch.float32, False)])
def test_master_weights_auto_answers_what_it_resolved_to(dtype, want):
    """``master_weights="auto"`` is resolved once, at construction: ``opt.master_weights`` is
    True for a bf16/fp16 model and False for an fp32 one, and the fp32 masters exist exactly
    then."""
    model = torch.nn.Linear(3, 2).to(dtype)
    opt = AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.master_weights is want
    masters = opt.master_params
    assert bool(masters) is want
    assert all(m.dtype == torch.float32 and m is not p for m, p in zip(masters, model.parameters()))
    explicit = AccumulatingOptimizer(torch.optim.SGD(torch.nn.Linear(3, 2).to(dtype).parameters(),
                                                     lr=0.1), master_weights=False)
    assert explicit.master_weights is False
