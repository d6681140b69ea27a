"""The control loop of a resilient job: turns what happens into the supervisor's typed
events and carries out the actions it returns (docs/design.md §2, "The supervisor's
state machine").

What happens comes from four places: the job session (commits, workers that left a
generation, storage faults), the workers' processes (alive or dead), the controller
(failure reports, on :attr:`ControlLoop.reports`) and repaired devices offered from
any thread (:attr:`ControlLoop.repaired`). The decisions are all the pure
:class:`~resihp_core.runtime.controller.supervisor.Supervisor`'s; this module does the effects:
it calls the planner, posts generations through the session, kills and relaunches
workers, and records each committed iteration (observers hear it through the session).

A restore uses the newest *complete* checkpoint of a committed iteration before the
resume point (:func:`resihp_core.checkpoints.restore_point`, the one rule for every
adapter); if newer ones are incomplete or corrupt it says so, and the job resumes
from the iteration after the one restored (``docs/checkpoints.md``). Where the job
keeps memory copies on peers and live workers hold a complete one at least as new
(:func:`resihp_core.runtime.peercopy.memory_restore_point`), the restore reads those
instead, and no file.
"""

from __future__ import annotations

import logging
import queue
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from resihp_core import checkpoints
from resihp_core.detector.sdc import SdcMonitor
from resihp_core.plan import ParallelPlan
from resihp_core.predictor.predict import IterationPredictor
from resihp_core.protocol import FailureReport, JobError, ScriptEnded
from resihp_core.protocols import events as jev
from resihp_core.protocols.metrics import IterationMetrics
from resihp_core.runtime.controller.launcher import LocalJob, NoProgress
from resihp_core.runtime.controller.payback import PaybackRule, worker_timing
from resihp_core.runtime.session import JobSession, WatchableStore, wait_news
from resihp_core.runtime.controller.supervisor import (
    Action, Committed, Deploy, Deployed, DeployFailed, Emit, EndJob, Event, Fail, Finish, Kill, NotifyFailure,
    PlanFailure, Planned,
    PlanRejoin, Ready, Reconfigured, Rejoin, Relaunch, RelaunchFailed, Retry, Supervisor, Tick, needs_restore,
)
from resihp_core.scheduler.planner import PlanDecision, Planner
from resihp_core.scheduler.state import PlannerState

__all__ = ["ControlLoop", "CheckpointPolicy", "Inbox", "JobFailed"]

logger = logging.getLogger("resihp.supervisor")


class JobFailed(RuntimeError):
    """The job's own code raised on a worker (docs/errors.md): the job ended."""

    def __init__(self, error: JobError) -> None:
        super().__init__(error.line())
        self.error = error


@dataclass(frozen=True)
class CheckpointPolicy:
    """Where restores look for complete checkpoints (None: the job writes none) and
    the workers' interval (how long to wait for a due write still in flight)."""

    directory: str | None = None
    every: int = 0
    grace_s: float = 3.0
    memory_every: int = 0  # job.memory_copy_every: peers hold memory copies (0: none)


