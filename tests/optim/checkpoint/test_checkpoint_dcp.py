"""Checkpoints through the paths large-model users take (DESIGN: "state_dict()/load_state_dict()"):
``torch.distributed.checkpoint``'s ``get_state_dict``/``set_state_dict`` with its options
(default, ``flatten_optimizer_state_dict``, ``full_state_dict``, ``cpu_offload`` and their
combinations), ``dcp.save``/``dcp.load`` into a fresh wrapper's state dict as the template, fp32
models and bf16 models with master weights, saved at a window boundary and in the middle of a
window, AdamW and SGD with momentum, one process.

Judge: the run that never stopped. The resumed run does the same operations on the same values
(the window, the masters and the inner state are restored exactly), so it is bit-identical. The
control: a native optimizer through the same harness (at a boundary: a native optimizer's
checkpoint holds no gradients) gives the same outcome for every option.

``flatten_optimizer_state_dict=True`` rebuilds the loaded state dict from the keys the *loading*
optimizer shows (``opt.state[p]``, ``opt.param_groups``): the wrapper shows its own keys there
(optim/live_state.py). ``flatten`` with ``full_state_dict`` cannot be loaded by
``set_state_dict`` in torch 2.13 for any optimizer (DCP raises KeyError 'param_groups.0.params.0'
for a native one too): the wrapper raises the same; such a checkpoint loads with ``flatten``
alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _dcp_options import STATE_DICT_OPTIONS
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)

from accumkernels import AccumulatingOptimizer

N = 4  # micro-batches per window
OPTIONS = {k: v for k, v in STATE_DICT_OPTIONS.items() if k != "flatten_full"}
FLATTEN_FULL = STATE_DICT_OPTIONS["flatten_full"]
INNERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd_momentum": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
}


def make(seed: int, dtype: torch.dtype, inner: str, wrap: bool = True):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(),
                          nn.Linear(8, 3)).to(dtype)
    opt = INNERS[inner](model.parameters())
    return model, AccumulatingOptimizer(opt, accumulation_steps=N) if wrap else opt


def data(seed: int, n: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed + 7)
    return [(torch.randn(5, 6, generator=g).to(dtype), torch.randn(5, 3, generator=g).to(dtype))
            for _ in range(n)]


def micro(model, opt, batch, k: int = 0) -> None:
    """Micro-batch ``k``: the wrapper is stepped every micro-batch; a native optimizer (the
    control) at the end of each window."""
    x, y = batch
    nn.functional.mse_loss(model(x).float(), y.float()).backward()
    if isinstance(opt, AccumulatingOptimizer) or (k + 1) % N == 0:
        opt.step()
        opt.zero_grad()


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def run_resumed(seed, dtype, inner, cut, save, load, wrap=True):
    """Train ``cut`` micro-batches, save with ``save(model, opt)``, build a fresh model and
    wrapper, ``load(model, opt, saved)``, train the rest; returns the final params."""
    batches = data(seed, 3 * N, dtype)
    model, opt = make(seed, dtype, inner, wrap)
    for k, b in enumerate(batches[:cut]):
        micro(model, opt, b, k)
    saved = save(model, opt)
    model2, opt2 = make(seed + 1, dtype, inner, wrap)  # other initial weights: all must be loaded
    load(model2, opt2, saved)
    if wrap:
        opt.remove_hooks()
    for k, b in enumerate(batches[cut:], start=cut):
        micro(model2, opt2, b, k)
    return params_of(model2)


def run_uninterrupted(seed, dtype, inner, wrap=True):
    model, opt = make(seed, dtype, inner, wrap)
    for k, b in enumerate(data(seed, 3 * N, dtype)):
        micro(model, opt, b, k)
    return params_of(model)


def assert_equal_params(got, want) -> None:
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), f"max |diff| {(a.float() - b.float()).abs().max().item():.3g}"


def get_set(options: StateDictOptions):
    def save(model, opt):
        msd, osd = get_state_dict(model, opt, options=options)
        return copy.deepcopy((msd, osd))  # what a checkpoint file would hold

    def load(model, opt, saved):
        msd, osd = saved
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return save, load


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cut", [N, N + 2], ids=["boundary", "mid_window"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_get_set_state_dict_resumes_exactly(option, cut, dtype, inner):
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    save, load = get_set(OPTIONS[option])
    got = run_resumed(seed, dtype, inner, cut, save, load)
    assert_equal_params(got, run_uninterrupted(seed, dtype, inner))


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("option", sorted(OPTIONS))
def test_native_control_through_the_same_harness(option, dtype, inner):
    """The harness is sound: a native optimizer saved at a window boundary resumes exactly with
    every option."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    save, load = get_set(OPTIONS[option])
    got = run_resumed(seed, dtype, inner, N, save, load, wrap=False)
    assert_equal_params(got, run_uninterrupted(seed, dtype, inner, wrap=False))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cut", [N, N + 2], ids=["boundary", "mid_window"])
