"""The supervisor: what a resilient job does about each thing that happens to it, as
an explicit state machine (docs/design.md, "The supervisor's state machine").

A pure core: :meth:`Supervisor.handle` takes one typed event and returns the actions
to take; it reads no store, starts no process and calls no planner, and its only sense
of time is the injected ``clock``. :class:`~resihp_core.runtime.controller.control.ControlLoop`
turns the job's session, processes and the controller's reports into events, carries
the actions out and feeds their outcome back (``Planned``, ``Deployed``, ...). Unit
tests drive the core without processes (tests/unit/test_supervisor.py).

Phases::

    Running --failure--> Planning --Planned--> Deploying --Committed--> Running
    Running --Rejoin--> Joining --Ready--> Planning (rejoin) --Planned--> Deploying

- **Running**: the current generation has committed an iteration.
- **Planning**: a planner call is out (:class:`PlanFailure` / :class:`PlanRejoin`);
  only :class:`Planned` and :class:`DeployFailed` are taken.
- **Deploying**: a generation was posted (:class:`Deploy` / :class:`Retry`) and has
  not committed yet. Failures are planned at once (a failure during recovery is
  handled like any other); repaired devices wait for a commit.
- **Joining**: repaired devices were started again (or paused ones came back); they
  are planned in once all are ready, or dropped when they die or time out.

Rules kept here (docs/design.md §2): fail-stop is planned before fail-slow, and one
merged report stands for every device lost (observers hear it once); a hung device is
fenced (:class:`Kill`) before the next generation, a paused one only fenced by the
plan; a plan that names a device found dead meanwhile is planned again; a restore
decision first moves the survivors' copies (unless ``move_before_restore`` is off) and
only a :class:`~resihp_core.protocol.WorkerLeft` with ``state_lost`` (the adapter's
``StateLost``) sends the job to a checkpoint; live workers that gave up with no device
failing get the same plan again, ``max_retries`` times in a row.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Literal, Union

from resihp_core.detector.sdc import Quarantine, Reexecute, SdcArbiter, SdcDetected
from resihp_core.protocol import FailureReport, JobError, PlanUpdate, ScriptEnded, WorkerLeft
from resihp_core.protocols import events as jev
from resihp_core.protocols.events import JobEvent
from resihp_core.runtime.controller.payback import PaybackRule, ReconfigurationMeter, is_recovery, origin_candidate
from resihp_core.runtime.session import Layout, StorageFault
from resihp_core.scheduler.planner import PlanDecision
from resihp_core.scheduler.state import PlannerState

__all__ = ["Phase", "Supervisor", "Event", "Action", "Committed", "Rejoin", "Ready", "Planned", "Deployed",
           "Reconfigured", "DeployFailed", "RelaunchFailed", "Tick", "Emit", "NotifyFailure", "Kill", "Relaunch",
           "PlanFailure", "PlanRejoin", "Deploy", "Retry", "Fail", "EndJob", "Finish", "SdcDetected", "needs_restore",
           "JOB_ERROR_GRACE_S"]

#: A job error waits this long for a device failure that would explain it (a peer's
#: death seen as an odd exception on a survivor) before it ends the job.
JOB_ERROR_GRACE_S = 2.0


class Phase(enum.Enum):
    RUNNING = "running"
    PLANNING = "planning"
    DEPLOYING = "deploying"
    JOINING = "joining"


# ------------------------------------------------------------------ events (what happened)
@dataclass(frozen=True)
class Committed:
    """Iteration ``iteration`` committed everywhere, in ``generation``."""

    iteration: int
    generation: int


@dataclass(frozen=True)
class Rejoin:
    """Repaired devices offered back (a healed node, an operator, a due repair)."""

    devices: tuple[int, ...]


@dataclass(frozen=True)
class Ready:
    """These relaunched or resumed devices' workers are up and wait for a generation."""

    devices: tuple[int, ...]


@dataclass(frozen=True)
class Planned:
    """The planner's answer to :class:`PlanFailure` / :class:`PlanRejoin`; ``dead``:
    devices whose processes were found dead meanwhile."""

    decision: PlanDecision
    seconds: float
    dead: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Deployed:
    """Generation ``generation`` was posted for the live workers ``members``."""

    generation: int
    members: tuple[int, ...]
    resume: int  # the first iteration it trains


