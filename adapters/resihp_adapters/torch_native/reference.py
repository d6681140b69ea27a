"""References the adapter is checked against, and the stock-torch trainer.

* :class:`StockPipeline`: what a user writes with stock torch — stages with
  ``fully_shard`` (HSDP with a 2-D mesh when asked), ``PipelineStage`` and
  ``Schedule1F1B`` / ``ScheduleGPipe`` stepping whole batches — with none of ResiHP's
  machinery (no lowered programs, no rebuilds). It is also what
  :func:`~resihp_adapters.torch_native.api.initialize` runs outside ``resihp launch``
  (plain ``accelerate launch`` / ``torchrun``): nothing survives a failure there.
* :func:`single_process_run`: the whole model in one process over the same global
  batches (any plan that covers a global batch with the same micro-batches must give
  these parameters).

Both read the job's data source through :class:`~.data.Batches`, like the adapter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from resihp_adapters.torch_native.data import Batches
from resihp_adapters.torch_native.model import LlamaConfig, build_stage, loss_sum

__all__ = ["StockPipeline", "plain_pipeline_fsdp_run", "reference_losses", "single_process_run"]

#: (parameter, exp_avg, exp_avg_sq) by parameter name
Full = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def reference_losses(job, iterations: int) -> list[float]:
    """Fault-free losses of ``job`` (a :class:`~resihp_core.job.JobSpec`) in one process:
    the job's whole global batch (``job.dp x job.num_microbatches``) per iteration."""
    from resihp_adapters.torch_native.adapter import parse_config
    from resihp_adapters.torch_native.data import job_source

    torch.set_num_threads(1)
    c = parse_config(job.adapter_config, job.seed)
    data = Batches(job_source(job, c["model"].vocab_size), c["model"].torch_dtype)
    return single_process_run(c["model"], data, iterations, lr=c["lr"], weight_decay=c["weight_decay"])[1]


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer, gather: bool) -> Full:
    out: Full = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        full = (lambda t: t.full_tensor()) if gather else (lambda t: t)  # noqa: E731
        out[name] = (full(p).detach().clone(),
                     full(st["exp_avg"]).clone() if "exp_avg" in st else torch.zeros_like(full(p)),
                     full(st["exp_avg_sq"]).clone() if "exp_avg_sq" in st else torch.zeros_like(full(p)))
    return out


def single_process_run(cfg: LlamaConfig, data: Batches, iterations: int, *, lr: float = 1e-3,
                       weight_decay: float = 0.0) -> tuple[Full, list[float]]:
    """Train the whole model on every global micro-batch of each iteration; returns
    ({name: (param, exp_avg, exp_avg_sq)}, losses)."""
    model = build_stage(cfg, 0, cfg.n_layers)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
    g_all = data.global_microbatches
    losses = []
    for it in range(iterations):
        denom = float(data.label_count(it))
        total = 0.0
        for g in range(g_all):
            mb = data.micro_batch(it, 0, g, g_all)
            loss = loss_sum(model(mb.tokens, **mb.kwargs()), mb.labels) / denom
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return _full(model, opt, gather=False), losses


class StockPipeline:
    """Stock torch on the default group: ``pp`` stages x ``world // pp`` FSDP2 replicas
    (world rank ``stage * dp + replica``), HSDP when ``shard`` is a smaller divisor of
    the replicas. :meth:`step` trains one iteration of the job's data and returns this
    rank's share of the loss (its replica's, on the last stage; 0 elsewhere)."""

    def __init__(self, cfg: LlamaConfig, data: Batches, *, pp: int, num_microbatches: int,
                 layer_ranges: list[tuple[int, int]] | None = None, shard: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.0, schedule: str = "1f1b") -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from resihp_adapters.torch_native.engine import shard_degree_for

        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        if schedule not in kinds:
            raise ValueError(f"schedule {schedule!r}: the stock trainer runs {sorted(kinds)}")
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % pp:
            raise ValueError(f"{world} processes do not split into pp={pp} stages")
        if layer_ranges is None:
            from resihp_core.plan import ParallelPlan

            layer_ranges = list(ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=cfg.n_layers,
                                                        num_microbatches=num_microbatches).layer_ranges)
        self.cfg, self.data, self.pp, self.m = cfg, data, pp, num_microbatches
        self.dp = world // pp
        self.stage_index, self.replica = divmod(rank, self.dp)
        k = shard_degree_for(self.dp, shard)
        mesh = init_device_mesh("cpu", (pp, self.dp // k, k), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        a, b = layer_ranges[self.stage_index]
        module = build_stage(cfg, a, b)
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        for block in module.layers.values():
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        for block in (*module.layers.values(), module):
            block.set_gradient_divide_factor(1.0)  # per FSDP module: it is not recursive
            block.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=lr, weight_decay=weight_decay, foreach=False)
        self._denom = 1.0
        stage = PipelineStage(module, self.stage_index, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = kinds[schedule](stage, num_microbatches, loss_fn=self._loss, scale_grads=False)
        self.iteration = 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.pp - 1

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_sum(out, y) / self._denom

    def step(self) -> float:
        it, m = self.iteration, self.m
        self._denom = float(self.data.label_count(it))
        mbs = [self.data.micro_batch(it, self.replica, j, m) for j in range(m)]
        kwargs = {"pos": torch.cat([b.pos for b in mbs]), "mask": torch.cat([b.mask for b in mbs])}
        x = torch.cat([b.tokens for b in mbs])
        y = torch.cat([b.labels for b in mbs])
        out: list = []
        first, last = self.stage_index == 0, self.is_last_stage
        if first and last:
            self.schedule.step(x, target=y, losses=out, **kwargs)
        elif first:
            self.schedule.step(x, **kwargs)
        elif last:
            self.schedule.step(target=y, losses=out, **kwargs)
        else:
            self.schedule.step(**kwargs)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return float(sum(float(v.detach()) for v in out))

    def full_state(self) -> Full:
        """Full tensors of this stage (collective over its data-parallel ranks)."""
        return _full(self.module, self.optimizer, gather=True)


def plain_pipeline_fsdp_run(rank: int, world: int, store: dist.Store, cfg: LlamaConfig, data: Batches, *,
                            pp: int, layer_ranges: list[tuple[int, int]], num_microbatches: int,
                            iterations: int, lr: float = 1e-3, weight_decay: float = 0.0,
                            schedule: str = "1f1b", timeout_s: float = 30.0) -> tuple[Full, list[float]]:
    """:class:`StockPipeline` in a world of its own (``store``); returns this rank's full
    stage tensors (gathered) and its per-iteration loss share."""
    import datetime

    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        run = StockPipeline(cfg, data, pp=pp, num_microbatches=num_microbatches, layer_ranges=layer_ranges,
                            lr=lr, weight_decay=weight_decay, schedule=schedule)
        losses = [run.step() for _ in range(iterations)]
        return run.full_state(), losses
    finally:
        dist.destroy_process_group()
