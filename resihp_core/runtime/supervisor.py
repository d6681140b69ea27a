"""The control loop of a resilient job: Detector -> failure report -> Scheduler plan ->
adapter reconfiguration -> resume (docs/design.md §2).

:class:`Supervisor` watches the job's iteration commits, takes failure reports from the
controller (heartbeats, hangs, fail-slow verification) and from process exits it sees
itself (a backstop), plans with the :class:`~resihp_core.scheduler.Planner` and deploys
the new generation: abort the running one, post the plan with the iteration to resume
from (or the checkpoint to restore). Fail-stop takes priority over pending fail-slow;
reports that arrive while a generation is being deployed are planned next, so a
failure during recovery is handled like any other. A hung device is fenced (SIGKILL)
before the next generation so it cannot block the new communicators.

Repaired devices are brought back (:meth:`Supervisor.rejoin`). They arrive on one
queue, ``repaired``: offered at run time by a node whose partition healed, put there by
another thread (an operator, the soak), or moved there from ``repairs`` once their
iteration is committed. A device is taken from it once its failure has been handled and
the current generation has committed an iteration: its worker is started again, the
Scheduler plans it back in (:meth:`~resihp_core.scheduler.Planner.rejoin`), and when
the new plan gives it work every worker reloads a checkpoint, since a fresh worker has
no state to move.

When the Scheduler answers a failure with a fresh layout (its "restore" decision), the
survivors first try to move their copies onto it; only an adapter that finds a piece
with no surviving holder (:class:`~resihp_core.adapter.StateLost`) sends the job to its
newest checkpoint.

A generation that moved state and was superseded before every live worker finished
reconfiguring may leave workers holding state in different layouts (some moved, some
did not): the next generation restores from a checkpoint instead of moving state.

A restore uses the newest *complete* checkpoint of a committed iteration (verified
files, :mod:`resihp_core.checkpoints`); if newer ones are incomplete or corrupt it says
so, and the job resumes from the iteration after the one restored, re-training the
iterations in between with the same micro-batches (``docs/checkpoints.md``). Failed
checkpoint writes reported by workers are storage faults: logged as events, and the
job goes on.

Every failure report and plan change is logged as one structured line with its
generation, and handed to ``on_event``.
"""

from __future__ import annotations

import json
import logging
import queue
import signal
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from resihp_core import checkpoints
from resihp_core.protocol import FailureReport
from resihp_core.runtime.launcher import JobError, LocalJob

__all__ = ["Supervisor", "IterationRecord"]

logger = logging.getLogger("resihp.supervisor")


@dataclass
class IterationRecord:
    iteration: int
    loss: float
    seconds: float  # wall time from the previous commit to this one
    samples: int
    generation: int
    phase: str


