"""``opt.state`` keeps the dict protocol of a torch optimizer's ``state`` (optim/live_state.py).

Judge: a native AdamW on the same model, data and init, with the same dict operations applied to
its ``state`` at the same points. Every operation must end and answer what native's answers
(``clear``, ``pop``, ``popitem``, ``del``, ``len``, iteration, ``in``, ``get``, ``setdefault``,
assigning a new dict for a param), and a write through ``opt.state[p][key]`` (resetting the
moments after a loss spike) must reach the state the next step uses: before the first step,
after it, and after a load. fp32: the params stay bit-identical to native's.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from accumkernels import AccumulatingOptimizer

N = 2


def make(wrap: bool):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, AccumulatingOptimizer(inner, accumulation_steps=N) if wrap else inner


def window(model, opt, w: int, items=range(N)) -> None:
    """Micro-batches ``items`` of window ``w`` (fresh data each), stepped natively at its end."""
    for i in items:
        g = torch.Generator().manual_seed(100 * w + i)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 2, generator=g)
        nn.functional.mse_loss(model(x), y).backward()
        if isinstance(opt, AccumulatingOptimizer) or i == N - 1:
            opt.step()
            opt.zero_grad()


def both():
    (m1, native), (m2, opt) = make(False), make(True)
    return m1, native, m2, opt


def same_params(m1, m2) -> None:
    for a, b in zip(m1.parameters(), m2.parameters(), strict=True):
        assert torch.equal(a, b), (a - b).abs().max().item()


def keys_of(model, state) -> list[int]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [index[id(k)] for k in state]


def inner_part(entry) -> dict:
    return {k: v for k, v in dict(entry).items() if not k.startswith("accumkernels")}


def assert_same_view(m1, native, m2, opt) -> None:
    """len, iteration (order), ``in``, ``get`` and the values: as native's."""
    assert len(opt.state) == len(native.state)
    assert keys_of(m2, opt.state) == keys_of(m1, native.state)
    for p, q in zip(m1.parameters(), m2.parameters()):
        assert (q in opt.state) == (p in native.state)
        want, got = native.state.get(p), opt.state.get(q)
        assert (got is None) == (want is None)
        if want is not None:
            got = inner_part(got)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)


def test_every_dict_operation_means_what_it_means_natively():
    m1, native, m2, opt = both()
    assert_same_view(m1, native, m2, opt)  # before the first step: empty
    for s in (native.state, opt.state):
        s.clear()  # ends (the landed live state yielded its params again forever)
    window(m1, native, 0)
    window(m2, opt, 0)
    assert_same_view(m1, native, m2, opt)
    p1, p2 = list(m1.parameters()), list(m2.parameters())
    popped = native.state.pop(p1[0]), opt.state.pop(p2[0])
    assert inner_part(popped[1]).keys() == popped[0].keys()
    del native.state[p1[1]], opt.state[p2[1]]
    with pytest.raises(KeyError):
        del opt.state[p2[1]]
    assert opt.state.pop(p2[1], "gone") == "gone"
    assert_same_view(m1, native, m2, opt)
    native.state.setdefault(p1[0], {})
    opt.state.setdefault(p2[0], {})  # an empty entry: the next step creates the state in it
    fresh = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p1[1]),
             "exp_avg_sq": torch.zeros_like(p1[1])}
    native.state[p1[1]] = copy.deepcopy(fresh)
    opt.state[p2[1]] = copy.deepcopy(fresh)
    assert_same_view(m1, native, m2, opt)
    window(m1, native, 1)
    window(m2, opt, 1)
    same_params(m1, m2)
    assert_same_view(m1, native, m2, opt)
    native.state.popitem()
    opt.state.popitem()
    assert_same_view(m1, native, m2, opt)
    native.state.clear()
    opt.state.clear()
    assert len(opt.state) == 0 and list(opt.state) == [] and not opt.optimizer.state
    window(m1, native, 2)
    window(m2, opt, 2)
    same_params(m1, m2)
    assert_same_view(m1, native, m2, opt)


def reset_moments(model, opt) -> None:
    for p in model.parameters():
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
        opt.state[p]["exp_avg_sq"].zero_()


@pytest.mark.parametrize("when", ["after_first_step", "after_load", "mid_window"])
def test_writes_through_opt_state_reach_the_next_step(when):
    m1, native, m2, opt = both()
    for w in range(2):
        window(m1, native, w)
        window(m2, opt, w)
    if when == "after_load":
        sd = copy.deepcopy(opt.state_dict())
        _, opt2 = make(True)
        opt.remove_hooks()
        opt = AccumulatingOptimizer(torch.optim.AdamW(m2.parameters(), lr=1e-2,
                                                      weight_decay=0.1), accumulation_steps=N)
        opt.load_state_dict(sd)
        opt2.remove_hooks()
        native.load_state_dict(copy.deepcopy(native.state_dict()))
    if when == "mid_window":  # a reset between two micro-batches of the window
        window(m1, native, 2, range(1))
        window(m2, opt, 2, range(1))
        reset_moments(m1, native)
        reset_moments(m2, opt)
        window(m1, native, 2, range(1, N))
        window(m2, opt, 2, range(1, N))
    else:
        reset_moments(m1, native)
        reset_moments(m2, opt)
        window(m1, native, 2)
        window(m2, opt, 2)
    window(m1, native, 3)
    window(m2, opt, 3)
    same_params(m1, m2)
    assert_same_view(m1, native, m2, opt)


def test_a_full_entry_assigned_before_the_first_step_is_used():
    """Before the first step native's state is empty; a user may assign a whole entry (here with
    non-zero moments): the first step uses it."""
    m1, native, m2, opt = both()
    for p, q in zip(m1.parameters(), m2.parameters()):
        g = torch.Generator().manual_seed(p.numel())
        entry = {"step": torch.tensor(3.0), "exp_avg": torch.randn(p.shape, generator=g),
                 "exp_avg_sq": torch.rand(p.shape, generator=g)}
        native.state[p] = copy.deepcopy(entry)
        opt.state[q] = copy.deepcopy(entry)
    assert_same_view(m1, native, m2, opt)
    window(m1, native, 0)
    window(m2, opt, 0)
    same_params(m1, m2)
