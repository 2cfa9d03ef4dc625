"""The declaration of the multi-process surface (see _matrix_declared): the options jobs set on
DDP and FSDP2, and what one rank does differently from the others."""

from __future__ import annotations

from _matrix_surface import ax, ex

_PLACEMENT = ex("device placement: one CPU device per rank on gloo; no effect on what is "
                "reduced")
_SCHEDULE = ex("FSDP2's communication schedule (prefetch, reshard, unshard, events, memory "
               "placement): changes when the reduce-scatter runs, not what it reduces")
_DIVISOR = ex("changes the divisor or the sum FSDP2 applies to its reduce-scatter: native and "
              "wrapper see the same collective; not crossed yet (the wrapper's average assumes "
              "FSDP2's defaults)")
_TP = "tests/distributed/test_tensor_parallel.py"
ENGINE = {
    "DDP.device_ids": _PLACEMENT,
    "DDP.output_device": _PLACEMENT,
    "DDP.dim": _PLACEMENT,
    "DDP.device_mesh": ex("a 1-D mesh instead of process_group: the same reducer",
                          "tests/distributed/_ddp_workers.py", "DistributedDataParallel"),
    "DDP.process_group": ax("multi.layout=ddp"),
    "DDP.broadcast_buffers": ex("buffers only (the matrix's model has none); no gradient"),
    "DDP.init_sync": ex("the params broadcast at construction: both sides start from rank 0's "
                        "(the same seed here)"),
    "DDP.bucket_cap_mb": ax("multi.engine=ddp-small-buckets"),
    "DDP.bucket_cap_mb_list": ax("multi.engine=ddp-small-buckets"),
    "DDP.find_unused_parameters": ax("multi.engine=ddp-find-unused"),
    "DDP.check_reduction": ex("deprecated by DDP: a no-op kept for compatibility"),
    "DDP.gradient_as_bucket_view": ax("multi.engine=ddp-bucket-view"),
    "DDP.static_graph": ax("multi.engine=ddp-static-graph"),
    "DDP.delay_all_reduce_named_params": ex("params all-reduced after the backward instead of "
                                            "by the reducer: DDP's experimental path, not "
                                            "supported with the wrapper's DDP hook"),
    "DDP.param_to_hook_all_reduce": ex("the hook of the delayed all-reduce above: DDP's "
                                       "experimental path, not supported"),
    "DDP.mixed_precision": ex("DDP's private _MixedPrecision casts params and gradients itself; "
                              "the supported low-precision recipe is a bf16 model with fp32 "
                              "masters"),
    "DDP.skip_all_reduce_unused_params": ax("multi.engine=ddp-find-unused"),
    "DDP.batched_grad_copy": ex("how DDP copies gradients into its buckets (a newer torch's "
                                "internal speed option): not what is reduced"),
    "DDP.forward_sync_buffers": ex("buffers only (the matrix's model has none); no gradient"),
    "fully_shard.mesh": ax("multi.layout=fsdp2", "multi.layout=hsdp", "multi.layout=fsdp2-tp"),
    "fully_shard.reshard_after_forward": ax("multi.engine=fsdp2-no-reshard"),
    "fully_shard.mp_policy": ax("multi.engine=fsdp2-mp"),
    "fully_shard.shard_placement_fn": ex("a custom shard dimension: the window follows each "
                                         "param's local shard whatever its placement", _TP,
                                         "fully_shard"),
    "fully_shard.offload_policy": ex("CPU offload of sharded params: they are on the CPU here "
                                     "already", "tests/distributed/test_fsdp2.py", "fully_shard"),
    "fully_shard.ignored_params": ex("params FSDP2 leaves unsharded and unreduced: the wrapper "
                                     "treats them as rank-local (refused in a multi-rank job "
                                     "without a reduce)"),
    "fully_shard.dp_mesh_dims": ex("which mesh dims are data-parallel on a newer torch: the "
                                   "hsdp and fsdp2-tp layouts build their meshes by name"),
    "FSDPModule.set_requires_gradient_sync": ex(
        "FSDP2's no_sync: the wrapper's window is fed by its post-reduce-scatter hooks; a "
        "window accumulated without sync is reduced at its end",
        "tests/distributed/_fsdp2_workers.py", "set_requires_gradient_sync"),
    "FSDPModule.set_requires_all_reduce": ex("HSDP's replicate all-reduce skipped: the hsdp "
                                             "layout runs it every micro-batch"),
    "FSDPModule.set_is_last_backward": _SCHEDULE,
    "FSDPModule.set_reshard_after_backward": _SCHEDULE,
    "FSDPModule.set_reshard_after_forward": ax("multi.engine=fsdp2-no-reshard"),
    "FSDPModule.set_modules_to_backward_prefetch": _SCHEDULE,
    "FSDPModule.set_modules_to_forward_prefetch": _SCHEDULE,
    "FSDPModule.set_post_optim_event": _SCHEDULE,
    "FSDPModule.set_unshard_in_backward": _SCHEDULE,
    "FSDPModule.set_allocate_memory_from_process_group_for_comm": _SCHEDULE,
    "FSDPModule.set_symm_mem_for_comm": _SCHEDULE,
    "FSDPModule.set_reduce_scatter_max_input_buffers": _SCHEDULE,
    "FSDPModule.set_separate_reduce_scatter_group": _SCHEDULE,
    "FSDPModule.reshard": _SCHEDULE,
    "FSDPModule.unshard": _SCHEDULE,
    "FSDPModule.reset_iter_state": _SCHEDULE,
    "FSDPModule.set_gradient_divide_factor": _DIVISOR,
    "FSDPModule.set_reduce_scatter_divide_factor": _DIVISOR,
    "FSDPModule.set_force_sum_reduction_for_comms": _DIVISOR,
    "FSDPModule.set_all_reduce_hook": _DIVISOR,
    "FSDPModule.set_reduce_scatter_unused_params": _DIVISOR,
    "FSDPModule.set_custom_all_gather": ex("the all-gather of the params (forward): no "
                                           "gradient"),
    "FSDPModule.set_custom_reduce_scatter": ex("the wrapper's own bf16 wire (fsdp2_wire) "
                                               "installs one: a user's is refused with it",
                                               "tests/distributed/test_fsdp2.py", "wire"),
}

RANKS = {
    "one-rank-missing-add_weight": ax("multi.ranks=missing-weight"),
    "one-rank-zero-add_weight": ax("multi.ranks=zero-weight"),
    "one-rank-extra-step": ax("multi.ranks=extra-step"),
    "one-rank-nan-microbatch": ax("multi.nonfinite=nan-skip_step"),
    "no_sync-on-every-microbatch": ax("multi.ranks=no_sync-all"),
    "dcp-checkpoint-ddp": ex("a mid-window DCP checkpoint under DDP: every rank's window saved "
                             "and resumed exactly, or refused alike on every rank",
                             "tests/distributed/test_ddp_checkpoint.py",
                             "test_a_mid_window_dcp_checkpoint_is_refused_on_every_rank"),
    "dcp-checkpoint-fsdp2": ex("a mid-window DCP checkpoint under FSDP2, resharded",
                               "tests/distributed/test_fsdp2_checkpoint.py", "dcp"),
    "dcp-checkpoint-fsdp2-tp": ex("a mid-window checkpoint under FSDP2 + TP, every inner "
                                  "optimizer, bit-identical to the uninterrupted run",
                                  "tests/distributed/test_tensor_parallel.py",
                                  "test_tp_mid_window_resume_is_bit_identical"),
}
