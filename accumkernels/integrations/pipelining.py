"""``torch.distributed.pipelining``: one line so every stage's weight pass is one micro-batch.

Zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, custom action lists
with ``W`` actions) split a stage's backward into an input pass and a weight pass; the weight
pass computes the weight gradients with ``torch.autograd.grad`` and assigns or adds them to
``.grad`` itself, so AccumulateGrad (and the wrapper's hooks on it) never runs. After::

    accumkernels.integrations.pipelining.accumulate_weight_passes(stage)  # each of your stages

every weight pass runs inside the owning ``AccumulatingOptimizer.weight_pass()``: its gradients
are accumulated in fp32 with the fused kernel, scaled (loss scale, ``mean``), checked and counted
as one micro-batch, exactly as a full backward's. Schedules without a split backward (GPipe,
1F1B, Interleaved1F1B, LoopedBFS) need nothing. pipelining is imported by the caller, not here.
"""

from __future__ import annotations

from accumkernels.slot import get_slot

__all__ = ["accumulate_weight_passes"]

_PATCHED = "_accumkernels_weight_pass"


def _owner(stage):
    """The live AccumulatingOptimizer managing the stage's params (looked up at each call:
    the wrapper may be built after this line)."""
    for p in stage.submod.parameters():
        slot = get_slot(p)
        if slot is not None and hasattr(slot.owner, "weight_pass"):
            return slot.owner
    return None


def accumulate_weight_passes(*stages) -> None:
    """Run each stage's weight pass (``backward_weight_one_chunk``) inside its wrapper's
    ``weight_pass()``. Idempotent; a stage whose params no wrapper manages runs as before."""
    for stage in stages:
        if isinstance(stage, (list, tuple)):
            accumulate_weight_passes(*stage)
            continue
        if not hasattr(stage, "backward_weight_one_chunk") or not hasattr(stage, "submod"):
            raise TypeError(f"accumulate_weight_passes expects pipeline stages "
                            f"(torch.distributed.pipelining.PipelineStage), got "
                            f"{type(stage).__name__}")
        if getattr(stage, _PATCHED, False):
            continue
        original = stage.backward_weight_one_chunk

        def backward_weight_one_chunk(*args, _original=original, _stage=stage, **kwargs):
            owner = _owner(_stage)
            if owner is None:
                return _original(*args, **kwargs)
            with owner.weight_pass():
                return _original(*args, **kwargs)

        stage.backward_weight_one_chunk = backward_weight_one_chunk
        setattr(stage, _PATCHED, True)
