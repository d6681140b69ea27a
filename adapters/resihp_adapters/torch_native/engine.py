"""One worker's share of a torch-native job: a pipeline stage sharded with FSDP2.

Per plan generation the engine builds, over the plan's devices only:

* a new default process group joined under ``PrefixStore(f"gen{g}/", store)`` (the
  store lives with the job, so the survivors of a failure keep their processes);
* one device mesh ``("pp", "dp_replicate", "dp_shard")`` over the world, world rank
  ``stage * dp + replica`` (replica ``r`` = ``dp_replicate`` index x shard degree +
  ``dp_shard`` index). Every group gets the engine's short timeout (gloo's default
  would be 30 minutes);
* its stage as a :class:`~.model.StageModel`, each transformer block and the stage
  itself wrapped by ``fully_shard`` over the ``(dp_replicate, dp_shard)`` sub-mesh:
  FSDP2 when the shard degree equals the replicas, HSDP when it is smaller (each
  replicate group holds a whole copy, so a dead rank's shard survives elsewhere);
* a ``PipelineStage`` over the ``pp`` sub-mesh group and a ``_PipelineScheduleRuntime``
  running the action lists lowered from the core's programs (:mod:`.lowering`).

Nothing of a generation can be re-pointed at new groups (stages, meshes and FSDP bind
their groups at construction), so :meth:`TorchNativeEngine.rebuild` drops every object
of the old generation and builds them again. gloo closes a group's sockets only when the
last reference to it is gone, and two things in torch keep old groups alive (found
while bringing kill -> first iteration from ~10 s to ~1 s; docs/torch_native.md): modules
imported after a group exists capture it as a default argument (``group=dist.group.WORLD``
in ``torch.distributed.nn.functional``, FSDP's grad scaler, ZeRO), so this module imports
them before any group exists (:data:`_EARLY`); and FSDP2's objects of a built stage are
not freed by the garbage collector (a reference it cannot see), keeping their device
meshes and groups, so :meth:`TorchNativeEngine.release` unbinds the groups from every
mesh and FSDP mesh info of the generation (:func:`_unbind_groups`). State crosses generations as plain tensors: the local
shards (:meth:`local_shards`), moved by name to the new layout (:mod:`.reshard`), or a
``torch.distributed.checkpoint`` checkpoint when every copy of a shard is lost.

Gradients are sums: each micro-batch (the job's data source, :mod:`.data`) contributes
its summed token cross-entropy divided by the labelled-token count of the whole global
batch, and FSDP's gradient divide factor is 1, so the step is the same for any number of
replicas, stages or micro-batches that cover the same global batch (the accounting the
fault-free reference uses).
"""

from __future__ import annotations

import datetime
import gc
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.plan import ParallelPlan
from resihp_core.program import Program
from resihp_adapters.torch_native.data import Batches
from resihp_adapters.torch_native.lowering import lower_pipeline, lower_program
from resihp_adapters.torch_native.model import LlamaConfig, StageModel, init_parameters, loss_sum

__all__ = ["TorchNativeEngine", "Place", "shard_degree_for", "place_of", "IterationResult", "captured_groups"]

#: torch modules whose import, once a process group exists, binds that group for good
#: (as a default argument): imported here, before this process creates any group.
_EARLY = ("torch._dynamo", "torch.distributed.nn.functional", "torch.distributed.optim",
          "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor",
          "torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict")


def _import_early() -> None:
    import importlib

    for name in _EARLY:
        importlib.import_module(name)
    from torch.distributed.fsdp import fully_shard  # noqa: F401 - its lazy imports too


_import_early()


