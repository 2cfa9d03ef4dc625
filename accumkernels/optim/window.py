"""The accumulation window: what has been summed since the last real step, and what it means.

The window is the only writer of its bookkeeping (counts, weights, which params it holds, the
divisor its storage is scaled by) and of the storage's scale: every other room asks it through
the methods below, so a rule about the window lives in one place.
"""

from __future__ import annotations

import torch

from accumkernels.optim.config import Config

_KEYS = ("micro_steps", "kept", "touched", "weights", "dropped", "divisor", "boundary_only")


class Window:
    """Counts, normalisation and cadence of the current window over its fp32 ``storage``.

    * ``micro_steps``: micro-batches in the window (dropped ones included);
    * ``kept``: those whose gradients were kept (``nonfinite="skip_microbatch"`` drops some);
    * touched params (:meth:`touch`, :meth:`holds`): those whose fp32 view holds data of this
      window. The first write of a window overwrites a view (no zeroing pass), so only these
      views are valid;
    * ``weights``: what ``add_weight`` reported, in order; ``dropped``: indices of dropped
      micro-batches (their weights do not count);
    * ``divisor``: the storage holds ``sum(g) / divisor`` (1/N is fused up front for
      ``reduction="mean"`` with a known N that is a power of two, where it is exact, or any N
      where the layout normalises only at the step: FSDP2);
    * ``boundary_only``: learned from the ``step()`` calls the wrapper receives, kept across
      windows: None until the first ``step()`` on a non-empty window; True if that one came
      on a complete window (Trainer-style caller: it also ends a short last window with
      ``step()``); False for good once a ``step()`` comes on an incomplete window without
      ending it (the caller steps every micro-batch).

    * ``carried_only``: after a real step the window keeps what the step used (as native
      ``.grad`` keeps it until a clear): the views stay touched, so the next backward adds to
      them, and a clear (``zero_grad``, ``model.zero_grad()``, ``p.grad = None``) drops them.
      Until something new arrives the window counts as empty (a ``step()`` then does nothing).
      ``carry_scale``: the factor the storage still owes the step's gradients (a fused master
      step that divided by its ``grad_scale`` without writing back; for ``"mean"`` the units
      of the new window, so its normalisation leaves them as the step used them), applied
      before the first write of the next window (:meth:`first_write`).

    ``storage`` is a MasterGradBuffer (flat fp32 buffers, one per device) or the FSDP2 room's
    sharded window: anything with ``buffers`` (device -> flat fp32 tensor) and ``view(p)``.
    """

    def __init__(self, config: Config, storage, *, fuse_inexact_mean: bool = False):
        self._n = config.accumulation_steps
        self._fuse_inexact_mean = fuse_inexact_mean
        self._mean = config.reduction == "mean"
        self._reduction = config.reduction
        self._weighted = config.weighted
        self.storage = storage
        self._fuse_mean = True  # (off for good once compiled autograd met the window)
        self.boundary_only: bool | None = None
        self.reset()

    def reset(self) -> None:
        self.micro_steps = 0
        self.kept = 0
        self._touched: set[int] = set()
        self.weights: list[float] = []
        self.dropped: set[int] = set()
        # "mean" with N given fuses 1/N into each add only where it is exact (N a power of two):
        # any other 1/N rounds every term, and a sum that cancels exactly natively (g + -g)
        # would leave that rounding where native has 0; then the sum is divided once, when the
        # N-th backward is in. (A layout that normalises only at the step fuses any 1/N.)
        n = self._n
        fuse = self._mean and n and self._fuse_mean and (n & (n - 1) == 0
                                                         or self._fuse_inexact_mean)
        self.divisor = float(n) if fuse else 1.0
        self.carried_only = False
        self.carry_scale: torch.Tensor | float | None = None

    def carry(self, scale: torch.Tensor | float | None = None) -> None:
        """A real step ended the window: a new one begins that holds what the step used (the
        storage times ``scale``), to be added to unless it is cleared first (native ``.grad``)."""
        touched = self._touched
        self.reset()
        self._touched = touched
        self.carried_only = bool(touched)
        owed = self._carried_units() if touched else 1.0
        if owed != 1.0:
            scale = owed if scale is None else scale * owed
        self.carry_scale = scale if touched else None

    def _carried_units(self) -> float:
        """What the carried gradients are multiplied by to sit in the new window's units: the
        step that ends it divides the whole storage by its target over the divisor, and the
        carried part must come out of that unchanged (``"mean"`` with N given: N / divisor,
        1 where 1/N is fused; the other targets are not known before that step)."""
        if self._mean and self._n:
            return float(self._n) / self.divisor
        return 1.0

    def settle_carry(self) -> None:
        """Apply the carried gradients' pending scale (before anything writes the storage)."""
        scale, self.carry_scale = self.carry_scale, None
        if scale is not None:
            torch._foreach_mul_(list(self.storage.buffers.values()), scale)

    # -- what it holds ---------------------------------------------------------------------------
    @property
    def empty(self) -> bool:
        """Nothing arrived since the last step or clear (carried gradients alone: empty)."""
        return self.micro_steps == 0 and (not self._touched or self.carried_only)

    @property
    def complete(self) -> bool:
        """N micro-batches (or more) are in the window."""
        return self._n is not None and self.micro_steps >= self._n

    @property
    def length_given(self) -> bool:
        """Whether N (``accumulation_steps``) is known: the window is complete at N backwards."""
        return self._n is not None

    def complete_with(self, more: int) -> bool:
        """Whether ``more`` backwards not counted yet (left in ``.grad``) complete the window."""
        return self._n is not None and self.micro_steps + more >= self._n

    def step_ends_it(self, more: int = 0) -> bool:
        """Whether ``step()`` now ends the window (N None, or N in with ``more`` uncounted)."""
        return self._n is None or self.micro_steps + more >= self._n

    def completing(self) -> bool:
        """Whether the backward now running (not counted yet) is the window's N-th."""
        return self._n is not None and self.micro_steps == self._n - 1

    def holds(self, p: torch.Tensor) -> bool:
        """Whether p's view holds data of this window."""
        return id(p) in self._touched

    def held(self, params: list[torch.Tensor]) -> list[bool]:
        return [id(p) in self._touched for p in params]

    def touch(self, params) -> None:
        """These params' views now hold data of this window."""
        self._touched.update(id(p) for p in params)
        self.carried_only = False

    def keep_only(self, params: list[torch.Tensor], keep: list[bool]) -> None:
        """The params that hold data after a reduction over ranks (some rank had a gradient)."""
        self._touched = {id(p) for p, k in zip(params, keep) if k}

    def first_write(self, p: torch.Tensor) -> bool:
        """Whether a write of p's gradient now overwrites its view (its first of the window);
        asked before every write, so the carried gradients' scale is settled here."""
        if self.carry_scale is not None:
            self.settle_carry()
        return id(p) not in self._touched

    def first_writes(self, ids: list[int]) -> bool | None:
        """:meth:`first_write` for the params of ``ids`` (their ``id``) at once: True if it is
        the first write of each, False if of none, None if of some (one settling of the carried
        scale)."""
        if self.carry_scale is not None:
            self.settle_carry()
        touched = self._touched
        if not touched or touched.isdisjoint(ids):
            return True
        return False if touched.issuperset(ids) else None

    def holds_all(self, ids: list[int]) -> bool:
        """Whether every param of ``ids`` (their ``id``) holds data of this window."""
        return self._touched.issuperset(ids)

    def touch_ids(self, ids: list[int]) -> None:
        """:meth:`touch` by the params' ``id``."""
        self._touched.update(ids)
        self.carried_only = False

    # -- micro-batches and weights ---------------------------------------------------------------
    def add_microbatch(self, kept: bool) -> None:
        if kept:
            self.kept += 1
        else:
            self.dropped.add(self.micro_steps)
        self.micro_steps += 1
        self.carried_only = False

    def add_weight(self, value: float) -> None:
        self.weights.append(value)

    def weights_pending(self) -> bool:
        """``weighted``: a micro-batch of the window has no weight yet (reported after it)."""
        return self._weighted and len(self.weights) < self.micro_steps

    def local_weight(self) -> float:
        return sum(w for i, w in enumerate(self.weights) if i not in self.dropped)

    def prescale(self, loss_scale: float) -> float:
        """The scale fused into each launch: unscale the loss, 1/N for 'mean' with a known N
        (a power of two)."""
        return (1.0 / loss_scale) / self.divisor

    def unfuse_mean(self) -> None:
        """Fuse no 1/N into the adds from now on, in this window and the next ones (compiled
        autograd adds gradients into the views unscaled): the storage is rescaled to hold the
        plain sum (exact: a fused 1/N is a power of two) and divided once when the N-th
        backward is in."""
        self._fuse_mean = False
        self.normalise(1.0)

    def keeps_on_clear(self) -> bool:
        """A clear now keeps the window: N given and the window still filling."""
        return self.micro_steps > 0 and self._n is not None and not self.complete

    def cleared(self, cleared: list[torch.Tensor]) -> bool:
        """Params whose ``.grad`` was cleared from outside, on the rule of ``zero_grad()``: a
        window still filling keeps them; otherwise their gradients leave the window. Returns
        True when the whole window went (the caller resets the rest of its state)."""
        cleared = [p for p in cleared if id(p) in self._touched]
        if not cleared or self.keeps_on_clear():
            return False
        if len(cleared) == len(self._touched):
            return True
        self._touched.difference_update(id(p) for p in cleared)
        return False

    # -- the cadence -----------------------------------------------------------------------------
    def due(self, force: bool) -> bool:
        """Whether a ``step()`` now ends the window (learning the caller's cadence)."""
        if force or self._n is None or self.complete:
            if self.complete and self.boundary_only is None:
                self.boundary_only = True  # its first step() came on a complete window
            return True
        if self.boundary_only is True:
            return True  # a Trainer-style caller ends a short last window with step()
        self.boundary_only = False  # this caller steps before windows are complete
        return False

    def needs_weights(self, force: bool, sync_step: bool) -> bool:
        """``reduction="weighted"`` at a step with kept micro-batches but no weight reported."""
        return self._weighted and bool(self.kept) and self.local_weight() <= 0 \
            and (force or sync_step or bool(self.boundary_only))

    # -- the storage's scale ---------------------------------------------------------------------
    def target_divisor(self, totals=None) -> float | None:
        """What the gradient sum is divided by (over all ranks when ``totals`` is given);
        None for ``weighted`` without a positive weight."""
        if self._reduction == "sum":  # data parallel: the average over ranks, like DDP
            target = float(totals.world) if totals else 1.0
        elif self._reduction == "mean":
            target = float(totals.kept if totals else self.kept)
        else:
            target = totals.weight if totals else self.local_weight()
            if not target > 0:
                return None
        if totals is not None and totals.averaged:  # DDP averaged (not summed) the window
            target /= totals.world
        return target

    def normalised_outside(self, target: float) -> None:
        """Someone else divided the storage (the inner optimizer wrote the divided gradients
        back): it holds ``sum(g) / target`` now."""
        self.divisor = target

    def rebase(self, storage) -> None:
        """The same params' window in new storage (rebuilt for more params, or after a move)."""
        self.storage = storage

    def normalise(self, target: float | None) -> None:
        """Rescale the storage so it holds ``sum(g) / target``."""
        if target is None or target == self.divisor:
            return
        torch._foreach_mul_(list(self.storage.buffers.values()), self.divisor / target)
        self.divisor = target

    def zero_untouched(self, params: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        """Views without data of this window hold an earlier one's: zero them, so norms,
        reductions and ``p.main_grad`` see 0 (the first write of a window skips this pass)."""
        touched = self._touched
        if len(touched) >= len(params) and touched.issuperset(map(id, params)):
            return  # (every view holds data of this window)
        stale = [v for p, v in zip(params, views) if id(p) not in touched]
        if stale:
            torch._foreach_zero_(stale)

    def seal(self, params: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        """The window is complete (N known): zero what it did not touch, normalise it."""
        self.zero_untouched(params, views)
        self.normalise(self.target_divisor())

    def zero_held(self, params: list[torch.Tensor], views: list[torch.Tensor],
                  shown: list[bool]) -> None:
        """``zero_grad(set_to_none=False)`` discarding the window: shown views become zeros
        that the next step still acts on, as native zero grads are."""
        for p, view, is_shown in zip(params, views, shown):
            if is_shown:
                view.zero_()
                self._touched.add(id(p))

    # -- checkpoint ------------------------------------------------------------------------------
    def state_dict(self, params: list) -> dict:
        return {
            "micro_steps": self.micro_steps,
            "kept": self.kept,
            "touched": [i for i, p in enumerate(params) if id(p) in self._touched],
            "weights": list(self.weights),
            "dropped": sorted(self.dropped),
            "divisor": self.divisor,
            "boundary_only": self.boundary_only,
        }

    def load(self, parsed: dict) -> None:
        for key, value in parsed.items():
            setattr(self, key, value)


def parse_window(state: object, params: list) -> dict:
    """Check a saved window (raises ValueError) and return it in the form ``Window.load``
    takes."""
    if not isinstance(state, dict):
        raise ValueError("load_state_dict: 'window' must be a dict")
    # (empty lists of weights and dropped micro-batches vanish in some tools' flattening)
    state = {"weights": [], "dropped": [], **state}
    missing = [k for k in _KEYS if k not in state]
    if missing:
        raise ValueError(f"load_state_dict: the saved window lacks {missing}")
    try:
        touched = [int(i) for i in state["touched"]]
        parsed = {
            "micro_steps": int(state["micro_steps"]), "kept": int(state["kept"]),
            "weights": [float(w) for w in state["weights"]],
            "dropped": {int(i) for i in state["dropped"]},
            "divisor": float(state["divisor"]),
            "boundary_only": None if state["boundary_only"] is None
            else bool(state["boundary_only"]),
        }
    except (TypeError, ValueError) as exc:
        raise ValueError(f"load_state_dict: malformed window ({exc})") from None
    if any(not 0 <= i < len(params) for i in touched):
        raise ValueError("load_state_dict: the saved window names params this optimizer lacks")
    if not 0 <= parsed["kept"] <= parsed["micro_steps"] or not parsed["divisor"] > 0:
        raise ValueError("load_state_dict: inconsistent window counts")
    parsed["_touched"] = {id(params[i]) for i in touched}
    return parsed
