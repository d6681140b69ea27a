"""The adapter contract: what a training framework must do for ResiHP, and the registry.

Everything in ResiHP is framework-neutral except two duties (SPEC §5.4): **communicator
rebuild** (tear the process groups down and build them again for a new plan generation)
and **primitive emission** (lower the core's :class:`~resihp_core.program.Program` into
the framework's own instructions and issue them). An :class:`Adapter` implements those,
plus moving state between plans, checkpoints and per-rank profiles, and declares its
:class:`Capabilities` so the Scheduler only produces plans the adapter can execute.

Adapters are registered by plugins (hook ``resihp_register_adapters``) under a name,
with their capabilities and a *lazy* target (``"module:Class"``): listing or planning
never imports the framework; only :meth:`AdapterRegistry.create` does.

The generic :class:`Registry` base lives here (the lowest module that needs it) and is
shared with the detector and stage registries in :mod:`resihp_core.plugins`.
"""

from __future__ import annotations

import abc
import importlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, TypeVar, Union

from resihp_core.plan import ParallelPlan, ScheduleKind
from resihp_core.program import Program

if TYPE_CHECKING:  # the wire message a worker sends; not needed at run time here
    from resihp_core.protocol import IterationProfile

__all__ = [
    "Adapter",
    "AdapterContext",
    "GenerationAborted",
    "IterationResult",
    "Shard",
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

T = TypeVar("T")


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
    :param schedules: the pipeline schedules it can execute.
    :param checkpoint: implements ``save_checkpoint`` / ``load_checkpoint``.
    """

    tp_resize: bool = False
    heterogeneous_tp: bool = False
    layer_repartition: bool = False
    cross_replica_migration: bool = False
    schedules: frozenset[ScheduleKind] = frozenset({ScheduleKind.ONE_F_ONE_B})
    checkpoint: bool = False

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
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; schedules sorted by name."""
        return {
            "tp_resize": self.tp_resize,
            "heterogeneous_tp": self.heterogeneous_tp,
            "layer_repartition": self.layer_repartition,
            "cross_replica_migration": self.cross_replica_migration,
            "schedules": sorted(k.value for k in self.schedules),
            "checkpoint": self.checkpoint,
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
        vanished = any(not g for rep in plan.tp_groups for g in rep)
        if (plan.migrations or vanished) and not self.cross_replica_migration:
            out.append("migrated micro-batches need cross_replica_migration")
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


# ----------------------------------------------------------------- the contract
class GenerationAborted(RuntimeError):
    """A newer plan generation was posted while this iteration ran: stop at once so
    peers blocked on this worker fail fast and everyone moves on."""


@dataclass
class AdapterContext:
    """What the runtime lends an adapter: one per worker process, built by the worker.

    :param device: this worker's device id (stable across plan generations).
    :param job: the job description; the adapter reads ``job.adapter_config`` (its own
        section), ``job.data``, ``job.dp``, ``job.num_microbatches``, ``job.seed``,
        ``job.checkpoint_dir``.
    :param store: the job store (a ``torch.distributed.Store``); rendezvous of
        generation ``g`` lives under the prefix ``gen{g}/``.
    :param faults: the worker's :class:`~resihp_core.runtime.injector.FaultInjector`;
        an adapter stretches compute with ``faults.stretch`` and delays transfers with
        ``faults.delay_comm``.
    :param superseded: true once a newer generation is posted (cheap; poll it often).
    :param beat: progress heartbeat ``beat(iteration, step)`` for hang detection.
    """

    device: int
    job: Any
    store: Any
    faults: Any
    superseded: Callable[[], bool] = lambda: False
    beat: Callable[[int, int], None] = lambda iteration, step: None
    generation: int = -1  # the generation being entered or run (set by the worker)

    @property
    def timeout_s(self) -> float:
        return float(self.job.timeout_s)

    def step(self, iteration: int, step: int) -> None:
        """Call before each primitive: beats progress and raises
        :class:`GenerationAborted` once this generation is superseded."""
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

    @abc.abstractmethod
    def start_fresh(self, plan: ParallelPlan) -> None:
        """The job's first generation: this device's part of the initial weights."""

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

    def save_checkpoint(self, iteration: int) -> None:
        """Persist the state after ``iteration`` under ``ctx.job.checkpoint_dir``, before
        the iteration commits (collective among the executors; the adapter decides who
        writes). Raise only when a peer is gone: a storage error must not fail the
        iteration; report it through :meth:`checkpoint_status` (the write may also
        finish in the background). A restore names a complete checkpoint of a
        committed iteration (``docs/checkpoints.md``)."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    def checkpoint_status(self) -> list[dict[str, Any]]:
        """Checkpoint writes of this worker finished since the last call, each
        ``{"iteration", "error" (None: written and verified), "bytes", "seconds"}``;
        the worker reports failed ones as storage faults. Default: none."""
        return []

    def load_checkpoint(self, iteration: int, plan: ParallelPlan) -> None:
        """Build this device's part of ``plan`` from checkpoint ``iteration``."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    def profile(self) -> IterationProfile | None:
        """This rank's :class:`~resihp_core.protocol.IterationProfile` of the last
        iteration (per micro-batch F/B times with document lengths), which the worker
        forwards to the Detector; None if the adapter does not measure them."""
        return None

    def close(self) -> None:
        """Release framework resources; default does nothing."""


# ------------------------------------------------------------------ registries
class RegistryError(Exception):
    """A registry lookup or registration failed; the message says what to do."""


class UnknownNameError(RegistryError, LookupError):
    """No entry of that name; the message lists the known names."""


class DuplicateNameError(RegistryError):
    """Two plugins registered the same name and neither is a ``trylast`` default."""


class AdapterUnavailableError(RegistryError):
    """The adapter's module cannot be imported (usually a missing optional extra)."""


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")


@dataclass(frozen=True)
class Registration(Generic[T]):
    """One registered value and who registered it (a plugin name, or ``"direct"``).
    ``default`` registrations (from ``trylast`` hook implementations) yield to others."""

    name: str
    value: T
    source: str
    default: bool = False


class Registry(Generic[T]):
    """Named values registered by plugins.

    Precedence is simple: a name is taken once. A *default* registration (made from a
    ``trylast`` hook implementation: built-ins and first-party adapters) yields to a
    non-default one of the same name, and the loser is kept in :meth:`shadowed`. Two
    non-default registrations of one name are an error: block one of the plugins.
    """

    kind = "entry"

    def __init__(self) -> None:
        self._entries: dict[str, Registration[T]] = {}
        self._shadowed: list[Registration[T]] = []
        self._source = "direct"
        self._default = False

    @contextmanager
    def registering_as(self, source: str, *, default: bool = False) -> Iterator[None]:
        """Attribute registrations made inside the block to ``source`` (used by the
        plugin facade around each hook implementation)."""
        saved = self._source, self._default
        self._source, self._default = source, default
        try:
            yield
        finally:
            self._source, self._default = saved

    def _add(self, name: str, value: T) -> None:
        if not isinstance(name, str) or not _NAME.match(name):
            raise RegistryError(
                f"{self.kind} name {name!r} (from {self._source}) must be letters, digits, '_', '.', '-'"
            )
        new = Registration(name, value, self._source, self._default)
        old = self._entries.get(name)
        if old is None:
            self._entries[name] = new
        elif new.default:
            self._shadowed.append(new)
        elif old.default:
            self._entries[name] = new
            self._shadowed.append(old)
        else:
            raise DuplicateNameError(
                f"{self.kind} {name!r} is registered twice, by {old.source!r} and by "
                f"{new.source!r}; block one (RESIHP_BLOCK_PLUGINS={new.source})"
            )

    def get(self, name: str) -> T:
        """The value registered as ``name``; the error lists every known name."""
        try:
            return self._entries[name].value
        except KeyError:
            known = ", ".join(self.names()) or "none registered"
            raise UnknownNameError(f"unknown {self.kind} {name!r} (known: {known})") from None

    def source_of(self, name: str) -> str:
        self.get(name)
        return self._entries[name].source

    def names(self) -> list[str]:
        return sorted(self._entries)

    def list(self) -> list[T]:
        """Every value, in name order."""
        return [self._entries[n].value for n in self.names()]

    def registrations(self) -> list[Registration[T]]:
        return [self._entries[n] for n in self.names()]

    def shadowed(self) -> list[Registration[T]]:
        """Default registrations that a plugin's registration of the same name replaced."""
        return list(self._shadowed)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.names()}>"


AdapterTarget = Union[str, Callable[..., Adapter]]


@dataclass(frozen=True)
class AdapterSpec:
    """A registered adapter: its capabilities and how to build it, not yet imported.

    ``target`` is ``"package.module:Class"`` (imported on :meth:`load`) or a class or
    factory returning an :class:`Adapter`. ``install_hint`` tells users what to install
    when the import fails (e.g. ``pip install 'resihp[deepspeed]'``).
    """

    name: str
    target: AdapterTarget
    capabilities: Capabilities
    description: str = ""
    install_hint: str = ""
    job_config: str = ""  # "module:function": (Config) -> the adapter's JobSpec section
    reference: str = ""  # "module:function": (JobSpec, iterations) -> fault-free losses
    default: bool = False  # the adapter a job uses when its configuration names none

    @property
    def target_path(self) -> str:
        """The target as text, for listings."""
        t = self.target
        if isinstance(t, str):
            return t
        return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', repr(t))}"

    def function(self, which: str) -> Callable[..., Any] | None:
        """The ``job_config`` or ``reference`` function, imported now; None if not given."""
        path = getattr(self, which)
        if not path:
            return None
        module, _, attr = path.partition(":")
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as e:
            raise AdapterUnavailableError(f"adapter {self.name!r}: {which} {path!r} cannot be imported ({e})") from e
        for part in attr.split("."):
            obj = getattr(obj, part)
        return obj  # type: ignore[no-any-return]

    def load(self) -> Callable[..., Adapter]:
        """Import the target (only now is the framework imported)."""
        if not isinstance(self.target, str):
            return self.target
        module, sep, attr = self.target.partition(":")
        if not sep or not module or not attr:
            raise RegistryError(
                f"adapter {self.name!r}: target {self.target!r} must look like 'module:Class'"
            )
        try:
            obj: Any = importlib.import_module(module)
        except ImportError as e:
            missing = getattr(e, "name", None) == module  # the adapter itself, not a dependency
            hint = ("; this installation does not contain it" if missing else
                    f"; install it with: {self.install_hint}" if self.install_hint else "")
            raise AdapterUnavailableError(
                f"adapter {self.name!r} cannot be imported ({e}){hint}"
            ) from e
        for part in attr.split("."):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                raise RegistryError(
                    f"adapter {self.name!r}: module {module!r} has no attribute {attr!r}"
                ) from None
        return obj  # type: ignore[no-any-return]


class AdapterRegistry(Registry[AdapterSpec]):
    """Adapters by name. Registering stores capabilities and a lazy target only."""

    kind = "adapter"

    def register(
        self,
        name: str,
        target: AdapterTarget,
        capabilities: Capabilities,
        *,
        description: str = "",
        install_hint: str = "",
        job_config: str = "",
        reference: str = "",
        default: bool = False,
    ) -> None:
        """Register adapter ``name``; ``target`` is ``"module:Class"`` or a factory.

        :param job_config: ``"module:function"`` building the adapter's own job section
            from a :class:`~resihp_core.config.Config` (default: the config's ``[adapter]``
            table as it is); it validates what it reads.
        :param reference: ``"module:function"`` computing a fault-free run's losses for
            ``(job, iterations)``, which ``resihp run`` checks the job's losses against.
        :param default: use this adapter when a configuration names none.
        """
        if not isinstance(capabilities, Capabilities):
            raise RegistryError(
                f"adapter {name!r}: capabilities must be a Capabilities, got {type(capabilities).__name__}"
            )
        if not (isinstance(target, str) or callable(target)):
            raise RegistryError(f"adapter {name!r}: target must be 'module:Class' or callable")
        for what, path in (("job_config", job_config), ("reference", reference)):
            if path and not re.match(r"^[\w.]+:[\w.]+$", path):
                raise RegistryError(f"adapter {name!r}: {what} {path!r} must look like 'module:function'")
        self._add(name, AdapterSpec(name, target, capabilities, description, install_hint, job_config,
                                    reference, default))

    def create(self, name: str, *args: Any, **kwargs: Any) -> Adapter:
        """Import and instantiate adapter ``name`` with the given arguments."""
        spec = self.get(name)
        return self._checked(name, spec.load()(*args, **kwargs))

    @staticmethod
    def _checked(name: str, adapter: Any) -> Adapter:
        if not isinstance(adapter, Adapter):
            raise RegistryError(
                f"adapter {name!r} built a {type(adapter).__name__}, not a resihp_core.adapter.Adapter"
            )
        return adapter

    def default_name(self) -> str:
        """The adapter registered as the default; the error says how to choose one."""
        chosen = [s.name for s in self.list() if s.default]
        if len(chosen) != 1:
            raise UnknownNameError(
                f"runtime.adapter is not set and {len(chosen) or 'no'} adapters are registered as the "
                f"default{' (' + ', '.join(chosen) + ')' if chosen else ''}; set runtime.adapter to one of: "
                f"{', '.join(self.names()) or 'none registered'}")
        return chosen[0]

    def supporting(self, plan: ParallelPlan, previous: ParallelPlan | None = None) -> list[str]:
        """Names of the adapters whose capabilities allow ``plan``."""
        return [s.name for s in self.list() if not s.capabilities.violations(plan, previous)]
