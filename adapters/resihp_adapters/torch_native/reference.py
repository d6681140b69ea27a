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

__all__ = ["StockPipeline", "plain_pipeline_fsdp_run", "reference_losses", "single_process_run",
           "user_single_process_run"]

#: (parameter, exp_avg, exp_avg_sq) by parameter name
Full = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


def reference_losses(job, iterations: int) -> list[float]:
    """Fault-free losses of ``job`` (a :class:`~resihp_core.job.JobSpec`) in one process:
    the job's whole global batch (``job.dp x job.num_microbatches``) per iteration, of
    the user's model, optimizer and data where ``adapter_config.user`` names them."""
    from resihp_adapters.torch_native.adapter import load_user, parse_config
    from resihp_adapters.torch_native.data import job_source

    torch.set_num_threads(1)
    c = parse_config(job.adapter_config, job.seed)
    if c["user"]:
        user = load_user(c["user"])
        return user_single_process_run(user.stages, user.recipe, user.data(job.dp * job.num_microbatches),
                                       iterations)[1]
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
    the replicas. :meth:`step` trains one iteration of the data and returns this rank's
    share of the loss (its replica's, on the last stage; 0 elsewhere). ``model``: the
    adapter's LLaMA config (AdamW at ``lr``) or a user's model as stages with its
    ``recipe``; tied copies and clipping are handled as the engine does (what a
    torchtitan user writes by hand)."""

    def __init__(self, model, data, *, pp: int, num_microbatches: int,
                 layer_ranges: list[tuple[int, int]] | None = None, shard: int = 0, lr: float = 1e-3,
                 weight_decay: float = 0.0, schedule: str = "1f1b", recipe=None, tp: int = 1,
                 tp_plan=None) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        from resihp_core.plan import ParallelPlan
        from resihp_adapters.torch_native.engine import adamw_recipe, shard_degree_for, tie_sets
        from resihp_adapters.torch_native.model import LlamaStages

        kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}
        if schedule not in kinds:
            raise ValueError(f"schedule {schedule!r}: the stock trainer runs {sorted(kinds)}")
        if isinstance(model, LlamaConfig):
            model, recipe = LlamaStages(model), recipe or adamw_recipe(lr, weight_decay)
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % pp:
            raise ValueError(f"{world} processes do not split into pp={pp} stages")
        if tp > 1:
            self._init_tp(model, data, pp=pp, tp=tp, num_microbatches=num_microbatches, layer_ranges=layer_ranges,
                          schedule=kinds[schedule], recipe=recipe, tp_plan=tp_plan)
            return
        self.tp, self.tp_index = 1, 0
        if layer_ranges is None:
            layer_ranges = list(ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=model.n_layers,
                                                        num_microbatches=num_microbatches).layer_ranges)
        self.model, self.recipe, self.data, self.pp, self.m = model, recipe, data, pp, num_microbatches
        self.dp = world // pp
        self.stage_index, self.replica = divmod(rank, self.dp)
        k = shard_degree_for(self.dp, shard)
        self.copies = self.dp // k
        mesh = init_device_mesh("cpu", (pp, self.dp // k, k), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
        a, b = layer_ranges[self.stage_index]
        module = model.build(a, b)
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        blocks = model.blocks(module)
        for block in blocks:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        for block in (*blocks, module):
            block.set_gradient_divide_factor(1.0)  # per FSDP module: it is not recursive
            block.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
        self.module = module
        self.optimizer = recipe.optimizer(list(module.parameters()))
        self.scheduler = recipe.lr_scheduler(self.optimizer) if recipe.lr_scheduler else None
        plan = ParallelPlan.uniform(tp=1, pp=pp, dp=self.dp, num_layers=model.n_layers,
                                    num_microbatches=num_microbatches).with_(layer_ranges=tuple(layer_ranges))
        self.ties = []
        for stages, where in tie_sets(model, plan):
            for r in range(self.dp):
                g = dist.new_group([s * self.dp + r for s in stages])
                if r == self.replica and self.stage_index in where:
                    self.ties.append((g, where[self.stage_index]))
        self._denom = 1.0
        stage = PipelineStage(module, self.stage_index, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = kinds[schedule](stage, num_microbatches, loss_fn=self._loss, scale_grads=False)
        self.iteration = 0

    def _init_tp(self, model, data, *, pp: int, tp: int, num_microbatches: int, layer_ranges, schedule, recipe,
                 tp_plan) -> None:
        """Stock TP x PP (one replica): a ``("pp", "tp")`` mesh, each stage parallelised
        with ``parallelize_module`` over its ``tp`` row, one ``PipelineStage`` per TP
        index over its ``pp`` column (what a torchtitan user writes)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.tensor.parallel import parallelize_module

        from resihp_core.plan import ParallelPlan
        from resihp_adapters.torch_native.engine import tie_sets
        from resihp_adapters.torch_native.tp import model_tp_plan, tp_styles

        world, rank = dist.get_world_size(), dist.get_rank()
        if world != pp * tp:
            raise ValueError(f"stock TP x PP runs one replica: {world} processes for pp={pp} x tp={tp}")
        if layer_ranges is None:
            layer_ranges = list(ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=model.n_layers,
                                                        num_microbatches=num_microbatches).layer_ranges)
        self.model, self.recipe, self.data, self.pp, self.m = model, recipe, data, pp, num_microbatches
        self.dp, self.replica, self.copies, self.tp = 1, 0, 1, tp
        self.stage_index, self.tp_index = divmod(rank, tp)
        mesh = init_device_mesh("cpu", (pp, tp), mesh_dim_names=("pp", "tp"))
        a, b = layer_ranges[self.stage_index]
        module = model.build(a, b)
        parallelize_module(module, mesh["tp"], tp_styles(model_tp_plan(model.source, tp_plan)))
        self.module = module
        self.optimizer = recipe.optimizer(list(module.parameters()))
        self.scheduler = recipe.lr_scheduler(self.optimizer) if recipe.lr_scheduler else None
        plan = ParallelPlan.uniform(tp=1, pp=pp, dp=1, num_layers=model.n_layers,
                                    num_microbatches=num_microbatches).with_(layer_ranges=tuple(layer_ranges))
        self.ties = []
        for stages, where in tie_sets(model, plan):
            for t in range(tp):  # each TP index sums its stages' copies
                g = dist.new_group([s * tp + t for s in stages])
                if t == self.tp_index and self.stage_index in where:
                    self.ties.append((g, where[self.stage_index]))
        self._denom = 1.0
        stage = PipelineStage(module, self.stage_index, pp, torch.device("cpu"), group=mesh["pp"].get_group())
        self.schedule = schedule(stage, num_microbatches, loss_fn=self._loss, scale_grads=False)
        self.iteration = 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_index == self.pp - 1

    def _loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.recipe.loss(out, y) / self._denom

    def step(self) -> float:
        from resihp_adapters.torch_native.engine import clip_global

        it, m = self.iteration, self.m
        self._denom = float(self.data.denominator(it))
        mbs = [self.data.micro_batch(it, self.replica, j, m) for j in range(m)]
        kwargs = {k: torch.cat([b.kwargs()[k] for b in mbs]) for k in mbs[0].kwargs()}
        x = torch.cat([b.args[0] for b in mbs])
        y = torch.cat([b.target for b in mbs])
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
        params = dict(self.module.named_parameters())
        for group, name in self.ties:  # tied copies on two stages: one gradient
            g = params[name].grad
            if g is not None:
                dist.all_reduce(g.to_local() if hasattr(g, "to_local") else g, group=group)
        if self.recipe.max_grad_norm is not None and self.tp > 1:
            from resihp_adapters.torch_native.tp import clip_tp

            clip_tp(self.module, self.model.aliases, self.recipe.max_grad_norm, None, self.tp_index)
        elif self.recipe.max_grad_norm is not None:
            clip_global(self.module, self.model.aliases, self.recipe.max_grad_norm, None, self.copies)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration += 1
        return float(sum(float(v.detach()) for v in out))

    def full_state(self) -> Full:
        """Full tensors of this stage (collective over its data-parallel ranks)."""
        return _full(self.module, self.optimizer, gather=True)

    def flat_state(self) -> dict:
        """The stage's complete state under the engine's layout-independent names
        (collective over its data-parallel ranks)."""
        from resihp_adapters.torch_native.engine import Held, flatten_state

        full: dict[str, Held] = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p, {})
            h = Held((p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone())
            for k, v in st.items():
                if hasattr(v, "full_tensor"):
                    h.sharded[k] = v.full_tensor().clone()
                elif isinstance(v, torch.Tensor) and v.dim() > 0:
                    h.sharded[k] = v.clone()
                else:
                    h.other[k] = v.detach().clone() if isinstance(v, torch.Tensor) else v
            full.setdefault(self.model.aliases.get(name, name), h)
        return flatten_state(full, self.optimizer, self.scheduler, self.iteration)


def user_single_process_run(stages, recipe, data, iterations: int) -> tuple[dict, list[float]]:
    """The whole user model in one process over every global micro-batch of each
    iteration, with torch's own ``clip_grad_norm_``: the reference the distributed runs
    must equal. Returns (flattened complete state, losses)."""
    from resihp_adapters.torch_native.engine import Held, flatten_state

    model = stages.build(0, stages.n_layers)
    opt = recipe.optimizer(list(model.parameters()))
    sched = recipe.lr_scheduler(opt) if recipe.lr_scheduler else None
    losses = []
    for it in range(iterations):
        denom = float(data.denominator(it))
        total = 0.0
        for g in range(data.global_microbatches):
            mb = data.global_batch(it, g)
            loss = recipe.loss(model(*mb.args, **mb.kwargs()), mb.target) / denom
            loss.backward()
            total += float(loss.detach())
        if recipe.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.max_grad_norm)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    full = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        h = Held(p.detach().clone())
        for k, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                h.sharded[k] = v.clone()
            else:
                h.other[k] = v.clone() if isinstance(v, torch.Tensor) else v
        full[name] = h
    return flatten_state(full, opt, sched, iterations), losses


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
