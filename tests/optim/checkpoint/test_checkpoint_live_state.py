"""What ``opt.state`` and ``opt.param_groups`` show (optim/live_state.py): the inner optimizer's,
with the keys a checkpoint of the wrapper holds, so that a tool that rebuilds the loaded state
dict from the live optimizer's keys (``torch.distributed.checkpoint`` with
``flatten_optimizer_state_dict=True``) finds the window, the masters and the bookkeeping.

* each managed param's ``opt.state[p]`` holds its window (``p.main_grad``) and, for a bf16 model,
  its fp32 master; before the inner optimizer's first step, the keys its state will have;
* the inner optimizer never sees the extra keys and steps as it would alone;
* writing an entry writes the inner optimizer's state; writing the extra keys copies into the
  wrapper's tensors; a tool that moves the state to a device (Lightning's
  ``_optimizer_to_device``) changes nothing, also on a fresh wrapper;
* a native optimizer's flattened DCP state dict cannot be loaded into the wrapper by
  ``set_optimizer_state_dict`` (DCP needs every group key the loading optimizer shows): DCP's
  KeyError names the missing key, never silent; loading it into the inner optimizer before
  wrapping resumes exactly. The wrapper's flattened state dict loads into a native optimizer.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from accumkernels import AccumulatingOptimizer

N = 3
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def make(seed: int = 0, dtype: torch.dtype = torch.float32, inner: str = "adamw", wrap=True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2)).to(dtype)
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1) if inner == "adamw"
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    return model, AccumulatingOptimizer(opt, accumulation_steps=N) if wrap else opt


def batch(k: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(1000 + k)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype)


def micro(model, opt, k: int, dtype: torch.dtype = torch.float32) -> None:
    x, y = batch(k, dtype)
    nn.functional.mse_loss(model(x).float(), y.float()).backward()
    if isinstance(opt, AccumulatingOptimizer) or (k + 1) % N == 0:
        opt.step()
        opt.zero_grad()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_entries_show_the_window_and_the_masters(dtype):
    model, opt = make(dtype=dtype)
    for k in range(N + 1):
        micro(model, opt, k, dtype)
    params = list(model.parameters())
    assert list(opt.state) == params and len(opt.state) == len(params) and opt.state
    for p, master in zip(params, opt.master_params if dtype == torch.bfloat16 else params):
        entry = opt.state[p]
        assert {"exp_avg", "exp_avg_sq", "step", "accumkernels_window"} <= set(entry)
        assert ("accumkernels_master" in entry) == (dtype == torch.bfloat16)
        window = entry["accumkernels_window"]
        assert window.dtype == torch.float32 and window.data_ptr() == p.main_grad.data_ptr()
        assert torch.equal(window, p.main_grad)
        if dtype == torch.bfloat16:
            assert entry["accumkernels_master"].data_ptr() == master.data_ptr()
        inner = opt.optimizer.state[p]
        assert not any(k.startswith("accumkernels") for k in inner), "the inner one sees them"
        assert entry["exp_avg"] is inner["exp_avg"]
    assert all(g["accumkernels"] == "" for g in opt.param_groups)
    assert opt.param_groups is opt.optimizer.param_groups


@pytest.mark.parametrize("inner", ["adamw", "sgd"])
def test_a_fresh_wrapper_shows_the_keys_its_state_will_have(inner):
    """Before the first step the inner optimizer has no state: the entries show the keys (zeros)
    an lr=0 step on zero gradients creates, and nothing of it is created in the inner one."""
    model, opt = make(inner=inner)
    native_model, native = make(inner=inner, wrap=False)
    for q in native_model.parameters():
        q.grad = torch.zeros_like(q)
    for g in native.param_groups:
        g["lr"] = 0.0
    native.step()
    for p, q in zip(model.parameters(), native_model.parameters()):
        entry = opt.state[p]
        want = native.state[q]
        assert want and set(entry) == set(want) | {"accumkernels_window"}
        for key, value in want.items():
            # (step 0: what a fresh optimizer is loaded with, see test_checkpoint_loads.py)
            assert torch.equal(entry[key], torch.zeros_like(value))
    assert not opt.optimizer.state, "showing the keys created inner state"


def test_writes_reach_the_inner_state_and_the_window():
    model, opt = make()
    for k in range(N + 1):
        micro(model, opt, k)
    p = next(model.parameters())
    new = torch.randn_like(p)
    opt.state[p]["exp_avg"] = new
    assert opt.optimizer.state[p]["exp_avg"] is new
    window = torch.randn_like(p)
    opt.state[p]["accumkernels_window"] = window
    assert torch.equal(p.main_grad, window)
    with pytest.raises(ValueError, match="own tensor"):
        opt.state[p]["accumkernels_window"] = torch.zeros(3)
    with pytest.raises(KeyError):
        del opt.state[p]["accumkernels_window"]
    opt.state["marker"] = 1  # a key that is no param: the inner optimizer's, as natively
    assert opt.optimizer.state["marker"] == 1 and opt.state.pop("marker") == 1
    assert opt.state.pop("absent", None) is None and "absent" not in opt.optimizer.state
    opt.state = {q: {"exp_avg": opt.optimizer.state[q]["exp_avg"], "accumkernels_window": w}
                 for q, w in zip(model.parameters(), [torch.zeros(1)] * 4)}
    assert all(set(e) == {"exp_avg"} for e in opt.optimizer.state.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("stepped", [False, True], ids=["fresh", "mid_window"])
def test_moving_the_state_to_a_device_changes_nothing(dtype, stepped):
    """Lightning's ``_optimizer_to_device`` writes every entry back (moved): on a fresh wrapper
    it creates no inner state from the shown keys; mid-window the window is kept. The run then
    equals one that was never moved."""
    from lightning.fabric.utilities.optimizer import _optimizer_to_device

    runs = []
    for move in (False, True):
        model, opt = make(dtype=dtype)
        for k in range(N + 1 if stepped else 0):
            micro(model, opt, k, dtype)
        if move:
            _optimizer_to_device(opt, torch.device("cpu"))
            assert bool(opt.optimizer.state) == stepped
        for k in range(N + 1 if stepped else 0, 3 * N):
            micro(model, opt, k, dtype)
        runs.append(params_of(model))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_deepcopy_and_pickle_keep_working():
    model, opt = make()
    for k in range(N + 1):
        micro(model, opt, k)
    twin = copy.deepcopy(opt)
    assert twin.micro_steps == opt.micro_steps
    restored = pickle.loads(pickle.dumps(opt))
    assert all(g["accumkernels"] == "" for g in restored.param_groups)


def test_a_native_flattened_state_dict_is_refused_by_dcp_not_taken_silently():
    """DCP's unflattening needs every group key the loading optimizer shows: a native
    optimizer's flattened state dict lacks the wrapper's, and DCP says which (KeyError). The
    way: load it into the inner optimizer before wrapping it; resumes exactly."""
    model, native = make(wrap=False)
    for k in range(N):
        micro(model, native, k)
    osd = copy.deepcopy(get_optimizer_state_dict(model, native, options=FLAT))
    model2, opt2 = make(seed=1)
    model2.load_state_dict(model.state_dict())
    with pytest.raises(KeyError, match="accumkernels"):
        set_optimizer_state_dict(model2, opt2, copy.deepcopy(osd), options=FLAT)
    model3, inner3 = make(seed=1, wrap=False)
    model3.load_state_dict(model.state_dict())
    set_optimizer_state_dict(model3, inner3, copy.deepcopy(osd), options=FLAT)
    opt3 = AccumulatingOptimizer(inner3, accumulation_steps=N)
    for k in range(N, 3 * N):
        micro(model, native, k)
        micro(model3, opt3, k)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(model3)))


def test_the_wrapper_flattened_state_dict_loads_into_a_native_optimizer():
    model, opt = make()
    for k in range(N):
        micro(model, opt, k)
    osd = copy.deepcopy(get_optimizer_state_dict(model, opt, options=FLAT))
    model2, native = make(seed=1, wrap=False)
    model2.load_state_dict(model.state_dict())
    set_optimizer_state_dict(model2, native, osd, options=FLAT)
    assert not any(str(k).startswith("accumkernels") for e in native.state.values() for k in e)
    for k in range(N, 3 * N):
        micro(model, opt, k)
        micro(model2, native, k)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(model2)))
