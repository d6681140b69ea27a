"""The plugin facade: the only way ResiHP loads plugins and calls hooks.

Load order (:class:`Plugins`):

1. entry points of group ``resihp`` from installed distributions (sorted by name),
   unless ``RESIHP_DISABLE_PLUGIN_AUTOLOAD=1`` or ``autoload=False``;
2. the built-in modules (:data:`BUILTINS`), whose implementations must all be
   ``@hookimpl(trylast=True)`` so any plugin can replace them.

A name in the block list (``RESIHP_BLOCK_PLUGINS=a,b`` plus the ``block`` argument) is
never imported or registered; that is also the way out of a broken plugin. A plugin that
implements a hook ResiHP does not define is rejected with :class:`UnknownHookError`
naming the plugin and the hook (pluggy's ``optionalhook=True`` opts out).

Hooks are called through typed methods (:meth:`Plugins.adapters`,
:meth:`Plugins.notify_failure`, ...), one implementation at a time in pluggy's order,
so every registration is attributed to its plugin and a failing observer cannot stop
the others.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import os
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence, TypeVar

import pluggy

from resihp_core import hookspecs
from resihp_core.registries import (  # the registries this facade fills (re-exported)
    BUILTIN_STAGE_ORDER,
    AdaptationStage,
    AdapterRegistry,
    CommandRegistry,
    DataSourceRegistry,
    DuplicateNameError,
    FactoryRegistry,
    PluginCommand,
    Registration,
    Registry,
    RegistryError,
    StageRegistry,
    UnknownNameError,
)
from resihp_core.plan import ParallelPlan

if TYPE_CHECKING:
    from resihp_core.protocol import FailureReport
    from resihp_core.protocols.metrics import IterationMetrics

__all__ = [
    "BUILTINS",
    "BUILTIN_STAGE_ORDER",
    "ENTRY_POINT_GROUP",
    "ENV_BLOCK",
    "ENV_DISABLE_AUTOLOAD",
    "AdaptationStage",
    "CommandRegistry",
    "PluginCommand",
    "DuplicateNameError",
    "FactoryRegistry",
    "PluginError",
    "PluginInfo",
    "Plugins",
    "Registration",
    "Registry",
    "RegistryError",
    "StageRegistry",
    "UnknownHookError",
    "UnknownNameError",
    "get_plugins",
    "reset_plugins",
]

logger = logging.getLogger("resihp.plugins")

ENTRY_POINT_GROUP = hookspecs.PROJECT
ENV_DISABLE_AUTOLOAD = "RESIHP_DISABLE_PLUGIN_AUTOLOAD"
ENV_BLOCK = "RESIHP_BLOCK_PLUGINS"

#: Modules (dotted paths, imported when a :class:`Plugins` is built) that provide the
#: built-in hook implementations; each implementation must be ``trylast``.
BUILTINS: list[str] = [
    "resihp_core.detector.builtin",
    "resihp_core.scheduler.builtin",
    "resihp_core.sim.builtin",
    "resihp_core.data.builtin",
]

R = TypeVar("R", bound=Registry[Any])


class PluginError(Exception):
    """A plugin could not be loaded, validated or called; the message names it."""


class UnknownHookError(PluginError):
    """A plugin implements a hook that ResiHP does not define."""

    def __init__(self, plugin: str, hook: str) -> None:
        self.plugin, self.hook = plugin, hook
        close = difflib.get_close_matches(hook, _HOOK_NAMES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        super().__init__(f"plugin {plugin!r} implements unknown hook {hook!r}{hint}")


_HOOK_NAMES = sorted(n for n in vars(hookspecs) if n.startswith("resihp_"))


@dataclass(frozen=True)
class PluginInfo:
    """A loaded plugin: ``source`` is ``"entry point"``, ``"builtin"`` or ``"direct"``."""

    name: str
    source: str
    module: str
    distribution: str | None = None
    version: str | None = None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _env_list(name: str) -> set[str]:
    return {x.strip() for x in os.environ.get(name, "").split(",") if x.strip()}


def _call(impl: pluggy.HookImpl, kwargs: Mapping[str, object]) -> object:
    """Call one implementation the way pluggy would (it may take a subset of the args)."""
    args = [kwargs[a] for a in impl.argnames]
    extra = {a: kwargs[a] for a in impl.kwargnames if a in kwargs}
    return impl.function(*args, **extra)


class Plugins:
    """The loaded plugins and the typed calls into them.

    :param builtins: built-in modules (dotted paths or modules); default :data:`BUILTINS`.
    :param block: plugin names never to load, added to ``RESIHP_BLOCK_PLUGINS``.
    :param autoload: load entry points; default: unless ``RESIHP_DISABLE_PLUGIN_AUTOLOAD=1``.
    """

    def __init__(
        self,
        builtins: Sequence[str | ModuleType] | None = None,
        *,
        block: Iterable[str] = (),
        autoload: bool | None = None,
    ) -> None:
        self._pm = pluggy.PluginManager(hookspecs.PROJECT)
        self._pm.add_hookspecs(hookspecs)
        self._info: list[PluginInfo] = []
        self._cache: dict[str, Registry[Any]] = {}
        self.blocked: frozenset[str] = frozenset(_env_list(ENV_BLOCK) | set(block))
        self.autoload: bool = (not _env_flag(ENV_DISABLE_AUTOLOAD)) if autoload is None else autoload
        for name in self.blocked:
            self._pm.set_blocked(name)
        if self.autoload:
            self._load_entry_points()
        for mod in BUILTINS if builtins is None else builtins:
            self._load_builtin(mod)

    # ------------------------------------------------------------- loading
    def _load_entry_points(self) -> None:
        from importlib.metadata import entry_points

        for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
            dist = getattr(ep, "dist", None)
            where = f"{dist.name} {dist.version}" if dist is not None else "unknown distribution"
            if self._pm.is_blocked(ep.name):
                continue
            if self._pm.has_plugin(ep.name):
                raise PluginError(
                    f"entry point {ep.name!r} ({ep.value}, {where}) clashes with an already "
                    f"loaded plugin of that name; uninstall or block one"
                )
            try:
                plugin = ep.load()
            except Exception as e:
                raise PluginError(
                    f"plugin {ep.name!r} ({ep.value}, {where}) failed to import: {e!r}; "
                    f"skip it with {ENV_BLOCK}={ep.name}"
                ) from e
            self._register(
                plugin,
                ep.name,
                PluginInfo(
                    ep.name,
                    "entry point",
                    ep.value,
                    dist.name if dist is not None else None,
                    dist.version if dist is not None else None,
                ),
            )

    def _load_builtin(self, mod: str | ModuleType) -> None:
        name = mod if isinstance(mod, str) else mod.__name__
        if self._pm.is_blocked(name):
            return
        if isinstance(mod, str):
            try:
                mod = importlib.import_module(mod)
            except ImportError as e:
                raise PluginError(f"built-in plugin module {name!r} failed to import: {e}") from e
        self._register(mod, name, PluginInfo(name, "builtin", name), builtin=True)

    def _register(self, plugin: object, name: str, info: PluginInfo, *, builtin: bool = False) -> None:
        try:
            registered = self._pm.register(plugin, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {name!r}: {e}") from e
        except ValueError as e:  # name or object already registered
            raise PluginError(f"plugin {name!r}: {e}") from e
        if registered is None:  # blocked
            return
        try:
            self._validate(plugin, name, builtin=builtin)
        except PluginError:
            self._pm.unregister(plugin)
            raise
        self._info.append(info)
        self._cache.clear()

    def _validate(self, plugin: object, name: str, *, builtin: bool) -> None:
        for caller in self._pm.get_hookcallers(plugin) or []:
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue
                if not caller.has_spec():
                    if impl.optionalhook:
                        continue
                    raise UnknownHookError(name, caller.name)
                if impl.wrapper or impl.hookwrapper:
                    raise PluginError(
                        f"plugin {name!r}: {caller.name} is a hook wrapper; ResiHP hooks "
                        "take plain implementations only"
                    )
                if builtin and not impl.trylast:
                    raise PluginError(
                        f"built-in {name!r}: {caller.name} must be @hookimpl(trylast=True) "
                        "so plugins can replace it"
                    )

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object or module at run time (source ``"direct"``); returns
        its name. Validated like an entry-point plugin."""
        name = name or getattr(plugin, "__name__", None) or f"plugin-{id(plugin):x}"
        if self._pm.is_blocked(name):
            raise PluginError(f"plugin {name!r} is blocked")
        module = getattr(plugin, "__name__", type(plugin).__module__)
        self._register(plugin, name, PluginInfo(name, "direct", module))
        return name

    def unregister(self, name: str) -> None:
        if self._pm.unregister(name=name) is None:
            raise PluginError(f"no plugin named {name!r} (loaded: {', '.join(self.names())})")
        self._info = [i for i in self._info if i.name != name]
        self._cache.clear()

    def info(self) -> list[PluginInfo]:
        """Loaded plugins, in load order."""
        return list(self._info)

    def names(self) -> list[str]:
        return [i.name for i in self._info]

    # ------------------------------------------------------------- calling
    def _impls(self, hook: str) -> list[pluggy.HookImpl]:
        return list(reversed(getattr(self._pm.hook, hook).get_hookimpls()))

    def _fill(self, hook: str, make: Callable[[], R]) -> R:
        """Build a registry by calling every implementation of ``hook``, each attributed
        to its plugin; cached until the set of plugins changes."""
        cached = self._cache.get(hook)
        if cached is not None:
            return cached  # type: ignore[return-value]
        registry = make()
        for impl in self._impls(hook):
            with registry.registering_as(impl.plugin_name, default=impl.trylast):
                try:
                    _call(impl, {"registry": registry})
                except RegistryError:
                    raise
                except Exception as e:
                    raise PluginError(f"plugin {impl.plugin_name!r} failed in {hook}: {e!r}") from e
        self._cache[hook] = registry
        return registry

    def _notify(self, hook: str, **kwargs: object) -> None:
        for impl in self._impls(hook):
            try:
                _call(impl, kwargs)
            except Exception:
                logger.exception("plugin %r failed in %s; the other observers still run", impl.plugin_name, hook)

    def adapters(self) -> AdapterRegistry:
        """Every registered adapter (built once, then cached until plugins change)."""
        return self._fill("resihp_register_adapters", AdapterRegistry)

    def changepoint_detectors(self) -> FactoryRegistry:
        return self._fill(
            "resihp_register_changepoint_detectors", lambda: FactoryRegistry("change-point detector")
        )

    def verification_strategies(self) -> FactoryRegistry:
        return self._fill(
            "resihp_register_verification_strategies", lambda: FactoryRegistry("verification strategy")
        )

    def sdc_detectors(self) -> FactoryRegistry:
        """Silent-data-corruption detectors (docs/sdc.md): ``factory()`` returns an
        object with ``poll(view) -> [SdcSuspect]``."""
        return self._fill("resihp_register_sdc_detectors", lambda: FactoryRegistry("SDC detector"))

    def adaptation_stages(self) -> StageRegistry:
        """The planner's stages; run them in ``.ordered()`` order."""
        return self._fill("resihp_register_adaptation_stages", StageRegistry)

    def sim_policies(self) -> FactoryRegistry:
        """Policies the cluster simulator can compare (``resihp simulate``)."""
        return self._fill("resihp_register_sim_policies", lambda: FactoryRegistry("simulation policy"))

    def commands(self) -> CommandRegistry:
        """Subcommands contributed by plugins (``resihp demo``, ...)."""
        return self._fill("resihp_register_commands", CommandRegistry)

    def data_sources(self) -> DataSourceRegistry:
        """Data sources a job's ``[data] source`` can name (``synthetic``, ``text``, ...)."""
        from resihp_core.data import DataSourceRegistry

        return self._fill("resihp_register_data_sources", DataSourceRegistry)

    def notify_failure(self, report: FailureReport) -> None:
        self._notify("resihp_failure_reported", report=report)

    def notify_plan_changed(self, old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None:
        self._notify("resihp_plan_changed", old=old, new=new, reason=reason)

    def notify_job_started(self, config: object, workdir: str) -> None:
        self._notify("resihp_job_started", config=config, workdir=workdir)

    def notify_iteration(self, metrics: IterationMetrics) -> None:
        self._notify("resihp_iteration_finished", metrics=metrics)


_default: Plugins | None = None


def get_plugins() -> Plugins:
    """The process-wide :class:`Plugins`, built on first use (env switches read then)."""
    global _default
    if _default is None:
        _default = Plugins()
    return _default


def reset_plugins() -> None:
    """Forget the process-wide instance (tests; after changing the environment)."""
    global _default
    _default = None
