"""``reduction="mean"`` with no clear between windows: natively (``loss / N``) the second window's
``.grad`` is S1/N + S2/N: what the first step used stays and the next window adds its own mean.
Judged against the native loop: bit for bit where 1/N is exact (N a power of two), within fp32
rounding otherwise."""

from __future__ import annotations

import pytest
import torch
from _optim_common import batches, make_model, mse

from accumkernels import AccumulatingOptimizer

WINDOWS = 3


def _train(wrap: bool, n: int, data, in_backward: bool = True):
    torch.manual_seed(0)
    model = make_model()
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    opt = AccumulatingOptimizer(inner, accumulation_steps=n, reduction="mean",
                                accumulate_in_backward=in_backward) if wrap else inner
    grads, params = [], []
    for w in range(WINDOWS):
        for x, y in data[w * n:(w + 1) * n]:
            loss = mse(model, x, y)
            (loss if wrap else loss / n).backward()
            if wrap:
                opt.step()  # (a no-op until the window is full)
        if not wrap:
            opt.step()
        grads.append([p.grad.detach().clone() for p in model.parameters()])
        params.append([p.detach().clone() for p in model.parameters()])
        # no clear: the next window adds to what this step used, as .grad does natively
    return grads, params


@pytest.mark.parametrize("in_backward", [True, False], ids=["hooks", "accumulate"])
@pytest.mark.parametrize("n", [2, 3, 4, 6])
def test_mean_without_clear_carries_the_last_mean_once(n, in_backward):
    data = batches(n * WINDOWS, 4)
    native = _train(False, n, data)
    ours = _train(True, n, data, in_backward)
    exact = n & (n - 1) == 0
    for what, a_all, b_all in (("p.grad", ours[0], native[0]), ("params", ours[1], native[1])):
        for w, (a_list, b_list) in enumerate(zip(a_all, b_all)):
            for a, b in zip(a_list, b_list):
                if exact:
                    assert torch.equal(a, b), f"{what} after window {w}"
                else:
                    torch.testing.assert_close(a, b, rtol=2e-6, atol=2e-7,
                                               msg=f"{what} after window {w}")
