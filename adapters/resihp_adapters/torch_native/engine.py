"""One worker's share of a torch-native job: a pipeline stage sharded with FSDP2.

Per plan generation the engine builds, over the plan's devices only:

* a new default process group joined in the generation's rendezvous (the
  store lives with the job, so the survivors of a failure keep their processes);
* one device mesh ``("pp", "dp_replicate", "dp_shard")`` over the world, world rank
  ``stage * dp + replica`` (replica ``r`` = ``dp_replicate`` index x shard degree +
  ``dp_shard`` index). Every group gets the engine's short timeout (gloo's default
  would be 30 minutes);
* its stage as a :class:`~.model.StageModel`, each transformer block and the stage
  itself wrapped by ``fully_shard`` over the ``(dp_replicate, dp_shard)`` sub-mesh:
  FSDP2 when the shard degree equals the replicas, HSDP when it is smaller (each
  replicate group holds a whole copy, so a dead rank's shard survives elsewhere); with
  shard degree 1 (nothing sharded) the stage alone is wrapped, one FSDP group;
* a ``PipelineStage`` over the ``pp`` sub-mesh group and a ``_PipelineScheduleRuntime``
  running the action lists lowered from the core's programs (:mod:`.lowering`); a
  one-stage program (pp = 1) runs on :class:`SingleStage` instead.

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
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from resihp_core.plan import ParallelPlan
from resihp_core.program import Program
from resihp_core.runtime.session import join_members, rendezvous_store
from resihp_adapters.torch_native.async_checkpoint import DcpPlan, Staging, plan_writes
from resihp_adapters.torch_native.lowering import lower_pipeline, lower_program
from resihp_adapters.torch_native.model import LlamaConfig, LlamaStages, loss_sum
from resihp_adapters.torch_native.unsharded import alias_unsharded
from resihp_adapters.torch_native.replica_reduce import ReplicaReducer
from resihp_adapters.torchkit.device import CPU, ChunkTimer, Placement, release_world

__all__ = ["TorchNativeEngine", "SingleStage", "Place", "Held", "Recipe", "StageSource", "shard_degree_for",
           "place_of", "live_replicas", "IterationResult", "captured_groups", "adamw_recipe"]

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

@dataclass
class Held:
    """One parameter's state on one rank as plain tensors (valid after the groups are
    gone): its dim-0 FSDP shard (or the whole tensor), the optimizer state sharded like
    it (``exp_avg``, ``momentum_buffer``, ...), and the rest, which every holder has
    whole (step counts). Names of the user's optimizer state are kept as they are."""

    param: Tensor
    sharded: dict[str, Tensor] = field(default_factory=dict)
    other: dict[str, object] = field(default_factory=dict)

    def tensors(self) -> tuple[Tensor, ...]:
        """The parameter, then its sharded optimizer state by key (the held-state order)."""
        return (self.param, *(self.sharded[k] for k in sorted(self.sharded)))


@dataclass
class Recipe:
    """The parts of the user's training that are not the model: optimizer factory (any
    ``torch.optim`` class over a list of parameters), loss (unscaled, see :meth:`run`),
    LR scheduler factory (its position follows the committed iteration) and clipping of
    the global gradient norm."""

    optimizer: Callable[[list], torch.optim.Optimizer]
    loss: Callable[[Tensor, Tensor], Tensor]
    lr_scheduler: Callable[[torch.optim.Optimizer], object] | None = None
    max_grad_norm: float | None = None


class StageSource(Protocol):
    """What the engine needs of a model (:class:`~.model.LlamaStages`,
    :class:`~.split.UserStages`): stages by block range, named by the model's own names."""

    n_layers: int
    dtype: torch.dtype
    aliases: dict[str, str]

    def build(self, start: int, end: int, *, init: bool = True) -> nn.Module:
        """Layers ``[start, end)``; ``init=False``: every parameter is about to be
        overwritten (a stage rebuilt from state), so a source may leave them
        uninitialised (buffers must still be right)."""
        ...

    def blocks(self, module: nn.Module) -> list[nn.Module]: ...

    def names(self, start: int, end: int) -> list[str]: ...


class Batch(Protocol):
    """One micro-batch as the pipeline takes it (:class:`~.data.MicroBatch`, :class:`~.data.UserBatch`)."""

    args: tuple[Tensor, ...]  # the first stage's input
    target: Tensor  # the last stage's loss target
    lengths: tuple[int, ...]  # document lengths, for the profiles

    def kwargs(self) -> dict[str, Tensor]: ...  # every stage's keyword arguments


class Feed(Protocol):
    """The job's data as micro-batches (:class:`~.data.Batches`, :class:`~.data.UserData`)."""

    def micro_batch(self, iteration: int, owner: int, mb: int, per_replica: int) -> Batch: ...

    def denominator(self, iteration: int) -> float: ...


def adamw_recipe(lr: float, weight_decay: float) -> Recipe:
    """The built-in model's recipe: AdamW, summed token cross-entropy, no clipping.
    AdamW's foreach kernels: on FSDP's DTensors the per-parameter loop costs several
    times as much in dispatch (docs/benchmarks.md); the result equals the single-process
    reference's loop within rounding."""
    return Recipe(optimizer=lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=weight_decay, foreach=True),
                  loss=loss_sum)


def shard_degree_for(dp: int, wanted: int) -> int:
    """The FSDP shard degree used with ``dp`` replicas: the largest divisor of ``dp`` not
    above ``wanted`` (0 = shard over every replica, plain FSDP2). The rest replicates."""
    if wanted <= 0 or wanted >= dp:
        return dp
    return max(k for k in range(1, wanted + 1) if dp % k == 0)


@dataclass(frozen=True)
class Place:
    """Where a device sits in a plan: world rank, replica (the plan's index: programs and
    data name it), stage, and its FSDP coordinates, which count only the replicas that
    have devices (``slot``: this replica's index among them)."""

    rank: int
    replica: int
    stage: int
    shard_degree: int
    slot: int
    tp_index: int = 0
    tp_degree: int = 1

    @property
    def shard_index(self) -> int:
        return self.slot % self.shard_degree

    @property
    def replicate_index(self) -> int:
        return self.slot // self.shard_degree


def live_replicas(plan: ParallelPlan) -> list[int]:
    """Replicas with devices. A replica without any (dropped; its micro-batches run
    whole on the others, docs/torch_native.md "Uneven DP") takes no part in FSDP."""
    return [r for r, rep in enumerate(plan.tp_groups) if any(rep)]


def place_of(plan: ParallelPlan, device: int, wanted_shard: int) -> Place | None:
    """The device's place in ``plan`` (None when the plan gives it no work)."""
    loc = plan.location(device)
    if loc is None:
        return None
    r, s, t = loc
    live = live_replicas(plan)
    slot = live.index(r)
    k = shard_degree_for(len(live), wanted_shard)
    if all(len(g) <= 1 for rep in plan.tp_groups for g in rep):
        return Place(s * len(live) + slot, r, s, k, slot)
    # TP (docs/torch_native.md, "Tensor parallelism"): ranks stage-major, then replica, TP index
    rank = sum(plan.degree(rr, ss) for ss in range(plan.pp) for rr in range(plan.dp)
               if (ss, rr) < (s, r)) + t
    return Place(rank, r, s, k, slot, t, plan.degree(r, s))


def check_plan(plan: ParallelPlan) -> None:
    """Plans this engine executes: TP 1; migrated micro-batches only whole (every stage
    on the executing replica's own pipeline: a torch schedule drives one pipeline group,
    docs/torch_native.md "Migration"); every replica with devices has work."""
    from resihp_core.adapter import partial_migrations

    for r, rep in enumerate(plan.tp_groups):
        for s, g in enumerate(rep):
            if len(g) > 1:
                raise ValueError(
                    f"replica {r} stage {s}: torch_native runs one device per stage "
                    f"(TP degree 1), got {len(g)} devices"
                )
    why = partial_migrations(plan)
    if why:
        raise ValueError(f"torch_native runs migrated micro-batches only whole: {why[0]}")
    for r in live_replicas(plan):
        if not plan.work(r, 0):
            raise ValueError(f"replica {r} has devices but no micro-batch: FSDP's gradient reduction "
                             "needs every replica's backward (drop the replica instead)")


