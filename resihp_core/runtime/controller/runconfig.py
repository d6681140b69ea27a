"""What one resilient run is given: :class:`ResilientConfig`, the one argument of
:func:`~resihp_core.runtime.controller.resilient.run_resilient` (docs/design.md §2).

:func:`~resihp_core.runtime.controller.assemble.assemble` builds it from a job's configuration
(``AssembledJob.run``); tests and benchmarks that assemble a job by hand build it
directly. It groups what a reader looks for together: the job (spec, first plan,
topology, the Scheduler's state and planner), how the controller meets its agents
(:class:`AgentSetup`), where a resumed job starts (:class:`Resume`) and who hears what
happens (:class:`RunHooks`).
"""

from __future__ import annotations

import queue
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Literal, Mapping

from resihp_core.config import DetectorConfig
from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.runtime.controller.payback import PaybackRule
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState

if TYPE_CHECKING:
    from resihp_core.config import Config
    from resihp_core.protocols.events import Event
    from resihp_core.runtime.failover import JobState
    from resihp_core.runtime.controller.launcher import LocalJob
    from resihp_core.runtime.session import Observers

__all__ = ["AgentSetup", "Resume", "RunHooks", "ResilientConfig"]


@dataclass(frozen=True)
class AgentSetup:
    """How the controller meets its node agents.

    :param mode: ``"local"`` starts one agent process per node here; ``"external"``
        waits up to ``timeout_s`` for agents started elsewhere (they need ``secret``).
    :param listen: the controller's address (``(host, 0)``: any free port).
    :param secret: the job secret agents authenticate with (empty: a fresh one).
    :param interface: the interface name or address every node's workers bind their
        collectives to (empty: each agent's choice).
    """

    mode: Literal["local", "external"] = "local"
    listen: tuple[str, int] = ("127.0.0.1", 0)
    secret: str = ""
    timeout_s: float = 60.0
    interface: str = ""


@dataclass(frozen=True)
class Resume:
    """Where the run starts: ``start`` (the first iteration trained) after the complete
    checkpoint ``restore``, or re-attached to the live job ``attach`` (a restarted
    controller, docs/failover.md)."""

    start: int = 0
    restore: int | None = None
    attach: JobState | None = None


def _running(iteration: int, generation: int) -> str:
    return "running"


def _ignore(*_: object) -> None:
    return None


@dataclass(frozen=True)
class RunHooks:
    """Who hears what happens during a run.

    :param phase_of: the label of an iteration in the report (fault phases).
    :param observe: every event of the run, one stream
        (:data:`~resihp_core.protocols.events.Event`): what the controller learns (on its
        loop), what the job decides and each committed iteration's metrics (on the
        supervisor's thread).
    :param on_listening: the controller's address and the nodes it waits for.
    :param before_run: the job and its local agent processes by node, before the
        first plan is posted (chaos tests kill an agent here).
    """

    phase_of: Callable[[int, int], str] = _running
    observe: Callable[[Event], None] = _ignore
    on_listening: Callable[[str, list[int]], None] = _ignore
    before_run: Callable[[LocalJob, dict[int, subprocess.Popen]], None] = _ignore


@dataclass(frozen=True)
class ResilientConfig:
    """One resilient run of a job (see the module docstring).

    :param workdir: the run's folder (worker and agent logs, the job file).
    :param supervised: False: no Detector and no adaptation (the baseline).
    :param timeout_s: the whole run's hang guard.
    :param repairs: iteration -> devices whose workers are started again once that
        many iterations are committed.
    :param controller_grace_s: > 0: agents and workers outlive a lost controller this
        long (docs/failover.md); needs ``agents.secret``.
    :param state_dir: where the job's state for a restarted controller is kept
        (default: ``workdir``).
    :param config: the job's configuration, for the observers' ``job_started``.
    :param observers: the plugin facade whose observer hooks the session fires.
    :param repair_requests: lists of repaired devices put from any thread; the
        supervisor's one queue of them (healed nodes offer theirs on it too).
    :param move_before_restore: False: a "restore" decision loads the newest complete
        checkpoint at once, without first moving the survivors' copies (docs/design.md §2.2).
    :param payback: the rule a fail-slow re-plan must pass before it is deployed
        (docs/detector.md "Acting on a slowdown"; None: every re-plan is deployed).
    :param worker_env: environment every worker gets besides the agent's own (e.g. a
        ``PYTHONPATH`` to the user's model or adapter modules).
    """

    spec: JobSpec
    plan: ParallelPlan  # the first plan
    topology: Topology
    state: PlannerState
    planner: Planner
    detector: DetectorConfig
    iterations: int
    workdir: Path
    worker_module: str = "resihp_core.runtime.worker"
    supervised: bool = True
    timeout_s: float = 900.0
    agents: AgentSetup = AgentSetup()
    repairs: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    controller_grace_s: float = 0.0
    resume: Resume = Resume()
    state_dir: Path | None = None
    config: Config | None = None
    observers: Observers | None = None
    repair_requests: queue.Queue[Iterable[int]] | None = None
    move_before_restore: bool = True
    payback: PaybackRule | None = field(default_factory=PaybackRule)
    worker_env: Mapping[str, str] = field(default_factory=dict)
    hooks: RunHooks = RunHooks()
