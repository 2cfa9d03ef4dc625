"""Pipeline parallelism (``torch.distributed.pipelining``) with AccumulatingOptimizer: one wrapper
per stage, any schedule, optionally data parallel across pipeline replicas (2-D).

    python examples/pipeline.py --world-size 2 --schedule ZBVZeroBubble --steps 3
    python examples/pipeline.py --world-size 4 --dp 2 --schedule 1F1B   # 2 stages x 2 replicas
    torchrun --nproc-per-node 8 examples/pipeline.py --dp 2 --schedule InterleavedZeroBubble

Run directly it spawns its ranks on CPU (gloo, a FileStore in a temporary directory); under
``torchrun`` each process is one rank. What differs from a native pipelining loop:

* ``accumulate_weight_passes(stages)`` right after building this rank's stages, before the
  wrappers: the zero-bubble schedules (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV, custom
  action lists with ``I``/``W``) compute weight gradients with ``torch.autograd.grad`` and
  write ``.grad`` themselves; the line makes each such weight pass one micro-batch of the
  stage's fp32 window. It also marks the stages, so a ``process_group`` spanning different
  stages is refused before it could broadcast one stage's weights over another's;
* one ``AccumulatingOptimizer`` per stage, with ``independent_ranks=True`` (each rank holds its
  own stages) or, with data parallelism, ``process_group=<this stage's data-parallel group>``;
  ``accumulation_steps`` = the schedule's ``n_microbatches``. The schedule's own
  ``scale_grads`` divides the window by the micro-batch count (``reduction="sum"``);
* ``clip_across_stages(opts, group=pp_group)``: ``max_grad_norm`` clips by the norm of the whole
  pipeline (every stage on every rank of the pipeline group, as torchtitan clips), and a
  non-finite gradient anywhere skips the step on every stage;
* ``--bf16``: bf16 params; the wrapper keeps fp32 master weights and sums every micro-batch's
  gradients in fp32.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from _ranks import assert_replicas_agree, launch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

import accumkernels
from accumkernels.integrations.pipelining import accumulate_weight_passes, clip_across_stages

N_MB = 4  # micro-batches per schedule step (the window)
MICRO = 8  # samples per micro-batch
LAYERS = 8


def stage_layout(schedule: str, pp_rank: int, pp_size: int) -> tuple[list[int], int]:
    """(this rank's stage indices, number of stages) for the schedule's placement."""
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        return [pp_rank], pp_size
    num = 2 * pp_size
    if schedule.lower() in ("zbvzerobubble", "dualpipev"):  # a V: rank r holds r and 2P-1-r
        return [pp_rank, num - 1 - pp_rank], num
    return [pp_rank, pp_rank + pp_size], num  # looped: round-robin


def stage_module(index: int, num_stages: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)  # the same model on every rank; each keeps its stages' layers
    layers = [torch.nn.Linear(32, 32) for _ in range(LAYERS - 1)] + [torch.nn.Linear(32, 1)]
    per = LAYERS // num_stages
    mods: list[torch.nn.Module] = []
    for k in range(index * per, (index + 1) * per):
        mods.append(layers[k])
        if k < LAYERS - 1:
            mods.append(torch.nn.GELU())
    return torch.nn.Sequential(*mods).to(dtype)


def train(rank: int, world_size: int, device: torch.device, args) -> None:
    dp = args.dp
    pp_size = world_size // dp
    pp_rank, dp_rank = rank % pp_size, rank // pp_size
    # every rank creates every group, in the same order
    pp_groups = [dist.new_group([d * pp_size + p for p in range(pp_size)]) for d in range(dp)]
    dp_groups = [dist.new_group([d * pp_size + p for d in range(dp)]) for p in range(pp_size)]
    pp_group, dp_group = pp_groups[dp_rank], dp_groups[pp_rank]

    dtype = torch.bfloat16 if args.bf16 else torch.float32
    indices, num_stages = stage_layout(args.schedule, pp_rank, pp_size)
    mods = [stage_module(i, num_stages, dtype).to(device) for i in indices]
    stages = [PipelineStage(m, i, num_stages, device, group=pp_group)
              for m, i in zip(mods, indices)]
    accumulate_weight_passes(stages)  # before the wrappers
    sync = {"process_group": dp_group} if dp > 1 else {"independent_ranks": True}
    opts = [accumkernels.AccumulatingOptimizer(torch.optim.AdamW(m.parameters(), lr=1e-3),
                                               accumulation_steps=N_MB, max_grad_norm=1.0,
                                               **sync)
            for m in mods]
    clip_across_stages(opts, group=pp_group)

    def loss_fn(out, y):
        return torch.nn.functional.mse_loss(out.float(), y)

    cls = get_schedule_class(args.schedule)
    schedule = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages,
                   n_microbatches=N_MB, loss_fn=loss_fn)
    data = torch.Generator().manual_seed(100 + dp_rank)  # each replica sees its own data
    last_loss = torch.zeros(2, dtype=torch.float64)
    for _ in range(args.steps):
        x = torch.randn(N_MB * MICRO, 32, generator=data)
        y = x[:, :1].sin()
        losses: list[torch.Tensor] = []
        inputs = (x.to(device, dtype),) if any(s.is_first for s in stages) else ()
        schedule.step(*inputs, target=y.to(device), losses=losses)  # inputs: the first stage's
        for opt in opts:
            opt.step()  # the window is complete after the schedule step: a real step
            opt.zero_grad()
        if losses:  # the ranks holding the last stage
            last_loss = torch.tensor([float(torch.stack(losses).detach().mean()), 1.0],
                                     dtype=torch.float64)
    dist.all_reduce(last_loss)  # the replicas' mean, for the print below
    if dp > 1:  # the replicas of each stage hold the same weights
        assert_replicas_agree((p for m in mods for p in m.parameters()), dp_group, "replicas")
    norm = float(opts[0].last_grad_norm)
    dist.barrier()
    if rank == 0:
        print(f"final loss {last_loss[0] / last_loss[1]:.4f} ({args.schedule}, "
              f"{num_stages} stages x {dp} replicas, pipeline grad norm {norm:.4f})")
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas")
    parser.add_argument("--schedule", default=None,
                        help="GPipe, 1F1B, Interleaved1F1B, LoopedBFS, InterleavedZeroBubble, "
                             "ZBVZeroBubble (the default), DualPipeV")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    if args.world_size % args.dp:
        parser.error("--world-size must be a multiple of --dp")
    # torch 2.11's V schedules send a warm-up message between the two stages they place on one
    # rank, which gloo (the CPU backend) cannot deliver: they fail natively there
    v_on_gloo = torch.cuda.is_available() or tuple(
        int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 12)
    if args.schedule is None:
        args.schedule = "ZBVZeroBubble" if v_on_gloo else "InterleavedZeroBubble"
    elif not v_on_gloo and args.schedule.lower() in ("zbvzerobubble", "dualpipev"):
        parser.error(f"--schedule {args.schedule} cannot run on gloo with torch "
                     f"{torch.__version__} (its warm-up sends to the rank's own stage; torch "
                     ">= 2.12 runs it): choose InterleavedZeroBubble")
    launch(train, args.world_size, args)


if __name__ == "__main__":
    main()