@dataclass
class IterationResult:
    iteration: int
    loss: float = 0.0  # this executor's share of the global loss (last stage only)
    forward_s: dict[int, float] = field(default_factory=dict)  # mb -> seconds
    backward_s: dict[int, float] = field(default_factory=dict)
    iteration_s: float = 0.0
    lengths: dict[int, tuple[int, ...]] = field(default_factory=dict)  # mb -> document lengths
    # (owner, mb) of each local micro-batch index the dicts above use: this replica's
    # work, its own micro-batches and those migrated to it (uneven DP)
    work: list[tuple[int, int]] = field(default_factory=list)


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
    """The torch objects of one worker for the current plan generation.

    ``model``: the adapter's :class:`~.model.LlamaConfig` (trained with AdamW at ``lr``
    / ``weight_decay``) or a :class:`StageSource` (a user's model) with its ``recipe``.
    ``data``: a :class:`Feed`."""

    def __init__(self, device: int, model: LlamaConfig | StageSource, data: Feed, store: dist.Store, *,
                 shard_degree: int = 0, lr: float = 1e-3, weight_decay: float = 0.0,
                 recipe: Recipe | None = None, timeout_s: float = 10.0, join_timeout_s: float = 60.0,
                 placement: Placement = CPU) -> None:
        self.device = device
        self.placement = placement  # where tensors live, which backend (docs/gpu.md)
        if isinstance(model, LlamaConfig):
            self.cfg: LlamaConfig | None = model
            self.model: StageSource = LlamaStages(model)
            self.recipe = recipe or adamw_recipe(lr, weight_decay)
        else:
            if recipe is None:
                raise ValueError("a user's model needs its recipe (optimizer factory, loss)")
            self.cfg, self.model, self.recipe = None, model, recipe
        self.data = data
        self.store = store
        self.wanted_shard = shard_degree
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.join_timeout = datetime.timedelta(seconds=join_timeout_s)
        self.plan: ParallelPlan | None = None
        self.place: Place | None = None
        self.generation = -1
        self.iteration = 0  # optimizer steps applied
        self.mesh = None
        self.module: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: object | None = None
        self.stage = None
        self.schedule = None
        self._lowered: Program | None = None
        self._denom = 1.0
        self.rank_of: dict[int, int] = {}
        self.executors_group = None
        # Who writes checkpoints (:meth:`save_checkpoint`): DCP over ``checkpoint_group``
        # (None: the executors' group), by the ranks whose ``writes_checkpoint`` is set.
        self.checkpoint_group = None
        self.writes_checkpoint = True
        # Checkpoints off the training path (:meth:`stage_checkpoint`, .async_checkpoint):
        # host buffers reused across checkpoints, and this generation's DCP write plan.
        self._staging = Staging()
        self._dcp_plan: DcpPlan | None = None
        self._ties: list[tuple[object, str]] = []  # (group, this stage's name of the tied parameter)
        self.stretch: Callable[[float], float] = lambda seconds: seconds  # fault injection
        self.delay_comm: Callable[[], None] = lambda: None  # fault injection
        self.flip_due: Callable[[str], bool] = lambda target: False  # injected SDC (docs/sdc.md)
        self.corrupt: Callable[[str, dict[str, Tensor]], None] = lambda target, named: None
        self.watch_grads = False  # compute grad_norm at each step (docs/sdc.md, range signals)
        self.grad_norm: float | None = None
        self.before_action: Callable[[], None] = lambda: None  # abort checks, heartbeats
        self.last: IterationResult | None = None
        self._kept: tuple[ParallelPlan | None, dict[str, Held]] = (None, {})
        # Rollback copies, oldest first: (shards, iteration they were taken at the start
        # of). One, or two while the worker overlaps a commit with the next iteration
        # (:meth:`keep_snapshots`, docs/torch_native.md "The commit off the critical path").
        self._snapshots: list[tuple[dict[str, Held], int]] = []
        self._depth = 1
        self._spare: dict[str, Held] | None = None  # a dropped snapshot's buffers, for the next one
        self._snap_module: nn.Module | None = None  # the stage the snapshots' buffers were made for
        # id(buffers) -> (buffers, sources, destinations, module, optimizer, guard): :meth:`_copy_into`
        self._copy_plans: dict[int, tuple] = {}
        self._bound: tuple[list, list] = ([], [])  # this generation's meshes, FSDP mesh infos
        self._reducer: ReplicaReducer | None = None  # a shard-degree-1 stage's gradient reduction
        # The step after the commit (:meth:`defer_steps`): :meth:`run` stops before the
        # optimizer step, which :meth:`apply_step` takes once the iteration committed.
        self.defer = False
        self._deferred: int | None = None  # the iteration whose step is pending
        self._step_s = 0.0  # the last deferred step's seconds, counted in the next iteration
        self._sharded: list[tuple[str, Tensor]] = []  # the stage's sharded parameters (_wrap), for _discard
        #: the user's loop mode (:mod:`.loop`): the stage is the user's whole model, no
        #: PipelineStage; pp = 1 only
        self.whole = False

    def canonical(self, name: str) -> str:
        """The state's name of a stage parameter (a tied copy is named by its first name)."""
        return self.model.aliases.get(name, name)

    def stage_names(self, plan: ParallelPlan, stage: int) -> list[str]:
        """State names (canonical) of the parameters ``plan``'s stage holds."""
        a, b = plan.layer_ranges[stage]
        return list(dict.fromkeys(self.canonical(n) for n in self.model.names(a, b)))

    # ------------------------------------------------------------ generations
    def release(self) -> None:
        """Drop every object bound to the current groups and destroy them (gloo closes
        its sockets only when nothing refers to a group any more). This rank's shards
        are kept as plain tensors for :meth:`move_state`."""
        if self.module is not None:
            # the stage's own tensors: nothing writes them once the stage is dropped here
            self._kept = (self.plan, self.local_shards(copy=False))
        self.schedule = self.stage = self.optimizer = self.scheduler = self.module = self.mesh = None
        self._drop_reducer()
        self._copy_plans = {}  # they hold the stage's tensors: nothing may pin the old groups
        self._sharded = []
        self.executors_group = self.checkpoint_group = None
        self.writes_checkpoint = True
        self._dcp_plan = None  # made over this generation's group: the next one plans again
        self._ties = []
        self._lowered = None
        _unbind_groups(*self._bound)
        self._bound = ([], [])
        release_world(self.placement)  # NCCL communicators aborted, gloo ones destroyed

    def _drop_reducer(self) -> None:
        """The generation's replica reduction goes with its groups (hooks removed)."""
        if self._reducer is not None:
            self._reducer.close()
            self._reducer = None

    def rebuild(self, plan: ParallelPlan, generation: int, devices: list[int] | None = None) -> None:
        """New world and meshes for ``plan`` over ``devices`` (default: the plan's);
        modules are (re)built by :meth:`start_fresh`, :meth:`move_state` or
        :meth:`load_checkpoint`. Executors take world ranks ``stage * dp + replica``;
        devices the plan leaves idle (standbys) follow, so they can still send state."""
        from torch.distributed.device_mesh import DeviceMesh

        check_plan(plan)
        if self.whole and plan.pp != 1:
            raise ValueError(f"the user's loop mode runs data-parallel plans only (pp = 1), got pp = {plan.pp}")
        self.release()
        self.plan, self.generation = plan, generation
        self.place = place_of(plan, self.device, self.wanted_shard)
        live = live_replicas(plan)
        executors = len(live) * plan.pp
        others = sorted(set(devices if devices is not None else plan.devices()) - set(plan.devices()))
        self.rank_of = {d: place_of(plan, d, self.wanted_shard).rank for d in plan.devices()}
        self.rank_of.update({d: executors + i for i, d in enumerate(others)})
        if self.device not in self.rank_of:
            raise ValueError(f"device {self.device} is not among generation {generation}'s devices")
        world = len(self.rank_of)
        rank = self.rank_of[self.device]
        prefix = rendezvous_store(self.store, generation)
        # Survivors arrive late by up to one op timeout (blocked in the dead generation's
        # collective): wait for every member under the long join timeout first, so the
        # short timeout then only bounds the group's own operations.
        join_members(prefix, rank, self.device, world, self.join_timeout)
        k = shard_degree_for(len(live), self.wanted_shard)
        with _default_timeout(self.timeout):
            dist.init_process_group(self.placement.init_backend, store=prefix, rank=rank, world_size=world,
                                    timeout=self.timeout)
            # Every rank takes part in creating every sub-group, standbys included.
            layout = torch.arange(executors).view(plan.pp, len(live) // k, k)
            mesh = DeviceMesh(self.placement.device.type, layout, mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
            self.executors_group = None if world == executors else dist.new_group(
                list(range(executors)), timeout=self.timeout)
            if len(live) > k:
                # HSDP: the replicas of replicate index 0 hold every shard of every stage,
                # so they alone write checkpoints (:meth:`save_checkpoint`).
                self.checkpoint_group = dist.new_group(
                    [s * len(live) + slot for s in range(plan.pp) for slot in range(k)], timeout=self.timeout)
                self.writes_checkpoint = self.place is not None and self.place.replicate_index == 0
            for stages, where in tie_sets(self.model, plan):
                for slot, r in enumerate(live):
                    ranks = [s * len(live) + slot for s in stages]
                    g = dist.new_group(ranks, timeout=self.timeout)
                    if self.place is not None and self.place.replica == r and self.place.stage in where:
                        self._ties.append((g, where[self.place.stage]))
        self._bound[0].append(mesh)
        self.mesh = mesh if self.place is not None else None

    def _layers(self, plan: ParallelPlan, stage: int) -> tuple[int, int]:
        return plan.layer_ranges[stage]

    def _build(self, init: bool = True) -> nn.Module:
        if self.whole:
            return self.model.build_whole().to(self.placement.device)
        a, b = self._layers(self.plan, self.place.stage)
        return self.model.build(a, b, init=init).to(self.placement.device)

    def _wrap(self, module: nn.Module) -> None:
        """FSDP2 / HSDP over this stage's data-parallel ranks, then optimizer, LR
        scheduler, pipeline stage and schedule runtime."""
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage

        plan, place = self.plan, self.place
        dp_mesh, pp_mesh = self.mesh["dp_replicate", "dp_shard"], self.mesh["pp"]
        self._bound[0].extend((dp_mesh, pp_mesh))
        # Per-block FSDP groups bound the unsharded memory and overlap each block's
        # reduction with the backward of the next. Unsharded, every rank holds the whole
        # stage anyway (shard degree 1: pure replicas, or one replica): one group for
        # the stage (one all-gather copy per iteration instead of one per block), and
        # its gradients reduced as DDP reduces them (below).
        blocks = self.model.blocks(module) if place.shard_degree > 1 else []
        with _default_timeout(self.timeout):
            for block in blocks:
                fully_shard(block, mesh=dp_mesh, reshard_after_forward=False)
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)
        _flags_on_known_groups(module, [*blocks, module])
        for block in (*blocks, module):
            block.set_gradient_divide_factor(1.0)  # sums: the loss carries the global scale
            block.set_force_sum_reduction_for_comms(True)  # gloo has no AVG / PREMUL_SUM
            group = getattr(block._get_fsdp_state(), "_fsdp_param_group", None)
            if group is not None:
                self._bound[1].extend(i for i in (group.mesh_info, group.post_forward_mesh_info) if i is not None)
        self._drop_reducer()
        if not blocks:
            # Pure replicas: FSDP's reduction (a flat copy, a temporary, one all-reduce
            # after the backward) is replaced by DDP's bucketed all-reduce overlapping
            # the backward (.replica_reduce); the layout stays FSDP's.
            replicas = dp_mesh["dp_replicate"]
            self._bound[0].append(replicas)
            # and FSDP's per-forward copy into unsharded buffers (and their free after
            # the backward) is skipped: the unsharded parameters view the sharded data
            alias_unsharded(module._get_fsdp_state()._fsdp_param_group)
            self._reducer = ReplicaReducer(module, replicas.get_group(),
                                           max(1, len(plan.work(place.replica, place.stage))))
        self.module = module
        self._sharded = list(module.named_parameters())  # the optimizer's parameters, by name
        self._copy_plans = {}
        self.optimizer = self.recipe.optimizer([p for _, p in self._sharded])
        # the factory's hyper-parameters: every scheduler built later starts from them
        self._base_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self._make_scheduler()
        self.schedule = None
        if self.whole:
            return  # the user's loop drives the model (:mod:`.loop`)
        self.stage = PipelineStage(module, place.stage, plan.pp, self.placement.device,
                                   group=pp_mesh.get_group())
        self._hook_stage(self.stage)

    def _make_scheduler(self) -> None:
        """The user's LR scheduler at the committed iteration: built anew and stepped
        ``iteration`` times, the sequence the fault-free run took."""
        import warnings

        self.scheduler = None
        if self.recipe.lr_scheduler is None or self.optimizer is None:
            return
        for group, base in zip(self.optimizer.param_groups, self._base_groups):
            group.pop("initial_lr", None)  # a new scheduler starts from the factory's lr,
            group.update(base)  # not from a restored or rolled-back group's scheduled one
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "step() before optimizer.step()": replaying, on purpose
            sched = self.recipe.lr_scheduler(self.optimizer)
            for _ in range(self.iteration):
                sched.step()
        self.scheduler = sched

    def _hook_stage(self, stage) -> None:
        """Run ``before_action`` (abort check, progress beat) before every compute chunk,
        time chunks for the profile, and apply injected faults: ``stretch`` (compute
        slowdown) on every chunk, ``delay_comm`` before receives and the reduction."""
        engine = self

        def timed(fn, book):
            def run(mb, *args, **kwargs):
                return engine.chunk(book, mb, fn, mb, *args, **kwargs)
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

    def chunk(self, book: str, mb: int, fn: Callable[..., object], *args: object, **kwargs: object) -> object:
        """One compute chunk of micro-batch ``mb``: ``before_action`` first, its time (after
        an injected ``stretch``) added to the iteration's ``book`` (``forward_s`` or
        ``backward_s``) for the profile."""
        self.before_action()
        timer = self.chunk_timer().start()  # CUDA events on a GPU
        out = fn(*args, **kwargs)
        dt = self.stretch(timer.stop())
        res = self._current
        if res is not None:
            times = getattr(res, book)
            times[mb] = times.get(mb, 0.0) + dt
        return out

    def chunk_timer(self) -> ChunkTimer:
        """The timer of one compute chunk in the profiles (the TP engine times busy time)."""
        return self.placement.timer()

    def start_fresh(self) -> None:
        """Generation 0: the model's initial weights, empty optimizer state."""
        self.iteration = 0
        if self.place is None:
            return
        self._wrap(self._build())

    def install(self, full: dict[str, Held], step: int) -> None:
        """Build the stage from full (unsharded) tensors by name: parameters and their
        optimizer state; each rank keeps its own FSDP shard of them (``full``'s own
        tensors become the state where they are the whole shard, :meth:`_state_like`)."""
        self.iteration = step
        if self.place is None:
            return
        module = self._build(init=False)  # every parameter is copied in below
        with torch.no_grad():
            for name, p in module.named_parameters():
                key = self.canonical(name)
                if key not in full:
                    raise KeyError(f"device {self.device}: no state for parameter {key!r}")
                p.copy_(full[key].param)
        self._wrap(module)
        taken: set[int] = set()  # a tensor becomes one parameter's state at most
        for name, p in self.module.named_parameters():
            h = full[self.canonical(name)]
            if not h.sharded and not h.other:
                continue
            st = {k: self._state_like(p, v if id(v) not in taken else v.clone()) for k, v in h.sharded.items()}
            taken.update(id(v) for v in h.sharded.values())
            st.update({k: (v.clone() if isinstance(v, Tensor) else v) for k, v in h.other.items()})
            self.optimizer.state[p] = st

    @staticmethod
    def _state_like(p: Tensor, full: Tensor) -> Tensor:
        """Optimizer state ``full`` (the whole tensor) laid out as parameter ``p``. Where
        ``p``'s local shard is the whole tensor (shard degree 1) ``full`` itself becomes
        it, with no copy: a fresh copy of every moment cost most of a re-plan's
        reconfiguration, in page faults of new memory (docs/benchmarks.md)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        local = p.to_local()
        if (full.device == local.device and full.shape == local.shape and full.dtype == local.dtype
                and full.is_contiguous() and full.stride() == local.stride()):
            return DTensor.from_local(full, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None)

    # ------------------------------------------------------------ state access
    def local_shards(self, params: Iterable[tuple[str, Tensor]] | None = None, *,
                     copy: bool = True) -> dict[str, Held]:
        """This rank's FSDP shards of its stage's parameters (``params``: these, by
        stage name; default the module's) and optimizer state, by state name, as plain
        tensors, valid after the groups are gone: clones, or with ``copy=False`` the
        stage's own local tensors (for a stage being dropped: nothing writes them then)."""
        import copy as copying

        from torch.distributed.tensor import DTensor

        out: dict[str, Held] = {}
        if self.module is None:
            return out
        own = (lambda t: t.detach().clone()) if copy else (lambda t: t.detach())  # noqa: E731
        for name, p in self.module.named_parameters() if params is None else params:
            st = self.optimizer.state.get(p, {})
            h = Held(own(p.to_local()))
            for k, v in st.items():
                if isinstance(v, DTensor):
                    h.sharded[k] = own(v.to_local())
                else:
                    h.other[k] = own(v) if isinstance(v, Tensor) else copying.deepcopy(v)
            out.setdefault(self.canonical(name), h)
        return out

    def restore_local(self, shards: dict[str, Held], step: int) -> None:
        """Put back what :meth:`local_shards` returned (rollback within a generation)."""
        from torch.distributed.tensor import DTensor

        self.iteration = step
        if self.module is None:
            return
        if self._reducer is not None:
            self._reducer.reset()  # the rolled-back iteration's reduction, if it did not finish
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                h = shards[self.canonical(name)]
                p.to_local().copy_(h.param)
                p.grad = None
                if not h.sharded and not h.other:
                    self.optimizer.state.pop(p, None)
                    continue
                st = self.optimizer.state.setdefault(p, {})
                for k, v in h.sharded.items():
                    if isinstance(st.get(k), DTensor):
                        st[k].to_local().copy_(v)
                    else:
                        st[k] = DTensor.from_local(v.clone(), p.device_mesh, p.placements, run_check=False,
                                                   shape=p.shape, stride=p.stride())
                for k, v in h.other.items():
                    st[k] = v.clone() if isinstance(v, Tensor) else v
        self._make_scheduler()
        self.schedule = None  # a failed step leaves receives and unshards pending in it

    def keep_snapshots(self, depth: int) -> None:
        """Keep the last ``depth`` (1 or 2) snapshots: with 2, :meth:`rollback_to` can go
        back past an iteration whose commit was still pending when the next began."""
        if depth not in (1, 2):
            raise ValueError(f"snapshot depth is 1 or 2, not {depth}")
        self._depth = depth
        del self._snapshots[:-depth]

    def snapshot(self, views: Sequence[Tensor] = ()) -> list[Tensor]:
        """Remember this rank's shards at the start of an iteration, for rollback. While
        the stage and its optimizer state keep their layout, the copy goes into the
        buffers of the oldest snapshot it replaces, in one foreach copy (the per-tensor
        clones of :meth:`local_shards` cost milliseconds per iteration; docs/benchmarks.md).

        Returns the :func:`~resihp_core.detector.sdc.window_sum` of each of ``views``
        (windows of this rank's tensors), read during the copy where it can be: the SDC
        fingerprint of the state the snapshot holds (docs/sdc.md "What it costs")."""
        from resihp_core.detector.sdc import window_sum

        snaps = self._snapshots
        if snaps and snaps[-1][1] == self.iteration and self._snap_module is self.module is not None:
            # Taken again at the same iteration (a rolled-back attempt runs again): the
            # state is that snapshot's, which stays the newest.
            if (sums := self._copy_into(snaps[-1][0], views)) is not None:
                return sums
        full = len(snaps) >= self._depth
        spare = snaps[0][0] if full else self._spare
        if (spare is not None and self._snap_module is self.module is not None
                and (sums := self._copy_into(spare, views)) is not None):
            if full:
                snaps.pop(0)
            self._spare = None
            snaps.append((spare, self.iteration))
            return sums
        self._spare = None
        if self._snap_module is not self.module:
            snaps.clear()  # another stage's layout: its copies cannot be put back into this one
        snaps.append((self.local_shards(), self.iteration))
        del snaps[:-self._depth]
        self._snap_module = self.module
        with torch.no_grad():
            return [window_sum(v) for v in views]

    def _copy_into(self, held: dict[str, Held], views: Sequence[Tensor] = ()) -> list[Tensor] | None:
        """Copy this rank's shards into ``held`` (a snapshot of the same stage) and return
        the sums of ``views`` (:meth:`snapshot`); None, copying nothing, if any tensor's
        place, shape or dtype differs.

        The source and destination lists are planned once per (stage, snapshot buffers)
        and reused while every object they were taken from is still the same one
        (:meth:`_copy_plan_valid`): walking the module, naming and checking each
        tensor cost more than the copy itself on small stages (docs/benchmarks.md,
        "Session 11")."""
        from resihp_core.detector.sdc import copy_with_sums, window_sum

        plan = self._copy_plans.get(id(held))
        with torch.no_grad():
            if plan is not None and plan[0] is held and self._copy_plan_valid(plan):
                return copy_with_sums(plan[2], plan[1], views)
            if not self._copy_into_slow(held):
                return None
            return [window_sum(v) for v in views]

    def _copy_plan_valid(self, plan: tuple) -> bool:
        """True while the module, optimizer, every parameter's local tensor, every
        optimizer-state entry and every snapshot buffer are the objects the plan was made of."""
        _, _, _, module, optimizer, guard = plan
        if module is not self.module or optimizer is not self.optimizer:
            return False
        for obj, attrs, mappings in guard:
            for name, expected in attrs:
                if getattr(obj, name, None) is not expected:
                    return False
            for m, items in mappings:
                if len(m) != len(items):
                    return False
                for k, v in items:
                    if m.get(k) is not v:
                        return False
        return True

    def _copy_into_slow(self, held: dict[str, Held]) -> bool:
        """:meth:`_copy_into` planned from scratch (and the plan kept for the next call)."""
        from torch.distributed.tensor import DTensor

        guard: list[tuple] = []
        srcs: list[Tensor] = []
        dsts: list[Tensor] = []
        seen: set[str] = set()
        with torch.no_grad():
            for name, p in self.module.named_parameters():
                key = self.canonical(name)
                if key in seen:
                    continue  # a tied copy: one state
                seen.add(key)
                h = held.get(key)
                st = self.optimizer.state.get(p, {})
                if h is None or len(st) != len(h.sharded) + len(h.other) or not isinstance(p, DTensor):
                    return False  # a new layout, or a plain (replicated) parameter: clone instead
                pairs = [(p.to_local(), h.param)]
                guard.append((p, (("_local_tensor", p._local_tensor),), ()))
                guard.append((h, (("param", h.param),), ((st, tuple(st.items())), (h.sharded, tuple(h.sharded.items())),
                                                        (h.other, tuple(h.other.items())))))
                for k, v in st.items():
                    if isinstance(v, DTensor) and k in h.sharded:
                        pairs.append((v.to_local(), h.sharded[k]))
                        guard.append((v, (("_local_tensor", v._local_tensor),), ()))
                    elif isinstance(v, Tensor) and not isinstance(v, DTensor) and isinstance(h.other.get(k), Tensor):
                        pairs.append((v, h.other[k]))
                    else:
                        return False  # not a tensor (copied by value), or a new kind of state
                for src, dst in pairs:
                    if src.shape != dst.shape or src.dtype != dst.dtype:
                        return False
                    srcs.append(src)
                    dsts.append(dst)
            if len(seen) != len(held):
                return False
            torch._foreach_copy_(dsts, srcs)
        state = self.optimizer.state
        params = [q for _, q in self.module.named_parameters()]
        guard.append((None, (), ((held, tuple(held.items())),
                                 (state, tuple((q, state[q]) for q in params if q in state)))))
        # Plans of this stage only, and of the (at most three) buffers it rotates through.
        plans = {k: v for k, v in self._copy_plans.items() if v[3] is self.module and k != id(held)}
        self._copy_plans = dict(list(plans.items())[-2:])
        self._copy_plans[id(held)] = (held, srcs, dsts, self.module, self.optimizer, guard)
        return True

    def rollback(self) -> None:
        """Back to the last snapshot (an iteration that was not committed everywhere);
        with the step deferred, back to the iteration's start by dropping its gradients."""
        if self.defer:
            self._discard()
        elif self._snapshots:
            self.rollback_to(self._snapshots[-1][1])

    def rollback_to(self, iteration: int) -> None:
        """Back to the state at the start of ``iteration`` (a kept snapshot): the newest,
        or with two kept the one before it too (the pending commit of ``iteration`` was
        refused while the next iteration had already stepped)."""
        from torch.distributed.tensor import DTensor

        at = [k for k, (_, step) in enumerate(self._snapshots) if step == iteration]
        if not at:
            raise RuntimeError(f"no snapshot of iteration {iteration} to roll back to "
                               f"(kept: {[step for _, step in self._snapshots]})")
        undone = self._snapshots[at[-1] + 1:]  # of iterations undone now: buffers to reuse
        del self._snapshots[at[-1] + 1:]
        if undone:
            self._spare = undone[0][0]
        shards, step = self._snapshots[-1]
        if self.module is not None and all(isinstance(p, DTensor) for p in self.module.parameters()):
            self.restore_local(shards, step)
            return
        # A step failed while FSDP had the stage unsharded: its objects are in no state
        # to reuse. Keep the snapshot for the next generation, which rebuilds the stage.
        self._kept = (self.plan if self.module is not None else self._kept[0], shards)
        self.schedule = self.stage = self.optimizer = self.scheduler = self.module = None
        self._drop_reducer()
        self._copy_plans = {}
        self.iteration = step

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, alive: set[int]) -> None:
        """Raise :class:`~resihp_core.adapter.StateLost` before any rendezvous when
        :meth:`move_state` would (the same plan arithmetic; ``alive``: the new world,
        whose devices outside ``new_plan``, such as a slow device the plan drops, still
        send the shards they hold)."""
        from resihp_adapters.torch_native.reshard import transfer_plan

        if self.iteration != 0:  # nothing trained yet: the initial weights are the state
            transfer_plan(self, old_plan, new_plan, set(alive), self.wanted_shard)

    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, alive: set[int],
                   step: int) -> int:
        """Build this plan's stage from the survivors' shards of ``old_plan`` (after
        :meth:`rebuild`); returns bytes received. Raises
        :class:`~resihp_core.adapter.StateLost` (on every device alike) when some shard
        has no surviving copy among ``alive`` devices of the new plan."""
        from resihp_adapters.torch_native.reshard import StateLost, exchange, transfer_plan

        members = set(alive) & set(self.rank_of)  # only they are in the new world
        try:
            plan = transfer_plan(self, old_plan, new_plan, members, self.wanted_shard)
        except StateLost:
            if step != 0:
                raise
            plan = None  # nothing trained yet: the initial weights are the state
        if plan is None:
            self.start_fresh()
            return 0
        kept_plan, kept = self._kept
        if place_of(old_plan, self.device, self.wanted_shard) is not None and (
                kept_plan is None or kept_plan.layer_ranges != old_plan.layer_ranges
                or kept_plan.location(self.device) != old_plan.location(self.device)):
            raise ValueError(f"device {self.device}: the shards it kept are not from the old plan")
        full, nbytes = exchange(plan, self.device, self.rank_of, kept)
        if self.place is not None:
            self.install(full, step)
        else:
            self.iteration = step
        return nbytes

    def full_state(self) -> dict[str, Held]:
        """Full tensors of this stage by state name (collective over the stage's
        data-parallel ranks): parameters and their optimizer state."""
        from torch.distributed.tensor import DTensor

        out: dict[str, Held] = {}
        for name, p in self.module.named_parameters():
            st = self.optimizer.state.get(p, {})
            h = Held(p.full_tensor().detach().clone())
            for k, v in st.items():
                if isinstance(v, DTensor):
                    h.sharded[k] = v.full_tensor().clone()
                else:
                    h.other[k] = v.detach().clone() if isinstance(v, Tensor) else v
            out.setdefault(self.canonical(name), h)
        return out

    def flat_state(self, gather: bool = True) -> dict[str, object]:
        """:meth:`full_state` and the rest of the training state, flattened by
        layout-independent names (see :func:`flatten_state`). ``gather``: full tensors
        (collective over the stage's data-parallel ranks, like :meth:`full_state`);
        else this rank's FSDP pieces as :class:`~resihp_core.adapter.Shard` (no
        communication: what the worker dumps at the job's end for the conformance kit,
        which puts the pieces together)."""
        if self.module is None:
            return {}
        if gather:
            return flatten_state(self.full_state(), self.optimizer, self.scheduler, self.iteration)
        from resihp_core.adapter import Shard

        pl = self.place
        piece = lambda t: Shard((t,), dim=0, index=pl.shard_index, parts=pl.shard_degree)  # noqa: E731
        local = {name: Held(piece(h.param), {k: piece(v) for k, v in h.sharded.items()}, h.other)
                 for name, h in self.local_shards().items()}
        return flatten_state(local, self.optimizer, self.scheduler, self.iteration)

    # ------------------------------------------------------------ execution
    def _loss(self, out: Tensor, target: Tensor) -> Tensor:
        return self.recipe.loss(out, target) / self._denom

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
        # Micro-batches are the runtime's indices 0..n-1 in this replica's work order
        # (the same at every stage: migrations are whole).
        work = plan.work(place.replica, place.stage)
        index = {w: k for k, w in enumerate(work)}
        own = lower_program(program, index)
        if plan.pp == 1 and SingleStage.runs(own):
            self.schedule, self._lowered = SingleStage(self, own), program
            return
        actions = lower_pipeline(emit_programs(plan), place.replica, index)
        actions[place.stage] = own
        sched = _PipelineScheduleRuntime([self.stage], len(work), loss_fn=self._loss, scale_grads=False)
        sched._prepare_schedule_with_comms(actions, format="compute_comms")
        self.schedule, self._lowered = sched, program

    def finish_grads(self) -> float | None:
        """After the backward of every micro-batch: sum the gradients of tied copies
        across their stages, then clip by the global norm over every stage and FSDP
        shard (each counted once). Returns the norm when clipping (collective over the
        executors). A pure replica's bucketed all-reduce (:mod:`.replica_reduce`) is
        waited for first, its gradients set."""
        if self._reducer is not None:
            self._reducer.finish()
        for group, name in self._ties:
            p = dict(self.module.named_parameters())[name]
            if p.grad is not None:
                dist.all_reduce(p.grad.to_local(), group=group)
        if self.recipe.max_grad_norm is None:
            return None
        n = len(live_replicas(self.plan))
        copies = n // shard_degree_for(n, self.wanted_shard)
        return clip_global(self.module, self.model.aliases, self.recipe.max_grad_norm, self.executors_group, copies)

    def run(self, program: Program, iteration: int | None = None) -> IterationResult:
        """One iteration of this executor's program, then its optimizer (and LR
        scheduler) step. Each micro-batch's loss is divided by the data's denominator for
        the whole global batch, so gradients are sums over any layout."""
        it = self.iteration if iteration is None else iteration
        plan, place = self.plan, self.place
        self._prepare(program)
        res = IterationResult(it)
        self._current = res
        t_iter = time.perf_counter()
        m = plan.num_microbatches
        self._denom = float(self.data.denominator(it))
        res.work = plan.work(place.replica, place.stage)
        batches = [self.data.micro_batch(it, owner, j, m) for owner, j in res.work]
        res.lengths = {j: b.lengths for j, b in enumerate(batches)}
        home = self.placement.to_home  # the data is built on the host
        args = [tuple(home(a) for a in b.args) for b in batches] if place.stage == 0 else None
        kwargs = [{k: home(v) for k, v in b.kwargs().items()} for b in batches]  # every stage: positions and masks
        targets = [home(b.target) for b in batches] if place.stage == plan.pp - 1 else None
        losses: list[Tensor] = []
        self.stage.has_backward = True
        self.stage.clear_runtime_states()
        try:
            self.schedule._step_microbatches(args, kwargs, targets, losses, return_outputs=False)
        except BaseException:
            self.schedule = None
            if self._reducer is not None:
                self._reducer.reset()
            raise
        finally:
            self._current = None
        self.before_action()
        self.finish_grads()
        self.inject_flip("grad")
        res.loss = float(sum(float(x.detach()) for x in losses))
        if self.defer:
            self._deferred = it
            # with the step before it (applied after that commit): one step per iteration, as stock
            res.iteration_s = time.perf_counter() - t_iter + self._step_s
        else:
            self._apply(it)
            res.iteration_s = time.perf_counter() - t_iter
        self.last = res
        return res

    def defer_steps(self, on: bool) -> bool:
        """From now on :meth:`run` stops before the optimizer step (``on``), and the
        worker calls :meth:`apply_step` once the iteration has committed everywhere: an
        iteration that does not commit has changed nothing but gradients, so no rollback
        snapshot is kept (the snapshots of an earlier generation are freed). Returns
        ``on``."""
        if on:
            self._snapshots.clear()
            self._spare = None
            self._copy_plans = {}
        self.defer, self._deferred, self._step_s = on, None, 0.0
        return on

    def apply_step(self) -> None:
        """The optimizer (and LR scheduler) step of the iteration :meth:`run` left pending."""
        if self._deferred is None:
            raise RuntimeError(f"device {self.device}: no iteration's optimizer step is pending")
        t = time.perf_counter()
        self._apply(self._deferred)
        self._step_s = time.perf_counter() - t

    def _apply(self, iteration: int) -> None:
        self._deferred = None
        self.step_optimizer()
        self.inject_flip("param")
        self.inject_flip("optimizer")
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.iteration = iteration + 1

    def _discard(self) -> None:
        """Rollback with the step deferred: drop the gradients (and a pending reduction);
        the state is the iteration's start. A stage a failed iteration left unsharded
        (FSDP swaps in its unsharded parameters for the forward and backward) is put
        back to its sharded parameters, which the forward and backward never write; if
        that fails, the stage is dropped and its shards (the sharded parameters the
        optimizer was built over, with their optimizer state) kept for the next generation,
        as :meth:`rollback_to` does."""
        from torch.distributed.tensor import DTensor

        self._deferred = None
        if self.module is None:
            return
        if self._reducer is not None:
            self._reducer.reset()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule = None  # a failed iteration leaves receives and unshards pending in it
        try:
            for m in self.module.modules():
                if hasattr(m, "reshard") and hasattr(m, "_get_fsdp_state"):
                    m.reshard()
        except Exception:  # noqa: BLE001 - FSDP's state after a failed collective: rebuilt below
            pass
        if all(isinstance(p, DTensor) for p in self.module.parameters()):
            for p in self.module.parameters():
                p.grad = None
            return
        self._kept = (self.plan, self.local_shards(self._sharded))
        self.schedule = self.stage = self.optimizer = self.scheduler = self.module = None
        self._drop_reducer()
        self._copy_plans = {}

    def inject_flip(self, target: str) -> None:
        """Injected silent data corruption (docs/sdc.md), when a flip is due: this
        rank's local shards of the reduced gradients (before the step), the parameters
        or the first optimizer-state tensor of each (after it)."""
        from torch.distributed.tensor import DTensor

        local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
        if self.flip_due(target):
            self._flip(target, local)
        if target != "grad":
            return
        self.grad_norm = None
        if (self.watch_grads and self.plan is not None and self.place is not None
                and len(live_replicas(self.plan)) // self.place.shard_degree < 2):
            # the range signal, where no replica compares this shard (docs/sdc.md)
            from resihp_core.detector.sdc import grad_norm

            self.grad_norm = grad_norm(local(p.grad) for p in self.module.parameters() if p.grad is not None)

    def _flip(self, target: str, local: Callable[[Tensor], Tensor]) -> None:
        named: dict[str, Tensor] = {}
        for name, p in self.module.named_parameters():
            if target == "grad":
                t = p.grad
            elif target == "param":
                t = p.detach()
            else:
                st = self.optimizer.state.get(p, {})
                t = next((st[k] for k in sorted(st) if isinstance(st[k], Tensor) and st[k].dim()), None)
            if t is not None:
                named[name] = local(t)
        self.corrupt(target, named)

    def step_optimizer(self) -> None:
        """:meth:`_step`, its temporaries kept in the host heap (:class:`StepHeap`)."""
        if self.placement.device.type != "cpu":
            self._step()
            return
        with _STEP_HEAP:
            self._step()

    def _step(self) -> None:
        """The optimizer's step, on the DTensors' local tensors when that is the same
        arithmetic: an element-wise optimizer (:data:`_ELEMENTWISE`) whose every
        parameter, gradient and state tensor is a DTensor of one layout (or a plain
        tensor, the step counts), after its first step (its lazily created state must be
        DTensors). The foreach kernels then run on the same local tensors without DTensor
        dispatch per op (0.6-0.75 ms an iteration on the peers' dp4 stage;
        docs/benchmarks.md, "Session 11"). On the host they run over groups of at most
        :data:`HOST_STEP_ELEMENTS` elements (:func:`_host_chunks`): each foreach kernel
        is one pass over all its tensors, so over a whole stage every pass reads its
        memory back from DRAM; a chunk's passes find it in the cache. Element-wise, so
        the same bits. Anything else steps the DTensors."""
        opt = self.optimizer
        view = _local_view(opt) if type(opt) in _ELEMENTWISE else None
        if view is None:
            opt.step()
            return
        groups, state, locals_ = view
        host = self.placement.device.type == "cpu"
        saved = opt.param_groups, opt.state
        try:
            opt.param_groups = [dict(g, params=c) for g, ps in zip(saved[0], groups)
                                for c in (_host_chunks(ps) if host else [ps])]
            opt.state = state
            opt.step()
        finally:
            opt.param_groups, opt.state = saved
            for lp in locals_:
                lp.grad = None

    # ------------------------------------------------------------ checkpoints
    def _state_dicts(self) -> dict:
        """Model and (flattened) optimizer state dicts keyed by state names: a tied
        copy is saved and read under its first name, so any split reads any other's."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, get_model_state_dict, get_optimizer_state_dict)

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        return {"model": _canon_keys(get_model_state_dict(self.module, options=opts), self.model.aliases),
                "optim": _canon_keys(get_optimizer_state_dict(self.module, self.optimizer, options=opts),
                                     self.model.aliases)}

    def save_checkpoint(self, path: str) -> None:
        """Collective over the checkpoint writers: every stage writes its shards by name
        (names are split-independent, so any later layout can read them). Under HSDP
        only the first replicate group writes: the other copies hold the same shards
        bit for bit (their gradients are all-reduced), DCP's planning costs every
        participant per tensor (a pickled plan of every tensor, gathered and scattered),
        and its de-duplication would write each tensor once anyway
        (docs/benchmarks.md, "Where a fault-free iteration goes")."""
        import torch.distributed.checkpoint as dcp

        if self.module is None:
            return
        self._ensure_optimizer_state()
        if not self.writes_checkpoint:
            return  # an HSDP copy: replicate index 0 holds the same shards and writes them
        group = self.executors_group if self.checkpoint_group is None else self.checkpoint_group
        dcp.save(pack_groups(self._state_dicts()), checkpoint_id=path, process_group=group)

    def stage_checkpoint(self) -> tuple[dict, DcpPlan] | None:
        """The training thread's part of a checkpoint written in the background
        (:class:`~.async_checkpoint.AsyncDcpWriter`): this rank's state copied into host
        staging buffers, and the generation's DCP write plan (made at the first
        checkpoint of a generation: a collective over the checkpoint writers, as
        :meth:`save_checkpoint`'s planning is). None on a rank that writes nothing
        (a standby, an HSDP copy). The buffers are reused: the previous write must
        have finished."""
        if self.module is None:
            return None
        self._ensure_optimizer_state()
        if not self.writes_checkpoint:
            return None
        staged = self._staging.stage(pack_groups(self._state_dicts()))
        if self._dcp_plan is None:
            group = self.executors_group if self.checkpoint_group is None else self.checkpoint_group
            self._dcp_plan = plan_writes(staged, group, self.generation)
        return staged, self._dcp_plan

    def _ensure_optimizer_state(self) -> None:
        """Optimizers create their state lazily; a checkpoint needs every key present:
        one step with zero gradients and a zero learning rate creates it (then the
        state is reset to its initial values, which are zeros and step 0 for the
        torch.optim classes)."""
        if all(self.optimizer.state.get(p) for p in self.module.parameters()):
            return
        saved = [dict(g) for g in self.optimizer.param_groups]
        for p in self.module.parameters():
            p.grad = torch.zeros_like(p)
        for g in self.optimizer.param_groups:
            g["lr"] = 0.0
            if "weight_decay" in g:
                g["weight_decay"] = 0.0
        before = [p.detach().clone() for p in self.module.parameters()]
        self.optimizer.step()
        with torch.no_grad():
            for p, b in zip(self.module.parameters(), before):
                p.copy_(b)
                for k, v in self.optimizer.state[p].items():
                    if isinstance(v, Tensor):
                        v.zero_()
        for g, s in zip(self.optimizer.param_groups, saved):
            g.update({k: v for k, v in s.items() if k != "params"})
        self.optimizer.zero_grad(set_to_none=True)

    def load_checkpoint(self, path: str, step: int) -> None:
        """Build this plan's stage and read its shards from checkpoint ``path``, written
        after ``step`` optimizer steps under any earlier layout."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions, set_model_state_dict, set_optimizer_state_dict)

        self.iteration = step
        if self.place is None:
            return
        self._wrap(self._build())
        self._ensure_optimizer_state()
        sd = read_checkpoint(self._state_dicts(), path, self.executors_group)
        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        aliases = self.model.aliases
        set_model_state_dict(self.module, _local_keys(sd["model"], self.module, aliases, both=True), options=opts)
        set_optimizer_state_dict(self.module, self.optimizer,
                                 _local_keys(sd["optim"], self.module, aliases), options=opts)
        self._make_scheduler()


_GROUPS = "param_groups."


class SingleStage:
    """The runtime of a one-stage program (pp = 1: a data-parallel replica), in place of
    torch's ``_PipelineScheduleRuntime``: the same actions in the same order on the
    stage's module (forward, the loss, ``backward()``; FSDP's flags, gathers and
    reduction as the runtime sets them), without its per-action bookkeeping, which on a
    short step costs more than the engine's own work (docs/torch_native.md). Programs
    with anything else (a split backward) keep torch's runtime (:meth:`runs`)."""

    def __init__(self, engine: TorchNativeEngine, actions: list) -> None:
        self.engine = engine
        self.actions = [(a.computation_type, a.microbatch_index) for a in actions]

    @staticmethod
    def kinds() -> tuple:
        """torch's action types this runs: forward, full backward, gradient reduction,
        unshard, reshard (in that order)."""
        from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, REDUCE_GRAD, RESHARD, UNSHARD

        return FORWARD, FULL_BACKWARD, REDUCE_GRAD, UNSHARD, RESHARD

    @staticmethod
    def runs(actions: list) -> bool:
        """Whether ``actions`` (one stage's lowered program) has only what this runs."""
        kinds = SingleStage.kinds()
        return all(a.computation_type in kinds for a in actions)

    def _step_microbatches(self, args: list, kwargs: list, targets: list, losses: list[Tensor],
                           return_outputs: bool = False) -> None:
        from torch.distributed.fsdp import FSDPModule

        forward, backward, reduce, unshard, reshard = self.kinds()
        engine = self.engine
        module = engine.module
        fsdp = [m for m in module.modules() if isinstance(m, FSDPModule)]
        pending: dict[int, Tensor] = {}
        for kind, mb in self.actions:
            if kind == forward:
                out = engine.chunk("forward_s", mb, module, *args[mb], **kwargs[mb])
                pending[mb] = engine._loss(out, targets[mb])
                losses.append(pending[mb])
            elif kind == backward:
                if fsdp:  # gradients accumulate; REDUCE_GRAD reduces them once
                    module.set_is_last_backward(False)
                    module.set_reshard_after_backward(False)
                    module.set_requires_gradient_sync(False)
                engine.chunk("backward_s", mb, pending.pop(mb).backward)
            elif kind == reduce:
                engine.stage.perform_reduce_grad(1)  # FSDP's post-backward (delay_comm hooked)
            elif kind == unshard:
                for m in fsdp:
                    m.unshard()
            elif kind == reshard:
                for m in fsdp:
                    m.reshard()


class StepHeap:
    """While the optimizer steps on the host, its temporaries come from glibc's heap
    and stay there for the next step once freed.

    A foreach optimizer allocates one temporary per parameter each step (AdamW: the
    square roots of its second moments). glibc serves allocations over its mmap
    threshold (at most 32 MiB) with fresh mappings and returns them on free, so a
    parameter of that size costs its size in page faults every step (about 95,000 per
    iteration on overhead.py's size-l stage: docs/benchmarks.md, "Where a fault-free
    iteration goes"). Inside this context mappings are off (``M_MMAP_MAX`` 0), and the
    heap's top is not trimmed (``M_TRIM_THRESHOLD`` set once, to 2 GiB), so the next
    step reuses the same pages. The trim threshold holds for the whole process from
    the first step on, so the backward's freed activations are reused the same way
    (a plain script gets that part with ``MALLOC_TRIM_THRESHOLD_``). Only where memory
    comes from changes, not a value.
    Nothing is changed where ``MALLOC_MMAP_MAX_`` or ``MALLOC_TRIM_THRESHOLD_`` is set
    (the user's own allocator settings) or where the C library has no ``mallopt``."""

    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4
    MMAP_MAX_DEFAULT = 65536  # glibc's
    TRIM_THRESHOLD = (1 << 31) - 1

    def __init__(self) -> None:
        self._mallopt: Callable[[int, int], int] | None = None
        self._trim_set = False
        import os

        if "MALLOC_MMAP_MAX_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
            return
        try:
            import ctypes
            import ctypes.util

            name = ctypes.util.find_library("c")
            self._mallopt = getattr(ctypes.CDLL(name), "mallopt", None) if name else None
        except OSError:
            self._mallopt = None

    def __enter__(self) -> None:
        if self._mallopt is not None:
            if not self._trim_set:
                self._trim_set = bool(self._mallopt(self.M_TRIM_THRESHOLD, self.TRIM_THRESHOLD))
            if self._trim_set:
                self._mallopt(self.M_MMAP_MAX, 0)

    def __exit__(self, *exc: object) -> None:
        if self._mallopt is not None and self._trim_set:
            self._mallopt(self.M_MMAP_MAX, self.MMAP_MAX_DEFAULT)


_STEP_HEAP = StepHeap()

#: torch.optim classes whose step is element-wise per tensor: on the local tensors of
#: same-layout DTensors it is the DTensor step's arithmetic (no norms across shards).
_ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
#: The most elements one foreach group of a host step holds (4 MiB of float32 per list):
#: AdamW's passes over a group of that size find it in the cache; over a whole stage
#: each pass reads it from memory again.
HOST_STEP_ELEMENTS = 1 << 20


def _host_chunks(params: list[Tensor]) -> list[list[Tensor]]:
    """``params`` in order, cut into runs of at most :data:`HOST_STEP_ELEMENTS` elements
    (a larger tensor alone)."""
    out: list[list[Tensor]] = []
    run: list[Tensor] = []
    n = 0
    for p in params:
        if run and n + p.numel() > HOST_STEP_ELEMENTS:
            out.append(run)
            run, n = [], 0
        run.append(p)
        n += p.numel()
    if run:
        out.append(run)
    return out


def _local_view(opt: torch.optim.Optimizer) -> tuple[list[list[Tensor]], dict, list[Tensor]] | None:
    """``opt``'s parameter groups and state with every DTensor replaced by its local
    tensor (the same storage: the step's in-place updates land in the DTensors), the
    local parameters carrying their DTensor's local gradient; None when any parameter,
    gradient or state entry is not of that form (the caller steps the DTensors)."""
    from collections import defaultdict

    from torch.distributed.tensor import DTensor

    groups: list[list[Tensor]] = []
    state: defaultdict = defaultdict(dict)  # as torch.optim keeps it
    locals_: list[Tensor] = []
    grads: list[tuple[Tensor, Tensor]] = []
    for g in opt.param_groups:
        ps = []
        for p in g["params"]:
            st = opt.state.get(p)
            if not isinstance(p, DTensor) or not st:
                return None  # a plain parameter, or state not made yet (it must be DTensors)
            lp = p._local_tensor
            if p.grad is not None:
                if not isinstance(p.grad, DTensor) or p.grad.placements != p.placements:
                    return None
                grads.append((lp, p.grad._local_tensor))
            local_st = {}
            for k, v in st.items():
                if isinstance(v, DTensor):
                    if v.placements != p.placements or v._local_tensor.shape != lp.shape:
                        return None
                    local_st[k] = v._local_tensor
                else:
                    local_st[k] = v
            state[lp] = local_st
            ps.append(lp)
            locals_.append(lp)
        groups.append(ps)
    for lp, grad in grads:
        lp.grad = grad
    return groups, state, locals_


def _flags_on_known_groups(root: nn.Module, members: list[nn.Module]) -> None:
    """Make ``root``'s recursive FSDP flag setters visit ``members`` (its FSDP modules,
    root included) instead of every submodule. torch's ``PipelineStage`` sets
    gradient sync and reshard-after-backward with ``recurse=True`` around every backward
    chunk and at the reduction, each a walk of the whole stage; the stage's FSDP modules
    are known once it is wrapped (docs/benchmarks.md, "Session 11"). Weak references:
    no cycle keeps the stage, and so its groups, alive after :meth:`release`."""
    import weakref

    refs, top = [weakref.ref(m) for m in members], weakref.ref(root)

    def visiting(name: str) -> Callable[..., None]:
        def set_flag(value: bool, *, recurse: bool = True) -> None:
            for m in ([r() for r in refs] if recurse else [top()]):
                if m is not None:
                    getattr(type(m), name)(m, value, recurse=False)
        return set_flag

    for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):
        object.__setattr__(root, name, visiting(name))


