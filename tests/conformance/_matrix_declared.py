"""The declaration of the public surface (_matrix_surface enumerates it): each item an axis value
of the matrix (``ax``: "single.<axis>=<value>", "multi.<axis>=<value>", or "single"/"multi" for
every case of that part) or an exclusion (``ex``) with its reason and the test file that covers it
instead. test_surface.py fails on an enumerated item missing here, an axis value the matrix does
not have, a reason without substance, or a test file that does not mention what it covers.

Keys are the enumeration's names; ``*.flag`` declares a flag for every optimizer class not
declared one by one.
"""

from __future__ import annotations

from _matrix_surface import NOT_GRAD, READS, ax, ex

OPT_SUITE = "tests/optim/test_conformance.py"  # torch's optim_db configs, native vs wrapper
_OP = ex("an op of its own, each backend against the float64 reference; the wrapper calls it "
         "on every case", "tests/op/test_accumulate.py", "accumulate_")
_STEP_OP = ex("the fused master step op, bit-identical to torch's fused step on every backend; "
              "the wrapper calls it on the bf16/fp16 cases with a fused inner optimizer",
              "tests/op/test_master_step.py", "master_adam_step_")
_TOOL = ex("a batch-size tool beside the wrapper: no window, no step",
           "tests/tools/test_batch_size.py", "find_micro_batch_size")
_BY_NAME = ax("single.construct=by-name")
_FRAMEWORK = "a framework's one line: its real loop against native in its own tests"
PACKAGE = {
    "AccumulatingOptimizer": ax("single.construct=by-hand", "multi"),
    "MasterGradBuffer": ex("the window's storage, its own tests; every case runs through it",
                           "tests/buffer/test_buffer.py", "MasterGradBuffer"),
    "MicroBatchSearch": _TOOL,
    "find_micro_batch_size": _TOOL,
    "validate_batch_sizes": ex("a batch-size check beside the wrapper: no window, no step",
                               "tests/tools/test_batch_size.py", "validate_batch_sizes"),
    "check_model": ex("warns about BatchNorm in training mode; the matrix's models have none",
                      "tests/optim/test_config.py", "check_model"),
    "accumulate_": _OP,
    "available_backends": _OP,
    "master_adam_step_": _STEP_OP,
    "master_sgd_step_": _STEP_OP,
    "accumulating": _BY_NAME,
    "build_info": ex("reports what was built and which backends run where",
                     "tests/tools/test_build_info.py", "build_info"),
    "ddp_comm_hook": ax("multi.layout=ddp"),
    "fuse_wgrad_accumulation": ex("the fused weight-gradient GEMM of nn.Linear layers, crossed "
                                  "with every reduction and the window logic in its own tests",
                                  "tests/wgrad/test_wgrad.py", "fuse_wgrad_accumulation"),
    "optimizers.accumulating": _BY_NAME,
    "optimizers.wrapper_options": _BY_NAME,
    "optimizers.COLLISION_PREFIX": ex("the spelling of a wrapper option an optimizer also takes "
                                      "(wrapper_<name>)",
                                      "tests/integrations/test_optimizers_by_name.py",
                                      "wrapper_"),
    "optimizers.TORCH_OPTIMIZERS": _BY_NAME,
    "optimizers.*": _BY_NAME,
    "integrations.transformers.AccumulatingTrainer": ex(
        _FRAMEWORK, "tests/integrations/test_transformers.py", "AccumulatingTrainer"),
    "integrations.transformers.AccumulatingTrainerMixin": ex(
        _FRAMEWORK, "tests/integrations/test_transformers.py", "AccumulatingTrainer"),
    "integrations.accelerate.AccumulatingAccelerator": ex(
        _FRAMEWORK, "tests/integrations/test_accelerate.py", "AccumulatingAccelerator"),
    "integrations.accelerate.make_skips_visible": ex(
        _FRAMEWORK, "tests/integrations/test_accelerate.py", "make_skips_visible"),
    "integrations.lightning.FP32Accumulation": ex(
        _FRAMEWORK, "tests/integrations/test_lightning.py", "FP32Accumulation"),
    "integrations.fabric.setup": ex(_FRAMEWORK, "tests/integrations/test_fabric.py", "setup"),
    "integrations.pipelining.accumulate_weight_passes": ax("multi.layout=pipe-zbv",
                                                           "multi.layout=pipe-zbv-forgotten"),
    "integrations.pipelining.clip_across_stages": ax("multi.layout=pipe-gpipe"),
}

