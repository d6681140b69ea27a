"""Every registry of named things plugins register, in one module.

A :class:`Registry` maps names to values and knows which plugin registered each one;
a ``trylast`` (default) registration yields to a plugin's registration of the same
name. The registries: adapters (:class:`AdapterRegistry`: capabilities and a lazy
target, so listing or planning never imports a framework), named factories
(:class:`FactoryRegistry`: change-point detectors, verification strategies, simulator
policies), the planner's adaptation stages (:class:`StageRegistry`, ordered by the one
table :data:`BUILTIN_STAGE_ORDER`), subcommands (:class:`CommandRegistry`) and data
sources (:class:`DataSourceRegistry`). The plugin facade
(:class:`resihp_core.plugins.Plugins`) fills them through the ``resihp_register_*`` hooks.
"""

from __future__ import annotations

import importlib
import re
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterator, Mapping, TypeVar, Union

if TYPE_CHECKING:
    from resihp_core.adapter import Adapter, Capabilities
    from resihp_core.data.source import DataSource, SourceContext
    from resihp_core.plan import ParallelPlan

__all__ = [
    "AdaptationStage",
    "AdapterRegistry",
    "AdapterSpec",
    "AdapterUnavailableError",
    "BUILTIN_STAGE_ORDER",
    "CommandRegistry",
    "DataSourceRegistry",
    "DuplicateNameError",
    "FactoryRegistry",
    "PluginCommand",
    "Registration",
    "Registry",
    "RegistryError",
    "SourceEntry",
    "StageRegistry",
    "UnknownNameError",
]

T = TypeVar("T")

#: Where the built-in adaptation stages run; a plugin replacing one inherits its order.
#: The one table of built-in adaptation stages and their order: TP selective exclusion,
#: PP layer repartition, DP migration, then the TP-level escalation that drops a
#: still-slow group when that is faster (``resihp_core.scheduler.builtin`` registers them).
BUILTIN_STAGE_ORDER: dict[str, int] = {"tp": 100, "pp": 200, "dp": 300, "drop": 400}

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


AdapterTarget = Union[str, Callable[..., "Adapter"]]


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
        from resihp_core.adapter import Capabilities

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
        from resihp_core.adapter import Adapter

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


# ------------------------------------------------------------------ plugin registries
class FactoryRegistry(Registry[Callable[..., Any]]):
    """Named factories (change-point detectors, verification strategies)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def register(self, name: str, factory: Callable[..., Any]) -> None:
        if not callable(factory):
            raise RegistryError(f"{self.kind} {name!r}: factory must be callable")
        self._add(name, factory)

    def create(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """Call the factory registered as ``name``."""
        return self.get(name)(*args, **kwargs)


@dataclass(frozen=True)
class AdaptationStage:
    """One stage of the progressive planner: ``run(state) -> state``, run by ``order``."""

    name: str
    run: Callable[..., Any]
    order: int


class StageRegistry(Registry[AdaptationStage]):
    """The planner's stages; :meth:`ordered` is the sequence the planner runs."""

    kind = "adaptation stage"

    def register(self, name: str, stage: Callable[..., Any], *, order: int | None = None) -> None:
        """Register ``stage`` as ``name``; ``order`` defaults to the built-in stage's."""
        if not callable(stage):
            raise RegistryError(f"{self.kind} {name!r}: stage must be callable")
        if order is None:
            if name not in BUILTIN_STAGE_ORDER:
                raise RegistryError(
                    f"{self.kind} {name!r} is new: give order= (built-ins: {BUILTIN_STAGE_ORDER})"
                )
            order = BUILTIN_STAGE_ORDER[name]
        self._add(name, AdaptationStage(name, stage, int(order)))

    def ordered(self) -> list[AdaptationStage]:
        return sorted(self.list(), key=lambda s: (s.order, s.name))


@dataclass(frozen=True)
class PluginCommand:
    """A ``resihp`` subcommand contributed by a plugin."""

    name: str
    help: str
    configure: Callable[[Any], None]
    run: Callable[[Any], int]


class CommandRegistry(Registry[PluginCommand]):
    """Subcommands plugins add to the ``resihp`` command line."""

    kind = "command"

    def register(self, name: str, help: str, configure: Callable[[Any], None],
                 run: Callable[[Any], int]) -> None:
        if not callable(configure) or not callable(run):
            raise RegistryError(f"{self.kind} {name!r}: configure and run must be callable")
        self._add(name, PluginCommand(name, help, configure, run))


# ----------------------------------------------------------------- the facade


# ------------------------------------------------------------------ data sources
#: ``factory(options, ctx) -> DataSource``: ``options`` is the ``[data]`` section
#: without ``source``; the factory validates them (errors name the field).
DataSourceFactory = Callable[[Mapping[str, Any], "SourceContext"], "DataSource"]


@dataclass(frozen=True)
class SourceEntry:
    name: str
    factory: DataSourceFactory
    description: str = ""


class DataSourceRegistry(Registry[SourceEntry]):
    """Data sources by name (built in: ``synthetic``, ``text``)."""

    kind = "data source"

    def register(self, name: str, factory: DataSourceFactory, *, description: str = "") -> None:
        if not callable(factory):
            raise RegistryError(f"{self.kind} {name!r}: factory must be callable")
        self._add(name, SourceEntry(name, factory, description))