def captured_groups() -> list[str]:
    """Function defaults in loaded ``torch`` modules that hold a process group (each pins
    that group's sockets for the life of the process); empty when :data:`_EARLY` did its
    job. For tests and diagnosis: it walks every loaded torch module."""
    import inspect
    import sys

    hits = []
    for mod_name, mod in list(sys.modules.items()):
        if not mod_name.startswith("torch") or not isinstance(getattr(mod, "__dict__", None), dict):
            continue
        for key, value in list(mod.__dict__.items()):
            try:
                funcs = list(vars(value).values()) if inspect.isclass(value) else [value]
                for f in funcs:
                    f = getattr(f, "__func__", f)
                    defaults = [*(getattr(f, "__defaults__", None) or ()),
                                *(getattr(f, "__kwdefaults__", None) or {}).values()]
                    if any(isinstance(d, dist.ProcessGroup) for d in defaults):
                        hits.append(f"{mod_name}.{key}")
            except Exception:  # noqa: BLE001 - lazy module attributes may raise
                continue
    return hits


def _unbind_groups(meshes: list, fsdp_infos: list) -> None:
    """Drop the process groups a generation's device meshes and FSDP mesh infos hold:
    those objects may outlive the generation (see the module docstring), their groups
    must not."""
    for mesh in meshes:
        registry = getattr(mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    for info in fsdp_infos:
        for attr in ("shard_process_group", "replicate_process_group", "reduce_scatter_process_group"):
            if getattr(info, attr, None) is not None:
                setattr(info, attr, None)

#: (parameter, exp_avg, exp_avg_sq) local shards of one parameter, plain tensors.
Shards = tuple[Tensor, Tensor, Tensor]


def shard_degree_for(dp: int, wanted: int) -> int:
    """The FSDP shard degree used with ``dp`` replicas: the largest divisor of ``dp`` not
    above ``wanted`` (0 = shard over every replica, plain FSDP2). The rest replicates."""
    if wanted <= 0 or wanted >= dp:
        return dp
    return max(k for k in range(1, wanted + 1) if dp % k == 0)


@dataclass(frozen=True)
class Place:
    """Where a device sits in a plan: world rank, replica, stage and its FSDP coordinates."""

    rank: int
    replica: int
    stage: int
    shard_degree: int

    @property
    def shard_index(self) -> int:
        return self.replica % self.shard_degree

    @property
    def replicate_index(self) -> int:
        return self.replica // self.shard_degree


def place_of(plan: ParallelPlan, device: int, wanted_shard: int) -> Place | None:
    """The device's place in ``plan`` (None when the plan gives it no work)."""
    loc = plan.location(device)
    if loc is None:
        return None
    r, s, _ = loc
    return Place(s * plan.dp + r, r, s, shard_degree_for(plan.dp, wanted_shard))


def check_plan(plan: ParallelPlan) -> None:
    """Plans this engine executes: TP 1, every replica holds every stage, no migration."""
    for r, rep in enumerate(plan.tp_groups):
        for s, g in enumerate(rep):
            if len(g) != 1:
                raise ValueError(
                    f"replica {r} stage {s}: torch_native runs one device per stage "
                    f"(TP degree 1), got {len(g)} devices"
                )
    if plan.migrations:
        m = plan.migrations[0]
        raise ValueError(
            f"torch_native cannot run migrated work (stage {m.stage} of replica {m.replica} "
            f"mb {m.mb} -> replica {m.to}): one schedule drives one replica's pipeline"
        )


@dataclass
class IterationResult:
    iteration: int
    loss: float = 0.0  # this executor's share of the global loss (last stage only)
    forward_s: dict[int, float] = field(default_factory=dict)  # mb -> seconds
    backward_s: dict[int, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    lengths: dict[int, tuple[int, ...]] = field(default_factory=dict)  # mb -> document lengths


@contextmanager
def _default_timeout(timeout: datetime.timedelta) -> Iterator[None]:
    """Groups made without a timeout (DeviceMesh's sub-groups) get gloo's default of 30
    minutes; lower it while this generation's groups are created."""
    c10d = dist.distributed_c10d
    saved = c10d.default_pg_timeout
    c10d.default_pg_timeout = timeout
    try:
        yield
    finally:
        c10d.default_pg_timeout = saved


class TorchNativeEngine:
    """The torch objects of one worker for the current plan generation."""

    def __init__(self, device: int, model: LlamaConfig, data: Batches, store: dist.Store, *,
                 shard_degree: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 timeout_s: float = 10.0, join_timeout_s: float = 60.0) -> None:
        self.device = device
        self.cfg = model
        self.data = data
        self.store = store
        self.wanted_shard = shard_degree
        self.lr = lr
        self.weight_decay = weight_decay
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.join_timeout = datetime.timedelta(seconds=join_timeout_s)
        self.plan: ParallelPlan | None = None
        self.place: Place | None = None
        self.generation = -1
        self.iteration = 0  # optimizer steps applied
        self.mesh = None
        self.module: StageModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.stage = None
        self.schedule = None
        self._lowered: Program | None = None
        self._denom = 1.0
        self.rank_of: dict[int, int] = {}
        self.executors_group = None
        self.stretch: Callable[[float], float] = lambda seconds: seconds  # fault injection
        self.delay_comm: Callable[[], None] = lambda: None  # fault injection
        self.before_action: Callable[[], None] = lambda: None  # abort checks, heartbeats
        self.last: IterationResult | None = None
        self._kept: tuple[ParallelPlan | None, dict[str, Shards]] = (None, {})
        self._snapshot: tuple[dict[str, Shards], int] | None = None
        self._bound: tuple[list, list] = ([], [])  # this generation's meshes, FSDP mesh infos

    # ------------------------------------------------------------ generations
    def release(self) -> None:
        """Drop every object bound to the current groups and destroy them (gloo closes
        its sockets only when nothing refers to a group any more). This rank's shards
        are kept as plain tensors for :meth:`move_state`."""
        if self.module is not None:
            self._kept = (self.plan, self.local_shards())
        self.schedule = self.stage = self.optimizer = self.module = self.mesh = None
        self.executors_group = None
        self._lowered = None
        _unbind_groups(*self._bound)
        self._bound = ([], [])
        if dist.is_initialized():
            dist.destroy_process_group()
        gc.collect()

    def rebuild(self, plan: ParallelPlan, generation: int, devices: list[int] | None = None) -> None:
        """New world and meshes for ``plan`` over ``devices`` (default: the plan's);
        modules are (re)built by :meth:`start_fresh`, :meth:`move_state` or
        :meth:`load_checkpoint`. Executors take world ranks ``stage * dp + replica``;
        devices the plan leaves idle (standbys) follow, so they can still send state."""
        from torch.distributed.device_mesh import DeviceMesh

        check_plan(plan)
        self.release()
        self.plan, self.generation = plan, generation
        self.place = place_of(plan, self.device, self.wanted_shard)
        executors = plan.dp * plan.pp
        others = sorted(set(devices if devices is not None else plan.devices()) - set(plan.devices()))
        self.rank_of = {d: place_of(plan, d, self.wanted_shard).rank for d in plan.devices()}
        self.rank_of.update({d: executors + i for i, d in enumerate(others)})
        if self.device not in self.rank_of:
            raise ValueError(f"device {self.device} is not among generation {generation}'s devices")
        world = len(self.rank_of)
        rank = self.rank_of[self.device]
        prefix = dist.PrefixStore(f"gen{generation}/", self.store)
        # Survivors arrive late by up to one op timeout (blocked in the dead generation's
        # collective): wait for every member under the long join timeout first, so the
        # short timeout then only bounds the group's own operations.
        prefix.set(f"joined/{rank}", str(self.device))
        prefix.wait([f"joined/{r}" for r in range(world)], self.join_timeout)
        k = shard_degree_for(plan.dp, self.wanted_shard)
        with _default_timeout(self.timeout):
            dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world, timeout=self.timeout)
            # Every rank takes part in creating every sub-group, standbys included.
            layout = torch.arange(executors).view(plan.pp, plan.dp // k, k)
            mesh = DeviceMesh("cpu", layout, mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
            self.executors_group = None if world == executors else dist.new_group(
                list(range(executors)), timeout=self.timeout)
        self._bound[0].append(mesh)
        self.mesh = mesh if self.place is not None else None

    def _layers(self, plan: ParallelPlan, stage: int) -> tuple[int, int]:
        return plan.layer_ranges[stage]

    def _wrap(self, module: StageModel) -> None:
        """FSDP2 / HSDP over this stage's data-parallel ranks, then optimizer, pipeline
        stage and schedule runtime."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage

        plan, place = self.plan, self.place
        dp_mesh, pp_mesh = self.mesh["dp_replicate", "dp_shard"], self.mesh["pp"]
        self._bound[0].extend((dp_mesh, pp_mesh))
        with _default_timeout(self.timeout):
            for block in module.layers.values():
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        for block in (*module.layers.values(), module):
            block.set_gradient_divide_factor(1.0)  # sums: the loss carries the global scale
            block.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
            group = getattr(block._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                self._bound[1].extend(i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None)
        self.module = module
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=self.lr,
                                           weight_decay=self.weight_decay, foreach=False)
        self.stage = PipelineStage(module, place.stage, plan.pp, torch.device("cpu"),
                                   group=pp_mesh.get_group())
        self._hook_stage(self.stage)
        self.schedule = None

    def _hook_stage(self, stage) -> None:
        """Run ``before_action`` (abort check, progress beat) before every compute chunk,
        time chunks for the profile, and apply injected faults: ``stretch`` (compute
        slowdown) on every chunk, ``delay_comm`` before receives and the reduction."""
        engine = self

        def timed(fn, book):
            def run(mb, *args, **kwargs):
                engine.before_action()
                t0 = time.perf_counter()
                out = fn(mb, *args, **kwargs)
                dt = engine.stretch(time.perf_counter() - t0)
                res = engine._current
                if res is not None:
                    getattr(res, book)[mb] = getattr(res, book).get(mb, 0.0) + dt
                return out
            return run

        def delayed(fn):
            def run(*args, **kwargs):
                engine.delay_comm()
                return fn(*args, **kwargs)
            return run

        stage.forward_one_chunk = timed(stage.forward_one_chunk, "forward_s")
        stage.backward_one_chunk = timed(stage.backward_one_chunk, "backward_s")
        stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk, "backward_s")
        stage.get_fwd_recv_ops = delayed(stage.get_fwd_recv_ops)
        stage.get_bwd_recv_ops = delayed(stage.get_bwd_recv_ops)
        stage.perform_reduce_grad = delayed(stage.perform_reduce_grad)

    _current: IterationResult | None = None

    def start_fresh(self) -> None:
        """Generation 0: the seeded initial weights, empty optimizer state."""
        self.iteration = 0
        if self.place is None:
            return
        a, b = self._layers(self.plan, self.place.stage)
        module = StageModel(self.cfg, a, b).to(self.cfg.torch_dtype)
        init_parameters(module, self.cfg)
        self._wrap(module)

    def install(self, full: dict[str, Shards], step: int) -> None:
        """Build the stage from full (unsharded) tensors by name: parameters and both
        AdamW moments; each rank keeps its own FSDP shard of them."""
        from torch.distributed.tensor import distribute_tensor
        from torch.optim.optimizer import _get_scalar_dtype

        self.iteration = step
        if self.place is None:
            return
        a, b = self._layers(self.plan, self.place.stage)
        module = StageModel(self.cfg, a, b).to(self.cfg.torch_dtype)
        with torch.no_grad():
            for name, p in module.named_parameters():
                if name not in full:
                    raise KeyError(f"device {self.device}: no state for parameter {name!r}")
                p.copy_(full[name][0])
        self._wrap(module)
        if step == 0:
            return
        for name, p in self.module.named_parameters():
            _, m, v = full[name]
            self.optimizer.state[p] = {
                "step": torch.tensor(float(step), dtype=_get_scalar_dtype()),
                "exp_avg": distribute_tensor(m, p.device_mesh, p.placements, src_data_rank=None),
                "exp_avg_sq": distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None),
            }

    # ------------------------------------------------------------ state access
    def local_shards(self) -> dict[str, Shards]:
        """This rank's FSDP shards of its stage's parameters and AdamW moments, by name,
        as plain tensors (clones: valid after the groups are gone)."""
        out: dict[str, Shards] = {}
        if self.module is None:
            return out
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p, {})
            loc = p.to_local().detach()
            m = st["exp_avg"].to_local() if "exp_avg" in st else torch.zeros_like(loc)
            v = st["exp_avg_sq"].to_local() if "exp_avg_sq" in st else torch.zeros_like(loc)
            out[name] = (loc.clone(), m.clone(), v.clone())
        return out

    def restore_local(self, shards: dict[str, Shards], step: int) -> None:
        """Put back what :meth:`local_shards` returned (rollback within a generation)."""
        from torch.optim.optimizer import _get_scalar_dtype

        self.iteration = step
        if self.module is None:
            return
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                sp, sm, sv = shards[name]
                p.to_local().copy_(sp)
                p.grad = None
                st = self.optimizer.state.get(p)
                if step == 0:
                    self.optimizer.state.pop(p, None)
                elif st:
                    st["exp_avg"].to_local().copy_(sm)
                    st["exp_avg_sq"].to_local().copy_(sv)
                    st["step"] = torch.tensor(float(step), dtype=_get_scalar_dtype())
        self.schedule = None  # a failed step leaves receives and unshards pending in it

    def snapshot(self) -> None:
        """Remember this rank's shards at the start of an iteration, for rollback."""
        self._snapshot = (self.local_shards(), self.iteration)

    def rollback(self) -> None:
        """Back to the last snapshot (an iteration that was not committed everywhere)."""
        if self._snapshot is None:
            return
        from torch.distributed.tensor import DTensor

        shards, step = self._snapshot
        if self.module is not None and all(isinstance(p, DTensor) for p in self.module.parameters()):
            self.restore_local(shards, step)
            return
        # A step failed while FSDP had the stage unsharded: its objects are in no state
        # to reuse. Keep the snapshot for the next generation, which rebuilds the stage.
        self._kept = (self.plan if self.module is not None else self._kept[0], shards)
        self.schedule = self.stage = self.optimizer = self.module = None
        self.iteration = step

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, alive: set[int],
                   step: int) -> int:
        """Build this plan's stage from the survivors' shards of ``old_plan`` (after
        :meth:`rebuild`); returns bytes received. Raises
        :class:`~.reshard.StateLost` (on every device alike) when some shard has no
        surviving copy among ``alive`` devices of the new plan."""
        from resihp_adapters.torch_native.reshard import exchange, transfer_plan

        from resihp_adapters.torch_native.reshard import StateLost

        members = set(alive) & set(self.rank_of)  # only they are in the new world
        try:
            plan = transfer_plan(self.cfg, old_plan, new_plan, members, self.wanted_shard)
        except StateLost:
            if step != 0:
                raise
            plan = None  # nothing trained yet: the seeded initial weights are the state
        if plan is None:
            self.start_fresh()
            return 0
        kept_plan, kept = self._kept
        if place_of(old_plan, self.device, self.wanted_shard) is not None and (
                kept_plan is None or kept_plan.layer_ranges != old_plan.layer_ranges
                or kept_plan.location(self.device) != old_plan.location(self.device)):
            raise ValueError(f"device {self.device}: the shards it kept are not from the old plan")
        full, nbytes = exchange(self.cfg, plan, self.device, self.rank_of, kept)
        if self.place is not None:
            self.install(full, step)
        else:
            self.iteration = step
        return nbytes

    def full_state(self) -> dict[str, Shards]:
        """Full tensors of this stage (collective over the stage's data-parallel ranks)."""
        out: dict[str, Shards] = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p, {})
            full = p.full_tensor().detach().clone()
            m = st["exp_avg"].full_tensor() if "exp_avg" in st else torch.zeros_like(full)
            v = st["exp_avg_sq"].full_tensor() if "exp_avg_sq" in st else torch.zeros_like(full)
            out[name] = (full, m.clone(), v.clone())
        return out

    # ------------------------------------------------------------ execution
    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        return loss_sum(logits, targets) / self._denom

    def _prepare(self, program: Program) -> None:
        from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime
        from resihp_core.predictor.schedules import emit_programs

        if self.schedule is not None and self._lowered == program:
            return
        plan, place = self.plan, self.place
        if (program.replica, program.stage) != (place.replica, place.stage):
            raise ValueError(
                f"device {self.device}: program is for replica {program.replica} stage "
                f"{program.stage}, this device runs replica {place.replica} stage {place.stage}"
            )
        # The runtime validates the whole pipeline group's lists; this rank runs its own.
        actions = lower_pipeline(emit_programs(plan), place.replica)
        actions[place.stage] = lower_program(program)
        sched = _PipelineScheduleRuntime([self.stage], plan.num_microbatches, loss_fn=self._loss,
                                         scale_grads=False)
        sched._prepare_schedule_with_comms(actions, format="compute_comms")
        self.schedule, self._lowered = sched, program

    def run(self, program: Program, iteration: int | None = None) -> IterationResult:
        """One iteration of this executor's program, then its optimizer step."""
        it = self.iteration if iteration is None else iteration
        plan, place = self.plan, self.place
        self._prepare(program)
        res = IterationResult(it)
        self._current = res
        t_iter = time.perf_counter()
        m = plan.num_microbatches
        self._denom = float(self.data.label_count(it))
        batches = [self.data.micro_batch(it, place.replica, j, m) for j in range(m)]
        res.lengths = {j: b.lengths for j, b in enumerate(batches)}
        args = [(b.tokens,) for b in batches] if place.stage == 0 else None
        kwargs = [b.kwargs() for b in batches]  # every stage: positions and document mask
        targets = [b.labels for b in batches] if place.stage == plan.pp - 1 else None
        losses: list[Tensor] = []
        self.stage.has_backward = True
        self.stage.clear_runtime_states()
        try:
            self.schedule._step_microbatches(args, kwargs, targets, losses, return_outputs=False)
        except BaseException:
            self.schedule = None
            raise
        finally:
            self._current = None
        self.before_action()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        res.loss = float(sum(float(x.detach()) for x in losses))
        self.iteration = it + 1
        res.iteration_s = time.perf_counter() - t_iter
        self.last = res
        return res

    # ------------------------------------------------------------ checkpoints
    def _state_dicts(self) -> dict:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        return {"model": get_model_state_dict(self.module, options=opts),
                "optim": get_optimizer_state_dict(self.module, self.optimizer, options=opts)}

    def save_checkpoint(self, path: str) -> None:
        """Collective over the whole world: every stage writes its shards by name
        (FQNs are split-independent, so any later layout can read them)."""
        import torch.distributed.checkpoint as dcp

        if self.module is None:
            return
        self._ensure_optimizer_state()
        dcp.save(self._state_dicts(), checkpoint_id=path, process_group=self.executors_group)

    def _ensure_optimizer_state(self) -> None:
        """AdamW creates its state lazily; a checkpoint needs every key present."""
        from torch.optim.optimizer import _get_scalar_dtype

        for p in self.module.parameters():
            if p not in self.optimizer.state or not self.optimizer.state[p]:
                self.optimizer.state[p] = {
                    "step": torch.tensor(0.0, dtype=_get_scalar_dtype()),
                    "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}

    def load_checkpoint(self, path: str, step: int) -> None:
        """Build this plan's stage and read its shards from checkpoint ``path``, written
        after ``step`` optimizer steps under any earlier layout."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        self.iteration = step
        if self.place is None:
            return
        a, b = self._layers(self.plan, self.place.stage)
        self._wrap(StageModel(self.cfg, a, b).to(self.cfg.torch_dtype))
        self._ensure_optimizer_state()
        sd = self._state_dicts()
        dcp.load(sd, checkpoint_id=path, process_group=self.executors_group)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        set_model_state_dict(self.module, sd["model"], options=opts)
        set_optimizer_state_dict(self.module, self.optimizer, sd["optim"], options=opts)