MEMBERS = {
    "OptimizerPreHook": ex("a type alias torch.optim.Optimizer exports for hook signatures"),
    "OptimizerPostHook": ex("a type alias torch.optim.Optimizer exports for hook signatures"),
    "accumulate": ax("single.in_backward=False"),
    "add_param_group": ax("single.loop=add_param_group-boundary",
                          "single.loop=add_param_group-mid"),
    "add_weight": ax("single.reduction=weighted-before", "single.reduction=weighted-after",
                     "multi.reduction=weighted-before", "multi.ranks=zero-weight",
                     "multi.ranks=missing-weight"),
    "collective_timeout": ex("a deadline on the wrapper's own collectives (a hang becomes an "
                             "error); nothing to cross on a healthy run",
                             "tests/distributed/test_data_parallel.py"),
    "defaults": ex("the inner optimizer's defaults dict, shared as natively", OPT_SUITE,
                   "test_public_interface_of_the_inner_optimizer"),
    "flush": ex("forces the step of a short last window; the matrix ends its short windows by "
                "step() at the loop's boundary (accum=N-short-last)",
                "tests/optim/test_window.py", "flush()"),
    "join_stage_norm": ex("a pipeline stage's share of the norm clipped across stages (run by "
                          "the pipeline layouts with clip=max_grad_norm)",
                          "tests/conformance/_matrix_ranks.py", "stage_norm"),
    "last_grad_norm": ax("single.clip=max_grad_norm", "multi.clip=max_grad_norm"),
    "load_state_dict": ax("single.checkpoint=save-load", "single.checkpoint=dcp-flat",
                          "single.checkpoint=native-step0"),
    "loss_scale": ax("single.dtype=fp16"),
    "master_params": ax("single.masters=auto"),
    "micro_steps": ex("reads how many micro-batches the window counts",
                      "tests/optim/test_window.py", "micro_steps"),
    "param_groups": ex("shared with the inner optimizer; LR schedulers write it",
                       "tests/optim/test_lr_schedulers.py", "param_groups"),
    "process_group": ax("multi.layout=process_group"),
    "profile_hook_step": ex("torch's profiler decorator, a static helper of "
                            "torch.optim.Optimizer that no loop calls"),
    "register_load_state_dict_post_hook": ex("state-dict hooks run as natively (optim_db)",
                                             OPT_SUITE),
    "register_load_state_dict_pre_hook": ex("state-dict hooks run as natively (optim_db)",
                                            OPT_SUITE),
    "register_state_dict_post_hook": ex("state-dict hooks run as natively (optim_db)",
                                        OPT_SUITE),
    "register_state_dict_pre_hook": ex("state-dict hooks run as natively (optim_db)", OPT_SUITE),
    "register_step_post_hook": ax("single.hooks=wrapper-post-hook"),
    "register_step_pre_hook": ex("step hooks fire once per real step in native order "
                                 "(optim_db); the post-hook is the crossed one", OPT_SUITE),
    "remove_hooks": ex("detaches the wrapper from the model; every checkpoint path of the "
                       "matrix calls it on the wrapper it replaces",
                       "tests/conformance/_matrix_ckpt.py"),
    "reset_window": ax("single.loop=reset_window"),
    "scale_loss": ax("single.dtype=fp16"),
    "skipped_microbatches": ax("single.nonfinite=nan-skip_microbatch"),
    "skipped_steps": ax("single.nonfinite=nan-skip_step", "multi.nonfinite=nan-skip_step"),
    "state": ax("single.hands=state-rewrite"),
    "state_dict": ax("single.checkpoint=save-load", "single.checkpoint=to-native",
                     "single.checkpoint=deepcopy"),
    "step": ax("single.accum=N", "single.accum=None", "single.accum=N-short-last"),
    "sync_step": ex("reads whether the next step is a real one", "tests/optim/intake/test_intake.py",
                    "sync_step"),
    "weight_pass": ax("single.grads=wp-assign", "single.grads=wp-mixed",
                      "single.grads=wp-nested", "single.grads=wp-raise"),
    "window_template": ex("the DCP load template of a sharded window; multi-rank DCP "
                          "checkpoints", "tests/distributed/test_fsdp2_checkpoint.py"),
    "zero_grad": ax("single.loop=opt-zero_grad", "single.hands=zero_grad-keep"),
    # not attributes of the class, but ways in
    "step(closure)": ex("a closure optimizer (LBFGS) evaluates the loss several times inside "
                        "one step: no window of micro-batches for the matrix's loop; every "
                        "wrapper option with a closure is tested against native there",
                        "tests/optim/test_ways_in.py", "LBFGS"),
    "train": ex("passes through to the inner optimizer (schedule-free optimizers)", OPT_SUITE,
                "test_train_eval_pass_through"),
    "eval": ex("passes through to the inner optimizer (schedule-free optimizers)", OPT_SUITE,
               "test_train_eval_pass_through"),
    "copy.copy": ax("single.checkpoint=deepcopy-direct", "single.checkpoint=pickle"),
    "copy.deepcopy": ax("single.checkpoint=deepcopy", "single.checkpoint=deepcopy-direct"),
    "pickle": ax("single.checkpoint=pickle"),
    "subclass": ax("single.construct=subclass"),
    "compiled_autograd": ax("single.autograd=eager", "single.autograd=compiled"),
    "compiled_autograd(fullgraph=True)": ex(
        "Dynamo cannot trace the wrapper's hooks: it raises before the backward runs, nothing "
        "changed", "tests/optim/intake/test_compiled_autograd.py", "fullgraph"),
}

