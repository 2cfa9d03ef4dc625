"""The private PyTorch behaviour the backward-as-a-transaction rule relies on
(accumkernels._torch_private), checked on the installed torch: a failure names what torch
changed."""

from __future__ import annotations

import weakref

import pytest
import torch

from accumkernels import _torch_private as tp


def test_a_raising_backward_frees_its_final_callbacks_before_it_returns():
    """The intake closes a raised backward from the weakref callback of its final callback:
    the engine must drop (free) the queued callback before ``backward()`` raises."""
    freed, ran = [], []

    class End:
        def __call__(self):
            ran.append(True)

    w, x = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    h = x * 3
    h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("boom")))
    refs = []

    def pre(g):
        end = End()
        refs.append(weakref.ref(end, lambda r: freed.append(True)))
        tp.queue_callback(end)

    w.register_hook(pre)
    with pytest.raises(RuntimeError, match="boom"):
        (h.sum() + (w * 2).sum()).backward()
    assert refs and not ran
    assert freed, "queue_callback: a raising backward no longer frees its final callbacks"


def test_post_accumulate_hook_ends_and_registrations():
    p = torch.nn.Parameter(torch.randn(2))
    assert tp.post_accumulate_hook_ends(p) == (0, None, None)
    mark = tp.hook_registrations()
    a = p.register_post_accumulate_grad_hook(lambda p: None)
    b = p.register_post_accumulate_grad_hook(lambda p: None)
    assert tp.hook_registrations() != mark, "hook_registrations: registrations no longer count"
    assert tp.post_accumulate_hook_ends(p) == (2, a.id, b.id)
    tp.run_post_accumulate_hook_first(p, b)
    assert tp.post_accumulate_hook_ends(p) == (2, b.id, a.id)
    a.remove()
    assert tp.post_accumulate_hook_ends(p) == (1, b.id, b.id)