def _group_entries(sd: dict) -> dict[str, dict[str, object]]:
    """The flattened optimizer state dict's hyper-parameters by parameter name:
    ``param_groups.NAME.KEY`` entries (NAME a parameter of the model state dict)."""
    names = set(sd["model"])
    out: dict[str, dict[str, object]] = {}
    for key, v in sd["optim"].items():
        if not key.startswith(_GROUPS):
            continue
        rest = key[len(_GROUPS):]
        name, _, hyper = rest.rpartition(".")
        while name and name not in names:  # a hyper-parameter name with a dot in it
            name, _, head = name.rpartition(".")
            hyper = f"{head}.{hyper}"
        if not name:
            raise ValueError(f"optimizer state dict entry {key!r} names no parameter of the stage")
        out.setdefault(name, {})[hyper] = v
    return out


def pack_groups(sd: dict) -> dict:
    """The checkpoint's view of ``sd``: each parameter's optimizer hyper-parameters
    (``lr``, ``betas``, ... of its group) as one entry ``param_groups.NAME`` (bytes of
    ``torch.save``, read back with ``weights_only``: a checkpoint is never trusted to
    run code) instead of one entry per value. DCP plans, pickles and writes every entry on its
    own (torch.save each), and the flattened state dict repeats a group's ~11 values
    for every parameter: 3 of every 4 entries of the built-in model's checkpoint."""
    import io

    optim = {k: v for k, v in sd["optim"].items() if not k.startswith(_GROUPS)}
    for name, hypers in _group_entries(sd).items():
        buf = io.BytesIO()
        torch.save(hypers, buf)
        optim[_GROUPS + name] = buf.getvalue()
    return {**sd, "optim": optim}


