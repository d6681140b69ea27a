"""The adapter contract: what a training framework must do for ResiHP.

Everything in ResiHP is framework-neutral except two duties: **communicator
rebuild** (tear the process groups down and build them again for a new plan generation)
and **primitive emission** (lower the core's :class:`~resihp_core.program.Program` into
the framework's own instructions and issue them). An :class:`Adapter` implements those,
plus moving state between plans, checkpoints and per-rank profiles, and declares its
:class:`Capabilities` so the Scheduler only produces plans the adapter can execute.

Adapters are registered by plugins (hook ``resihp_register_adapters``) under a name,
with their capabilities and a *lazy* target (``"module:Class"``): listing or planning
never imports the framework (the registry is in :mod:`resihp_core.registries`). The
lifecycle the worker drives is in :class:`Adapter` and ``docs/adapters.md``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from resihp_core.plan import ParallelPlan, ScheduleKind
from resihp_core.program import Program

if TYPE_CHECKING:  # types of the contract; not needed at run time here (no torch import)
    import torch.distributed as dist

    from resihp_core.detector.sdc import Fingerprint
    from resihp_core.job import JobSpec
    from resihp_core.protocol import IterationProfile
    from resihp_core.protocols.checkpoints import CheckpointWrite
    from resihp_core.runtime.peercopy import MemoryCopy, MemoryPiece
    from resihp_core.runtime.worker.injector import FaultInjector

__all__ = [
    "Adapter",
    "AdapterContext",
    "GenerationAborted",
    "StateLost",
    "IterationResult",
    "Shard",
    "partial_migrations",
    "AdapterSpec",
    "AdapterRegistry",
    "AdapterUnavailableError",
    "Capabilities",
    "DuplicateNameError",
    "Registration",
    "Registry",
    "RegistryError",
    "UnknownNameError",
]



# ------------------------------------------------------------------ capabilities
@dataclass(frozen=True)
class Capabilities:
    """What an adapter can execute. The Scheduler reads these (without importing the
    framework) and never emits a plan that needs more.

    :param tp_resize: can change a TP group's degree between plan generations.
    :param heterogeneous_tp: can run TP groups of different degrees in one plan.
    :param layer_repartition: can move layers (parameters and optimizer state) between
        stages between plan generations.
    :param cross_replica_migration: can run (stage, micro-batch) work owned by another
        DP replica (plan ``migrations``, or a replica's stage with no devices).
    :param uneven_dp: can run another replica's micro-batch *whole* (every stage on one
        replica): uneven micro-batch counts per replica and replicas with no devices,
        but no single stage of a micro-batch away from the rest of it. Implied by
        ``cross_replica_migration``; with ``pp = 1`` the two are the same, so the
        Scheduler's migrating stages use it there (:meth:`migrates`).
    :param schedules: the pipeline schedules it can execute.
    :param checkpoint: implements ``save_checkpoint`` / ``load_checkpoint``.
    :param tp_with_dp: can run TP degrees > 1 in a plan with more than one replica
        (False: tensor parallelism with one replica only, e.g. torch_native, whose DP
        reduction does not span replicas of different TP layouts).
    :param sdc_fingerprint: implements :meth:`Adapter.fingerprint`: replicas that must
        hold bit-identical state compare it before each iteration commits (docs/sdc.md).
    :param restage: can move from one whole-replica layout to another with a different
        stage count and replica count (state moved in memory by global layer index, the
        same global batch in more or fewer micro-batches per replica). Lets the
        Scheduler re-stage the survivors into whole replicas when the adapter cannot keep
        a partial replica busy (:func:`~resihp_core.scheduler.candidates.restage`).
    :param memory_copy: implements :meth:`Adapter.memory_copy` and
        :meth:`Adapter.load_memory_copy`: with ``training.memory_copy_every`` set, each
        rank's committed state is also held in a peer's memory on another node, and a
        restore after a whole stage is lost reads it instead of a checkpoint file
        (docs/checkpoints.md). Without it such a job restores from disk, and says so.
    """

    tp_resize: bool = False
    heterogeneous_tp: bool = False
    layer_repartition: bool = False
    cross_replica_migration: bool = False
    schedules: frozenset[ScheduleKind] = frozenset({ScheduleKind.ONE_F_ONE_B})
    checkpoint: bool = False
    uneven_dp: bool = False
    tp_with_dp: bool = True
    sdc_fingerprint: bool = False
    restage: bool = False
    memory_copy: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.schedules, str):
            raise ValueError(
                f"Capabilities.schedules must be a set of schedules, not the string {self.schedules!r}"
            )
        try:
            kinds = frozenset(ScheduleKind(s) for s in self.schedules)
        except ValueError as e:
            known = ", ".join(k.value for k in ScheduleKind)
            raise ValueError(f"Capabilities.schedules: {e} (known: {known})") from None
        if not kinds:
            raise ValueError("Capabilities.schedules must name at least one schedule")
        object.__setattr__(self, "schedules", kinds)
        if self.cross_replica_migration:  # any migration includes whole micro-batches
            object.__setattr__(self, "uneven_dp", True)

    @classmethod
    def all(cls) -> Capabilities:
        """Everything ResiHP can ask for (the reference backend's set)."""
        return cls(
            tp_resize=True,
            heterogeneous_tp=True,
            layer_repartition=True,
            cross_replica_migration=True,
            schedules=frozenset(ScheduleKind),
            checkpoint=True,
            uneven_dp=True,
            sdc_fingerprint=True,
            memory_copy=True,
        )

    def migrates(self, pp: int) -> bool:
        """Whether the Scheduler may plan migrations for a plan of ``pp`` stages: any
        migration, or whole micro-batches when there is only one stage (its stages
        migrate single stages, docs/adapters.md)."""
        return self.cross_replica_migration or (self.uneven_dp and pp == 1)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; schedules sorted by name."""
        return {
            "tp_resize": self.tp_resize,
            "heterogeneous_tp": self.heterogeneous_tp,
            "layer_repartition": self.layer_repartition,
            "cross_replica_migration": self.cross_replica_migration,
            "schedules": sorted(k.value for k in self.schedules),
            "checkpoint": self.checkpoint,
            "uneven_dp": self.uneven_dp,
            "tp_with_dp": self.tp_with_dp,
            "sdc_fingerprint": self.sdc_fingerprint,
            "restage": self.restage,
            "memory_copy": self.memory_copy,
        }

    def violations(self, plan: ParallelPlan, previous: ParallelPlan | None = None) -> list[str]:
        """Why ``plan`` (reached from ``previous``) cannot run on this adapter; empty if it
        can. The Scheduler filters candidate plans with this."""
        out: list[str] = []
        if plan.schedule not in self.schedules:
            have = ", ".join(sorted(k.value for k in self.schedules))
            out.append(f"schedule {plan.schedule.value} not supported (supports: {have})")
        degrees = {plan.degree(r, s) for r, s in plan.executors()}
        if len(degrees) > 1 and not self.heterogeneous_tp:
            out.append(f"heterogeneous TP degrees {sorted(degrees)} need heterogeneous_tp")
        if not self.tp_with_dp and max(degrees, default=1) > 1 and sum(1 for rep in plan.tp_groups if any(rep)) > 1:
            out.append(f"TP degree {max(degrees)} with {plan.dp} replicas needs tp_with_dp (this adapter runs "
                       "tensor parallelism with one replica)")
        vanished = any(not g for rep in plan.tp_groups for g in rep)
        if (plan.migrations or vanished) and not self.cross_replica_migration:
            if not self.uneven_dp:
                out.append("migrated micro-batches need cross_replica_migration")
            else:
                out.extend(partial_migrations(plan)[:1])
        if previous is not None:
            if plan.layer_ranges != previous.layer_ranges and not self.layer_repartition:
                out.append("changed layer ranges need layer_repartition")
            if not self.tp_resize and (plan.dp, plan.pp) == (previous.dp, previous.pp):
                for r, s in plan.executors():
                    old = previous.degree(r, s)
                    if old and old != plan.degree(r, s):
                        out.append(
                            f"replica {r} stage {s}: TP degree {old} -> {plan.degree(r, s)} "
                            "needs tp_resize"
                        )
                        break
        return out


def partial_migrations(plan: ParallelPlan) -> list[str]:
    """Why ``plan`` needs more than whole micro-batch migration (``uneven_dp``): a
    micro-batch whose stages run on different replicas, or a replica that lost some of
    its stages but not all. Empty when every migrated micro-batch runs whole on one
    replica."""
    out: list[str] = []
    for r, rep in enumerate(plan.tp_groups):
        if any(rep) and not all(rep):
            s = next(s for s, g in enumerate(rep) if not g)
            out.append(f"replica {r} lost stage {s} but not all its stages: its other stages would "
                       "exchange micro-batches with another replica (needs cross_replica_migration)")
    seen: set[tuple[int, int]] = set()
    for m in plan.migrations:
        key = (m.replica, m.mb)
        if key in seen:
            continue
        seen.add(key)
        where = {plan.executor(s, m.replica, m.mb) for s in range(plan.pp)}
        if len(where) > 1:
            out.append(f"micro-batch (replica {m.replica}, mb {m.mb}) runs its stages on replicas "
                       f"{sorted(where)} (a single stage migrated needs cross_replica_migration)")
    return out


# ----------------------------------------------------------------- the contract
class GenerationAborted(RuntimeError):
    """A newer plan generation was posted while this iteration ran: stop at once so
    peers blocked on this worker fail fast and everyone moves on."""


class StateLost(RuntimeError):
    """Raised by ``move_state`` (on every device alike) when some piece of the training
    state has no surviving holder: the supervisor then restores the newest complete
    checkpoint every survivor can read. Any adapter raises this one class; the core never
    reads an adapter's error text."""


@dataclass
class AdapterContext:
    """What the runtime lends an adapter: one per worker process, built by the worker.

    :param device: this worker's device id (stable across plan generations).
    :param job: the job description; the adapter reads ``job.adapter_config`` (its own
        section), ``job.data``, ``job.dp``, ``job.num_microbatches``, ``job.seed``,
        ``job.checkpoint_dir``.
    :param store: the job store (a ``torch.distributed.Store``); rendezvous of
        generation ``g`` lives under the prefix ``gen{g}/``.
    :param faults: the worker's :class:`~resihp_core.runtime.worker.injector.FaultInjector`;
        an adapter stretches compute with ``faults.stretch``, delays transfers with
        ``faults.delay_comm`` and applies injected bit flips at its optimizer step with
        ``faults.corrupt`` (docs/sdc.md).
    :param superseded: true once a newer generation is posted (cheap; poll it often).
    :param beat: progress heartbeat ``beat(iteration, step)`` for hang detection.
    """

    device: int
    job: JobSpec
    store: dist.Store
    faults: FaultInjector
    superseded: Callable[[], bool] = lambda: False
    beat: Callable[[int, int], None] = lambda iteration, step: None
    generation: int = -1  # the generation being entered or run (set by the worker)

    @property
    def timeout_s(self) -> float:
        return float(self.job.timeout_s)

    def step(self, iteration: int, step: int) -> None:
        """Call before each primitive: beats progress and raises
        :class:`GenerationAborted` once this generation is superseded. Starts a chunk
        for the worker's CPU-wait meter (``faults.cpu_wait``, if it has one)."""
        meter = getattr(self.faults, "cpu_wait", None)
        if meter is not None:
            meter.start_chunk()
        self.beat(iteration, step)
        if self.superseded():
            raise GenerationAborted(f"generation {self.generation} was superseded")


@dataclass
class IterationResult:
    """What one executor did in one iteration (accounting, loss, timings)."""

    iteration: int
    loss: float = 0.0  # this executor's share of the global mean loss (last stage only)
    computed: list[tuple[int, int, int]] = field(default_factory=list)  # (stage, owner, mb)
    forward_s: dict[tuple[int, int], float] = field(default_factory=dict)  # (owner, mb) ->
    backward_s: dict[tuple[int, int], float] = field(default_factory=dict)
    comm_s: float = 0.0
    iteration_s: float = 0.0


@dataclass(frozen=True)
class Shard:
    """One held piece of a named parameter: the parameter tensor followed by its
    optimizer tensors, and where it sits in the full tensor (``index`` of ``parts``
    equal chunks along ``dim``; ``dim`` None: the whole tensor). Layout-independent, so
    the conformance kit can compare any two runs of any adapter."""

    tensors: tuple[Any, ...]
    dim: int | None = None
    index: int = 0
    parts: int = 1


class Adapter(abc.ABC):
    """One framework's execution layer, one instance per worker process.

    The worker (``resihp_core.runtime.worker``) drives it through this lifecycle, and
    calls nothing else (``docs/adapters.md``)::

        __init__(ctx)
        per plan generation:   rebuild_communicators(plan, generation, devices)
                               start_fresh(plan) | move_state(old, plan, devices)
                                                 | load_checkpoint(iteration, plan)
        per iteration:         snapshot(); run_iteration(program, i) -> IterationResult
                               rollback() if the iteration does not commit everywhere
                               fingerprint() before committing i (sdc_fingerprint)
                               save_checkpoint(i) before committing i, when due
                               checkpoint_status() (finished writes, storage faults)
        after a failure:       release()   (drop every reference to broken groups)
        at the end:            held_state() (dumps, conformance), close()

    ``where`` is this device's (replica, stage, TP rank) in the plan it holds state
    for, None for a standby. Set ``name`` and ``capabilities`` as class attributes.
    ``save_checkpoint``/``load_checkpoint`` are needed only with ``capabilities.checkpoint``.
    """

    name: str = ""
    capabilities: Capabilities = Capabilities()

    def __init__(self, ctx: AdapterContext) -> None:
        self.ctx = ctx

    @property
    @abc.abstractmethod
    def where(self) -> tuple[int, int, int] | None:
        """(replica, stage, TP rank) of this device in the current plan; None: standby."""

    @abc.abstractmethod
    def rebuild_communicators(self, plan: ParallelPlan, generation: int, devices: list[int]) -> None:
        """Drop every process group of older generations (and every reference to them)
        and build the groups ``plan`` needs over ``devices`` (this generation's world:
        executors and standbys), rendezvousing under ``gen{generation}/``."""

    def communicator_report(self) -> dict[str, float | str]:
        """How the last :meth:`rebuild_communicators` made its groups (``comm_path``:
        shrink, split, keep or rebuild) and what each part took (seconds), for the
        worker's ready record and log. Default: nothing to say."""
        return {}

    @abc.abstractmethod
    def start_fresh(self, plan: ParallelPlan) -> None:
        """The job's first generation: this device's part of the initial weights."""

    def check_move(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> None:
        """Raise :class:`StateLost` when :meth:`move_state` could not build ``new_plan``
        from copies on ``devices``. Called before :meth:`rebuild_communicators`, so every
        device (each computes the same answer from the two plans) leaves the generation
        before any rendezvous; found later, inside ``move_state``, some peers may already
        be connecting to ones that left, and wait out the backend's connect timeout.
        Default: nothing (``move_state`` finds out)."""

    @abc.abstractmethod
    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan, devices: list[int]) -> int:
        """Move or re-shard parameters and optimizer state from ``old_plan``'s layout to
        ``new_plan``'s, sourcing only from ``devices``; returns bytes received. On
        failure, put the previous layout back (the next generation may source here)."""

    @abc.abstractmethod
    def run_iteration(self, program: Program, iteration: int) -> IterationResult:
        """Primitive emission: lower ``program`` into the framework's own instructions
        and issue them, one iteration of this executor's work including its optimizer
        step. Call ``ctx.step(iteration, k)`` before each primitive."""

    @abc.abstractmethod
    def snapshot(self) -> None:
        """Remember the state at the start of an iteration."""

    @abc.abstractmethod
    def rollback(self) -> None:
        """Return to the last snapshot (the iteration did not commit everywhere)."""

    @abc.abstractmethod
    def release(self) -> None:
        """Drop every reference to the current communicators (after a failure: gloo only
        closes sockets when the last reference goes)."""

    @abc.abstractmethod
    def held_state(self) -> dict[str, Shard]:
        """Every parameter piece (with its optimizer state) this device holds, by the
        parameter's global name."""

    def full_state(self) -> dict[str, Any]:
        """The framework's own complete training state held by this device, flattened to
        ``{name: tensor or plain value}``: everything the framework itself would put in a
        checkpoint (parameters by fully qualified name including tied ones, optimizer
        state including master weights and step counts, LR scheduler, loss scaler, RNG,
        data position). Names must not depend on the layout (stage split, TP degree,
        sharding), so the conformance kit can compare two runs of any layout; a tensor
        this device holds only part of is given as a :class:`Shard` of it (the kit
        assembles the pieces of every device). Default:
        not provided (the kit then compares :meth:`held_state` only and says so)."""
        raise NotImplementedError(f"adapter {self.name!r} does not report its full state")

    def fingerprint(self) -> Fingerprint | None:
        """A cheap checksum of this device's parameters and optimizer state after the
        optimizer step of the iteration just run, with the name of the group of devices
        that must hold exactly the same bits (DP replicas of a stage with the same TP
        layout; :class:`~resihp_core.detector.sdc.Fingerprint`). Called after
        :meth:`run_iteration`, before the iteration commits, only with
        ``capabilities.sdc_fingerprint``; None: this device shares its state with no
        replica. :func:`~resihp_core.detector.sdc.tensor_digest` computes the checksum
        (docs/sdc.md)."""
        raise NotImplementedError(f"adapter {self.name!r} does not fingerprint its state")

    def sdc_signals(self) -> dict[str, float]:
        """This device's range signals of the iteration just run, for the check where no
        replica shares its state (docs/sdc.md): ``grad_norm``, the L2 norm of its local
        reduced gradient as the optimizer step read it
        (:func:`~resihp_core.detector.sdc.grad_norm`). Called with :meth:`fingerprint`;
        default: none."""
        return {}

    def save_checkpoint(self, iteration: int) -> None:
        """Persist the state after ``iteration`` under ``ctx.job.checkpoint_dir``, before
        the iteration commits (collective among the executors; the adapter decides who
        writes). Raise only when a peer is gone: a storage error must not fail the
        iteration; report it through :meth:`checkpoint_status` (the write may also
        finish in the background). The core owns the layout: write your files (any
        format) inside :func:`resihp_core.checkpoints.iteration_dir`, then, once every
        writer has finished, one writer calls :func:`resihp_core.checkpoints.seal` and
        :func:`~resihp_core.checkpoints.prune` (``job.checkpoint_keep``); only sealed
        checkpoints are ever selected. A restore names a complete checkpoint of a
        committed iteration (``docs/checkpoints.md``)."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    def checkpoint_status(self) -> list[CheckpointWrite]:
        """Checkpoint writes of this worker finished since the last call; the worker
        reports failed ones as storage faults. Default: none."""
        return []

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        """Build this device's part of ``plan`` from checkpoint ``iteration``."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    def memory_copy(self) -> MemoryCopy | None:
        """This rank's part of the state its last :meth:`snapshot` holds (a committed
        iteration's), as pieces a peer keeps in memory: references to the snapshot's
        tensors, not copies (the snapshot is replaced, never changed in place, by the
        next one). None: this rank hands over nothing (another replica holds the same
        state, or a standby). Called only with ``capabilities.memory_copy``, right after
        :meth:`snapshot`; serialized and sent off the training thread."""
        raise NotImplementedError(f"adapter {self.name!r} does not keep memory copies on peers")

    def load_memory_copy(self, iteration: int, plan: ParallelPlan,
                         read: Callable[[str], list[MemoryPiece]]) -> None:
        """Build this device's part of ``plan`` from the memory copies of ``iteration``:
        ``read(component)`` returns every part of a component (from this worker's own
        holder or a peer's) and raises ``OSError`` if its holder cannot give it (the
        supervisor then restores from disk)."""
        raise NotImplementedError(f"adapter {self.name!r} does not keep memory copies on peers")

    def profile(self) -> IterationProfile | None:
        """This rank's :class:`~resihp_core.protocol.IterationProfile` of the last
        iteration (per micro-batch F/B times with document lengths), which the worker
        forwards to the Detector; None if the adapter does not measure them."""
        return None

    def close(self) -> None:
        """Release framework resources at the job's end, process groups included (a gloo
        group left to interpreter shutdown can abort the finished process). Default:
        :meth:`release`, so an adapter that keeps nothing else still ends its groups;
        override it to also finish queued work (checkpoint writes) first."""
        self.release()


# The registries live in resihp_core.registries; these names stay importable from here.
from resihp_core.registries import (  # noqa: E402
    AdapterRegistry,
    AdapterSpec,
    AdapterUnavailableError,
    DuplicateNameError,
    Registration,
    Registry,
    RegistryError,
    UnknownNameError,
)
