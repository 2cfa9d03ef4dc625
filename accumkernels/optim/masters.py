"""fp32 master weights for bf16/fp16 params: the inner optimizer steps these, the model gets a copy.

The model's low-precision weights are what the user sees and may change behind the
optimizer's back (``model.load_state_dict`` after wrapping, ``p.data.clamp_()``, a re-init).
Such a change is never reverted: before each step, every master whose model weight no longer
equals the master rounded to the model dtype is re-synced from the model weight.

On the CPU that check costs 2 B per element, not a compare of both (6 B): the copy-back (a
native pass) fingerprints the weights it writes, the step fingerprints them again, and only a
weight whose fingerprint changed (or whose storage was replaced) is compared element by
element. A change of one element always changes the fingerprint; several changes could leave
it unchanged only by a coincidence of two 32-bit sums (about 2^-64), not a version counter that
writes through ``.data`` bypass.
"""

from __future__ import annotations

import torch

from accumkernels._util import LOW_PRECISION
from accumkernels.backends import native
from accumkernels.backends import triton as triton_backend


class MasterWeights:
    """The fp32 copies (by ``id`` of the model param), the inner optimizer's state remap and
    the copy-back."""

    def __init__(self, optimizer: torch.optim.Optimizer, enabled: bool):
        self.optimizer = optimizer
        self.enabled = enabled
        self.masters: dict[int, torch.nn.Parameter] = {}
        self.model_params: list[torch.Tensor] = []  # in registration order, those with masters
        # id(param) -> (fingerprint, data_ptr) of the weight the last native copy-back wrote
        self.fingerprints: dict[int, tuple[int, int]] = {}

    def retarget(self, params: list[torch.Tensor]) -> None:
        """Point the inner optimizer at fp32 copies of the low-precision ``params``; remap state."""
        if not self.enabled:
            return
        wanted = {id(p) for p in params if p.dtype in LOW_PRECISION and id(p) not in self.masters}
        if wanted:
            self.optimizer._accumkernels_masters = True
        state = self.optimizer.state
        for group in self.optimizer.param_groups:
            new_params = []
            for p in group["params"]:
                if id(p) in wanted:
                    master = torch.nn.Parameter(p.detach().float().clone())
                    self.masters[id(p)] = master
                    self.model_params.append(p)
                    if p in state:
                        state[master] = {
                            k: v.float() if torch.is_tensor(v) and v.dtype in LOW_PRECISION else v
                            for k, v in state.pop(p).items()
                        }
                    p = master
                new_params.append(p)
            group["params"] = new_params

    def get(self, p: torch.Tensor) -> torch.nn.Parameter | None:
        return self.masters.get(id(p))

    def master_list(self) -> list[torch.nn.Parameter]:
        return [self.masters[id(p)] for p in self.model_params]

    @torch.no_grad()
    def resync_changed(self) -> None:
        """Take the model's weight wherever it differs from the rounded master (changed outside).

        On the CPU a weight whose fingerprint still equals the one the copy-back recorded is
        unchanged (reading 2 B/element); the others get one native pass that reads the master
        and the weight and writes only what differs (no temporaries). On a GPU with Triton,
        one launch per device and dtype does the same compare (6 B/element); otherwise torch
        ops per param."""
        rest = self.model_params
        if native.resync_masters_cpu is not None:
            rest = _resync_native(self._changed_since_copy_back(rest), self.masters)
        rest = _resync_triton(rest, self.masters)
        for p in rest:
            m = self.masters[id(p)]
            changed = p.ne(m.to(p.dtype))
            torch.where(changed, p.float(), m, out=m)

    @torch.no_grad()
    def follow(self, old_devices: list[torch.device], params: list[torch.Tensor]) -> None:
        """Masters of params that moved to another device move too (from ``meta``, which holds
        no values, they are taken from the model's weights)."""
        old = {id(p): d for p, d in zip(params, old_devices)}
        for p in self.model_params:
            m = self.masters[id(p)]
            if m.device == p.device:
                continue
            if old.get(id(p), m.device).type == "meta" or m.device.type == "meta":
                m.data = p.detach().float().clone()
            else:
                m.data = m.data.to(p.device)

    @torch.no_grad()
    def take_from_model(self) -> None:
        """Masters equal to the model's weights (a native optimizer's state was loaded)."""
        for p in self.model_params:
            self.masters[id(p)].copy_(p)

    @torch.no_grad()
    def copy_back(self) -> None:
        """The model's weights = the masters rounded (torch's cast); on the CPU a native pass
        that also fingerprints what it wrote (see ``resync_changed``)."""
        self.fingerprints = {}
        rest = self.model_params
        if native.copy_back_cpu is not None:
            rest = self._copy_back_native(rest)
        if rest:
            torch._foreach_copy_(rest, [self.masters[id(p)] for p in rest])

    def _copy_back_native(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        done: set[int] = set()
        plain = [p for p in params if _plain_pair(p, self.masters[id(p)], "cpu")]
        for dtype in LOW_PRECISION:
            group = [p for p in plain if p.dtype == dtype]
            if not group:
                continue
            prints = native.copy_back_cpu([self.masters[id(p)].data_ptr() for p in group],
                                          [p.data_ptr() for p in group],
                                          [p.numel() for p in group], native.DTYPE_CODES[dtype])
            if prints is None:
                continue
            for p, fp in zip(group, prints):
                self.fingerprints[id(p)] = (fp, p.data_ptr())
                torch.autograd.graph.increment_version(p)  # written around autograd's counter
            done.update(id(p) for p in group)
        return [p for p in params if id(p) not in done]

    def _changed_since_copy_back(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The params whose weight may differ from the rounded master: no fingerprint recorded,
        the storage replaced, or a fingerprint that no longer matches."""
        known = [p for p in params if id(p) in self.fingerprints
                 and self.fingerprints[id(p)][1] == p.data_ptr()]
        if not known:
            return params
        now = native.weight_fingerprints_cpu([p.data_ptr() for p in known],
                                             [p.numel() for p in known])
        same = {id(p) for p, fp in zip(known, now) if fp == self.fingerprints[id(p)][0]}
        return [p for p in params if id(p) not in same]

    def state_dict(self) -> list[torch.Tensor]:
        return self.master_list()

    def parse(self, saved: object) -> list[torch.Tensor]:
        mine = self.master_list()
        if not isinstance(saved, (list, tuple)) or len(saved) != len(mine) or any(
                not isinstance(t, torch.Tensor) or t.shape != m.shape for t, m in zip(saved, mine)):
            raise ValueError("load_state_dict: master_weights do not match this optimizer's params")
        return [t.detach().clone() for t in saved]

    @torch.no_grad()
    def load(self, parsed: list[torch.Tensor]) -> None:
        for m, t in zip(self.master_list(), parsed):
            m.copy_(t)
        self.copy_back()


def _plain_pair(p: torch.Tensor, m: torch.Tensor, device_type: str) -> bool:
    """A (weight, master) pair the raw-pointer passes can take: both contiguous, on one device
    of ``device_type``, the weight without a negative bit."""
    return p.device.type == device_type and m.device == p.device and p.is_contiguous() \
        and m.is_contiguous() and not p.is_neg()


def _resync_native(params: list[torch.Tensor], masters: dict[int, torch.Tensor]
                   ) -> list[torch.Tensor]:
    """Re-sync the CPU (master, weight) pairs of one dtype in one native call each; returns
    the params it could not take (another device, a non-contiguous weight, no fp16 support)."""
    rest: list[torch.Tensor] = []
    for dtype in LOW_PRECISION:
        pairs = [(masters[id(p)], p) for p in params if p.dtype == dtype]
        if not pairs:
            continue
        fits = [(m, p) for m, p in pairs if _plain_pair(p, m, "cpu")]
        code = native.DTYPE_CODES[dtype]
        if not fits or native.resync_masters_cpu(
                [m.data_ptr() for m, _ in fits], [p.data_ptr() for _, p in fits],
                [p.numel() for _, p in fits], code) < 0:
            fits = []
        done = {id(p) for _, p in fits}
        rest.extend(p for _, p in pairs if id(p) not in done)
    return rest


def _resync_triton(params: list[torch.Tensor], masters: dict[int, torch.Tensor]
                   ) -> list[torch.Tensor]:
    """GPU (Triton) pairs: one launch per device and dtype; returns the params left over."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    rest: list[torch.Tensor] = []
    for p in params:
        m = masters[id(p)]
        if _plain_pair(p, m, "cuda") and triton_backend.is_available(p.device):
            groups.setdefault((p.device, p.dtype), []).append(p)
        else:
            rest.append(p)
    for group in groups.values():
        triton_backend.resync_masters([masters[id(p)] for p in group], group)
    return rest
