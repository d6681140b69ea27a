"""The user's Megatron-Core job as ``pretrain_gpt`` shapes it, and what the adapter
refuses up front.

A job is a :class:`MegatronJob`: the ``TransformerConfig`` fields of the model (the
parallel sizes and the pipeline layout are the plan's), a model provider building the
model of one pipeline stage, a ``forward_step_func``, a map-style dataset of samples,
the ``OptimizerConfig`` / ``DistributedDataParallelConfig`` fields and the
``OptimizerParamScheduler`` arguments. ``adapter_config["user"] = "module:function"``
names a function returning one; without it, the built-in GPT job of
:mod:`.gpt` is used with ``adapter_config``'s model fields.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Sequence

from resihp_core.config import ConfigError

if TYPE_CHECKING:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["MegatronJob", "load_job", "check_supported", "UnsupportedFeature"]

Sample = Mapping[str, "torch.Tensor"]
ForwardStep = Callable[[Iterator[Any], "torch.nn.Module"], tuple["torch.Tensor", Callable[..., tuple]]]


class UnsupportedFeature(ConfigError):
    """A Megatron-Core feature this adapter cannot carry across a reconfiguration: refused
    before any worker trains, with the feature's name."""


@dataclass
class MegatronJob:
    """A ``pretrain_gpt``-shaped job.

    :param transformer: ``TransformerConfig`` keyword arguments of the model (not the
        parallel sizes nor ``pipeline_model_parallel_layout``: each plan sets them).
    :param model_provider: ``(config, pre_process, post_process) -> GPTModel`` for one
        pipeline stage (``pretrain_gpt``'s ``model_provider`` with the config given).
    :param forward_step: ``forward_step_func(data_iterator, model) -> (output, loss_func)``;
        ``loss_func(output)`` returns ``(loss, {...})`` (a mean) or
        ``(loss_sum, num_tokens, {...})``, as Megatron's schedules accept.
    :param dataset: map-style: ``dataset[i]`` is one sample (a dict of tensors); iteration
        ``i``'s global micro-batch ``g`` takes samples ``(i * G + g) * mbs + k``.
    :param micro_batch_size: samples per micro-batch.
    :param seq_length: tokens per sample (the schedules' tensor shapes).
    :param optimizer: ``OptimizerConfig`` keyword arguments (``lr``, ``min_lr``,
        ``weight_decay``, ``clip_grad``, ``adam_beta1``, ...).
    :param scheduler: ``OptimizerParamScheduler`` keyword arguments (``init_lr``,
        ``max_lr``, ``min_lr``, ``lr_warmup_steps``, ``lr_decay_steps``, ``lr_decay_style``,
        ``start_wd``, ``end_wd``, ``wd_incr_steps``, ``wd_incr_style``); steps count
        samples, as in Megatron-LM (each iteration adds the global batch); None: no scheduler.
    :param ddp: ``DistributedDataParallelConfig`` keyword arguments.
    """

    transformer: dict[str, Any]
    model_provider: Callable[["TransformerConfig", bool, bool], "torch.nn.Module"]
    forward_step: ForwardStep
    dataset: Sequence[Sample]
    micro_batch_size: int = 1
    seq_length: int = 16
    optimizer: dict[str, Any] = field(default_factory=lambda: {"lr": 1e-3})
    scheduler: dict[str, Any] | None = None
    ddp: dict[str, Any] = field(default_factory=dict)
    collate: Callable[[list[Sample]], Any] | None = None


_PARALLEL_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "pipeline_model_parallel_layout",
                    "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")


def load_job(section: Mapping[str, Any]) -> MegatronJob:
    """The job of an adapter section: ``user`` = ``"module:function"`` returning a
    :class:`MegatronJob`, or the built-in GPT job built from the section's fields."""
    target = section.get("user")
    if target:
        extra = sorted(set(section) - {"user", "backend", "devices_per_node"})
        if extra:
            raise ConfigError(f"adapter: field(s) {extra} with 'user': the user's job sets its own model, optimizer "
                              "and data", path="adapter", value=extra)
        mod, _, fn = str(target).partition(":")
        if not fn:
            raise ConfigError("adapter.user must be 'module:function' returning a MegatronJob", path="adapter.user",
                              value=target)
        job = getattr(importlib.import_module(mod), fn)()
        if not isinstance(job, MegatronJob):
            raise ConfigError(f"adapter.user {target!r} returned {type(job).__name__}, not a MegatronJob",
                              path="adapter.user", value=target)
        return job
    from resihp_adapters.megatron_core.gpt import gpt_job

    known = {"vocab_size", "hidden", "num_heads", "ffn_hidden", "num_layers", "seq_length", "micro_batch_size",
             "lr", "seed", "clip_grad", "backend", "devices_per_node", "dtype", "distributed_optimizer"}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"adapter: unknown field(s) {unknown} for megatron_core (known: {sorted(known)}, or "
                          "'user' naming a job function)", path="adapter", value=unknown)
    return gpt_job(**{k: v for k, v in section.items() if k not in ("seed", "backend", "devices_per_node")})


