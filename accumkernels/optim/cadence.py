"""The caller's cadence as the wrapper sees it from its own ``step()``/``flush()`` calls, and the
two mistakes of cadence it warns about, each once per wrapper (:class:`AccumulationWarning`):

* **an LR scheduler stepped on ``step()`` calls that did not step**: the param groups' ``lr``
  (what schedulers write) changed after a ``step()`` that did not end the window and before the
  next ``step()``/``flush()``. Two such changes in one window, or in windows running, warn: a
  scheduler stepped after every ``step()`` makes one after each no-op, while a per-epoch
  scheduler whose epoch ended mid-window makes one in a window between clean ones.
* **windows of one micro-batch where accumulation was asked for** (``accumulation_steps`` > 1):
  three windows running that each ended holding a single micro-batch (``flush()`` after every
  backward, or ``step()`` on a wrapper that learned a boundary-only caller: window.py ``due``).
  A short last window at an epoch end is one such window between full ones.

With ``accumulation_steps=None`` every ``step()`` ends the window: nothing is watched.
"""

from __future__ import annotations

import torch

from accumkernels._util import warn_user

SILENCE = ("To silence it: warnings.filterwarnings('ignore', "
           "category=accumkernels.optim.AccumulationWarning).")
SCHEDULER_ON_NO_OPS = (
    "AccumulatingOptimizer(accumulation_steps={n}): the learning rate changed after step() calls "
    "that did not step (the window was not complete), so an LR scheduler stepped after every "
    "step() call advances {n} times per real optimizer step. Step the scheduler only when "
    "`opt.sync_step` was True before `step()` (`real = opt.sync_step; opt.step(); if real: "
    "scheduler.step()`), or pass accumulation_steps=None when the framework already calls "
    "step() only at window ends (the HF Trainer, Accelerate and Lightning given their own "
    "gradient accumulation steps). " + SILENCE)
SINGLE_MICROBATCH_WINDOWS = (
    "AccumulatingOptimizer(accumulation_steps={n}): {count} windows in a row ended holding a "
    "single micro-batch, so nothing was accumulated. {cause} " + SILENCE)
ENDED_BY_FLUSH = (
    "flush() ended each one: call flush() only to end a short last window (e.g. at an epoch "
    "end); step() after every backward is a no-op until {n} micro-batches are in.")
ENDED_BY_STEP = (
    "step() ended each one, as this wrapper learned that its caller calls step() only at window "
    "ends (its first step() came on a complete window, or a checkpoint it loaded said so): run "
    "{n} backwards per step() (or let the framework accumulate {n} and pass "
    "accumulation_steps=None), or pass accumulation_steps=None if one micro-batch per step is "
    "what you want.")
STRIKES_TO_WARN = 2  # lr changes after no-op step() calls, in one window or in windows running
SINGLES_TO_WARN = 3  # windows in a row of one micro-batch


def _lr_marks(groups: list[dict]) -> list[tuple]:
    """Each group with its ``lr``, and a tensor lr's version: schedulers write it in place, and
    its value cannot be read without a device sync."""
    marks = []
    for g in groups:
        lr = g.get("lr")
        marks.append((g, lr, lr._version if isinstance(lr, torch.Tensor) else None))
    return marks


def _lr_changed(before: list[tuple] | None, groups: list[dict]) -> bool:
    """Whether a group's ``lr`` changed since ``before`` (other groups, e.g. after a load or
    ``add_param_group``: no judgement)."""
    if before is None or len(before) != len(groups):
        return False
    changed = False
    for (group, lr, version), (now_group, now, now_version) in zip(before, _lr_marks(groups)):
        if group is not now_group:
            return False
        if version is None:
            changed |= isinstance(now, torch.Tensor) or now != lr
        else:
            changed |= now is not lr or now_version != version
    return changed


class Cadence:
    """What the last ``step()`` calls did, and the two warnings' counts (see the module)."""

    def __init__(self, accumulation_steps: int | None):
        self._n = accumulation_steps
        self._marks: list[tuple] | None = None  # the groups' lr after the last step()/flush()
        self._after_no_op = False  # the last call was a step() that did not end the window
        self._strikes = 0  # lr changes after no-op step() calls, in the windows running
        self._struck = False  # (one in the current window)
        self._singles = 0  # windows running that ended holding one micro-batch
        self._warned: set[str] = set()

    def end_window(self, step, groups: list[dict], force: bool, sync_step: bool, run) -> None:
        """``step.end_window(force, sync_step, run)`` (``step()``: ``force`` False; ``flush()``:
        True), watching what it did to the window and what changed since the last call."""
        if self._n is None:
            return step.end_window(force, sync_step, run)
        if self._after_no_op and _lr_changed(self._marks, groups):
            self._strikes += 1
            self._struck = True
            if self._strikes >= STRIKES_TO_WARN:
                self._warn("scheduler", SCHEDULER_ON_NO_OPS)
        sizes: list[int] = []

        def counted():
            sizes.append(step.window.micro_steps)  # (after end_window took in what .grad held)
            run()

        try:
            step.end_window(force, sync_step, counted)
        finally:
            self._ended(groups, sizes[0] if sizes else None, force)

    def _ended(self, groups: list[dict], size: int | None, force: bool) -> None:
        """After a ``step()``/``flush()``: ``size`` micro-batches were in the window it ended
        (None: it ended none)."""
        self._marks = _lr_marks(groups)
        self._after_no_op = size is None and not force
        if size is None:
            return
        if not self._struck:
            self._strikes = 0
        self._struck = False
        self._singles = self._singles + 1 if size == 1 and self._n > 1 else 0
        if self._singles >= SINGLES_TO_WARN:
            cause = (ENDED_BY_FLUSH if force else ENDED_BY_STEP).format(n=self._n)
            self._warn("single", SINGLE_MICROBATCH_WINDOWS, count=self._singles, cause=cause)

    def _warn(self, kind: str, template: str, **fields) -> None:
        """``template`` filled in, the first time only: once per wrapper and kind."""
        if kind not in self._warned:
            self._warned.add(kind)
            warn_user(template.format(n=self._n, **fields))