@dataclass
class Supervisor:
    """Runs ``job`` to ``iterations`` iterations, adapting to failures.

    :param planner: a :class:`~resihp_core.scheduler.Planner`.
    :param state: its :class:`~resihp_core.scheduler.state.PlannerState` for the first plan.
    :param reports: a thread-safe queue the controller's ``on_report`` puts reports on.
    :param set_generation: tells the controller a new generation started (plan, speeds).
    :param samples: micro-batches per iteration (for throughput).
    :param phase_of: names the phase of an iteration (for the report), e.g. by faults.
    :param restore_from_checkpoint: whether restore decisions may use checkpoints.
    """

    job: LocalJob
    planner: Any
    state: Any
    iterations: int
    reports: "queue.Queue[FailureReport]" = field(default_factory=queue.Queue)
    set_generation: Callable[[int, Any, dict[int, float]], None] = lambda g, plan, speeds: None
    samples: int = 1
    phase_of: Callable[[int, int], str] = lambda iteration, generation: "running"
    on_event: Callable[[dict], None] = lambda event: None
    on_iteration: Callable[[IterationRecord], None] = lambda rec: None
    records: list[IterationRecord] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    handled_devices: set[int] = field(default_factory=set)
    stall_s: float = 15.0  # no commit and no report this long, with worker errors: give up
    repairs: dict[int, tuple[int, ...]] = field(default_factory=dict)  # iteration -> devices repaired then
    rejoined: dict[int, int] = field(default_factory=dict)  # device -> generation it rejoined in
    # Devices repaired at run time (lists or tuples of ids), from any thread: healed
    # nodes, operators, ``repairs`` once due. The only way a device comes back.
    repaired: "queue.Queue[Any]" = field(default_factory=queue.Queue)
    # Whether relaunched devices' workers are up and waiting for a generation (e.g. the
    # controller hears their heartbeats); they are planned in only then.
    ready: Callable[[list[int]], bool] = lambda devices: True
    join_timeout_s: float = 120.0
    _joining: dict[int, float] = field(default_factory=dict)  # relaunched device -> give-up time
    observers: Any = None  # the plugin facade (resihp_core.plugins.Plugins): observer hooks fire here
    fitted: Callable[[], Any] = lambda: None  # the job's own fitted IterationPredictor, once there is one
    checkpoint_dir: str | None = None  # where restores look for complete checkpoints (None: assume every iteration has one)
    checkpoint_every: int = 1  # the workers' interval: how long to wait for a write still in flight
    checkpoint_grace_s: float = 3.0  # wait this long for a due checkpoint still being written
    first: int = 0  # a resumed job: the first iteration this run trains
    # Restore decisions first try moving the survivors' copies onto the fresh layout
    # (False: always read the newest checkpoint, as before).
    move_before_restore: bool = True
    restore_at_start: int | None = None  # a resumed job: the checkpoint its first generation loads
    storage_faults: list[dict] = field(default_factory=list)
    max_retries: int = 3  # same-plan redeployments in a row (no commit between) after unexplained stalls
    retries: int = 0
    # A restarted controller re-attached to the job's live workers: the job's current
    # generation goes on as it is (no post, no restore; docs/failover.md).
    adopt: bool = False
    # Fail-stopped devices whose processes were stopped, not dead: fenced, not killed;
    # planned back in without a relaunch when their node offers them (docs/detector.md).
    paused: set[int] = field(default_factory=set)

    def _event(self, kind: str, text: str, *, at: int | None = None, **extra: Any) -> None:
        """Log and hand on one event, labelled with the iteration the job was at
        (``at``; default: the committed count), not the one a restore rewinds to."""
        it = self.job.committed if at is None else at
        ev = {"time": time.monotonic() - self._t0, "iteration": it, "kind": kind,
              "generation": self.job.generation, "text": text, **extra}
        self.events.append(ev)
        logger.info("event=%s generation=%d iteration=%d %s", kind, self.job.generation, it, text)
        self.on_event(ev)

    def run(self, timeout: float = 600.0) -> list[IterationRecord]:
        self._t0 = time.monotonic()
        self._faults_seen = 0
        if self.adopt:
            self._adopted()
        else:
            self.job.committed = self.first
            g = self.job.post(self.state.plan, iterations=self.iterations, resume=self.first,
                              restore=self.restore_at_start)
            self.set_generation(g, self.state.plan, dict(self.state.speeds))
            self._event("plan", f"generation {g}: initial plan", plan=self.state.plan.to_text())
            if self.observers is not None:
                self.observers.notify_plan_changed(None, self.state.plan, "initial plan")
        last_commit = time.monotonic()
        deadline = self._t0 + timeout
        while self.first + len(self.records) < self.iterations:
            self.job.committed_through()
            for i in range(self.first + len(self.records), self.job.committed):
                now = time.monotonic()
                rep = self.job.report(i)
                rec = IterationRecord(i, sum(r.loss for r in rep.values()), now - last_commit,
                                      self.samples, self.job.committed_in.get(i, self.job.generation),
                                      self.phase_of(i, self.job.generation))
                last_commit = now
                self.retries = 0  # the job makes progress: a later stall gets its own retries
                self.records.append(rec)
                self.on_iteration(rec)
                if self.observers is not None:
                    self.observers.notify_iteration(rec)
            if self.first + len(self.records) >= self.iterations:
                break
            self._storage_faults()
            if self._check_joining():
                last_commit = time.monotonic()
                continue
            pending = self._pending_reports()
            if pending:
                self._adapt(pending)
                last_commit = time.monotonic()
            elif self._offered():
                last_commit = time.monotonic()
            elif self._unsourceable():
                last_commit = time.monotonic()
            elif time.monotonic() - last_commit > self.stall_s:
                failures = self.job.worker_failures()
                if failures and self.retries < self.max_retries:
                    # Live workers gave up without any device failing (a rendezvous
                    # that ran out of patience, a peer that left for a transient
                    # reason). Deploy the same plan again.
                    self.retries += 1
                    self._retry(failures)
                    last_commit = time.monotonic()
                elif failures:  # retried enough: say why, stop
                    raise RuntimeError(
                        f"generation {self.job.generation} stalled at iteration {self.job.committed}; "
                        "workers failed: " + "; ".join(f"device {d}: {t}" for d, t in sorted(failures.items()))
                    )
            if time.monotonic() > deadline:
                raise TimeoutError(f"job did not finish {self.iterations} iterations in {timeout:.0f}s")
            time.sleep(0.005)
        self._end_pauses()
        return self.records

    def _adopted(self) -> None:
        """Go on with the generation the live workers are in (a restarted controller)."""
        g = self.job.generation
        self.set_generation(g, self.state.plan, dict(self.state.speeds))
        self.first = self.job.committed_through()
        self.job.steer()  # the held iteration commits now
        self._event("attach", f"controller restarted: re-attached to generation {g} at iteration "
                              f"{self.first} with its live workers (no restore)",
                    plan=self.state.plan.to_text(), resume=self.first)

    def _end_pauses(self) -> None:
        """The job is done: workers still paused (fenced, never back) hold stale state
        and are no part of its end; they are killed, not stopped with the others."""
        alive = set(self.job.alive())
        for d in sorted(self.paused & alive):
            self._event("kill", f"device {d} was still paused at the job's end: killed", devices=[d])
            self.job.kill(d, signal.SIGKILL)
        self.paused.clear()

    # ------------------------------------------------------------ checkpoints
    def _unsourceable(self) -> bool:
        """A reconfiguration whose state has no surviving copy (the adapter's
        ``move_state`` said so): deploy the same plan again, restored from a checkpoint.
        Checked twice a second."""
        now = time.monotonic()
        if now - getattr(self, "_last_source_check", 0.0) < 0.5 or self.checkpoint_dir is None:
            return False
        self._last_source_check = now
        # The typed signal: a worker whose adapter raised StateLost says so in its
        # WorkerLeft report (never matched from error text).
        lost = {d: left.reason for d, left in self.job.workers_left().items() if left.state_lost}
        if not lost:
            return False
        from types import SimpleNamespace

        self._event("failure", f"state cannot be moved to generation {self.job.generation}'s plan "
                               f"({next(iter(lost.values()))[:120]}): restoring it from a checkpoint",
                    failure="state-lost", devices=sorted(lost), cause="state")
        decision = SimpleNamespace(state=self.state, plan=self.state.plan,
                                   reason="no live copy of some state: restore from checkpoint")
        self._deploy(decision, 0.0, "restore", from_checkpoint=True)
        return True

    def _storage_faults(self) -> None:
        """Checkpoint writes that failed on a worker: say so; training goes on.
        Polled four times a second."""
        now = time.monotonic()
        if now - getattr(self, "_last_fault_check", 0.0) < 0.25:
            return
        self._last_fault_check = now
        for f in self.job.session.new_storage_faults():
            st = {"device": f.device, "iteration": f.iteration, "error": f.error}
            self.storage_faults.append(st)
            nxt = f"at iteration {st['iteration'] + self.checkpoint_every}" if self.checkpoint_every else "never"
            self._event("storage", f"storage fault: checkpoint of iteration {st['iteration']} not written by "
                                   f"device {st['device']} ({st['error'][:160]}); training goes on, "
                                   f"next checkpoint {nxt}", devices=[st["device"]], checkpoint=st["iteration"])

    def _restore_point(self, resume: int) -> tuple[int | None, str]:
        """The newest complete checkpoint of an iteration before ``resume`` (None: none,
        restart from the seed), and what was skipped on the way: the one rule,
        :func:`resihp_core.checkpoints.restore_point`, for every adapter."""
        if self.checkpoint_dir is None:
            return resume - 1, ""
        it, skipped = checkpoints.restore_point(self.checkpoint_dir, resume, self.checkpoint_every,
                                                grace_s=self.checkpoint_grace_s)
        every = max(1, self.checkpoint_every)
        due = (resume // every) * every - 1
        note = "; ".join(f"checkpoint of iteration {s.iteration} is not usable: {s.problem}" for s in skipped)
        if note or (-1 if it is None else it) < due:
            self._event("checkpoint", (note + "; " if note else "") +
                        (f"falling back to the checkpoint of iteration {it}" if it is not None
                         else "no complete checkpoint: restarting from the initial state"),
                        restore=it, skipped=[s.iteration for s in skipped])
        return it, note

    def _retry(self, failures: dict[int, str]) -> None:
        prev = self.job.message
        resume = at = self.job.abort()
        restore, fresh = None, False
        if self._needs_restore(prev, resume):
            # The generation retried was a restore (a rejoin: fresh workers hold no
            # state) or left workers in different layouts: restore from the newest
            # complete checkpoint.
            restore = self._restore_point(resume)[0] if resume > 0 else None
            fresh = restore is None
            resume = self.job.committed = 0 if restore is None else restore + 1
        g = self.job.post(self.state.plan, iterations=self.iterations, resume=resume, restore=restore,
                          fresh=fresh, exclude=self.handled_devices)
        self.set_generation(g, self.state.plan, dict(self.state.speeds))
        why = "; ".join(f"device {d}: {t[:80]}" for d, t in sorted(failures.items()))[:300]
        self._event("plan", f"generation {g} (retry {self.retries} of the same plan: workers left the "
                            f"previous one with no device failing: {why}"
                            + (f"; resumed from the checkpoint of iteration {restore}" if restore is not None else "")
                            + ")", at=at, plan=self.state.plan.to_text(),
                    kind_of_plan="retry", planning_s=0.0, resume=resume, restore=restore)

    def _needs_restore(self, prev: Any, resume: int) -> bool:
        """Whether the generation after ``prev`` (aborted at ``resume``) must restore
        from a checkpoint because the live workers may not hold the state ``prev``'s
        plan says, or not all in the same layout.

        Only a ``prev`` that committed no iteration is in doubt (a commit needs every
        executor reconfigured). Then: a restore being replaced is restored again (a
        rejoined worker holds no state); a state move is trusted only if every live
        worker of ``prev`` finished it (``ready``) or every one gave it up before
        (``failed``, its previous layout kept) -- a mix, or a worker still busy, means
        some hold the old layout and some the new one (docs/worker-protocol.md)."""
        if prev is None or resume > prev.resume or prev.stop:
            return False
        if prev.restore is not None or prev.fresh:
            return True
        if self.checkpoint_dir is None:
            return False  # nothing to restore from: moving is the only way
        g, alive = prev.generation, set(self.job.alive())
        live = [d for d in prev.devices if d in alive and d not in self.handled_devices]
        states = set(self.job.session.layout(g, live).values())
        if "unknown" not in states and len(states) <= 1:
            return False
        self._event("checkpoint", f"generation {g} was superseded while its workers moved state "
                                  f"({', '.join(sorted(states))}): restoring from a checkpoint",
                    layout=sorted(states))
        return True

    # ------------------------------------------------------------ failures
    def _pending_reports(self) -> list[FailureReport]:
        out = []
        while True:
            try:
                out.append(self.reports.get_nowait())
            except queue.Empty:
                break
        # Backstop: a worker process that exited without the controller saying so yet.
        current = set(self.job.message.devices) if self.job.message else set()
        dead = [d for d in self.job.dead() if d in current and d not in self.handled_devices]
        if dead:
            out.append(FailureReport(generation=self.job.generation, failure="fail-stop",
                                     devices=tuple(dead), evidence="worker process exited"))
        fresh = []
        for r in out:
            devs = set(r.devices) - (self.handled_devices if r.failure == "fail-stop" else set())
            devs -= {d for d, g in self.rejoined.items() if r.generation < g}  # about its previous life
            if devs:
                fresh.append(r)
        return fresh

    def _adapt(self, reports: list[FailureReport]) -> None:
        stops = [r for r in reports if r.failure == "fail-stop"]
        slows = [r for r in reports if r.failure != "fail-stop"]
        if stops:  # fail-stop first; one report for every device lost
            devices = sorted({d for r in stops for d in r.devices} - self.handled_devices)
            report = FailureReport(generation=self.job.generation, failure="fail-stop",
                                   devices=tuple(devices), cause="unknown",
                                   evidence="; ".join(r.evidence for r in stops)[:500])
            for r in slows:  # keep them for the next round
                self.reports.put(r)
        else:
            report = slows[0]
            for r in slows[1:]:
                self.reports.put(r)
        if self.observers is not None:
            self.observers.notify_failure(report)
        fitted = self.fitted()  # plan with the job's own cost model once it is fitted
        if fitted is not None:
            self.state = self.state.with_predictor(fitted)
        self._event("failure", f"{report.failure} of devices {list(report.devices)} "
                               f"({report.cause}): {report.evidence[:120]}",
                    failure=report.failure, devices=list(report.devices), cause=report.cause)
        if report.failure == "fail-stop":
            paused = {d for r in stops for d in r.paused}
            for d in report.devices:
                self.handled_devices.add(d)
                if d in paused:
                    self.paused.add(d)  # stopped, not hung: fenced by the plan, kept alive
                elif d in self.job.alive():
                    self.paused.discard(d)
                    self.job.kill(d, signal.SIGKILL)  # fence a hung device (SIGCONT first)
        for attempt in range(4):
            # Processes found dead meanwhile join the report: never plan onto them.
            gone = sorted(set(self.job.dead()) - set(report.devices) - self.handled_devices)
            if gone and report.failure == "fail-stop":
                report = FailureReport(generation=report.generation, failure="fail-stop",
                                       devices=tuple(sorted(set(report.devices) | set(gone))),
                                       cause=report.cause, evidence=report.evidence)
                self.handled_devices.update(gone)
            t0 = time.perf_counter()
            decision = self.planner.plan(self.state, report)
            plan_s = time.perf_counter() - t0
            dead_in_plan = sorted(set(decision.plan.devices()) & set(self.job.dead()))
            if not dead_in_plan:
                break
            # A device died while we planned: plan again with it counted as failed.
            self._event("failure", f"fail-stop of devices {dead_in_plan} during recovery",
                        failure="fail-stop", devices=dead_in_plan, cause="unknown")
            report = FailureReport(generation=self.job.generation, failure="fail-stop",
                                   devices=tuple(dead_in_plan), evidence="died during recovery")
            self.state = decision.state
            self.handled_devices.update(dead_in_plan)
        try:
            # A restore decision is a fresh layout over the survivors. Where they still
            # hold a copy of every piece (replicas), moving it there beats reading a
            # checkpoint and re-training since it: try the move; an adapter that finds a
            # piece with no holder raises StateLost, and _unsourceable restores then.
            from_checkpoint = decision.kind == "restore" and not self.move_before_restore
            self._deploy(decision, plan_s, decision.kind, from_checkpoint=from_checkpoint)
        except JobError:
            # A device of the plan died between the check above and the post (two
            # workers killed together, one reported first): plan again without it.
            gone = sorted(set(decision.plan.devices()) - set(self.job.alive()))
            if not gone:
                raise
            self._event("failure", f"fail-stop of devices {gone} during recovery", failure="fail-stop",
                        devices=gone, cause="unknown")
            self._adapt([FailureReport(generation=self.job.generation, failure="fail-stop", devices=tuple(gone),
                                       evidence="died during recovery")])

    def _deploy(self, decision: Any, plan_s: float, kind: str, *, from_checkpoint: bool,
                what: str = "", **extra: Any) -> int:
        """Abort the running generation and post ``decision``'s plan from the last
        committed iteration, or from its checkpoint (none yet: from the seed)."""
        old = self.state.plan
        self.state = decision.state
        prev = self.job.message
        resume = at = self.job.abort()
        if not from_checkpoint and self._needs_restore(prev, resume):
            from_checkpoint = True
        restore, fresh = None, False
        if from_checkpoint:
            restore = self._restore_point(resume)[0] if resume > 0 else None
            fresh = restore is None
            resume = 0 if restore is None else restore + 1  # re-train the iterations after it
            self.job.committed = resume
        g = self.job.post(decision.plan, iterations=self.iterations, resume=resume, restore=restore,
                          fresh=fresh, exclude=self.handled_devices)
        self.set_generation(g, decision.plan, dict(self.state.speeds))
        if self.observers is not None:
            self.observers.notify_plan_changed(old, decision.plan, f"{what or kind}: {decision.reason[:200]}")
        where = (f", resumed from the checkpoint of iteration {restore} at iteration {resume}"
                 if restore is not None else ", from the initial state (no complete checkpoint)" if fresh else "")
        self._event("plan", f"generation {g} ({what or kind}, planned in {plan_s * 1e3:.0f} ms{where}): "
                            f"{decision.reason[:200]}", at=at, plan=decision.plan.to_text(),
                    kind_of_plan=kind, planning_s=plan_s, resume=resume, restore=restore, **extra)
        return g

    # ------------------------------------------------------------ repairs
    def _offered(self) -> bool:
        """Rejoin the devices on ``repaired`` whose failure was handled (a device whose
        loss is not planned yet stays on the queue until it is). Returns whether it did.

        A rejoin waits until the current generation has committed an iteration: it is
        not urgent, and superseding a generation whose workers are still meeting in
        its rendezvous or moving state only costs another reconfiguration."""
        for it in sorted(it for it in self.repairs if it <= self.job.committed and self.job.committed > 0):
            self.repaired.put(tuple(self.repairs.pop(it)))  # scheduled repairs, now due
        if self.repaired.empty() or self.job.generation not in self.job.committed_in.values():
            return False
        offered: set[int] = set()
        while True:
            try:
                offered.update(int(d) for d in self.repaired.get_nowait())
            except queue.Empty:
                break
        alive = set(self.job.alive())
        self._resumed(sorted(d for d in offered if d in self.paused and d in alive))
        ready = sorted(d for d in offered if d in self.handled_devices and d not in alive and d not in self._joining)
        waiting = tuple(sorted(d for d in offered if d not in self.handled_devices and d not in alive))
        if waiting:
            self.repaired.put(waiting)
        if not ready:
            return False
        self.rejoin(ready)
        return True

    def _resumed(self, devices: list[int]) -> None:
        """Paused workers back and healthy (their agent checked): the same process is
        planned in once the controller hears it, as a relaunched one would be."""
        devices = [d for d in devices if d in self.handled_devices and d not in self._joining]
        if not devices:
            return
        self.paused.difference_update(devices)
        self._joining.update({d: time.monotonic() + self.join_timeout_s for d in devices})
        self._event("resumed", f"paused workers of devices {devices} are back and healthy; planned in once ready",
                    devices=devices)

    def rejoin(self, devices: list[int]) -> None:
        """Bring repaired ``devices`` back: start their workers now; once they are
        ready (:attr:`ready`: started up, waiting for a generation) plan them in and
        deploy (:meth:`_joined`). Until then the job goes on without them: a plan
        that named them while they are still starting (seconds on a loaded host) would
        leave the others waiting in its rendezvous."""
        devices = sorted(d for d in devices if d not in self.job.alive() and d not in self._joining)
        if not devices:
            return
        try:
            self.job.relaunch(devices)
        except Exception as e:  # noqa: BLE001 - e.g. their node's agent is gone: they stay out
            self._event("failure", f"workers of devices {devices} could not be started again: "
                                   f"{type(e).__name__}: {str(e)[:200]}", failure="fail-stop", devices=devices,
                        cause="unknown")
            return
        self._joining.update({d: time.monotonic() + self.join_timeout_s for d in devices})
        self._event("relaunch", f"workers of devices {devices} started again; planned in once ready",
                    devices=devices)

    def _check_joining(self) -> bool:
        """Plan in the relaunched devices that are ready; forget those that died or
        never got ready. Returns whether a generation was deployed."""
        if not self._joining:
            return False
        dead = set(self.job.dead())
        now = time.monotonic()
        gone = sorted(d for d, t in self._joining.items() if d in dead or now > t)
        for d in gone:
            del self._joining[d]
            self._event("failure", f"relaunched device {d} did not get ready", failure="fail-stop",
                        devices=[d], cause="unknown")
            if d not in dead:
                self.job.kill(d)
        waiting = sorted(self._joining)
        if not waiting:
            return False
        try:
            if not self.ready(waiting):
                return False
        except Exception:  # noqa: BLE001 - the controller did not answer in time (a loaded host): ask again
            logger.warning("could not learn whether relaunched devices %s are ready; asking again", waiting)
            return False
        self._joining.clear()
        self._joined(waiting)
        return True

    def _joined(self, devices: list[int]) -> None:
        self.handled_devices.difference_update(devices)
        t0 = time.perf_counter()
        decision = self.planner.rejoin(self.state, devices)
        plan_s = time.perf_counter() - t0
        needs_state = bool(set(devices) & set(decision.plan.devices())) or decision.kind == "restore"
        g = self._deploy(decision, plan_s, "rejoin", from_checkpoint=needs_state,
                         what=f"rejoin of devices {devices}", devices=devices)
        self.rejoined.update({d: g for d in devices})
