"""The intake's launches: gradients moved into the fp32 window with the fused kernel, bucket by
bucket, and the bucket bookkeeping the per-param hooks share (``HookState.pending``/``flushed``).

The intake (intake.py), the front moves of params with the user's hooks (user_hooks.py) and the
gradients left in ``.grad`` (unmoved.py) all move through one :class:`Mover`; it tells the sync
when a bucket is in (DDP and ``process_group`` reduce it while the backward goes on).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from accumkernels.buffer import Bucket, MasterGradBuffer


class HookState:
    """What the per-param hooks (csrc/grad_hooks.cpp, hooks.py) share with the intake: the
    objects are updated in place and never replaced, since the C hooks hold them.

    * ``fast``: the hooks' fast case applies to the running backward: the weakref to its final
      callback (alive while it runs), else None;
    * ``views``: each param's fp32 view; ``showable``: what ``.grad`` shows of it (the view, or
      None for a bf16/fp16 param on a torch without ``grad_dtype``);
    * ``hidden``: param indices whose view a pre-hook hid and no post hook showed again;
    * ``pending``: bucket index -> {param index: its gradient of this backward, held until
      moved}; ``flushed``: bucket index -> params of it moved early.
    """

    __slots__ = ("fast", "flushed", "hidden", "pending", "showable", "views")

    def __init__(self, views: list, showable: list):
        self.fast = None
        self.views, self.showable = views, showable
        self.hidden: set[int] = set()
        self.pending: dict[int, dict[int, torch.Tensor]] = {}
        self.flushed: dict[int, int] = {}


class Mover:
    """Fused launches into the window for one wrapper's managed ``params``."""

    def __init__(self, parts, params: list[torch.Tensor], buffer: MasterGradBuffer,
                 state: HookState, refuse_layout: Callable[[int, torch.Tensor], None]):
        self.config, self.window = parts.config, parts.window
        self.scaler, self.nonfinite, self._parts = parts.scaler, parts.nonfinite, parts
        self.params, self.state, self.refuse_layout = params, state, refuse_layout
        self.index = {id(p): i for i, p in enumerate(params)}
        self.rebase(buffer)

    @property
    def sync(self):
        """The window's synchronisation (it changes once when DDP is met)."""
        return self._parts.sync

    def rebase(self, buffer: MasterGradBuffer) -> None:
        """A new buffer of the same params (after they moved device)."""
        self.buffer = buffer
        self.bucket_index = [buffer.bucket_of(p).index for p in self.params]
        self.bucket_len = [len(b.params) for b in buffer.buckets]
        self._bucket_ids = [[id(p) for p in b.params] for b in buffer.buckets]

    def launch_held(self, index: int, pend: dict[int, torch.Tensor]) -> None:
        """Move the gradients held for bucket ``index`` (``pend``: param index -> gradient)."""
        params = self.params
        whole = len(pend) == self.bucket_len[index]
        try:
            self.launch(self.buffer.buckets[index], [params[i] for i in pend],
                        list(pend.values()), self._bucket_ids[index] if whole else None)
        except (TypeError, ValueError, RuntimeError):
            for i, g in pend.items():  # (the hooks' fast case leaves the layout to the launch)
                if g.layout is not torch.strided:
                    self.refuse_layout(i, g)
            raise

    def launch(self, bucket: Bucket, params: list[torch.Tensor],
               grads: list[torch.Tensor], ids: list[int] | None = None) -> None:
        """Move ``grads`` of ``params`` (of one bucket) into the window."""
        if not params:
            return
        self.move(params, grads, ids)
        self.bucket_moved(bucket)

    def bucket_moved(self, bucket: Bucket) -> None:
        self.sync.bucket_moved(bucket, self.window.completing())

    def flush(self, params: list[torch.Tensor]) -> bool:
        """Move the held gradients of ``params`` before their buckets are complete; whether any
        was held."""
        state, wanted, moved = self.state, {self.index.get(id(p)) for p in params}, False
        for index in list(state.pending):
            pend = state.pending[index]
            take = {i: g for i, g in pend.items() if i in wanted}
            if not take:
                continue
            for i in take:
                del pend[i]
            if not pend:
                del state.pending[index]
            state.flushed[index] = state.flushed.get(index, 0) + len(take)
            self.launch_held(index, take)
            moved = True
        return moved

    def hold(self, i: int, g: torch.Tensor, launch: bool
             ) -> tuple[int, dict[int, torch.Tensor]] | None:
        """Hold param i's gradient of this backward until its bucket is complete; (bucket,
        held gradients) when it is and ``launch`` (else the end of the backward moves them)."""
        index = self.bucket_index[i]
        pending = self.state.pending
        pend = pending.get(index)
        if pend is None:
            pend = pending[index] = {}
        held = pend.get(i)
        if held is not None:  # a second gradient for p in this backward (reentrant
            held.add_(g)  # checkpointing): added in p's dtype, as AccumulateGrad adds it
            return None
        pend[i] = g
        if not launch or len(pend) + self.state.flushed.get(index, 0) != self.bucket_len[index]:
            return None
        del pending[index]
        return index, pend

    def counted_early(self, i: int) -> dict[int, torch.Tensor] | None:
        """Param i was moved ahead of its bucket (a front move): count it toward the bucket;
        the bucket's held gradients when that completes it ({} if none are held), else None."""
        state, index = self.state, self.bucket_index[i]
        flushed = state.flushed[index] = state.flushed.get(index, 0) + 1
        pend = state.pending.get(index, {})
        if len(pend) + flushed != self.bucket_len[index]:
            return None
        state.pending.pop(index, None)
        return pend

    def move(self, params: list[torch.Tensor], grads: list[torch.Tensor],
             ids: list[int] | None = None) -> None:
        """Move ``grads`` of ``params`` into their views (``ids``: the params' ``id``, if
        known): one launch when all are first writes of the window, or none is (the usual
        case), else one of each."""
        window = self.window
        ids = [id(p) for p in params] if ids is None else ids
        first = window.first_writes(ids)
        if first is None:
            touched = [window.holds(p) for p in params]
            groups = [([p for p, t in zip(params, touched) if t is not fresh],
                       [g for g, t in zip(grads, touched) if t is not fresh], fresh)
                      for fresh in (True, False)]
        else:
            groups = [(params, grads, first)]
        for group_params, group_grads, overwrite in groups:
            self.buffer.accumulate(group_params, group_grads,
                                   window.prescale(self.scaler.scale), overwrite=overwrite,
                                   found_inf=self.nonfinite.launch_flag(),
                                   backend=self.config.backend)
        window.touch_ids(ids)

    def absorb(self, p: torch.Tensor, g: torch.Tensor) -> None:
        """``g`` (assigned from outside) is p's window now."""
        self.window.settle_carry()  # (before a write: the other views' carried gradients)
        with torch.no_grad():  # same units as the view it replaced
            self.buffer.view(p).copy_(g)
        self.window.touch([p])