def unpack_groups(packed: dict, like: dict) -> dict:
    """``like`` (the flattened state dicts) with what :func:`pack_groups`'s view
    ``packed`` was loaded with: tensors and the packed hyper-parameters put back."""
    import io

    optim = {k: v for k, v in packed["optim"].items() if not k.startswith(_GROUPS)}
    for name in _group_entries(like):
        blob = packed["optim"][_GROUPS + name]
        for hyper, v in torch.load(io.BytesIO(blob), weights_only=True).items():
            optim[f"{_GROUPS}{name}.{hyper}"] = v
    return {**packed, "optim": optim}


def read_checkpoint(sd: dict, path: str, process_group: object | None = None, *, alone: bool = False) -> dict:
    """``sd`` (the flattened model and optimizer state dicts) filled from the DCP
    checkpoint at ``path``, in either layout (hyper-parameters packed or one entry per
    value); over ``process_group``, or with ``alone`` in this process without one (a
    reader outside the job: a verifier, a test)."""
    import torch.distributed.checkpoint as dcp

    kw = {"no_dist": True} if alone else {"process_group": process_group}
    if _packed(path, sd):
        packed = pack_groups(sd)
        dcp.load(packed, checkpoint_id=path, **kw)
        return unpack_groups(packed, sd)
    dcp.load(sd, checkpoint_id=path, **kw)  # written before the hyper-parameters were packed
    return sd


