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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, TypeVar, Union

from resihp_core.plan import ParallelPlan, ScheduleKind
from resihp_core.program import Program

if TYPE_CHECKING:  # the wire message a worker sends; not needed at run time here
    from resihp_core.protocol import IterationProfile

__all__ = [
    "Adapter",
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
class Adapter(abc.ABC):
    """One framework's execution layer, one instance per worker process.

    Concrete adapters set ``name`` and ``capabilities`` (class attributes are fine) and
    implement the abstract duties. ``save_checkpoint``/``load_checkpoint`` are required
    only when ``capabilities.checkpoint`` is true.
    """

    @property
    @abc.abstractmethod
    def name(self) -> str:
        """The registry name, e.g. ``"deepspeed"``."""

    @property
    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """What this adapter can execute (the same value it registers with)."""

    @abc.abstractmethod
    def rebuild_communicators(self, plan: ParallelPlan, generation: int) -> None:
        """Drop every process group of older generations (and every reference to them)
        and build the groups ``plan`` needs, keyed by ``generation``."""

    @abc.abstractmethod
    def emit(self, program: Program) -> None:
        """Lower ``program`` into the framework's own instructions and issue them: run
        one iteration of this executor's work."""

    @abc.abstractmethod
    def move_state(self, old_plan: ParallelPlan, new_plan: ParallelPlan) -> None:
        """Move or re-shard parameters and optimizer state from ``old_plan``'s layout to
        ``new_plan``'s (layer repartition, TP resize, replica re-sync)."""

    def save_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Persist model and optimizer state of the last completed iteration."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    def load_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Restore what :meth:`save_checkpoint` wrote."""
        raise NotImplementedError(f"adapter {self.name!r} does not implement checkpoints")

    @abc.abstractmethod
    def profile(self) -> IterationProfile | None:
        """This rank's :class:`~resihp_core.protocol.IterationProfile` of the last finished
        iteration (per micro-batch F/B times, communication and iteration time), which
        the worker forwards to the Detector; None before the first iteration."""

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

    @property
    def target_path(self) -> str:
        """The target as text, for listings."""
        t = self.target
        if isinstance(t, str):
            return t
        return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', repr(t))}"

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
    ) -> None:
        """Register adapter ``name``; ``target`` is ``"module:Class"`` or a factory."""
        if not isinstance(capabilities, Capabilities):
            raise RegistryError(
                f"adapter {name!r}: capabilities must be a Capabilities, got {type(capabilities).__name__}"
            )
        if not (isinstance(target, str) or callable(target)):
            raise RegistryError(f"adapter {name!r}: target must be 'module:Class' or callable")
        self._add(name, AdapterSpec(name, target, capabilities, description, install_hint))

    def create(self, name: str, *args: Any, **kwargs: Any) -> Adapter:
        """Import and instantiate adapter ``name`` with the given arguments."""
        spec = self.get(name)
        adapter = spec.load()(*args, **kwargs)
        if not isinstance(adapter, Adapter):
            raise RegistryError(
                f"adapter {name!r}: {spec.target_path} built a {type(adapter).__name__}, "
                "not a resihp_core.adapter.Adapter"
            )
        return adapter

    def supporting(self, plan: ParallelPlan, previous: ParallelPlan | None = None) -> list[str]:
        """Names of the adapters whose capabilities allow ``plan``."""
        return [s.name for s in self.list() if not s.capabilities.violations(plan, previous)]
