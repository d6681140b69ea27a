"""What ``pretrain_gpt``'s setup builds, for one plan or one stock run: the
``TransformerConfig`` of a TP x PP layout with a layer split, and this stage's model,
Megatron ``DistributedDataParallel``, Megatron optimizer and parameter scheduler. The
adapter (every plan generation) and the stock runner (:mod:`.stock`, plain torchrun)
share it, so both train the same job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from resihp_core.config import ConfigError

from resihp_adapters.megatron_core.spec import MegatronJob

__all__ = ["Training", "transformer_config", "build_training", "samples_of"]


@dataclass
class Training:
    """One stage's training objects; they hold this generation's process groups."""

    config: Any  # TransformerConfig
    model: Any  # the user's GPTModel
    ddp: Any  # megatron.core.distributed.DistributedDataParallel
    optimizer: Any  # MegatronOptimizer
    scheduler: Any  # OptimizerParamScheduler | None


def transformer_config(job: MegatronJob, *, tp: int, pp: int, layer_ranges: Sequence[tuple[int, int]] | None,
                       cuda: bool) -> Any:
    """The job's ``TransformerConfig`` for TP ``tp`` and PP ``pp``; ``layer_ranges``
    (one per stage) becomes Megatron's ``pipeline_model_parallel_layout`` (None: its own
    even split). Without CUDA: CPU initialisation and unbatched point-to-point (gloo)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    t = dict(job.transformer)
    t.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    t.setdefault("pipeline_dtype", t.get("params_dtype", torch.float32))
    if pp > 1 and layer_ranges is not None:
        layout = [["decoder"] * (b - a) for a, b in layer_ranges]
        layout[0].insert(0, "embedding")
        layout[-1].append("loss")
        t["pipeline_model_parallel_layout"] = layout
    if not cuda:
        t.setdefault("use_cpu_initialization", True)
        t["batch_p2p_comm"] = False  # gloo has no batched isend/irecv
    if layer_ranges is not None and t.get("num_layers") != layer_ranges[-1][1]:
        raise ConfigError(f"the plan has {layer_ranges[-1][1]} layers, the model's TransformerConfig.num_layers is "
                          f"{t.get('num_layers')}", path="transformer.num_layers", value=t.get("num_layers"))
    return TransformerConfig(**t)


def build_training(job: MegatronJob, config: Any, *, seed: int, device: torch.device | None) -> Training:
    """This stage's model (seeded: every rank holding a parameter starts from the same
    values), wrapped and optimised as ``pretrain_gpt`` does; ``device`` None: the CPU."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    torch.manual_seed(seed)
    if device is not None and device.type == "cuda":
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
    model = job.model_provider(config, ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage())
    if device is not None:
        model = model.to(device)
    ddp_kw, opt_kw = dict(job.ddp), dict(job.optimizer)
    # pretrain_gpt sets both from one flag: the DDP buffers are laid out for the
    # optimizer's shards.
    dist_opt = bool(ddp_kw.get("use_distributed_optimizer") or opt_kw.get("use_distributed_optimizer"))
    ddp_kw["use_distributed_optimizer"] = opt_kw["use_distributed_optimizer"] = dist_opt
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(**ddp_kw), model)
    opt_kw.setdefault("params_dtype", config.params_dtype)
    optimizer = get_megatron_optimizer(OptimizerConfig(**opt_kw), [ddp])
    scheduler = OptimizerParamScheduler(optimizer, **job.scheduler) if job.scheduler else None
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    return Training(config, model, ddp, optimizer, scheduler)


def samples_of(job: MegatronJob, iteration: int, global_mb: int, global_mbs: int) -> Any:
    """Global micro-batch ``global_mb`` of ``iteration`` (``global_mbs`` per iteration),
    collated: samples ``(iteration * global_mbs + global_mb) * mbs + k``."""
    b = job.micro_batch_size
    first = (iteration * global_mbs + global_mb) * b
    samples = [job.dataset[first + k] for k in range(b)]
    if job.collate is not None:
        return job.collate(samples)
    return {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
