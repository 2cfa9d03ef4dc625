"""``torch.distributed.pipelining``: one line per job so every schedule accumulates in fp32.

Every pipeline schedule runs each micro-batch's backward stage by stage; the zero-bubble ones
(InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, custom action lists with ``I``/``W`` actions)
split it into an input pass and a weight pass, and the weight pass computes the weight gradients
with ``torch.autograd.grad`` and assigns or adds them to ``.grad`` itself, so AccumulateGrad (and
the wrapper's hooks on it) never runs. After::

    accumkernels.integrations.pipelining.accumulate_weight_passes(stages)  # this rank's stages

every weight pass runs inside the owning ``AccumulatingOptimizer.weight_pass()``: its gradients
are accumulated in fp32 with the fused kernel, scaled (loss scale, ``mean``), checked and counted
as one micro-batch, exactly as a full backward's. The line also marks each stage's params with
the stage's index, so a wrapper given a ``process_group`` that spans different stages (rather
than this stage's data-parallel replicas) is refused before it broadcasts anything, even where
the stages' shapes agree: call it right after building the stages, before the wrappers.
Schedules without a split backward (GPipe, 1F1B, Interleaved1F1B, LoopedBFS) need only that
guard; the line is the same for all.

``clip_across_stages(optimizers, group=pp_group)`` makes ``max_grad_norm`` clip by the norm of the
whole pipeline's gradients (every stage on every rank of the pipeline group, as torchtitan
clips), and a non-finite gradient on any stage skip (or raise) on every stage.

pipelining is imported by the caller, not here.
"""

from __future__ import annotations

import torch.distributed as dist

from accumkernels.optim.sync.reducer import PIPELINE_STAGE_ATTR
from accumkernels.slot import get_slot

__all__ = ["accumulate_weight_passes", "clip_across_stages"]

_PATCHED = "_accumkernels_weight_pass"


def _owner(stage):
    """The live AccumulatingOptimizer managing the stage's params (looked up at each call:
    the wrapper may be built after this line)."""
    for p in stage.submod.parameters():
        slot = get_slot(p)
        if slot is not None and hasattr(slot.owner, "weight_pass"):
            return slot.owner
    return None


def _ranks(group) -> set[int]:
    return set(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))


def _check_owner_group(stage) -> None:
    """A wrapper built before this line with a ``process_group`` holding another rank of this
    stage's pipeline group reduced over different stages (and broadcast one's weights over the
    others' at its construction): say so instead of training on."""
    owner = _owner(stage)
    group = owner.process_group if owner is not None else None
    if group is None or not dist.is_initialized():
        return
    shared = _ranks(group) & _ranks(stage.group)
    if len(shared) > 1:
        raise ValueError(
            f"accumulate_weight_passes: the AccumulatingOptimizer of pipeline stage "
            f"{stage.stage_index} was built with a process_group that holds ranks "
            f"{sorted(shared)} of this pipeline, i.e. different stages, not replicas of this "
            "one; its construction broadcast one stage's weights over the others'. Rebuild the "
            "model and the wrapper with process_group=<this stage's data-parallel group> (or "
            "independent_ranks=True without data parallelism), and call "
            "accumulate_weight_passes(stages) before building the wrappers")


def accumulate_weight_passes(*stages) -> None:
    """Run each stage's weight pass (``backward_weight_one_chunk``) inside its wrapper's
    ``weight_pass()``, and mark the stage's params with the stage's index (the wrapper's
    ``process_group`` check tells stages apart by it). Takes stages or lists of them;
    idempotent; a stage whose params no wrapper manages runs as before."""
    for stage in stages:
        if isinstance(stage, (list, tuple)):
            accumulate_weight_passes(*stage)
            continue
        if not hasattr(stage, "backward_weight_one_chunk") or not hasattr(stage, "submod"):
            raise TypeError(f"accumulate_weight_passes expects pipeline stages "
                            f"(torch.distributed.pipelining.PipelineStage), got "
                            f"{type(stage).__name__}")
        for p in stage.submod.parameters():
            setattr(p, PIPELINE_STAGE_ATTR, (stage.stage_index, stage.num_stages))
        _check_owner_group(stage)
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


def clip_across_stages(optimizers, group=None) -> None:
    """The wrappers of this rank's stages (``optimizers``, one per stage) measure the norm of the
    whole pipeline: ``max_grad_norm`` clips by the 2-norm of every stage's window on every rank of
    the pipeline ``group`` (the stages' ``group``; None: the default group), and
    ``last_grad_norm`` reports it; a non-finite gradient on any stage makes every stage skip its
    step (``nonfinite="skip_step"``) or raise. Each window is reduced over its data-parallel
    ranks first (``process_group`` or DDP), so the norm is the one the step uses.

    Call it once on every rank of the pipeline, with the same number of wrappers per rank, and
    step all of them at every window end (each step takes part in one all-reduce of a float
    over ``group`` per window)."""
    from accumkernels.optim.optimizer import AccumulatingOptimizer
    from accumkernels.optim.sync.stage_norm import StageNorm

    optimizers = list(optimizers)
    for opt in optimizers:
        if not isinstance(opt, AccumulatingOptimizer):
            raise TypeError(f"clip_across_stages expects the AccumulatingOptimizers of this "
                            f"rank's stages, got {type(opt).__name__}")
    if not dist.is_initialized():
        raise ValueError("clip_across_stages needs torch.distributed (the pipeline group)")
    norm = StageNorm(group)
    for opt in optimizers:
        opt.join_stage_norm(norm)
