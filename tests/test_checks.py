"""Guards, argument checks and framework integration: check_model, validate_batch_sizes, the
wrapper's bad arguments, LR schedulers."""

from __future__ import annotations

import copy
import math
import re
import warnings

import pytest
import torch
from test_optim import SMALL_BUCKET, batches, make_model, mse
from torch import nn

from accumkernels import AccumulatingOptimizer, check_model, validate_batch_sizes


def _sgd(model, **kw):
    return AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 bucket_size_mb=SMALL_BUCKET, **kw)


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


# -- validate_batch_sizes -----------------------------------------------------------------------

@pytest.mark.parametrize("g,m,w", [(64, 8, 1), (64, 64, 1), (96, 4, 3), (7, 1, 7), (1, 1, 1)])
def test_validate_batch_sizes_returns_the_accumulation_steps(g, m, w):
    n = validate_batch_sizes(g, m, w)
    assert isinstance(n, int) and n * m * w == g


@pytest.mark.parametrize("g,m,w", [(10, 4, 1), (100, 8, 2), (3, 4, 1), (64, 5, 3)])
def test_validate_batch_sizes_says_what_to_change(g, m, w):
    with pytest.raises(ValueError) as info:
        validate_batch_sizes(g, m, w)
    message = str(info.value)
    assert "micro_batch_size" in message and str(g) in message
    per_step = m * w
    found = re.search(r"global batch of (\d+)(?: or (\d+))?", message)
    suggested = {int(s) for s in found.groups() if s is not None}
    assert suggested and all(s % per_step == 0 and s > 0 for s in suggested)
    assert (g // per_step + 1) * per_step in suggested  # the next valid global batch


@pytest.mark.parametrize("args,error", [
    ((0, 4, 1), ValueError), ((64, 0, 1), ValueError), ((64, 4, 0), ValueError),
    ((64, -4, 1), ValueError), ((64.0, 4, 1), TypeError), ((64, True, 1), TypeError),
    ((64, 4, "2"), TypeError),
])
def test_validate_batch_sizes_bad_arguments(args, error):
    with pytest.raises(error, match="must be"):
        validate_batch_sizes(*args)


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
        opt = _sgd(model, backend="cuda")  # CPU params
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
              "wrapper": lambda: _sgd(model)}[not_an_optimizer]()
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
    (NAN, ValueError, "weight must be finite and positive"),
    (INF, ValueError, "weight must be finite and positive"),
    (0, ValueError, "weight must be finite and positive"),
    (-3.0, ValueError, "weight must be finite and positive"),
    (torch.tensor(-1.0), ValueError, "weight must be finite and positive"),
    (True, TypeError, "weight must be a number"),
    ("3", TypeError, "weight must be a number"),
    (None, TypeError, "weight must be a number"),
])
def test_bad_weight(weight, error, message):
    opt = _sgd(make_model(), reduction="weighted")
    with pytest.raises(error, match=message):
        opt.add_weight(weight)


def test_weight_needs_weighted_reduction_and_weighted_needs_weights():
    with pytest.raises(ValueError, match="reduction='weighted'"):
        _sgd(make_model(), reduction="mean").add_weight(4)
    model = make_model()
    opt = _sgd(model, reduction="weighted")
    mse(model, *batches(1, 4)[0]).backward()
    with pytest.raises(ValueError, match="add_weight"):
        opt.step()


# -- LR schedulers ----------------------------------------------------------------------------

SCHEDULERS = {
    "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5),
    "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1.0 / (1 + e)),
    "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.2, total_steps=6),
    "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=5),
    "ReduceLROnPlateau": lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o, patience=1),
}


@pytest.mark.parametrize("name", list(SCHEDULERS))
def test_lr_schedulers(name):
    N, windows = 2, 5
    model = make_model()
    ref = copy.deepcopy(model)

    def groups(mod):  # two param groups with different lrs
        return [{"params": mod[0].parameters(), "lr": 0.1},
                {"params": [p for layer in list(mod)[1:] for p in layer.parameters()]}]

    inner = torch.optim.SGD(groups(model), lr=0.05, momentum=0.9)
    opt = AccumulatingOptimizer(inner, accumulation_steps=N, bucket_size_mb=SMALL_BUCKET)
    assert isinstance(opt, torch.optim.Optimizer)
    assert opt.param_groups is inner.param_groups
    ref_opt = torch.optim.SGD(groups(ref), lr=0.05, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sched, ref_sched = SCHEDULERS[name](opt), SCHEDULERS[name](ref_opt)
        lrs, ref_lrs = [], []
        for _ in range(windows):
            data = batches(N, 4)
            # Accelerate-style: step() every micro-batch, the scheduler after a real step.
            for x, y in data:
                (mse(model, x, y) / N).backward()
                real = opt.sync_step
                opt.step()
                if real:
                    sched.step(1.0) if name == "ReduceLROnPlateau" else sched.step()
            for x, y in data:
                (mse(ref, x, y) / N).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_sched.step(1.0) if name == "ReduceLROnPlateau" else ref_sched.step()
            lrs.append([g["lr"] for g in inner.param_groups])
            ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
    assert not [w for w in caught if "lr_scheduler" in str(w.message)]
    assert lrs == ref_lrs
    assert len({tuple(lr) for lr in lrs}) > 1  # the schedule did change the lr
    # The lr the scheduler set is the one the steps used: same params as the native run
    # (fp32 accumulation of 2 grads on both sides, momentum SGD: differences ~1e-7).
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)