class Inbox(queue.Queue):
    """A queue whose every put wakes the control loop it is given to (its ``wake``):
    the loop sleeps until something happens instead of polling every few milliseconds."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Event()

    def _put(self, item: object) -> None:
        super()._put(item)
        self.wake.set()


@dataclass
class ControlLoop:
    """Runs ``job`` to ``iterations`` iterations, adapting to failures.

    :param reports: the controller's failure reports (thread-safe queue).
    :param repaired: devices repaired at run time (lists or tuples of ids), from any
        thread: healed nodes, operators. The only way a device comes back besides
        ``repairs``.
    :param set_generation: tells the controller a new generation started (plan, speeds).
    :param ready: whether relaunched devices' workers are up and waiting.
    :param fitted: the job's own fitted cost model, once there is one.
    :param first: a resumed job's first iteration; ``restore_at_start``: the checkpoint
        its first generation loads.
    :param adopt: a restarted controller re-attached to the job's live workers: their
        generation goes on as it is (no post, no restore; docs/failover.md).
    :param wake: set from any thread to make the loop look now (a worker process that
        exited or came up); :class:`Inbox` queues given as ``reports``/``repaired`` set it.
    :param watch_store: a store connection the loop may block in to hear of the next
        commit verdict and of workers leaving the generation (None: the session's store
        if it lives in this process; a client connection must be one of its own, since
        a blocking wait holds it).
    :param payback: the rule a fail-slow re-plan must pass before it is deployed
        (``runtime/controller/payback.py``; None: every re-plan is deployed).
    :param idle_s: the longest the loop sleeps with nothing waking it (timers, storage
        faults, repairs). The loop sleeps on what wakes it only when ``reports`` is an
        :class:`Inbox` and it has a store to watch; otherwise it polls every 5 ms.
    """

    job: LocalJob
    planner: Planner
    state: PlannerState
    iterations: int
    reports: "queue.Queue[FailureReport]" = field(default_factory=Inbox)
    repaired: "queue.Queue[Iterable[int]]" = field(default_factory=Inbox)
    set_generation: Callable[[int, ParallelPlan, Mapping[int, float]], None] = lambda g, plan, speeds: None
    ready: Callable[[list[int]], bool] = lambda devices: True
    fitted: Callable[[], IterationPredictor | None] = lambda: None
    samples: int = 1
    phase_of: Callable[[int, int], str] = lambda iteration, generation: "running"
    on_iteration: Callable[[IterationMetrics], None] = lambda rec: None
    checkpoints: CheckpointPolicy = CheckpointPolicy()
    move_before_restore: bool = True
    repairs: dict[int, tuple[int, ...]] = field(default_factory=dict)
    handled: set[int] = field(default_factory=set)
    stall_s: float = 15.0
    join_timeout_s: float = 120.0
    first: int = 0
    restore_at_start: int | None = None
    adopt: bool = False
    records: list[IterationMetrics] = field(default_factory=list)
    storage_faults: list[dict] = field(default_factory=list)
    clock: Callable[[], float] = time.monotonic
    wake: threading.Event = field(default_factory=threading.Event)
    watch_store: WatchableStore | None = None
    idle_s: float = 0.1
    sdc: SdcMonitor | None = None  # None: the fingerprints' findings and the plugins' SDC detectors
    payback: PaybackRule | None = field(default_factory=PaybackRule)

    def __post_init__(self) -> None:
        self.session: JobSession = self.job.session
        # Memory copies serve restores only where the adapter declares it (else: disk,
        # announced when the job starts).
        self._memory = self.checkpoints.memory_every > 0 and self.state.capabilities.memory_copy
        self._memory_holders: dict[str, list[int]] | None = None  # the restore being posted reads these
        self.core = Supervisor(self.state, clock=self.clock, stall_s=self.stall_s,
                               join_timeout_s=self.join_timeout_s,
                               can_restore=self._can_restore,
                               checkpoint_every=self.checkpoints.every,
                               move_before_restore=self.move_before_restore, repairs=self.repairs,
                               handled=self.handled, payback=self.payback, iterations=self.iterations)
        if self.sdc is None:
            self.sdc = SdcMonitor.from_plugins()
        self._polled = {"faults": 0.0, "left": 0.0}
        self._timed = -1  # the newest generation whose workers' reconfiguration timings were read
        self._left_news = False  # the watcher saw a worker leave: read who now, not at the next throttle
        for q in (self.reports, self.repaired):
            if isinstance(q, Inbox):
                q.wake = self.wake
        if self.watch_store is None:
            from resihp_core.runtime.store import LocalStore

            if isinstance(self.session.store, LocalStore):  # in this process: a wait holds no connection
                self.watch_store = self.session.store
        self._sleeps = isinstance(self.reports, Inbox) and self.watch_store is not None
        self._rounds = threading.Condition()
        self._round = 0
        self._running = False
        self._dead_seen: frozenset[int] = frozenset()
        self.ended: ScriptEnded | None = None  # the user's script returned before the end

    @property
    def _can_restore(self) -> bool:
        """Whether a lost state can be read back: from checkpoints or peers' memory."""
        return self.checkpoints.directory is not None or self._memory

    @property
    def events(self) -> list[jev.JobEvent]:
        return self.session.events

    @property
    def plan(self) -> ParallelPlan:
        return self.core.state.plan

    # ------------------------------------------------------------ the loop
    def run(self, timeout: float = 600.0) -> list[IterationMetrics]:
        t0 = self.clock()
        state = self.core.state
        if self.adopt:
            g = self.job.generation
            self.set_generation(g, state.plan, dict(state.speeds))
            self.first = self.job.committed_through()
            self.job.steer()  # the held iteration commits now
            self.session.publish(jev.Attached(text=f"controller restarted: re-attached to generation {g} at "
                                                   f"iteration {self.first} with its live workers (no restore)",
                                              plan=state.plan.to_text(), resume=self.first))
        else:
            self.job.committed = self.first
            g = self.job.post(state.plan, iterations=self.iterations, resume=self.first,
                              restore=self.restore_at_start)
            self.set_generation(g, state.plan, dict(state.speeds))
            self.session.publish(jev.PlanPosted(text=f"generation {g}: initial plan", plan=state.plan.to_text()))
            self.session.plan_changed(None, state.plan, "initial plan")
            self._announce_memory()
        self._feed(Deployed(self.job.generation, tuple(self.job.message.devices) if self.job.message else (),
                            self.job.committed))
        last_commit = self.clock()
        watcher = self._start_watcher() if self._sleeps else None
        try:
            while self.first + len(self.records) < self.iterations and self.ended is None:
                last_commit = self._commits(last_commit)
                if self.first + len(self.records) >= self.iterations:
                    break
                generation = self.job.generation
                self._poll()
                alive, dead = frozenset(self.job.alive()), frozenset(self.job.dead())
                # A worker posts its job error before it exits: read after the snapshot,
                # a death the error explains is never taken for a failure.
                self._job_errors(force=dead != self._dead_seen)
                self._dead_seen = dead
                # A lost node's report is queued before its workers count as dead: the
                # reports drained after the snapshot carry why they died (not just "exited").
                self._drain_reports()
                self._feed(Tick(alive=alive, dead=dead))
                if self.job.generation != generation:
                    last_commit = self.clock()  # the pause is the reconfiguration's, not an iteration's
                if self.clock() - t0 > timeout:
                    raise TimeoutError(f"job did not finish {self.iterations} iterations in {timeout:.0f}s")
                self._sleep()
        finally:
            with self._rounds:
                self._running = False
                self._rounds.notify_all()
            if watcher is not None:  # it looks again within a second (a wait in the store is not interruptible)
                watcher.join(timeout=1.5)
        if self.ended is None:
            self._do(self.core.finish(self.job.alive()))
        return self.records

    def _sleep(self) -> None:
        """Until something happens: a commit, a worker leaving, a report, a process event
        (``wake``), or ``idle_s`` for the timers. Polling the store every 5 ms cost the
        controller an eighth of what four workers used on a 2-core host (docs/benchmarks.md)."""
        with self._rounds:
            self._round += 1
            self._rounds.notify_all()
        if not self._sleeps:
            time.sleep(0.005)
            return
        self.wake.wait(self.idle_s)
        self.wake.clear()  # before the round: whatever is set during it wakes the next sleep

    def _start_watcher(self) -> threading.Thread:
        self._running = True
        t = threading.Thread(target=self._watch, name="resihp-commit-watch", daemon=True)
        t.start()
        return t

    def _watch(self) -> None:
        """Block in the store on the next verdict and on workers leaving the current
        generation, and wake the loop when one is written. A verdict the loop was told
        of but has not taken in yet (or an abort, which it does not advance over) is
        not told again until the loop has gone round once more: no busy wake-ups."""
        store = self.watch_store
        assert store is not None
        patience = min(self.idle_s, 1.0)  # how soon it notices the loop has ended
        told_verdict: tuple[int, int] | None = None
        told_left: dict[int, set[int]] = {}
        while self._running:
            g, i = self.session.generation, self.session.committed
            message = self.session.message
            members = message.devices if message is not None and message.generation == g else ()
            told = told_left.setdefault(g, set())
            try:
                news = wait_news(store, g, i, members, told, patience)
            except Exception as e:  # noqa: BLE001 - the store is gone (the job ends): the loop still polls
                if self._running:
                    logger.warning("cannot watch the job store (%s): the control loop polls it instead", e)
                    self._sleeps = False
                    self.wake.set()
                return
            if news is None:
                continue
            kind, what = news
            if kind == "left":
                told.add(what)
                self._left_news = True
            elif told_verdict == (g, i):
                with self._rounds:  # told already: wait for the loop to take it in
                    r = self._round
                    self._rounds.wait_for(lambda: self._round > r or not self._running, patience)
                continue
            else:
                told_verdict = (g, i)
            self.wake.set()

    def _commits(self, last_commit: float) -> float:
        """Record the iterations committed since the last call (each once)."""
        self.job.committed_through()
        for i in range(self.first + len(self.records), self.job.committed):
            now = self.clock()
            g = self.job.committed_in.get(i, self.job.generation)
            rep = self.job.report(i)
            rec = IterationMetrics(i, sum(r.loss for r in rep.values()), now - last_commit, self.samples, g,
                                  self.phase_of(i, self.job.generation))
            last_commit = now
            self.records.append(rec)
            self.on_iteration(rec)
            self.session.iteration(rec)
            self._feed(Committed(i, g))
            if g > self._timed:  # its first commit: its workers have all entered it, their timings are in
                self._timed = g
                if (seconds := worker_timing(self.job.ready_info(g))) is not None:
                    self._feed(Reconfigured(g, seconds))
        return last_commit

    def _poll(self) -> None:
        """Turn what happened since the last round into events (the store is read at
        most four times a second for faults, twice for workers that left)."""
        now = self.clock()
        if now - self._polled["faults"] >= 0.25:
            self._polled["faults"] = now
            for f in self.session.new_storage_faults():
                self.storage_faults.append({"device": f.device, "iteration": f.iteration, "error": f.error})
                self._feed(f)
        if self._left_news or now - self._polled["left"] >= 0.5:
            self._polled["left"], self._left_news = now, False
            for left in self.job.workers_left().values():
                self._feed(left)
        self._drain_reports()
        if self.sdc is not None:  # silent data corruption found (docs/sdc.md)
            for found in self.sdc.poll(self.session):
                self._feed(found)
        while True:
            try:
                self._feed(Rejoin(tuple(int(d) for d in self.repaired.get_nowait())))
            except queue.Empty:
                break
        waiting = sorted(self.core.joining)
        if waiting:
            try:
                if self.ready(waiting):
                    self._feed(Ready(tuple(waiting)))
            except Exception:  # noqa: BLE001 - the controller did not answer in time (a loaded host): ask again
                logger.warning("could not learn whether relaunched devices %s are ready; asking again", waiting)

    def _job_errors(self, force: bool) -> None:
        """Feed the job errors and early script ends workers posted (at most four reads
        a second, or now when a worker's process ended)."""
        now = self.clock()
        if not force and now - self._polled.get("errors", 0.0) < 0.25:
            return
        self._polled["errors"] = now
        for e in self.session.new_job_ends():
            self._feed(e)

    # ------------------------------------------------------------ carrying out actions
    def _drain_reports(self) -> None:
        """Buffer the Detector's queued reports in the core (feeding one acts on nothing)."""
        while True:
            try:
                self._feed(self.reports.get_nowait())
            except queue.Empty:
                break

    def _feed(self, event: Event) -> None:
        self._do(self.core.handle(event))

    def _do(self, actions: list[Action]) -> None:
        for a in actions:
            if isinstance(a, Emit):
                self.session.publish(a.event, at=a.at)
            elif isinstance(a, NotifyFailure):
                self.session.failure(a.report)
            elif isinstance(a, Kill):
                self.job.kill(a.device, signal.SIGKILL)
            elif isinstance(a, Relaunch):
                try:
                    self.job.relaunch(list(a.devices))
                except Exception as e:  # noqa: BLE001 - e.g. their node's agent is gone: they stay out
                    self._feed(RelaunchFailed(a.devices, f"{type(e).__name__}: {e}"))
            elif isinstance(a, PlanFailure):
                state = a.state
                fitted = self.fitted()  # plan with the job's own cost model once it is fitted
                if fitted is not None:
                    state = state.with_predictor(fitted)
                t0 = time.perf_counter()
                decision = self.planner.plan(state, a.report)
                self._feed(Planned(decision, time.perf_counter() - t0, frozenset(self.job.dead())))
            elif isinstance(a, PlanRejoin):
                t0 = time.perf_counter()
                decision = self.planner.rejoin(a.state, a.devices)
                self._feed(Planned(decision, time.perf_counter() - t0, frozenset(self.job.dead())))
            elif isinstance(a, Deploy):
                self._deploy(a)
            elif isinstance(a, Retry):
                self._retry(a)
            elif isinstance(a, Fail):
                raise RuntimeError(a.message)
            elif isinstance(a, EndJob):
                raise JobFailed(a.error)
            elif isinstance(a, Finish):
                self.ended = a.ended
                self.session.publish(jev.JobEnded(
                    text=f"the training script returned after {self.first + len(self.records)} of "
                         f"{self.iterations} iterations (device {a.ended.device}): the job ends here",
                    devices=(a.ended.device,)))
            else:
                raise TypeError(f"not a supervisor action: {a!r}")

    def _abort(self) -> tuple[int, int, int | None, bool]:
        """Abort the running generation; returns (where it was, resume, restore, fresh)
        for the next one, from a checkpoint when its workers may not hold the state."""
        prev = self.job.message
        resume = at = self.job.abort()
        alive, handled = set(self.job.alive()), self.core.handled

        def layouts() -> Iterable[str]:
            live = [d for d in prev.devices if d in alive and d not in handled] if prev else []
            return self.session.layout(prev.generation, live).values() if prev else ()

        restore, fresh = None, False
        if needs_restore(prev, resume, can_restore=self._can_restore, layouts=layouts):
            if prev is not None and prev.restore is None and not prev.fresh:
                seen = tuple(sorted(set(layouts())))
                self.session.publish(jev.CheckpointChosen(
                    text=f"generation {prev.generation} was superseded while its workers moved state "
                         f"({', '.join(seen)}): restoring from a checkpoint", layout=seen))
            restore, fresh, resume = self._from_checkpoint(resume)
        return at, resume, restore, fresh

    def _from_checkpoint(self, resume: int) -> tuple[int | None, bool, int]:
        restore = self._restore_point(resume) if resume > 0 else None
        fresh = restore is None
        resume = 0 if restore is None else restore + 1  # re-train the iterations after it
        self.job.committed = resume
        return restore, fresh, resume

    def _announce_memory(self) -> None:
        """Memory copies asked for on an adapter that cannot keep them: say that restores
        read disk (never a silent fallback)."""
        if self.checkpoints.memory_every > 0 and not self._memory:
            self.session.publish(jev.CheckpointChosen(
                text="memory copies on peers were asked for (memory_copy_every = "
                     f"{self.checkpoints.memory_every}), but the adapter does not declare the memory_copy "
                     "capability: restores read checkpoints from disk"
                     + ("" if self.checkpoints.directory else " (none are written: from the initial state)")))

    def _restore_point(self, resume: int) -> int | None:
        """The newest complete checkpoint of an iteration before ``resume`` (None: none,
        restart from the seed), or the newest memory copy live peers hold when it is at
        least as new (then :attr:`_memory_holders` says where each part is)."""
        cp = self.checkpoints
        self._memory_holders = None
        mem = self._memory_point(resume)
        if mem is not None and (mem[0] == resume - 1 or cp.directory is None):
            return self._from_memory(*mem)
        if cp.directory is None:
            return None if self._memory else resume - 1  # memory copies only: none complete, from the seed
        it, skipped = checkpoints.restore_point(cp.directory, resume, cp.every, grace_s=cp.grace_s)
        if mem is not None and mem[0] >= (-1 if it is None else it):
            return self._from_memory(*mem)
        if mem is not None:
            self.session.publish(jev.CheckpointChosen(
                text=f"the newest complete memory copy (iteration {mem[0]}) is older than the checkpoint of "
                     f"iteration {it}: restoring from disk", restore=it))
        every = max(1, cp.every)
        due = (resume // every) * every - 1
        note = "; ".join(f"checkpoint of iteration {s.iteration} is not usable: {s.problem}" for s in skipped)
        if note or (-1 if it is None else it) < due:
            self.session.publish(jev.CheckpointChosen(
                text=(note + "; " if note else "") + (f"falling back to the checkpoint of iteration {it}"
                                                      if it is not None else
                                                      "no complete checkpoint: restarting from the initial state"),
                restore=it, skipped=tuple(s.iteration for s in skipped)))
        return it

    def _memory_point(self, resume: int) -> tuple[int, dict[str, list[int]]] | None:
        """The newest memory copy live workers hold completely, unless the job keeps
        none or the restore being replaced read memory and failed (a holder died before
        it served): then this one reads disk."""
        if not self._memory or resume <= 0:
            return None
        from resihp_core.runtime import peercopy

        prev = self.job.message
        if getattr(prev, "memory_holders", None) is not None and resume <= prev.resume:
            failed = {d: w.reason for d, w in self.job.workers_left(prev.generation).items() if w.state_lost}
            if failed:  # a read failed with its holder alive (or not known dead yet): not again
                d, why = min(failed.items())
                self.session.publish(jev.CheckpointChosen(
                    text=f"device {d} could not read the memory copies of iteration {prev.restore} ({why[:200]}): "
                         "restoring from a checkpoint on disk" if self.checkpoints.directory else
                         f"device {d} could not read the memory copies of iteration {prev.restore} ({why[:200]}) "
                         "and the job writes no checkpoints: restarting from the initial state",
                    devices=(d,)))
                return None
        live = set(self.job.alive()) - set(self.core.handled)
        why: list[str] = []
        got = peercopy.memory_restore_point(self.session.store, live, resume, self.session.committed_in, why)
        if got is None:
            self.session.publish(jev.CheckpointChosen(
                text=f"no memory copy to restore from ({why[0]}): "
                     + ("restoring from a checkpoint on disk" if self.checkpoints.directory else
                        "the job writes no checkpoints, restarting from the initial state")))
        return got

    def _from_memory(self, iteration: int, holders: dict[str, list[int]]) -> int:
        self._memory_holders = holders
        by = sorted({h for hs in holders.values() for h in hs})
        self.session.publish(jev.CheckpointChosen(
            text=f"restoring iteration {iteration} from the memory copies held by devices {by} (no checkpoint file "
                 "read)", restore=iteration))
        return iteration

    def _post(self, plan: ParallelPlan, resume: int, restore: int | None, fresh: bool) -> int | None:
        """Post ``plan``; None (and a :class:`DeployFailed` fed) if a device of it has
        no live worker any more."""
        try:
            holders, self._memory_holders = self._memory_holders, None
            # named only for a restore from memory (a job without memory copies is unchanged)
            extra = {"memory_holders": holders} if holders is not None and restore is not None else {}
            g = self.job.post(plan, iterations=self.iterations, resume=resume, restore=restore, fresh=fresh,
                              exclude=self.core.handled, **extra)
        except NoProgress:
            gone = sorted(set(plan.devices()) - set(self.job.alive()))
            if not gone:
                raise
            self._feed(DeployFailed(tuple(gone)))
            return None
        self.set_generation(g, plan, dict(self.core.state.speeds))
        return g

    def _deploy(self, a: Deploy) -> None:
        old = self.session.plan
        decision: PlanDecision = a.decision
        if a.from_checkpoint:
            prev_at = self.job.abort()
            at = prev_at
            restore, fresh, resume = self._from_checkpoint(prev_at)
        else:
            at, resume, restore, fresh = self._abort()
        g = self._post(decision.plan, resume, restore, fresh)
        if g is None:
            return
        self.session.plan_changed(old, decision.plan, f"{a.what or a.kind}: {decision.reason}")
        where = (f", resumed from {self._source()} of iteration {restore} at iteration {resume}"
                 if restore is not None else ", from the initial state (no complete checkpoint)" if fresh else "")
        self.session.publish(jev.PlanPosted(text=f"generation {g} ({a.what or a.kind}, planned in "
                                                 f"{a.seconds * 1e3:.0f} ms{where}): {decision.reason}",
                                            plan=decision.plan.to_text(), kind_of_plan=a.kind, planning_s=a.seconds,
                                            resume=resume, restore=restore, devices=tuple(a.devices or ())), at=at)
        self._feed(Deployed(g, tuple(self.job.message.devices), resume))

    def _source(self) -> str:
        """What the generation just posted restores from, for its event."""
        msg = self.job.message
        return "the memory copies" if getattr(msg, "memory_holders", None) is not None else "the checkpoint"

    def _retry(self, a: Retry) -> None:
        # The generation retried may have been a restore (a rejoin: fresh workers hold
        # no state) or have left workers in different layouts: then it restores.
        at, resume, restore, fresh = self._abort()
        plan = self.core.state.plan
        g = self._post(plan, resume, restore, fresh)
        if g is None:
            return
        why = a.why[:300] or ("workers left the previous one with no device failing: " + "; ".join(
            f"device {d}: {t[:80]}" for d, t in sorted(a.failures.items()))[:300])
        self.session.publish(jev.PlanPosted(text=f"generation {g} (retry {a.attempt} of the same plan: {why}"
                                                 + (f"; resumed from {self._source()} of iteration {restore}"
                                                    if restore is not None else "") + ")",
                                            plan=plan.to_text(), kind_of_plan="retry", resume=resume,
                                            restore=restore), at=at)
        self._feed(Deployed(g, tuple(self.job.message.devices), resume))
