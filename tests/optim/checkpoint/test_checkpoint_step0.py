"""A state dict taken before the first step loads into a native optimizer as a fresh one
(DESIGN: "state_dict()/load_state_dict()"), for every class of torch.optim: the wrapper's
step-0 state dict loaded into a native optimizer, then several native steps, equal a fresh native
optimizer's steps bit for bit (fp32). The state a fresh optimizer steps from is not always zeros:
Rprop's ``step_size`` starts at lr, ASGD's ``eta`` at lr and ``mu`` at 1, NAdam's ``mu_product``
at 1. (SGD's momentum buffer, which only the first update makes, is saved as zeros, the key
a checkpoint tool's template needs: exact for dampening 0; with dampening the first gradient is
scaled by 1 - dampening, as after native DCP's own state init.)"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from _optim_common import batches, make_model, mse

from accumkernels import AccumulatingOptimizer

# every class of torch.optim with the flags that change what its state starts from (SparseAdam:
# sparse gradients, refused by the wrapper; LBFGS needs a closure, run below with one)
CASES = {
    "SGD-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "SGD-nesterov-foreach": ("SGD", {"lr": 0.1, "momentum": 0.9, "nesterov": True, "foreach": True}),
    "Adam-amsgrad": ("Adam", {"lr": 0.02, "amsgrad": True, "weight_decay": 0.01}),
    "Adam-fused": ("Adam", {"lr": 0.02, "fused": True}),
    "AdamW-foreach": ("AdamW", {"lr": 0.02, "foreach": True}),
    "Adamax": ("Adamax", {"lr": 0.02, "weight_decay": 0.01}),
    "NAdam-foreach": ("NAdam", {"lr": 0.02, "foreach": True, "weight_decay": 0.01}),
    "NAdam-decoupled": ("NAdam", {"lr": 0.02, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    "RAdam": ("RAdam", {"lr": 0.02, "weight_decay": 0.01}),
    "RMSprop-centered": ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "Adagrad": ("Adagrad", {"lr": 0.1, "initial_accumulator_value": 0.1}),
    "Adadelta-foreach": ("Adadelta", {"lr": 0.5, "foreach": True}),
    "Adafactor": ("Adafactor", {"lr": 0.01}),
    "ASGD": ("ASGD", {"lr": 0.05, "t0": 1.0}),
    "ASGD-foreach": ("ASGD", {"lr": 0.05, "foreach": True}),
    "Rprop": ("Rprop", {"lr": 0.01}),
    "Rprop-foreach": ("Rprop", {"lr": 0.01, "foreach": True}),
    "LBFGS": ("LBFGS", {"lr": 0.5, "max_iter": 2}),
}
STEPS = 3


def _roundtrip(sd: dict) -> dict:
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _native_steps(model, opt, data) -> list[torch.Tensor]:
    for x, y in data:
        def closure(x=x, y=y):
            opt.zero_grad()
            loss = mse(model, x, y)
            loss.backward()
            return loss
        opt.step(closure)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", list(CASES))
def test_step0_state_dict_loads_into_native_as_a_fresh_one(name):
    cls_name, kwargs = CASES[name]
    if cls_name not in dir(torch.optim):
        pytest.skip(f"torch.optim.{cls_name} is not in this torch")
    cls = getattr(torch.optim, cls_name)
    torch.manual_seed(0)
    model = make_model()
    data = batches(STEPS, 4)
    fresh_model = copy.deepcopy(model)
    expected = _native_steps(fresh_model, cls(fresh_model.parameters(), **kwargs), data)

    wrapped_model = copy.deepcopy(model)
    opt = AccumulatingOptimizer(cls(wrapped_model.parameters(), **kwargs), accumulation_steps=2)
    sd = _roundtrip(opt.state_dict())
    opt.remove_hooks()
    loaded_model = copy.deepcopy(model)
    native = cls(loaded_model.parameters(), **kwargs)
    native.load_state_dict(sd)
    got = _native_steps(loaded_model, native, data)
    for i, (a, b) in enumerate(zip(got, expected)):
        assert torch.equal(a, b), f"{name}: param {i} differs by {(a - b).abs().max():.3g}"