OPTIONS = {
    "accumulation_steps": ax("single.accum=N", "single.accum=None"),
    "accumulation_steps=int": ax("single.accum=N", "multi.accum=N"),
    "accumulation_steps=None": ax("single.accum=None", "multi.accum=None"),
    "reduction": ax("single.reduction=sum"),
    "reduction=sum": ax("single.reduction=sum"),
    "reduction=mean": ax("single.reduction=mean"),
    "reduction=weighted": ax("single.reduction=weighted-before"),
    "master_weights": ax("single.masters=auto"),
    "master_weights=auto": ax("single.masters=auto"),
    "master_weights=False": ax("single.masters=False"),
    "master_weights=True": ex("=auto on the low-precision models the matrix builds; True on an "
                              "fp32 model has no master to keep",
                              "tests/optim/step/test_masters.py", "master_weights"),
    "accumulate_in_backward": ax("single.in_backward=True"),
    "accumulate_in_backward=True": ax("single.in_backward=True"),
    "accumulate_in_backward=False": ax("single.in_backward=False"),
    "max_grad_norm": ax("single.clip=max_grad_norm"),
    "max_grad_norm=None": ax("single.clip=none"),
    "max_grad_norm=float": ax("single.clip=max_grad_norm", "single.clip=max_grad_norm-loose"),
    "nonfinite": ax("single.nonfinite=none"),
    "nonfinite=skip_step": ax("single.nonfinite=nan-skip_step"),
    "nonfinite=skip_microbatch": ax("single.nonfinite=nan-skip_microbatch"),
    "nonfinite=raise": ax("single.nonfinite=nan-raise"),
    "loss_scale": ax("single.dtype=fp16"),
    "loss_scale=None": ax("single.dtype=fp32"),
    "loss_scale=float": ax("single.dtype=fp16"),
    "loss_scale=dynamic": ex("growth and backoff like torch.amp.GradScaler over many steps; the "
                             "matrix's fp16 runs a fixed scale", "tests/optim/test_loss_scale.py",
                             "dynamic"),
    "process_group": ax("multi.layout=process_group"),
    "process_group=None": ax("single"),
    "process_group=group": ax("multi.layout=process_group"),
    "bucket_size_mb": ex("bucket granularity: the matrix runs 0.0005 MB (a bucket per param or "
                         "two) everywhere; bucket sizes are the buffer's tests",
                         "tests/buffer/test_buffer.py", "bucket_size_mb"),
    "backend": ex("the kernel backend: each backend is checked against the float64 reference",
                  "tests/op/test_accumulate.py", "backend"),
    "backend=auto": ax("single"),
    "backend=torch": ex("the reference backend, checked against the float64 reference",
                        "tests/op/test_accumulate.py", "torch"),
    "backend=cpu": ex("the C++ kernel (what auto picks on a CPU)", "tests/op/test_accumulate.py",
                      "cpu"),
    "backend=triton": ex("Triton runs on a GPU, or under TRITON_INTERPRET=1",
                         "tests/op/test_triton_backend.py", "triton"),
    "backend=cuda": ex("the CUDA kernel needs a GPU (its host emulation runs here)",
                       "tests/op/test_gpu_kernels.py", "cuda"),
    "model": ax("single"),
    "model=None": ex("the wrapper finds its params through the inner optimizer; the optim_db "
                     "suite wraps without model=", OPT_SUITE, "AccumulatingOptimizer("),
    "model=module": ax("single"),
    "model=DDP": ax("multi.layout=ddp"),
    "model=FSDP2": ax("multi.layout=fsdp2", "multi.layout=hsdp", "multi.layout=fsdp2-tp"),
    "independent_ranks": ex("pipeline stages step their own params without a data-parallel "
                            "reduce", "tests/distributed/test_pipelining.py",
                            "independent_ranks"),
    "independent_ranks=False": ax("multi.layout=ddp"),
    "independent_ranks=True": ex("pipeline stages step their own params without a "
                                 "data-parallel reduce", "tests/distributed/test_pipelining.py",
                                 "independent_ranks"),
}

