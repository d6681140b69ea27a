"""Every ResiHP extension point, as pluggy hook specifications.

Plugins implement these with ``@hookimpl`` and ship in the entry-point group
``resihp``; built-ins implement them with ``@hookimpl(trylast=True)``. Hooks are called
only through the typed facade :class:`resihp_core.plugins.Plugins`, which calls each
implementation in pluggy's order (plugins first, ``trylast`` built-ins last) and knows
which plugin made each registration. Hook wrappers are not supported.

Six families:

- **adapters** — ``resihp_register_adapters``: the execution layer for a framework.
- **detection** — ``resihp_register_changepoint_detectors``,
  ``resihp_register_verification_strategies`` and ``resihp_register_sdc_detectors``:
  named factories the Detector picks from its configuration or (SDC) runs them all.
- **scheduling** — ``resihp_register_adaptation_stages``: the ordered stages of the
  progressive planner (built in: ``tp``, ``pp``, ``dp``), which a plugin replaces by
  registering the same name or extends with a new name and order.
- **simulation** — ``resihp_register_sim_policies``: the mitigation policies the
  cluster simulator (:mod:`resihp_core.sim`) compares.
- **data** — ``resihp_register_data_sources``: where a job's documents come from
  (built in: ``synthetic``, ``text``).
- **observers** — ``resihp_job_started``, ``resihp_failure_reported``,
  ``resihp_plan_changed``, ``resihp_iteration_finished``: notifications for logging, metrics, dashboards.

Registration hooks follow DESIGN's ``resihp_register_<things>(registry)``; in every
registry a ``trylast`` (default) registration yields to a plugin's registration of the
same name (see :class:`resihp_core.adapter.Registry`). Observer hooks are
``resihp_<noun>_<past verb>``; their return values are ignored and an exception in one
observer is logged without stopping the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from resihp_core.adapter import AdapterRegistry
    from resihp_core.data import DataSourceRegistry
    from resihp_core.plan import ParallelPlan
    from resihp_core.plugins import CommandRegistry, FactoryRegistry, StageRegistry
    from resihp_core.protocol import FailureReport
    from resihp_core.protocols.metrics import IterationMetrics

__all__ = ["PROJECT", "hookimpl", "hookspec"]

PROJECT = "resihp"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


# ------------------------------------------------------------------- adapters
@hookspec
def resihp_register_adapters(registry: AdapterRegistry) -> None:
    """Register execution-layer adapters.

    Call ``registry.register(name, "module:Class", Capabilities(...))``. Registering must
    not import the framework: the target is imported only when the adapter is created.

    :param registry: the :class:`~resihp_core.adapter.AdapterRegistry` to fill.
    """


# ------------------------------------------------------------------ detection
@hookspec
def resihp_register_changepoint_detectors(registry: FactoryRegistry) -> None:
    """Register change-point detectors for the fail-slow Detector (docs/design.md §3.2).

    Call ``registry.register(name, factory)``; the Detector calls ``factory(**options)``
    with the options from its configuration and feeds the result per-iteration times.
    The detector interface is defined in :mod:`resihp_core.detector`.

    :param registry: a :class:`~resihp_core.plugins.FactoryRegistry` of detector factories.
    """


@hookspec
def resihp_register_verification_strategies(registry: FactoryRegistry) -> None:
    """Register verification strategies: how a suspected fail-slow is localised to
    device(s) and classified as compute or communication, producing a failure report.

    Call ``registry.register(name, factory)``; the Detector calls ``factory(**options)``.

    :param registry: a :class:`~resihp_core.plugins.FactoryRegistry` of strategy factories.
    """


@hookspec
def resihp_register_sdc_detectors(registry: FactoryRegistry) -> None:
    """Register silent-data-corruption detectors (hardware error counters, vendor health
    checks) that report through the same path as the cross-replica fingerprints
    (docs/sdc.md).

    Call ``registry.register(name, factory)``; the controller calls ``factory()`` once per
    job and then ``poll(view)`` about ten times a second with a
    :class:`~resihp_core.detector.sdc.SdcView`; each
    :class:`~resihp_core.detector.sdc.SdcSuspect` it returns is reported fail-stop with
    cause ``sdc`` and its device quarantined.

    :param registry: a :class:`~resihp_core.plugins.FactoryRegistry` of detector factories.
    """


# ----------------------------------------------------------------- scheduling
@hookspec
def resihp_register_adaptation_stages(registry: StageRegistry) -> None:
    """Register stages of the progressive planner (docs/design.md §4).

    Call ``registry.register(name, stage, order=...)``. The planner runs the stages in
    ascending ``order``; each stage is a callable taking and returning the planner's
    ``PlannerState`` (defined in :mod:`resihp_core.scheduler`). Built-ins are ``tp``
    (order 100), ``pp`` (200) and ``dp`` (300), registered ``trylast``: register the
    same name to replace one (``order`` defaults to the built-in's), or a new name
    with an order in between to add a stage.

    :param registry: the :class:`~resihp_core.plugins.StageRegistry` to fill.
    """


# ----------------------------------------------------------------- simulation
@hookspec
def resihp_register_sim_policies(registry: FactoryRegistry) -> None:
    """Register mitigation policies for the cluster simulator (``resihp simulate``).

    Call ``registry.register(name, factory)``; the simulator calls ``factory()`` once per
    run and drives the result through the interface of
    :class:`resihp_core.sim.policies.Policy` (``start``, ``on_stop``, ``on_repair``,
    ``on_slow``, ``on_recover``, ``on_timer``, ``iteration_time``). Built-ins:
    ``resihp``, ``none``, ``recycle``, ``oobleck``, ``greyhound``, ``adaptra``,
    ``enh-recycle``, ``enh-oobleck``.

    :param registry: a :class:`~resihp_core.plugins.FactoryRegistry` of policy factories.
    """


# ----------------------------------------------------------------------- data
@hookspec
def resihp_register_data_sources(registry: DataSourceRegistry) -> None:
    """Register data sources: what a job trains on (``[data] source = NAME``).

    Call ``registry.register(name, factory, description=...)``; ``factory(options, ctx)``
    gets the ``[data]`` section without ``source`` and a
    :class:`~resihp_core.data.SourceContext` (dp, micro-batches, seed, token budget,
    vocabulary), validates the options (a :class:`~resihp_core.data.DataError` naming
    the field) and returns a :class:`~resihp_core.data.DataSource`. Built-ins:
    ``synthetic`` and ``text``, registered ``trylast``.

    :param registry: the :class:`~resihp_core.data.DataSourceRegistry` to fill.
    """


# ------------------------------------------------------------------ commands
@hookspec
def resihp_register_commands(registry: CommandRegistry) -> None:
    """Add subcommands to the ``resihp`` command line (``resihp demo`` is one).

    Call ``registry.register(name, help, configure, run)``: ``configure(parser)`` adds
    the arguments, ``run(args)`` does the work and returns the exit code. Import heavy
    modules inside ``run`` so ``resihp --help`` stays fast.

    :param registry: the :class:`~resihp_core.plugins.CommandRegistry` to fill.
    """


# ------------------------------------------------------------------ observers
@hookspec
def resihp_failure_reported(report: FailureReport) -> None:
    """A failure was confirmed by the Detector and handed to the Scheduler.

    :param report: the :class:`~resihp_core.protocol.FailureReport`: plan generation,
        failure class (fail-stop / fail-slow), devices, cause (compute /
        communication), normalised throughputs, evidence.
    """


@hookspec
def resihp_plan_changed(old: ParallelPlan | None, new: ParallelPlan, reason: str) -> None:
    """A new plan generation was deployed.

    :param old: the previous plan, or None for the job's first plan.
    :param new: the plan now running (``new.generation`` is its generation).
    :param reason: a short human-readable cause, e.g. ``"fail-stop device 5"``.
    """


@hookspec
def resihp_job_started(config: Any, workdir: str) -> None:
    """A job is starting on this controller (``resihp run``, ``resihp demo``).

    :param config: the job's :class:`~resihp_core.config.Config` (an exporter reads its
        settings from it, e.g. ``runtime.metrics_port``).
    :param workdir: the job's working folder (worker logs, checkpoints by default).
    """


@hookspec
def resihp_iteration_finished(metrics: IterationMetrics) -> None:
    """A training iteration finished (called on the controller, once per iteration).

    :param metrics: the :class:`~resihp_core.protocols.IterationMetrics` of that
        iteration: iteration number, loss, wall time, samples, plan generation, phase.
    """
