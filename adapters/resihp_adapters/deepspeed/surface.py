"""What the engine ``initialize`` returns answers of DeepSpeed's ``PipelineEngine`` API.

Every public name of DeepSpeed's ``PipelineEngine`` (its methods, the ``nn.Module``
methods it inherits, and the attributes its code sets on ``self``) is in exactly one of
three tables, so a script written against DeepSpeed's engine either works unchanged or
is told, at the call, why it cannot:

- :data:`OWN`: the handle implements the name itself, as DeepSpeed documents it, for
  the job rather than for one plan generation (``train_batch``, ``global_steps``, the
  batch sizes, checkpoints, ...).
- :data:`DELEGATED`: read from the current plan generation's engine, which *is*
  DeepSpeed's ``PipelineEngine`` (ResiHP's subclass): ``module``, ``optimizer``,
  ``lr_scheduler``, ``stage_id``, ``grid``, the config queries, ...
  A reconfiguration builds a new engine, so read these again after ``train_batch``
  instead of keeping the objects.
- :data:`REFUSED`: calls that would bypass ResiHP's schedule or change only the current
  generation's engine (which the next reconfiguration builds again from the layer
  specs); each raises :class:`EngineCallRefused` with the call's name and the reason.

``tests/adapters/deepspeed/test_deepspeed_surface.py`` enumerates the installed
DeepSpeed's ``PipelineEngine`` and fails on a name in none of the tables.
"""

from __future__ import annotations

from typing import Callable, NoReturn

__all__ = ["OWN", "DELEGATED", "REFUSED", "EngineCallRefused", "refusal", "refused_call"]


class EngineCallRefused(NotImplementedError):
    """A ``PipelineEngine`` call ResiHP's engine does not run, with the reason."""


#: Implemented by the handle itself (``api.ResilientEngine``).
OWN = frozenset({
    "train_batch", "eval_batch", "save_checkpoint", "load_checkpoint", "destroy",
    "global_rank", "global_steps", "global_samples", "micro_batches", "micro_batch_size",
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "is_first_stage", "is_last_stage", "training_data", "collate_fn", "get_lr", "deepspeed_io",
})

_SCHEDULE = ("ResiHP's schedule runs forward, backward and the optimizer step inside train_batch() (as "
             "DeepSpeed's PipelineEngine, which refuses it too)")
_DATA = ("under resihp launch micro-batches are read by address from initialize(training_data=...), so a "
         "migrated or recovered micro-batch is the right one; give the dataset to initialize and call "
         "train_batch() or train_batch(RepeatingLoader(engine.deepspeed_io(training_data)))")
_BATCH = ("the job's global batch is fixed by the DeepSpeed JSON; each plan generation derives its own "
          "batch settings from it")
_REDUCE = ("gradient reductions run inside train_batch() over the plan generation's groups, which a "
           "reconfiguration rebuilds; reducing outside the schedule would double or miss gradients")
_REBUILT = ("it would change only the current plan generation's engine; ResiHP builds the module and engine "
            "again from the layer specs at every reconfiguration, so the change would be lost silently "
            "(put it in the layer's constructor or the DeepSpeed JSON)")
_LOAD = "use engine.load_checkpoint(dir): it checks the checkpoint and loads everything or changes nothing"
_ZERO3 = "ZeRO stage 2/3 and offload are refused by the adapter (docs/deepspeed.md)"
_EFFICIENCY = "DeepSpeed's data-efficiency pipeline is not supported: " + _DATA

#: Refused, with the reason (``name -> why``).
REFUSED: dict[str, str] = {
    "set_dataiterator": _DATA, "set_dataloader": _DATA, "set_batch_fn": _DATA,
    "set_data_post_process_func": _DATA, "data_iterator": _DATA, "training_dataloader": _DATA,
    "batch_fn": _DATA,
    "forward": _SCHEDULE, "backward": _SCHEDULE, "step": _SCHEDULE,
    "set_train_batch_size": _BATCH, "set_train_micro_batch_size": _BATCH,
    "set_gradient_accumulation_boundary": _SCHEDULE, "no_sync": _REDUCE,
    "allreduce_gradients": _REDUCE, "allreduce_bucket": _REDUCE, "allreduce_and_copy": _REDUCE,
    "allreduce_no_retain": _REDUCE, "buffered_allreduce_fallback": _REDUCE, "sparse_allreduce": _REDUCE,
    "sparse_allreduce_bucket": _REDUCE, "sparse_allreduce_no_retain": _REDUCE, "sparse_all_gather": _REDUCE,
    "all_gather_scalar": _REDUCE,
    "load_module_state_dict": _LOAD, "load_universal_checkpoint": _LOAD, "load_moe_state_dict": _LOAD,
    "load_state_dict": _LOAD,
    "offload_states": _ZERO3, "reload_states": _ZERO3,
    "random_ltd_initialize": _EFFICIENCY, "set_custom_curriculum_learning_schedule": _EFFICIENCY,
    "set_has_attention_mask": _REBUILT, "register_compile_pass": _REBUILT, "compile": _REBUILT,
    # nn.Module's mutators: they change this generation's module only.
    **{n: _REBUILT for n in (
        "add_module", "apply", "bfloat16", "cpu", "cuda", "double", "float", "half", "ipu", "mtia", "xpu",
        "register_backward_hook", "register_buffer", "register_forward_hook", "register_forward_pre_hook",
        "register_full_backward_hook", "register_full_backward_pre_hook", "register_load_state_dict_post_hook",
        "register_load_state_dict_pre_hook", "register_module", "register_parameter",
        "register_state_dict_post_hook", "register_state_dict_pre_hook", "requires_grad_", "set_extra_state",
        "set_submodule", "share_memory", "to", "to_empty", "type")},
}