_CAPTURABLE = ex("torch refuses capturable=True for CPU params ('params and state_steps must be "
                 "on supported devices'); a CUDA-graph path", "tests/op/test_cuda_graphs.py",
                 "capturable")
_SUITE_FLAG = ex("torch's optim_db configs of this flag, several steps and windows "
                 "bit-identical to native", "tests/optim/_conformance_common.py", "optim_db")
OPTIMIZERS = {
    "SGD": ax("single.optimizer=sgd-forloop", "single.optimizer=sgd-foreach",
              "single.optimizer=sgd-fused"),
    "SGD.foreach": ax("single.optimizer=sgd-foreach"),
    "SGD.fused": ax("single.optimizer=sgd-fused"),
    "SGD.nesterov": ax("single.optimizer=sgd-forloop"),
    "Adam": ax("single.optimizer=adam-forloop"),
    "Adam.foreach": ax("single.optimizer=adam-foreach"),
    "Adam.fused": ax("single.optimizer=adam-fused"),
    "Adam.amsgrad": ax("single.optimizer=adam-amsgrad-maximize-fused"),
    "Adam.maximize": ax("single.optimizer=adam-amsgrad-maximize-fused"),
    "AdamW": ax("single.optimizer=adamw-forloop", "multi.optimizer=adamw-forloop"),
    "AdamW.foreach": ax("single.optimizer=adamw-foreach"),
    "AdamW.fused": ax("single.optimizer=adamw-fused", "multi.optimizer=adamw-fused"),
    "RMSprop": ax("single.optimizer=rmsprop-foreach"),
    "RMSprop.foreach": ax("single.optimizer=rmsprop-foreach"),
    "Adagrad": ax("single.optimizer=adagrad-forloop"),
    "Adagrad.fused": ax("single.optimizer=adagrad-fused"),
    "NAdam": ax("single.optimizer=nadam-foreach"),
    "NAdam.foreach": ax("single.optimizer=nadam-foreach"),
    "RAdam": ax("single.optimizer=radam-forloop"),
    "RAdam.decoupled_weight_decay": ax("single.optimizer=radam-forloop"),
    "Adamax": ax("single.optimizer=adamax-foreach"),
    "Adamax.foreach": ax("single.optimizer=adamax-foreach"),
    "ASGD": ax("single.optimizer=asgd-forloop"),
    "Rprop": ax("single.optimizer=rprop-foreach"),
    "Rprop.foreach": ax("single.optimizer=rprop-foreach"),
    "Adadelta": ax("single.optimizer=adadelta-foreach"),
    "Adadelta.foreach": ax("single.optimizer=adadelta-foreach"),
    "Adafactor": ax("single.optimizer=adafactor-forloop"),
    "LBFGS": ex("a closure optimizer: every wrapper option with step(closure) against native",
                "tests/optim/test_ways_in.py", "LBFGS"),
    "SparseAdam": ex("sparse gradients: refused at construction by name", OPT_SUITE, "sparse"),
    "Muon": ex("2-D params only (no biases, no convolutions): the matrix's models have 1-D "
               "params; its optim_db configs run against native",
               "tests/optim/_conformance_common.py", "Muon"),
    "*.capturable": _CAPTURABLE,
    "*.differentiable": ex("refused at construction by name: a step autograd differentiates "
                           "through cannot run on an accumulated window", OPT_SUITE,
                           "differentiable"),
    "*.foreach": _SUITE_FLAG,
    "*.fused": _SUITE_FLAG,
    "*.maximize": _SUITE_FLAG,
    "*.amsgrad": _SUITE_FLAG,
    "*.decoupled_weight_decay": _SUITE_FLAG,
    "*.nesterov": _SUITE_FLAG,
    "*.centered": _SUITE_FLAG,
    "*.line_search_fn": _SUITE_FLAG,
    "LBFGS.max_eval": ex("LBFGS's own budget of closure calls per step: the wrapper runs the "
                         "closure whenever LBFGS calls it", "tests/optim/test_ways_in.py",
                         "max_eval"),
    "Muon.*": ex("Muon's own options (adjust_lr_fn): torch's optim_db configs against native",
                 "tests/optim/_conformance_common.py", "Muon"),
}

