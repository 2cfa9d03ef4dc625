"""``host.lists_plain`` (csrc/list_meta.cpp): the fused master step's bulk test of its lists,
one C++ pass in place of the Python rules (master_step_checks._lists_ok, layouts, the plan).

It may only ever accept: every list it accepts must satisfy the Python rules and be all plain
(contiguous, no neg bit, one device), and everything else must be refused so that the Python
path applies its rules and names the problem. Checked against a Python model of the rule on
fresh random cases, on each way an entry can break it, and through the op: the master step gives
the same bits with the reader on and off (the reader off takes the Python path throughout).
"""

from __future__ import annotations

import random

import pytest
import torch

from accumkernels.ops import master_step_checks as checks
from accumkernels.ops import host
from accumkernels.ops.backends import native
from accumkernels.ops.master_step import master_adam_step_, master_sgd_step_

pytestmark = pytest.mark.skipif(not native.READER, reason=f"no tensor reader: {native.READER_NOTE}")

F32, LOW, STEP = host.LIST_FP32, host.LIST_LOW, host.LIST_STEP


def model(lists, kinds) -> bool:
    """The rule in Python, from torch's own attributes."""
    if type(lists) is not list or not lists or len(kinds) != len(lists):
        return False
    masters = lists[0]
    if any(type(t) is not list or len(t) != len(masters) for t in lists):
        return False
    if not masters:
        return True
    device = masters[0].device if type(masters[0]) in (torch.Tensor, torch.nn.Parameter) \
        else None
    for ts, kind in zip(lists, kinds):
        for t, m in zip(ts, masters):
            if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided:
                return False
            if not t.is_contiguous() or t.is_neg() or t.device != device:
                return False
            if kind == STEP:
                if t.dtype != torch.float32 or t.numel() != 1:
                    return False
                continue
            if (t.dtype not in (torch.bfloat16, torch.float16)) if kind == LOW \
                    else t.dtype != torch.float32:
                return False
            if ts is not masters and t.shape != m.shape:
                return False
    return True


def plain_case(rng: random.Random, n: int):
    shapes = [tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3))) for _ in range(n)]
    masters = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    weights = [torch.nn.Parameter(m.detach().to(rng.choice([torch.bfloat16, torch.float16])))
               for m in masters]
    grads = [torch.randn(s) for s in shapes]
    steps = [torch.zeros(()) for _ in shapes]
    return [masters, weights, grads, steps], [F32, LOW, F32, STEP]


BREAKS = {
    "transposed": lambda t: t.t() if t.dim() == 2 and 1 not in t.shape else None,
    "strided": lambda t: torch.empty(*t.shape, 2, dtype=t.dtype)[..., 0] if t.numel() > 1
    else None,
    "neg bit": lambda t: torch._neg_view(t.detach()),  # contiguous, the neg bit set
    "float64": lambda t: t.double(),
    "float32 weight": lambda t: t.float() if t.dtype != torch.float32 else None,
    "bf16 where fp32": lambda t: t.bfloat16() if t.dtype == torch.float32 else None,
    "other shape": lambda t: t.reshape(-1) if t.dim() != 1 and t.numel() > 1 else None,
    "meta device": lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"),
    "subclass": lambda t: torch.Tensor._make_subclass(Sub, t.detach()),
    "not a tensor": lambda t: 1.0,
    "two-element step": lambda t: torch.zeros(2) if t.numel() == 1 else None,
}


class Sub(torch.Tensor):
    pass


def test_accepts_what_the_python_rules_accept_as_plain():
    rng = random.Random("plain")  # (seeded: a failure is reproducible)
    for n in (0, 1, 7, 40):
        lists, kinds = plain_case(rng, n)
        assert host.lists_plain(lists, kinds) is True
        assert model(lists, kinds)
        if n:  # and what it accepts passes check_lists' own rules
            named = dict(zip(("masters", "weights", "grads", "state_steps"), lists))
            assert checks._lists_ok(named)


@pytest.mark.parametrize("how", list(BREAKS))
def test_every_broken_entry_is_refused(how):
    rng = random.Random(f"broken-{how}")
    tried = 0
    for _ in range(30):
        lists, kinds = plain_case(rng, rng.randint(1, 6))
        k, i = rng.randrange(len(lists)), None
        i = rng.randrange(len(lists[0]))
        bad = BREAKS[how](lists[k][i])
        if bad is None:
            continue
        lists[k] = list(lists[k])
        lists[k][i] = bad
        expected = model(lists, kinds)
        assert host.lists_plain(lists, kinds) is expected, (how, k, i)
        tried += 1
    assert tried, f"no case could be broken by {how}"


def test_list_structure_is_refused():
    lists, kinds = plain_case(random.Random("structure"), 3)
    assert not host.lists_plain([tuple(t) for t in lists], kinds)  # tuples: the Python path
    assert not host.lists_plain(lists, kinds[:-1])
    assert not host.lists_plain(lists[:2] + [lists[2][:2]] + lists[3:], kinds)
    assert not host.lists_plain([], [])
    assert not host.lists_plain(lists, [F32, LOW, F32, 7.5])


def test_reader_off_gives_no_verdict(monkeypatch):
    lists, kinds = plain_case(random.Random("reader-off"), 3)
    monkeypatch.setattr(native, "READER", False)
    assert not host.lists_plain(lists, kinds)


def _adam_run(seed: int):
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 3), (7,), (2, 2, 2), (1,)]
    masters = [torch.randn(s, generator=g) for s in shapes]
    weights = [m.bfloat16() for m in masters]
    grads = [torch.randn(s, generator=g) for s in shapes]
    avgs = [torch.randn(s, generator=g) * 0.1 for s in shapes]
    sqs = [torch.rand(s, generator=g) * 0.1 for s in shapes]
    steps = [torch.tensor(3.0) for _ in shapes]
    master_adam_step_(masters, weights, grads, avgs, sqs, None, steps, lr=1e-2, beta1=0.9,
                      beta2=0.99, weight_decay=0.01, eps=1e-8, grad_scale=torch.tensor(3.0),
                      found_inf=torch.tensor(0.0))
    bufs = [torch.randn(s, generator=g) for s in shapes]
    master_sgd_step_(masters, weights, grads, bufs, lr=1e-2, momentum=0.9, dampening=0.0,
                     weight_decay=0.0)
    return masters + weights + grads + avgs + sqs + steps + bufs


def test_master_step_same_bits_with_and_without_the_bulk_test(monkeypatch):
    """The op on plain lists: the C++ verdict skips the Python rules, the reader off runs them;
    every output bit agrees (and the plain lists do take the C++ verdict)."""
    seen = []
    real = host.lists_plain
    monkeypatch.setattr(host, "lists_plain", lambda *a: seen.append(real(*a)) or seen[-1])
    fast = _adam_run(5)
    assert seen and all(seen)
    monkeypatch.setattr(host, "lists_plain", lambda *a: False)
    slow = _adam_run(5)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a.view(torch.int8) if a.dim() else a, b.view(torch.int8) if b.dim()
                           else b)
