"""References the adapter is checked against.

* :func:`plain_pipeline_fsdp_run`: what a user writes with stock torch — stages with
  ``fully_shard``, ``PipelineStage`` and ``Schedule1F1B`` / ``ScheduleGPipe`` stepping
  whole batches — with none of ResiHP's machinery (no lowered programs, no rebuilds).
* :func:`single_process_run`: the whole model in one process over the same global
  batches (any plan that covers a global batch with the same micro-batches must give
  these parameters).
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from resihp_adapters.torch_native.data import DataSpec, micro_batch
from resihp_adapters.torch_native.model import LlamaConfig, build_stage, loss_sum

__all__ = ["plain_pipeline_fsdp_run", "reference_losses", "single_process_run"]


def reference_losses(job, iterations: int) -> list[float]:
    """Fault-free losses of ``job`` (a :class:`~resihp_core.job.JobSpec`) in one process:
    ``job.dp x job.num_microbatches`` micro-batches per iteration, whatever the plan."""
    from resihp_adapters.torch_native.adapter import parse_config

    torch.set_num_threads(1)
    c = parse_config(job.adapter_config, job.seed)
    return single_process_run(c["model"], c["data"], [job.dp * job.num_microbatches] * iterations,
                              lr=c["lr"], weight_decay=c["weight_decay"])[1]


def single_process_run(cfg: LlamaConfig, data: DataSpec, microbatches: list[int], *,
                       lr: float = 1e-3, weight_decay: float = 0.0) -> tuple[dict, list[float]]:
    """Train the whole model, iteration ``i`` on global micro-batches
    ``0 .. microbatches[i] - 1`` (the accounting of the plan that ran it); returns
    ({name: (param, exp_avg, exp_avg_sq)}, losses)."""
    model = build_stage(cfg, 0, cfg.n_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    losses = []
    for it, count in enumerate(microbatches):
        denom = float(count * data.tokens_per_microbatch)
        total = 0.0
        for g in range(count):
            x, y = micro_batch(data, it, g)
            loss = loss_sum(model(x), y) / denom
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    out = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        out[name] = (p.detach().clone(), st.get("exp_avg", torch.zeros_like(p)).clone(),
                     st.get("exp_avg_sq", torch.zeros_like(p)).clone())
    return out, losses


def plain_pipeline_fsdp_run(rank: int, world: int, store: dist.Store, cfg: LlamaConfig,
                            data: DataSpec, *, pp: int, layer_ranges: list[tuple[int, int]],
                            num_microbatches: int, iterations: int, lr: float = 1e-3,
                            weight_decay: float = 0.0, schedule: str = "1f1b", timeout_s: float = 30.0) -> tuple[dict, list[float]]:
    """Stock torch: ``pp`` stages x ``world // pp`` FSDP2 replicas (world rank
    ``stage * dp + replica``). Returns this rank's full stage tensors (gathered) and
    the per-iteration loss of its replica (last stage; zeros elsewhere)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, Schedule1F1B

    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    try:
        dp = world // pp
        s, r = divmod(rank, dp)
        mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
        a, b = layer_ranges[s]
        module = build_stage(cfg, a, b)
        for block in module.layers.values():
            fully_shard(block, mesh=mesh["dp"], reshard_after_forward=False)
        fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
        for block in (*module.layers.values(), module):
            block.set_gradient_divide_factor(1.0)  # per FSDP module: it is not recursive
            block.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        opt = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        m = num_microbatches
        denom = float(dp * m * data.tokens_per_microbatch)
        stage = PipelineStage(module, s, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        sched = kind(stage, m, loss_fn=lambda out, y: loss_sum(out, y) / denom, scale_grads=False)
        losses = []
        for it in range(iterations):
            mbs = [micro_batch(data, it, r * m + j) for j in range(m)]
            x = torch.cat([x for x, _ in mbs])
            y = torch.cat([y for _, y in mbs])
            out: list = []
            if s == 0 and s == pp - 1:
                sched.step(x, target=y, losses=out)
            elif s == 0:
                sched.step(x)
            elif s == pp - 1:
                sched.step(target=y, losses=out)
            else:
                sched.step()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(sum(float(v.detach()) for v in out)))
        full = {}
        for name, p in module.named_parameters():
            st = opt.state[p]
            full[name] = (p.full_tensor().clone(), st["exp_avg"].full_tensor().clone(),
                          st["exp_avg_sq"].full_tensor().clone())
        return full, losses
    finally:
        dist.destroy_process_group()
