"""``LaunchPlan``: the cached launch of a ``MasterGradBuffer`` bucket (see the class).

It is the op of ``ops.py`` with the dst side checked once; what the extension's C++ plan
cannot take goes through that op.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import accumkernels.ops.backends as backends
from accumkernels.ops.backends import native
from accumkernels.ops import validate
from accumkernels.ops.validate import fail
from accumkernels.ops.accumulate import (
    accumulate_slots,
    as_list,
    check_backend,
    check_call,
    kernel_flags,
    plain_eager,
    accumulate_,
)

__all__ = ["LaunchPlan"]


class LaunchPlan:
    """``accumulate_`` into a fixed list of dst tensors, checked once; launches check only src.

    The dst side (dtypes, devices, density, no overlap, sizes) is read and checked when the
    plan is built, so a launch reads each src once and makes one call into the extension. Give
    ``keys`` (objects naming each dst, e.g. the params the dst belong to) to launch on a subset
    of the dst in any order. ``owner``, a tensor every dst is a view of (found by itself when the
    dst are views of one ``_base``), lets a launch bump one version counter instead of one per
    dst, and check one ``requires_grad`` (the dst must not be made to require grad on their
    own). The plan holds the dst tensors. Each launch first checks that their memory has not
    moved (one look at the owner's address; without an owner, at each launched dst's): after a
    move (``share_memory_``, a storage resized or swapped) it reads the dst again and launches on
    the new addresses, or raises ValueError, with nothing written, if a dst no longer lies in
    the owner's memory or no longer qualifies. With an owner, a dst view given other memory on
    its own (``view.data = t``) is not seen (the write lands in the owner's memory, which stays
    valid). Without the extension's tensor reader, or for backends other than ``cpu``/``cuda``,
    a launch is a plain ``accumulate_``.

    A dst may have any dense layout (see ``accumulate_``); its src must share it, or, in a plan
    built with ``reorder=True``, is first copied into it (exact: a gradient whose strides are
    not its param's, e.g. after ``p.data = p.data.t()``).

    A launch's ``norm_sq`` (optional, see ``accumulate_``) is a float32 vector of ``norm_size``
    elements (default: one per dst); the squared norm of ``dst[i]`` goes to element
    ``norm_slots[i]`` (default: ``i``), and a launch writes only the elements of the dst it
    writes, the others keep their values.
    """

    def __init__(self, dst: Sequence[torch.Tensor], *, keys: Sequence | None = None,
                 owner: torch.Tensor | None = None, backend: str = "auto",
                 norm_slots: Sequence[int] | None = None, norm_size: int | None = None,
                 reorder: bool = False):
        dst = list(as_list("dst", dst))
        check_backend(backend)
        self.norm_slots, self.norm_size = _plan_norm_slots(len(dst), norm_slots, norm_size)
        if keys is not None:
            keys = list(keys)
            if len(keys) != len(dst) or len({id(k) for k in keys}) != len(keys):
                raise ValueError("LaunchPlan: keys must name each dst once")
        for i, d in enumerate(dst):
            validate.check_plain(f"dst[{i}]", d)
            validate.check_dst(i, d, dst[0].device)
        if owner is None and dst and dst[0]._base is not None \
                and all(d._base is dst[0]._base for d in dst):
            owner = dst[0]._base  # views of one tensor share its version counter
        self.dst, self.keys, self.owner, self.reorder = dst, keys, owner, reorder
        # Non-contiguous dst: the C++ plan holds them as 1-D views in memory order (their src
        # go the same way at each launch).
        self._bent = frozenset(i for i, d in enumerate(dst) if not d.is_contiguous())
        self.device = dst[0].device if dst else torch.device("cpu")
        self.backend = backends.resolve(backend, self.device)
        self._slot_of: dict[int, int] | None = None
        self._native = None
        if native.READER and self.backend in native.KERNELS and dst:
            inference = owner.is_inference() if owner is not None else any(
                d.is_inference() for d in dst)
            flat = [validate.flat(d) if i in self._bent else d for i, d in enumerate(dst)]
            plan = native.make_plan(flat, keys, owner, inference,
                                    None if norm_slots is None else self.norm_slots,
                                    self.norm_size)
            if isinstance(plan, tuple):
                if plan[0] != "slow":
                    validate.raise_failure(plan, dst, dst, None, None)
            else:
                self._native = plan

    def __len__(self) -> int:
        return len(self.dst)

    def __call__(self, src: Sequence[torch.Tensor], scale: float | torch.Tensor = 1.0, *,
                 keys: Sequence | None = None, overwrite: bool = False,
                 found_inf: torch.Tensor | None = None,
                 norm_sq: torch.Tensor | None = None) -> None:
        """``dst_k = (0 if overwrite else dst_k) + scale * src[k]`` where ``dst_k`` is the dst of
        ``keys[k]`` (without keys: ``dst[k]``, and src covers every dst); with ``norm_sq``, its
        element ``norm_slots[j]`` = the squared norm of each written ``dst[j]``. A key that is not
        one of the plan's raises KeyError (before anything is written)."""
        src, value, scale_tensor = check_call(src, overwrite, scale, found_inf, norm_sq)
        if keys is not None and len(keys) != len(src):
            fail(ValueError, f"dst has {len(keys)} tensors but src has {len(src)}")
        if keys is None and len(src) != len(self.dst):
            fail(ValueError, f"dst has {len(self.dst)} tensors but src has {len(src)}")
        if self._native is not None and plain_eager():
            given = self._native_src(keys, src) if self._bent else src
            failed = native.run_plan(self._native, keys, given, value, scale_tensor, overwrite,
                                     found_inf, kernel_flags(), self.backend, self.device, norm_sq)
            if failed is not None and failed[0] == "pair" and not self._bent:
                given = self._native_src(keys, src)  # a src in another layout
                if given is not src:
                    failed = native.run_plan(self._native, keys, given, value, scale_tensor,
                                             overwrite, found_inf, kernel_flags(), self.backend,
                                             self.device, norm_sq)
            if failed is None:
                return
            if failed[0] == "plan_stale":
                self._raise_stale(failed)
            if failed[0] not in ("slow", "not_member"):
                validate.raise_failure(failed, self._select(keys), src, scale_tensor, found_inf,
                                       norm_sq, self.norm_size)
        if self.reorder:
            dst = self._select(keys)
            src = [validate.in_layout_of(d, x) for d, x in zip(dst, src)]
        if norm_sq is None:
            accumulate_(self._select(keys), src, scale, overwrite=overwrite, found_inf=found_inf,
                        backend=self.backend)
            return
        positions = self._positions(keys)
        if self.dst:
            validate.check_norm_sq(norm_sq, self.norm_size, self.device)
        accumulate_slots([self.dst[i] for i in positions], src, scale, overwrite, found_inf,
                          norm_sq, [self.norm_slots[i] for i in positions], self.backend)

    def _native_src(self, keys: Sequence | None, src: Sequence) -> Sequence:
        """``src`` as the C++ plan takes it: in its dst's layout (``reorder``) and, for a
        non-contiguous dst, as a 1-D view in memory order; ``src`` itself if nothing changes.
        A src that cannot be paired with its dst is left for the checks to name."""
        out = None
        for k, i in enumerate(self._positions(keys)):
            d, x = self.dst[i], src[k]
            if i not in self._bent and (not isinstance(x, torch.Tensor) or x.is_contiguous()):
                continue
            if self.reorder:
                x = validate.in_layout_of(d, x)
            if i in self._bent and isinstance(x, torch.Tensor) and validate.same_layout(d, x):
                x = validate.flat(x)
            if x is not src[k]:
                out = list(src) if out is None else out
                out[k] = x
        return src if out is None else out

    def _raise_stale(self, failed: tuple) -> None:
        """A dst moved since the plan read it and, read again, breaks a rule: nothing written."""
        _, i, why = failed
        if why == 1:
            validate.check_dst(i, self.dst[i], self.device)
        reason = {0: "no longer lies in the memory of the plan's owner (it is not a view of it "
                     "any more)",
                  2: "now overlaps another dst in memory"}.get(why, "cannot be used any more")
        fail(ValueError, f"LaunchPlan: dst[{i}] moved since the plan was built and {reason}; "
             "nothing was written; build a new plan")

    def _select(self, keys: Sequence | None) -> list[torch.Tensor]:
        return self.dst if keys is None else [self.dst[i] for i in self._positions(keys)]

    def _positions(self, keys: Sequence | None) -> list[int]:
        """The dst index of each key (without keys: every dst)."""
        if keys is None:
            return list(range(len(self.dst)))
        if self._slot_of is None:
            self._slot_of = {id(k): i for i, k in enumerate(self.keys or ())}
        try:
            return [self._slot_of[id(k)] for k in keys]
        except KeyError:
            raise KeyError("LaunchPlan: a key is not one of this plan's keys") from None


def _plan_norm_slots(n: int, slots: Sequence[int] | None,
                     size: int | None) -> tuple[list[int], int]:
    """A plan's norm_sq layout: (the element of each dst, the elements), checked."""
    if size is None:
        size = n
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"LaunchPlan: norm_size must be an int >= 0, got {size!r}")
    if slots is None:
        if size != n:
            raise ValueError("LaunchPlan: a norm_size other than len(dst) needs norm_slots")
        return list(range(n)), size
    slots = list(slots)
    if len(slots) != n or any(isinstance(s, bool) or not isinstance(s, int) for s in slots) \
            or len(set(slots)) != n or not all(0 <= s < size for s in slots):
        raise ValueError(f"LaunchPlan: norm_slots must give each dst a distinct int in "
                         f"[0, {size})")
    return slots, size