#: Read from the current plan generation's engine (DeepSpeed's own behaviour there).
DELEGATED = frozenset({
    # what scripts use
    "module", "optimizer", "lr_scheduler", "basic_optimizer", "client_optimizer", "client_lr_scheduler",
    "stage_id", "num_stages", "grid", "prev_stage", "next_stage", "get_mom", "get_global_grad_norm",
    "device", "local_rank", "world_size", "dp_world_size", "mp_world_size", "seq_dp_world_size",
    "config", "mpu", "monitor", "timers", "get_wall_clock_timers", "engine_timers", "engine_timers_cache",
    "get_data_parallel_rank", "get_model_parallel_rank", "get_pipeline_parallel_rank", "get_tensor_parallel_rank",
    "get_sequence_parallel_group", "data_parallel_group", "seq_data_parallel_group", "seq_parallel_group",
    "expert_parallel_group", "expert_data_parallel_group", "all_to_all_group", "local_all_to_all_group",
    "sequence_parallel_size", "is_data_parallel", "is_model_parallel", "is_pipe_parallel", "is_pipe_partitioned",
    "is_grad_partitioned", "pipeline_parallelism", "has_moe_layers", "moe_layers", "num_experts", "gate_modules",
    "module_state_dict", "save_16bit_model", "save_fp16_model", "dump_state", "was_step_applied", "skipped_steps",
    "empty_partition_cache", "reset_activation_shape", "tput_log", "print_forward_breakdown", "get_batch_info",
    "get_optimizer_configuration", "get_data_types", "get_type", "log_for_device", "get_additional_losses",
    "is_gradient_accumulation_boundary", "is_iterable_style_dataset", "is_map_style_dataset",
    "is_first_weights_partition_group", "is_sanity_checks_enabled", "get_compile_time", "is_compiled",
    "get_autosp_backend", "get_autotp_backend", "get_deepcompile_backend", "get_deepspeed_compile_backend",
    "is_deepcompile_active", "is_deepcompile_enabled", "uses_parallelization_pass_only",
    # nn.Module's queries
    "T_destination", "buffers", "call_super_init", "children", "dump_patches", "eval", "extra_repr", "get_buffer",
    "get_extra_state", "get_parameter", "get_submodule", "modules", "named_buffers", "named_children",
    "named_modules", "named_parameters", "parameters", "state_dict", "train", "zero_grad",
    # the config's queries
    "DTYPE_TO_ID", "ID_TO_DTYPE", "aio_config", "autotp_size", "autotuning_enabled", "autotuning_end_profile_step",
    "autotuning_metric", "autotuning_metric_path", "autotuning_model_info_path", "autotuning_profile_model_info",
    "autotuning_start_profile_step", "autotuning_model_info", "bf16_master_weights_and_gradients",
    "bf16_optimizer_states", "bfloat16_enabled", "checkpoint_serialization_enabled",
    "checkpoint_tag_validation_enabled", "checkpoint_tag_validation_fail", "checkpoint_writer_enabled",
    "clip_fp32_gradients", "coalesce_grad_reduction", "collect_python_gc", "communication_data_type",
    "compile_autosp", "compile_autotp", "compile_zero_optimization_stage", "cpuadam_cores_perc",
    "curriculum_learning_config", "curriculum_learning_enabled", "data_efficiency_config",
    "data_efficiency_enabled", "data_sampling_config", "data_sampling_enabled", "dataloader_drop_last",
    "dynamic_loss_scale", "dynamic_loss_scale_args", "flops_profiler_detailed", "flops_profiler_enabled",
    "flops_profiler_module_depth", "flops_profiler_output_file", "flops_profiler_profile_step",
    "flops_profiler_recompute_fwd_factor", "flops_profiler_top_modules", "fp16_auto_cast", "fp16_enabled",
    "fp16_master_weights_and_gradients", "gradient_clipping", "gradient_predivide_factor", "initial_dynamic_scale",
    "log_level", "loss_scale", "managed_gradient_accumulation", "memory_breakdown", "optimizer_legacy_fusion",
    "optimizer_name", "optimizer_params", "postscale_gradients", "random_ltd_config", "random_ltd_enabled",
    "scale", "scheduler_name", "scheduler_params", "steps_per_print", "super_offload", "swap_tensor_config",
    "tensor_parallel_config", "torch_autocast_dtype", "torch_autocast_enabled",
    "torch_autocast_lower_precision_safe_modules", "use_node_local_storage", "wall_clock_breakdown",
    "zenflow_config", "zero_allgather_bucket_size", "zero_allgather_partitions", "zero_allgather_sequential",
    "zero_allow_untested_optimizer", "zero_compute_grad_norm", "zero_contiguous_gradients", "zero_cpu_offload",
    "zero_elastic_checkpoint", "zero_force_ds_cpu_optimizer", "zero_gather_16bit_weights_on_model_save",
    "zero_hpz_partition_size", "zero_ignore_unused_parameters", "zero_legacy_stage1",
    "zero_load_from_fp32_weights", "zero_log_trace_cache_warnings", "zero_max_live_parameters",
    "zero_max_reuse_distance", "zero_model_persistence_threshold", "zero_module_granularity_threshold",
    "zero_multi_rank_bucket_allreduce", "zero_nvme_offload_optimizer", "zero_offload_optimizer",
    "zero_offload_param", "zero_optimization", "zero_optimization_partition_gradients",
    "zero_optimization_partition_weights", "zero_optimization_stage", "zero_overlap_comm",
    "zero_param_persistence_threshold", "zero_parameter_alignment", "zero_partial_offload",
    "zero_prefetch_bucket_size", "zero_quantized_gradients", "zero_quantized_nontrainable_weights",
    "zero_quantized_weights", "zero_reduce_bucket_size", "zero_reduce_scatter", "zero_round_robin_gradients",
    "zero_save_muon_momentum_buffer_in_memory", "zero_sub_group_size", "zero_use_cpu_optimizer",
    # the engine's own state of the current generation (DeepSpeed's attributes)
    "agg_additional_losses", "agg_loss", "agg_train_loss", "batch_timer", "checkpoint_engine",
    "checkpoint_mp_rank", "dist_backend", "dont_change_device", "dp_group_loss", "dynamic_shape",
    "enable_backward_allreduce", "eval_return_logits", "first_dataloader_check", "first_gradient_send",
    "first_output_send", "flatten", "flops", "flops_profiler", "fwd_duration", "fwd_outputs", "grad_layer",
    "grad_partition_grad_layer_meta_cache", "gradient_average", "has_attention_mask", "has_bool_tensors",
    "inside_no_sync_ctxt", "loaded_checkpoint_dp_world_size", "loaded_checkpoint_mp_world_size",
    "log_batch_step_id", "loss", "losses", "mesh_device", "meta_buffer", "micro_steps",
    "module_forward_post_hook", "module_forward_pre_hook", "num_pipe_buffers", "optimized_linear_base_weight_sharding",
    "optimized_linear_lora_enabled", "outputs", "param_names", "pipe_buffers", "pipe_partition_grad_meta_cache",
    "pipe_partition_input_meta_cache", "pipe_partition_output_meta_cache", "pipe_recv_buf",
    "pipeline_enable_backward_allreduce", "random_ltd_scheduler", "save_non_zero_checkpoint",
    "save_zero_checkpoint", "scale_wrt_gas", "summary_events", "torch_autocast_z0_gradscaler",
    "total_additional_losses", "total_loss", "tput_timer", "unflatten", "update_interval", "use_ds_comm",
    "using_bf16_optimizer", "warn_unscaled_loss", "training",
})


def refusal(name: str) -> str:
    """The message for refused ``name``."""
    return f"engine.{name}: not available under resihp launch: {REFUSED[name]}"


def refused_call(name: str) -> Callable[..., NoReturn]:
    """A stand-in for refused method ``name`` that raises when called (so ``hasattr``
    and ``getattr`` still answer, as for DeepSpeed's engine)."""

    def call(*args: object, **kwargs: object) -> NoReturn:
        raise EngineCallRefused(refusal(name))

    call.__name__ = name
    call.__doc__ = refusal(name)
    return call