def test_flatten_with_full_state_dict(cut, dtype):
    """``flatten`` + ``full_state_dict``: ``get_state_dict`` carries everything, and the dict
    resumes exactly through ``set_state_dict`` with ``flatten`` alone. ``set_state_dict`` with
    both options fails in torch's own code for native optimizers (torch 2.13: KeyError); the
    wrapper then fails the same way, never silently. Should torch fix it, both resume."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    save, _ = get_set(FLATTEN_FULL)
    _, load_flat = get_set(OPTIONS["flatten"])
    got = run_resumed(seed, dtype, "adamw", cut, save, load_flat)
    assert_equal_params(got, run_uninterrupted(seed, dtype, "adamw"))

    save_n, load_n = get_set(FLATTEN_FULL)
    try:
        native = run_resumed(seed, dtype, "adamw", N, save_n, load_n, wrap=False)
    except Exception as exc:  # noqa: BLE001 - whatever native raises, the wrapper raises too
        with pytest.raises(type(exc)):
            run_resumed(seed, dtype, "adamw", cut, save_n, load_n)
    else:
        assert_equal_params(native, run_uninterrupted(seed, dtype, "adamw", wrap=False))
        got = run_resumed(seed, dtype, "adamw", cut, save_n, load_n)
        assert_equal_params(got, run_uninterrupted(seed, dtype, "adamw"))


DCP_OPTIONS = {k: OPTIONS[k] for k in ("default", "flatten")}


@pytest.mark.parametrize("inner", sorted(INNERS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cut", [N, N + 2], ids=["boundary", "mid_window"])
@pytest.mark.parametrize("option", sorted(DCP_OPTIONS))
def test_dcp_save_load_into_a_fresh_template(tmp_path, option, cut, dtype, inner):
    """``dcp.save`` of ``get_state_dict``'s dicts; ``dcp.load`` into the state dicts of a fresh
    model and wrapper (the template), then ``set_state_dict``: the torchtitan recipe (which
    flattens). A fresh wrapper is at a window boundary, where its state dict holds no window: a
    checkpoint taken in the middle of a window is refused with an error naming the recipe
    (``opt.window_template()``), the wrapper's window and counts unchanged; through the template
    built inside ``opt.window_template()`` it resumes exactly (README: checkpoints)."""
    seed = int(torch.randint(0, 2**31 - 1, ()).item())
    options = DCP_OPTIONS[option]

    def save(model, opt):
        msd, osd = get_state_dict(model, opt, options=options)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "ckpt"))

    def load_through(model, opt, msd, osd):
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)

    def load(model, opt, _):
        if cut % N:
            with pytest.raises(ValueError, match=r"middle of a window.*opt\.window_template"):
                load_through(model, opt, *get_state_dict(model, opt, options=options))
            assert opt.micro_steps == 0 and all(p.grad is None for p in model.parameters())
            with opt.window_template():
                template = get_state_dict(model, opt, options=options)
        else:
            template = get_state_dict(model, opt, options=options)
        load_through(model, opt, *template)

    got = run_resumed(seed, dtype, inner, cut, save, load)
    assert_equal_params(got, run_uninterrupted(seed, dtype, inner))


def test_masters_are_checkpointed_under_the_model_names():
    """A bf16 model's fp32 masters are the state of its parameters, under their names."""
    model, opt = make(0, torch.bfloat16, "adamw")
    for b in data(0, N, torch.bfloat16):
        micro(model, opt, b)
    _, osd = get_state_dict(model, opt)
    names = [n for n, _ in model.named_parameters()]
    assert sorted(osd["state"]) == sorted(names)
    for name, m in zip(names, opt.master_params):
        assert torch.equal(osd["state"][name]["accumkernels_master"], m)
        assert osd["state"][name]["exp_avg"].dtype == torch.float32


def test_a_stripped_bookkeeping_is_refused_not_taken_as_an_empty_window():
    """A tool that drops unknown param_group keys: the window's tensors arrive without the
    counts. Refused with a ValueError naming what is lost, nothing changed."""
    model, opt = make(1, torch.float32, "adamw")
    for b in data(1, N + 2, torch.float32):
        micro(model, opt, b)
    sd = opt.state_dict()
    for g in sd["param_groups"]:
        g.pop("accumkernels")
    model2, opt2 = make(2, torch.float32, "adamw")
    before = params_of(model2)
    with pytest.raises(ValueError, match="bookkeeping"):
        opt2.load_state_dict(sd)
    assert all(torch.equal(a, b) for a, b in zip(before, params_of(model2)))
    assert opt2.micro_steps == 0


def test_a_missing_window_is_refused():
    """The bookkeeping says a window is open, its tensors are gone: a clear error."""
    model, opt = make(3, torch.float32, "adamw")
    for b in data(3, N + 2, torch.float32):
        micro(model, opt, b)
    sd = opt.state_dict()
    for entry in sd["state"].values():
        entry.pop("accumkernels_window")
    with pytest.raises(ValueError, match="middle of a window"):
        make(4, torch.float32, "adamw")[1].load_state_dict(sd)


def test_wrapper_state_dict_loads_into_native_and_back():
    """Both ways with a native optimizer, mid-run: the native optimizer takes the inner state
    (the wrapper's extra keys are ignored), and a native state dict loads into the wrapper."""
    model, opt = make(5, torch.float32, "adamw")
    for b in data(5, N, torch.float32):
        micro(model, opt, b)
    native_model = copy.deepcopy(model)
    native = INNERS["adamw"](native_model.parameters())
    native.load_state_dict(copy.deepcopy(opt.state_dict()))
    rest = data(6, N, torch.float32)
    for x, y in rest:
        nn.functional.mse_loss(native_model(x), y).backward()
    native.step()
    for b in rest:
        micro(model, opt, b)
    assert all(torch.equal(a, b) for a, b in zip(params_of(model), params_of(native_model)))
    model3, opt3 = make(7, torch.float32, "adamw")
    model3.load_state_dict(native_model.state_dict())
    opt3.load_state_dict(copy.deepcopy(native.state_dict()))
    assert opt3.micro_steps == 0