def _packed(path: str, sd: dict) -> bool:
    """Whether the checkpoint at ``path`` holds packed hyper-parameters (:func:`pack_groups`)."""
    import torch.distributed.checkpoint as dcp

    names = _group_entries(sd)
    if not names:
        return True  # nothing to pack either way
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    return f"optim.{_GROUPS}{next(iter(names))}" in keys


def flatten_state(full: dict[str, Held] | dict, optimizer: torch.optim.Optimizer, scheduler: object | None,
                  iteration: int) -> dict[str, object]:
    """The complete training state of a stage by layout-independent names:
    ``param/NAME`` (state names: the model's own, a tied copy under its first name),
    ``optim/NAME/KEY`` (every optimizer state entry, step counts included),
    ``optim/group/KEY`` (the optimizer's hyper-parameters, learning rate included; one
    group), ``lr_scheduler/KEY`` (its state dict, functions left out) and
    ``data/iteration`` (the next micro-batches' address). No RNG: the engine draws no
    random numbers and models with active dropout are refused (docs/torch_native.md)."""
    out: dict[str, object] = {"data/iteration": iteration}
    for name, h in full.items():
        out[f"param/{name}"] = h.param
        for k, v in {**h.sharded, **h.other}.items():
            out[f"optim/{name}/{k}"] = v
    for i, g in enumerate(optimizer.param_groups):
        for k, v in g.items():
            if k != "params":
                out[f"optim/group{i}/{k}"] = v
    if scheduler is not None:
        for k, v in scheduler.state_dict().items():
            if not callable(v) and not (isinstance(v, list) and any(callable(x) for x in v)):
                out[f"lr_scheduler/{k}"] = v
    return out