HOOKS = {
    "Tensor.register_hook": ax("single.hooks=tensor-hook", "single.hooks=tensor-hook-after",
                               "single.grads=raise"),
    "Tensor.register_post_accumulate_grad_hook": ax("single.hooks=post-hook-after"),
    "inner.register_step_pre_hook": ax("single.hooks=inner-pre-hook"),
    "inner.register_step_post_hook": ax("single.hooks=inner-post-hook"),
    "inner.register_state_dict_pre_hook": ex("state-dict hooks of the inner optimizer run as "
                                             "natively", OPT_SUITE, "state_dict"),
    "inner.register_state_dict_post_hook": ex("state-dict hooks of the inner optimizer run as "
                                              "natively", OPT_SUITE, "state_dict"),
    "inner.register_load_state_dict_pre_hook": ex("state-dict hooks of the inner optimizer run "
                                                  "as natively", OPT_SUITE, "load_state_dict"),
    "inner.register_load_state_dict_post_hook": ex("state-dict hooks of the inner optimizer "
                                                   "run as natively", OPT_SUITE,
                                                   "load_state_dict"),
}

_MOVES = ex("changes the params' dtype or device between calls: native's result or a clear "
            "error with nothing changed", "tests/optim/test_device_moves.py", "to(")
_MODULE_HOOK = ex("a module backward hook changes grad_output/grad_input before the params' "
                  "AccumulateGrad, the same path as the crossed full backward pre-hook",
                  "tests/optim/intake/test_user_hooks.py", "register_full_backward_hook")
_FORWARD = ex(NOT_GRAD + "; both sides run the same forward")
MODEL = {
    **{f"Module.{n}": ex(READS) for n in (
        "T_destination", "buffers", "children", "extra_repr", "get_buffer", "get_extra_state",
        "get_parameter", "get_submodule", "modules", "named_buffers", "named_children",
        "named_modules", "named_parameters", "parameters", "state_dict", "dump_patches",
        "call_super_init")},
    **{f"Module.{n}": _FORWARD for n in (
        "forward", "register_forward_hook", "register_forward_pre_hook", "register_buffer",
        "set_extra_state", "register_state_dict_pre_hook", "register_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook")},
    **{f"Module.{n}": _MOVES for n in (
        "to", "cpu", "cuda", "double", "float", "half", "bfloat16", "type", "xpu", "ipu", "mtia",
        "to_empty", "apply")},
    "Module.register_full_backward_pre_hook": ax("single.hooks=module-hook"),
    "Module.register_full_backward_hook": _MODULE_HOOK,
    "Module.register_backward_hook": _MODULE_HOOK,
    "Module.add_module": ax("single.loop=add_param_group-boundary"),
    "Module.register_module": ax("single.loop=add_param_group-boundary"),
    "Module.set_submodule": ax("single.loop=add_param_group-boundary"),
    "Module.register_parameter": ax("single.loop=add_param_group-boundary"),
    "Module.eval": ex("a module flag (dropout, BatchNorm: check_model warns on BatchNorm in "
                      "training mode)", "tests/optim/test_conformance.py", "eval"),
    "Module.train": ex("a module flag (dropout, BatchNorm: check_model warns on BatchNorm in "
                       "training mode)", "tests/optim/test_conformance.py", "train"),
    "Module.load_state_dict": ax("single.checkpoint=save-load"),
    "Module.requires_grad_": ax("single.loop=freeze-before", "single.loop=freeze-between",
                                "single.params=frozen"),
    "Module.share_memory": ex("moves the params' storage to shared memory between calls",
                              "tests/optim/step/test_fused_master.py", "share_memory"),
    "Module.zero_grad": ax("single.loop=model-zero_grad", "single.loop=model-zero_grad-every"),
    "Module.compile": ex("the model compiled: the accumulation op is a custom op that works "
                         "under torch.compile", "tests/op/test_op_registration.py", "compile"),
    "requires_grad-before-forward": ax("single.loop=freeze-before"),
    "requires_grad-between-forward-and-backward": ax("single.loop=freeze-between"),
    "requires_grad-mid-window": ax("single.loop=freeze-before"),
    "param-added": ax("single.loop=add_param_group-boundary", "single.loop=add_param_group-mid"),
    "param-replaced": ax("single.hands=data-write", "single.hands=data-transpose"),
    "no-zero_grad": ax("single.loop=no-zero_grad"),
    "p.grad=None": ax("single.loop=grad-none"),
}