@dataclass(frozen=True)
class Reconfigured:
    """Generation ``generation``'s workers entered it in ``seconds`` by their own timing
    (:func:`~resihp_core.runtime.controller.payback.worker_timing`): what a re-plan's
    reconfiguration is estimated at before one is measured."""

    generation: int
    seconds: float


@dataclass(frozen=True)
class DeployFailed:
    """The plan could not be posted: ``gone`` devices of it have no live worker."""

    gone: tuple[int, ...]


@dataclass(frozen=True)
class RelaunchFailed:
    devices: tuple[int, ...]
    error: str


@dataclass(frozen=True)
class Tick:
    """Time to decide: which workers' processes are alive and dead now."""

    alive: frozenset[int]
    dead: frozenset[int]


Event = Union[Committed, FailureReport, WorkerLeft, StorageFault, Rejoin, Ready, Planned, Deployed, Reconfigured,
              DeployFailed, RelaunchFailed, Tick, JobError, ScriptEnded, SdcDetected]


# ------------------------------------------------------------------ actions (what to do)
@dataclass(frozen=True)
class Emit:
    """Publish a job event (:mod:`resihp_core.protocols.events`), labelled with
    iteration ``at`` (None: the committed count)."""

    event: JobEvent
    at: int | None = None

    @property
    def kind(self) -> str:
        return self.event.kind

    @property
    def text(self) -> str:
        return self.event.text


@dataclass(frozen=True)
class NotifyFailure:
    """Tell observers about one failure (once per failure)."""

    report: FailureReport


@dataclass(frozen=True)
class Kill:
    """Fence ``device``: SIGKILL its worker (a stopped one is continued first)."""

    device: int


@dataclass(frozen=True)
class Relaunch:
    devices: tuple[int, ...]


@dataclass(frozen=True)
class PlanFailure:
    """Ask the planner for a plan answering ``report`` from ``state``; answer with
    :class:`Planned`."""

    report: FailureReport
    state: PlannerState


@dataclass(frozen=True)
class PlanRejoin:
    devices: tuple[int, ...]
    state: PlannerState


@dataclass(frozen=True)
class Deploy:
    """Abort the running generation and post ``decision.plan`` from the last committed
    iteration, or from the newest complete checkpoint (``from_checkpoint``); answer
    with :class:`Deployed` or :class:`DeployFailed`."""

    decision: PlanDecision
    seconds: float
    kind: str
    from_checkpoint: bool
    what: str = ""
    devices: tuple[int, ...] = ()


@dataclass(frozen=True)
class Retry:
    """Deploy the same plan again (workers left with no device failing: ``failures``)."""

    failures: dict[int, str]
    attempt: int
    why: str = ""  # set when the retry is not for workers that left (an SDC re-execution)


@dataclass(frozen=True)
class Fail:
    """Give up: the job cannot make progress."""

    message: str


@dataclass(frozen=True)
class EndJob:
    """The job's own code raised (docs/errors.md): end the job now, nothing planned."""

    error: JobError


@dataclass(frozen=True)
class Finish:
    """The user's script returned before the configured end: stop the job normally."""

    ended: ScriptEnded


Action = Union[Emit, NotifyFailure, Kill, Relaunch, PlanFailure, PlanRejoin, Deploy, Retry, Fail, EndJob, Finish]


def needs_restore(prev: PlanUpdate | None, resume: int, *, can_restore: bool,
                  layouts: Callable[[], Iterable[Layout]]) -> bool:
    """Whether the generation after ``prev`` (aborted at ``resume``) must restore from
    a checkpoint because the live workers may not hold the state ``prev``'s plan says,
    or not all in the same layout.

    Only a ``prev`` that committed no iteration is in doubt (a commit needs every
    executor reconfigured). Then: a restore being replaced is restored again (a
    rejoined worker holds no state); a state move is trusted only if every live worker
    of ``prev`` finished it (``moved``) or every one gave it up before (``kept``) -- a
    mix, or a worker still busy (``unknown``), means some hold the old layout and some
    the new one (docs/worker-protocol.md). ``layouts``: the live members' layouts in
    ``prev``, read only when needed."""
    if prev is None or resume > prev.resume or prev.stop:
        return False
    if prev.restore is not None or prev.fresh:
        return True
    if not can_restore:
        return False  # nothing to restore from: moving is the only way
    states = set(layouts())
    return "unknown" in states or len(states) > 1