def check_supported(job: MegatronJob, *, cuda: bool) -> None:
    """Refuse, by name, the Megatron-Core features whose state or schedule this adapter
    cannot carry exactly across a reconfiguration (``docs/megatron_core.md``)."""
    import torch

    t, o, d = job.transformer, job.optimizer, job.ddp

    def refuse(feature: str, path: str, value: object, why: str) -> None:
        raise UnsupportedFeature(f"{feature} is not supported by the megatron_core adapter: {why}", path=path,
                                 value=value)

    for name in _PARALLEL_FIELDS:
        if t.get(name) not in (None, 1) or (name == "pipeline_model_parallel_layout" and t.get(name) is not None):
            refuse(name, f"transformer.{name}", t.get(name), "the plan sets the parallel layout of every generation")
    if t.get("virtual_pipeline_model_parallel_size") not in (None, 1):
        refuse("interleaved virtual pipeline (virtual_pipeline_model_parallel_size)",
               "transformer.virtual_pipeline_model_parallel_size", t["virtual_pipeline_model_parallel_size"],
               "ResiHP's plans place one contiguous block of layers per stage and run 1F1B")
    if t.get("num_moe_experts") or t.get("expert_model_parallel_size", 1) != 1:
        refuse("MoE / expert parallelism (num_moe_experts, expert_model_parallel_size)", "transformer.num_moe_experts",
               t.get("num_moe_experts"), "expert-parallel groups and expert state are not moved between layouts")
    if t.get("context_parallel_size", 1) != 1:
        refuse("context parallelism (context_parallel_size)", "transformer.context_parallel_size",
               t["context_parallel_size"], "plans have TP x PP x DP only")
    if t.get("sequence_parallel"):
        refuse("sequence_parallel", "transformer.sequence_parallel", True,
               "its layernorm gradients are reduced outside the state this adapter moves")
    if t.get("mtp_num_layers"):
        refuse("multi-token prediction (mtp_num_layers)", "transformer.mtp_num_layers", t["mtp_num_layers"],
               "its layers are not placed by the plan")
    if (o.get("use_distributed_optimizer") or d.get("use_distributed_optimizer")) \
            and t.get("params_dtype") not in (None, torch.float32):
        refuse(f"the distributed optimizer with params_dtype {t.get('params_dtype')}",
               "optimizer.use_distributed_optimizer", True,
               "Megatron-Core's distributed optimizer takes float32 parameters (or fp16 / bf16 with float32 main "
               "parameters): it casts each main gradient shard to float32")
    if o.get("optimizer", "adam") != "adam":
        refuse(f"optimizer {o['optimizer']!r}", "optimizer.optimizer", o["optimizer"],
               "only Adam's state (exp_avg, exp_avg_sq, step) is moved")
    if t.get("fp16") or o.get("fp16") or t.get("bf16") or o.get("bf16"):
        refuse("mixed precision (fp16 / bf16)", "optimizer.bf16", True,
               "Megatron's mixed-precision optimizers keep float32 main parameters apart from the fp16 / bf16 "
               "model parameters, and the adapter's state moves one tensor per parameter in the model's dtype: the "
               "main parameters would come back rounded to fp16 / bf16 at every reconfiguration; train in float32")
    if float(o.get("clip_grad", 1.0)) > 0 and t.get("params_dtype") not in (None, torch.float32):
        refuse(f"gradient clipping with params_dtype {t.get('params_dtype')}", "optimizer.clip_grad", o.get("clip_grad", 1.0),
               "Megatron-Core's clipping accepts float32 gradients only; set clip_grad to 0.0 or train in float32")
    if d.get("overlap_grad_reduce") or d.get("overlap_param_gather"):
        refuse("overlapped gradient reduction (overlap_grad_reduce / overlap_param_gather)", "ddp.overlap_grad_reduce",
               True, "a reduction in flight cannot be rolled back with the iteration")
    if t.get("calculate_per_token_loss"):
        refuse("calculate_per_token_loss", "transformer.calculate_per_token_loss", True,
               "the global batch is re-split across replicas; the adapter scales each micro-batch's loss itself")
    if not cuda:
        for name in ("hidden_dropout", "attention_dropout"):
            if float(t.get(name, 0.1)) != 0.0:
                refuse(f"dropout without CUDA ({name}={t.get(name, 0.1)})", f"transformer.{name}", t.get(name, 0.1),
                       "Megatron-Core coordinates only the CUDA generator between TP ranks, so on CPU the masks of "
                       "a TP group differ and replicated layers drift; set it to 0.0")
