"""The layers of one ``accumulate_`` call and of one ``LaunchPlan`` launch, as callables.

Host-overhead benchmarks (overhead.py) time each layer on its own to see what each adds. The
layers below the public call are private to the library (``ops._run``, the extension's entry
points): this module is the one place in benchmarks/ that reaches them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from accumkernels.ops import backends, accumulate as ops
from accumkernels.ops.backends import native
from accumkernels.ops.plan import LaunchPlan


def call_layers(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], scale: float = 1.0, *,
                overwrite: bool = False, backend: str = "auto") -> dict[str, Callable[[], None]]:
    """The layers of one ``accumulate_`` call, outermost first.

    Each does the whole call's work from its layer down: ``"accumulate_"`` the public call;
    ``"custom_op"`` the torch.library op (the path compiled graphs take; eager calls skip its
    dispatcher); ``"backend"`` the op's implementation (checks, version bumps, launch);
    ``"binding"`` the extension's entry point alone (with the C++ tensor reader: checks and
    launch in one call; without: the launch on addresses marshalled once, up front). Backends
    other than ``cpu``/``cuda`` have no ``"binding"``.
    """
    dst, src = list(dst), list(src)
    device = dst[0].device
    name = backends.resolve(backend, device)
    layers: dict[str, Callable[[], None]] = {
        "accumulate_": lambda: ops.accumulate_(dst, src, scale, overwrite=overwrite,
                                               backend=backend),
        "custom_op": lambda: torch.ops.accumkernels.accumulate_(dst, src, scale, None, overwrite,
                                                                None, name, None, None),
        "backend": lambda: ops._run(dst, src, scale, None, overwrite, None, name, device),
    }
    if name in native.KERNELS:
        if native.READER:
            layers["binding"] = lambda: native.run(dst, src, scale, None, overwrite, None,
                                                   ops.kernel_flags(), name, device)
        else:
            layers["binding"] = native.prepared_launch(dst, src, scale, overwrite)
    return layers


def plan_layers(plan: LaunchPlan, src: Sequence[torch.Tensor], scale: float = 1.0, *,
                keys: Sequence | None = None,
                overwrite: bool = False) -> dict[str, Callable[[], None]]:
    """A launch's layers: ``"plan"`` the call, ``"plan_binding"`` the extension's entry point
    alone (absent without the C++ plan)."""
    layers = {"plan": lambda: plan(src, scale, keys=keys, overwrite=overwrite)}
    if plan._native is not None:
        layers["plan_binding"] = lambda: native.run_plan(
            plan._native, keys, src, scale, None, overwrite, None, ops.kernel_flags(), plan.backend,
            plan.device)
    return layers