class Supervisor:
    """The state machine of one resilient job (see the module docstring).

    :param state: the Scheduler's state of the first plan (the core keeps the newest).
    :param clock: seconds, monotonic; the only time the core knows.
    :param stall_s: no commit this long while workers left the generation with no
        device failing: retry the same plan.
    :param can_restore: the job writes checkpoints (a ``StateLost`` can be answered);
        ``checkpoint_every``: how often (for the storage-fault events).
    :param repairs: iteration -> devices repaired once that many iterations committed.
    :param handled: devices already out of the job (a re-attached job's lost members).
    :param payback: the rule a fail-slow re-plan must pass before it is deployed (None:
        every re-plan is deployed); ``iterations``: the job's length (caps its horizon).
    """

    def __init__(self, state: PlannerState, *, clock: Callable[[], float], stall_s: float = 15.0,
                 max_retries: int = 3, join_timeout_s: float = 120.0, can_restore: bool = False,
                 checkpoint_every: int = 0, move_before_restore: bool = True, repairs: dict[int, tuple[int, ...]] | None = None,
                 handled: Iterable[int] = (), payback: PaybackRule | None = None,
                 iterations: int | None = None) -> None:
        self.state = state
        self.clock = clock
        self.stall_s, self.max_retries, self.join_timeout_s = stall_s, max_retries, join_timeout_s
        self.can_restore, self.move_before_restore = can_restore, move_before_restore
        self.checkpoint_every = checkpoint_every
        self.repairs = dict(repairs or {})
        self.phase = Phase.DEPLOYING
        self.generation = -1
        self.members: tuple[int, ...] = ()
        self.committed = 0  # iterations committed
        self.handled: set[int] = set(handled)  # devices whose loss was planned
        self.paused: set[int] = set()  # fenced by the plan, process stopped, kept alive
        self.joining: dict[int, float] = {}  # relaunched / resumed device -> give-up time
        self.rejoined: dict[int, int] = {}  # device -> generation it rejoined in
        self.retries = 0
        self._pending: list[FailureReport] = []
        self._offered: set[int] = set()
        self._ready: set[int] = set()
        self._left: dict[int, WorkerLeft] = {}  # of the current generation
        self._last_progress = clock()
        self._planning: Literal["failure", "rejoin"] = "failure"
        self._report: FailureReport | None = None
        self._attempt = 0
        self._futile = 0  # deploys in a row that failed on devices known dead
        self._rejoining: tuple[int, ...] = ()
        self._gen_committed = False  # the current generation committed an iteration
        self._job_errors: dict[int, tuple[JobError, float]] = {}  # device -> error, when seen
        self.ended: dict[int, ScriptEnded] = {}  # devices whose script returned (not failures)
        self.sdc = SdcArbiter()  # silent data corruption: what a finding means (docs/sdc.md)
        self._reexecute: Reexecute | None = None
        self.payback, self.iterations = payback, iterations
        self.meter = ReconfigurationMeter()  # what a fail-slow re-plan costs this job
        self._replan = False  # the next Deployed is a fail-slow re-plan's (measured)

    # ------------------------------------------------------------ the one entry point
    def handle(self, event: Event) -> list[Action]:
        """Take one event; return the actions to carry out, in order."""
        if isinstance(event, Committed):
            return self._committed(event)
        if isinstance(event, FailureReport):
            self._pending.append(event)
            return []
        if isinstance(event, WorkerLeft):
            if event.generation == self.generation:
                self._left[event.device] = event
            return []
        if isinstance(event, StorageFault):
            nxt = f"at iteration {event.iteration + self.checkpoint_every}" if self.checkpoint_every else "never"
            return [Emit(jev.CheckpointFailed(text=f"storage fault: checkpoint of iteration {event.iteration} not "
                                                  f"written by device {event.device} ({event.error}); training "
                                                  f"goes on, next checkpoint {nxt}",
                                             devices=(event.device,), checkpoint=event.iteration))]
        if isinstance(event, Rejoin):
            self._offered.update(event.devices)
            return []
        if isinstance(event, Ready):
            self._ready.update(event.devices)
            return []
        if isinstance(event, Planned):
            return self._planned(event)
        if isinstance(event, Deployed):
            return self._deployed(event)
        if isinstance(event, DeployFailed):
            return self._deploy_failed(event)
        if isinstance(event, Reconfigured):
            self.meter.timed_s = event.seconds
            return []
        if isinstance(event, RelaunchFailed):
            for d in event.devices:
                self.joining.pop(d, None)
            self._settle()
            return [Emit(jev.Failure(text=f"workers of devices {list(event.devices)} could not be started again: "
                                         f"{event.error}", failure="fail-stop", devices=tuple(event.devices)))]
        if isinstance(event, Tick):
            return self._tick(event)
        if isinstance(event, JobError):
            self._job_errors.setdefault(event.device, (event, self.clock()))
            return []
        if isinstance(event, ScriptEnded):
            self.ended[event.device] = event
            return []
        if isinstance(event, SdcDetected):
            return self._sdc(event)
        raise TypeError(f"not a supervisor event: {event!r}")

    def finish(self, alive: Iterable[int]) -> list[Action]:
        """The job is done: workers still paused (fenced, never back) hold stale state
        and are no part of its end; they are killed, not stopped with the others."""
        out: list[Action] = []
        for d in sorted(self.paused & set(alive)):
            out += [Emit(jev.Killed(text=f"device {d} was still paused at the job's end: killed", devices=(d,))),
                    Kill(d)]
        self.paused.clear()
        return out

    # ------------------------------------------------------------ commits and deployments
    def _committed(self, ev: Committed) -> list[Action]:
        self.committed = max(self.committed, ev.iteration + 1)
        self._last_progress = self.clock()
        self.retries = 0  # the job makes progress: a later stall gets its own retries
        if ev.generation == self.generation:
            self._gen_committed = True
            self.meter.committed(self.clock())
            self._settle()
        for it in sorted(it for it in self.repairs if it <= self.committed):
            self._offered.update(self.repairs.pop(it))  # scheduled repairs, now due
        transient = self.sdc.committed(ev.iteration)
        return [Emit(jev.SdcFound(text=transient), at=ev.iteration)] if transient else []

    def _sdc(self, ev: SdcDetected) -> list[Action]:
        """Silent data corruption found (docs/sdc.md): quarantine the outvoted devices
        (a fail-stop report with cause ``sdc``, acted on at the next tick like any),
        re-execute an iteration whose replicas have no majority, or stop the job when
        that re-execution disagrees again."""
        f = ev.finding
        d = self.sdc.decide(f)

        def found(text: str, suspects: tuple[int, ...] = tuple(f.suspects)) -> Emit:
            return Emit(jev.SdcFound(text=text, suspects=suspects, candidates=tuple(f.candidates),
                                    source=f.source), at=f.iteration)

        if isinstance(d, Quarantine):
            self._pending.append(d.report)
            # a range finding's suspects are decided on re-execution: the report names them
            return [found(f"silent data corruption at iteration {f.iteration}: devices {list(d.report.devices)} "
                          f"quarantined ({f.evidence[:200]})", tuple(d.report.devices))]
        if isinstance(d, Reexecute):
            self._reexecute = d
            return [found(d.text)]
        return [found(d.text), Fail(d.text)]

    def _settle(self) -> None:
        """The phase the job is in now, outside a planner call: Deploying until the
        current generation commits, then Joining while devices are on their way back."""
        if self.phase is Phase.PLANNING:
            return
        if not self._gen_committed:
            self.phase = Phase.DEPLOYING
        else:
            self.phase = Phase.JOINING if self.joining else Phase.RUNNING

    def _deployed(self, ev: Deployed) -> list[Action]:
        self.generation, self.members, self.committed = ev.generation, ev.members, ev.resume
        self._left = {}
        self._futile = 0
        self._gen_committed = False
        self.phase = Phase.DEPLOYING
        self._last_progress = self.clock()
        self.meter.deployed(replan=self._replan)
        self._replan = False
        if self._rejoining:
            self.rejoined.update({d: ev.generation for d in self._rejoining})
            self._rejoining = ()
        return []

    # ------------------------------------------------------------ deciding
    def _tick(self, ev: Tick) -> list[Action]:
        if self.phase is Phase.PLANNING:
            return []
        if self._job_errors or self.ended:
            got = self._job_end(ev)
            if got is not None:
                return got
        out = self._expire_joining(ev)
        if self.joining and set(self.joining) <= self._ready:
            devices = tuple(sorted(self.joining))
            self.joining.clear()
            self._ready.clear()
            self.handled.difference_update(devices)
            self.phase, self._planning, self._rejoining = Phase.PLANNING, "rejoin", devices
            return out + [PlanRejoin(devices, self.state)]
        reports = self._fresh_reports(ev)
        if reports:
            return out + self._failure(reports, ev)
        if self._reexecute is not None:
            d, self._reexecute = self._reexecute, None
            self.phase = Phase.PLANNING
            return out + [Retry({c: "silent data corruption suspected" for c in d.candidates}, 1, why=d.text)]
        if self._gen_committed and self._offered:
            got = self._offers(ev)
            if got:
                return out + got
        lost = {d: left.reason for d, left in self._left.items() if left.state_lost}
        if lost and self.can_restore:
            self._left = {}
            decision = PlanDecision(plan=self.state.plan, kind="restore", predicted_time=0.0, timings={},
                                    state=self.state, reason="no live copy of some state: restore from checkpoint")
            self.phase = Phase.PLANNING
            return out + [Emit(jev.Failure(text=f"state cannot be moved to generation {self.generation}'s plan "
                                               f"({next(iter(lost.values()))}): restoring it from a checkpoint",
                                          failure="state-lost", devices=tuple(sorted(lost)), cause="state")),
                          Deploy(decision, 0.0, "restore", from_checkpoint=True)]
        if self.clock() - self._last_progress > self.stall_s:
            failures = {d: left.reason for d, left in self._left.items()}
            if failures and self.retries < self.max_retries:
                # Live workers gave up without any device failing (a rendezvous that
                # ran out of patience, a peer that left for a transient reason).
                self.retries += 1
                self._last_progress = self.clock()
                self.phase = Phase.PLANNING
                return out + [Retry(failures, self.retries)]
            if failures:
                return out + [Fail(f"generation {self.generation} stalled at iteration {self.committed}; "
                                   "workers failed: " + "; ".join(f"device {d}: {t}"
                                                                  for d, t in sorted(failures.items())))]
        return out

    def _expired(self, d: int) -> bool:
        return d in self._job_errors or d in self.ended

    def _job_end(self, ev: Tick) -> list[Action] | None:
        """A job error ends the job once no device failure explains it within the grace
        period (then the error was a peer's death seen from a survivor, and its device
        is lost with the rest); a script that ended ends the job normally."""
        failing = any(set(r.devices) - set(self._job_errors) - set(self.ended) - self.handled
                      for r in self._pending if r.failure == "fail-stop")
        failing |= any(d in self.members and d not in self.handled and not self._expired(d) for d in ev.dead)
        if self._job_errors:
            if failing:
                self._job_errors.clear()  # secondary: planned as the failure it followed
                return None
            first, seen = min(self._job_errors.values(), key=lambda x: x[1])
            if self.clock() - seen < JOB_ERROR_GRACE_S:
                return []
            return [Emit(jev.JobErrorEvent(text=first.line(), devices=tuple(sorted(self._job_errors)),
                                          where=first.where, exception=first.exc_type, phase=first.phase)),
                    EndJob(first)]
        if failing:
            return None
        ended = min(self.ended.values(), key=lambda e: e.iteration)
        return [Finish(ended)]

    def _expire_joining(self, ev: Tick) -> list[Action]:
        """Forget relaunched devices that died or never got ready."""
        now = self.clock()
        out: list[Action] = []
        for d in sorted(d for d, t in self.joining.items() if d in ev.dead or now > t):
            del self.joining[d]
            self._ready.discard(d)
            out.append(Emit(jev.Failure(text=f"relaunched device {d} did not get ready", failure="fail-stop",
                                       devices=(d,))))
            if d not in ev.dead:
                out.append(Kill(d))
        if out:
            self._settle()
        return out

    def _fresh_reports(self, ev: Tick) -> list[FailureReport]:
        """The pending reports that say something new, plus a backstop: a worker process
        of the generation that exited without the controller saying so yet."""
        got, self._pending = self._pending, []
        dead = [d for d in sorted(ev.dead) if d in self.members and d not in self.handled and not self._expired(d)]
        if dead:
            got.append(FailureReport(generation=self.generation, failure="fail-stop", devices=tuple(dead),
                                     evidence="worker process exited"))
        fresh = []
        for r in got:
            devs = set(r.devices) - (self.handled if r.failure == "fail-stop" else set())
            devs -= {d for d in devs if self._expired(d)}  # its exit was the job's end, not a failure
            devs -= {d for d, g in self.rejoined.items() if r.generation < g}  # about its previous life
            if devs:
                fresh.append(r)
        return fresh

    def _failure(self, reports: list[FailureReport], ev: Tick) -> list[Action]:
        stops = [r for r in reports if r.failure == "fail-stop"]
        slows = [r for r in reports if r.failure != "fail-stop"]
        if stops:  # fail-stop first; one report for every device lost
            devices = sorted({d for r in stops for d in r.devices} - self.handled)
            causes = {r.cause for r in stops}  # one cause shared by all (e.g. sdc) is kept
            report = FailureReport(generation=self.generation, failure="fail-stop", devices=tuple(devices),
                                   cause=causes.pop() if len(causes) == 1 else "unknown",
                                   evidence="; ".join(r.evidence for r in stops)[:500])
            self._pending += slows  # kept for the next round
        else:
            report = slows[0]
            self._pending += slows[1:]
        out: list[Action] = [NotifyFailure(report),
                             Emit(jev.Failure(text=f"{report.failure} of devices {list(report.devices)} "
                                                  f"({report.cause}): {report.evidence}", failure=report.failure,
                                             devices=tuple(report.devices), cause=report.cause))]
        if is_recovery(report):  # not a failure: the devices are back at full speed
            out = [Emit(jev.Recovered(text=f"devices {list(report.devices)} healthy again: {report.evidence}",
                                     devices=tuple(report.devices)))]
        if report.failure == "fail-stop":
            paused = {d for r in stops for d in r.paused}
            for d in report.devices:
                self.handled.add(d)
                if d in paused:
                    self.paused.add(d)  # stopped, not hung: fenced by the plan, kept alive
                elif d in ev.alive:
                    self.paused.discard(d)
                    out.append(Kill(d))  # fence a hung device (SIGCONT first)
            # Processes found dead meanwhile join the report: never plan onto them.
            gone = sorted(set(ev.dead) - set(report.devices) - self.handled)
            if gone:
                report = FailureReport(generation=report.generation, failure="fail-stop",
                                       devices=tuple(sorted(set(report.devices) | set(gone))),
                                       cause=report.cause, evidence=report.evidence)
                self.handled.update(gone)
        self.phase, self._planning, self._report, self._attempt = Phase.PLANNING, "failure", report, 0
        return out + [PlanFailure(report, self.state)]

    def _planned(self, ev: Planned) -> list[Action]:
        if self.phase is not Phase.PLANNING:
            raise RuntimeError("a plan arrived while none was asked for")
        decision = ev.decision
        if self._planning == "rejoin":
            devices = self._rejoining
            needs_state = bool(set(devices) & set(decision.plan.devices())) or decision.kind == "restore"
            self.state = decision.state
            return [Deploy(decision, ev.seconds, "rejoin", from_checkpoint=needs_state,
                           what=f"rejoin of devices {list(devices)}", devices=devices)]
        dead_in_plan = sorted(set(decision.plan.devices()) & ev.dead)
        if dead_in_plan and self._attempt < 3:
            # A device died while we planned: plan again with it counted as failed.
            self._attempt += 1
            self.state = decision.state
            self.handled.update(dead_in_plan)
            self._report = FailureReport(generation=self.generation, failure="fail-stop",
                                         devices=tuple(dead_in_plan), evidence="died during recovery")
            return [Emit(jev.Failure(text=f"fail-stop of devices {dead_in_plan} during recovery", failure="fail-stop",
                                    devices=tuple(dead_in_plan))),
                    PlanFailure(self._report, self.state)]
        if self.payback is not None and self._report is not None and self._report.failure == "fail-slow":
            return self._judged(decision, ev.seconds)
        self.state = decision.state
        # A restore decision is a fresh layout over the survivors. Where they still hold
        # a copy of every piece (replicas), moving it there beats reading a checkpoint
        # and re-training since it: try the move; an adapter that finds a piece with no
        # holder raises StateLost, answered by a restore (Tick).
        return [Deploy(decision, ev.seconds, decision.kind,
                       from_checkpoint=decision.kind == "restore" and not self.move_before_restore)]

    def _judged(self, decision: PlanDecision, seconds: float) -> list[Action]:
        """A fail-slow re-plan (or the return after a device is healthy again) is deployed
        only when it pays back its reconfiguration (runtime/controller/payback.py); otherwise the job
        runs on with its plan, the new speeds noted. The event says which and why."""
        assert self.payback is not None and self._report is not None
        report = self._report
        back = is_recovery(report)
        if back:
            decision = origin_candidate(decision) or decision
        remaining = None if self.iterations is None else max(0, self.iterations - self.committed)
        verdict = self.payback.judge(decision, self.state, self.meter, remaining)
        devices = list(report.devices)
        what = f"devices {devices} healthy again" if back else f"fail-slow of devices {devices} ({report.cause})"
        if report.cause == "communication" and not back:
            # The planner says which link, what still crosses it and why (scheduler/links.py),
            # whether its layout is deployed or not.
            said = [n for n in decision.notes if "the link of node" in n]
            if said or verdict.unchanged:
                what += ": " + ("; ".join(said) if said else
                                f"no layout the planner found moves traffic off the slow link of devices {devices}")
        if not verdict.pays:
            self.state = self.state.with_health(speeds=decision.state.speeds,
                                                link_speeds=decision.state.link_speeds)
            self.phase = Phase.DEPLOYING  # back to where the running generation is
            self._settle()
            return [Emit(jev.Replanned(text=f"{what}: plan generation {self.generation} kept, the re-plan does not "
                                           f"pay back: {verdict.text}", devices=tuple(devices), pays=False,
                                      gain_s=verdict.gain_s, cost_s=verdict.cost_s, horizon=verdict.horizon))]
        self.state = decision.state
        self._replan = True
        decision = replace(decision, reason=f"{decision.reason}; pays back: {verdict.text}")
        return [Emit(jev.Replanned(text=f"{what}: re-planned, it pays back: {verdict.text}", devices=tuple(devices),
                                  pays=True, gain_s=verdict.gain_s, cost_s=verdict.cost_s, horizon=verdict.horizon)),
                Deploy(decision, seconds, decision.kind,
                       from_checkpoint=decision.kind == "restore" and not self.move_before_restore,
                       what="return to the better layout" if back else "")]

    def _deploy_failed(self, ev: DeployFailed) -> list[Action]:
        """A device of the plan died between the plan and the post (two workers killed
        together, one reported first): plan again without it."""
        gone = tuple(sorted(ev.gone))
        # A plan onto devices already known dead, again and again, would loop forever
        # (plan, post, fail): give up after max_retries of them in a row.
        self._futile = self._futile + 1 if set(gone) <= self.handled else 0
        if self._futile > self.max_retries:
            return [Fail(f"the planner placed work on dead devices {list(gone)} {self._futile} times in a row; "
                         "giving up (a planner must leave out the state's failed devices)")]
        self.handled.update(gone)
        report = FailureReport(generation=self.generation, failure="fail-stop", devices=gone,
                               evidence="died during recovery")
        self.phase, self._planning, self._report, self._attempt = Phase.PLANNING, "failure", report, 0
        self._rejoining = ()
        return [Emit(jev.Failure(text=f"fail-stop of devices {list(gone)} during recovery", failure="fail-stop",
                                devices=tuple(gone))),
                NotifyFailure(report), PlanFailure(report, self.state)]

    # ------------------------------------------------------------ repairs
    def _offers(self, ev: Tick) -> list[Action]:
        """Rejoin the offered devices whose failure was handled (a device whose loss is
        not planned yet stays offered until it is). Only once the current generation
        has committed: a rejoin is not urgent, and superseding a generation whose
        workers are still meeting or moving state costs another reconfiguration."""
        offered, self._offered = self._offered, set()
        out: list[Action] = []
        back = sorted(d for d in offered if d in self.paused and d in ev.alive and d in self.handled
                      and d not in self.joining)
        if back:  # paused workers back and healthy: planned in once ready, like relaunched ones
            self.paused.difference_update(back)
            self.joining.update({d: self.clock() + self.join_timeout_s for d in back})
            self._settle()
            out.append(Emit(jev.Resumed(text=f"paused workers of devices {back} are back and healthy; planned in "
                                            "once ready", devices=tuple(back))))
        ready = tuple(sorted(d for d in offered if d in self.handled and d not in ev.alive
                             and d not in self.joining))
        self._offered = {d for d in offered if d not in self.handled and d not in ev.alive}
        if not ready:
            return out
        self.joining.update({d: self.clock() + self.join_timeout_s for d in ready})
        self._settle()
        return out + [Emit(jev.Relaunched(text=f"workers of devices {list(ready)} are started again; planned in "
                                              "once ready", devices=tuple(ready))), Relaunch(ready)]