def tie_sets(model: StageSource, plan: ParallelPlan) -> list[tuple[list[int], dict[int, str]]]:
    """Tied parameters split over ``plan``'s stages: (stages holding a copy, stage ->
    its name of the parameter there). Their gradients are summed across those stages."""
    out = []
    groups: dict[str, list[str]] = {}
    for alias, canon in sorted(model.aliases.items()):
        groups.setdefault(canon, [canon]).append(alias)
    for canon, names in sorted(groups.items()):
        where: dict[int, str] = {}
        for s in range(plan.pp):
            held = set(model.names(*plan.layer_ranges[s]))
            for n in names:
                if n in held:
                    where.setdefault(s, n)
        if len(where) > 1:
            out.append((sorted(where), where))
    return out


def _rename(key: str, aliases: dict[str, str]) -> str:
    """``key`` with an alias parameter name inside it replaced by its state name."""
    for alias, canon in aliases.items():
        if f".{alias}." in f".{key}.":
            return key.replace(alias, canon, 1)
    return key


def _canon_keys(sd: dict, aliases: dict[str, str]) -> dict:
    out: dict = {}
    for k, v in sd.items():
        out.setdefault(_rename(k, aliases), v)
    return out


def _local_keys(sd: dict, module: nn.Module, aliases: dict[str, str], *, both: bool = False) -> dict:
    """The state dict back under this stage's own names (a tied copy reads its first name's).
    ``both``: a model state dict of a module holding both names of a tied parameter (the
    user's whole model, :mod:`.loop`) gets the alias key too (``load_state_dict`` wants it)."""
    names = {n for n, _ in module.named_parameters()}
    if both:
        every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        sd = dict(sd)
        for alias, canon in aliases.items():
            if alias in every and canon in names and canon in sd:
                sd.setdefault(alias, sd[canon])
    back = {canon: alias for alias, canon in aliases.items() if alias in names and canon not in names}
    if not back:
        return sd
    out: dict = {}
    for k, v in sd.items():
        for canon, alias in back.items():
            if k == canon or f".{canon}." in f".{k}.":
                k = k.replace(canon, alias, 1)
                break
        out[k] = v
    return out


def clip_global(module: nn.Module, aliases: dict[str, str], max_norm: float, group: object,
                copies: int) -> float:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` (at most 1), torch's
    ``clip_grad_norm_`` rule, with the norm over the whole model: local FSDP shards'
    squares summed over ``group`` (every executor), divided by the ``copies`` of each
    shard (HSDP replicate groups); tied copies (alias names) counted once."""
    grads = [p.grad for n, p in module.named_parameters() if p.grad is not None and n not in aliases]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    sq = torch.zeros((), dtype=torch.float64, device=local[0].device if local else None)
    for g in local:
        sq += g.detach().to(torch.float64).pow(2).sum()
    dist.all_reduce(sq, group=group)
    norm = float((sq / copies).sqrt())
    coef = min(max_norm / (norm + 1e-6), 1.0)
    if coef < 1.0:
        with torch.no_grad():
            for n, p in module.named_parameters():
                if p.grad is not None:
                    (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).mul_(coef)
    return norm
