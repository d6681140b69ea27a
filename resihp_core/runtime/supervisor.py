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

Repaired devices are brought back (:meth:`Supervisor.rejoin`: ``repairs`` due at an
iteration, devices put on ``repair_requests`` by another thread, or offered on
``repaired`` at run time by a node whose partition healed, once their failure has been
handled): their workers are started again, the Scheduler plans them back in
(:meth:`~resihp_core.scheduler.Planner.rejoin`), and when the new plan gives them work
every worker reloads a checkpoint, since a fresh worker has no state to move.

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
    repaired: "queue.Queue[tuple[int, ...]]" = field(default_factory=queue.Queue)  # offered at run time
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
    restore_at_start: int | None = None  # a resumed job: the checkpoint its first generation loads
    repair_requests: "queue.Queue[list[int]]" = field(default_factory=queue.Queue)  # devices repaired now
    storage_faults: list[dict] = field(default_factory=list)
    max_retries: int = 3  # same-plan redeployments after a stall that no device failure explains
    retries: int = 0

    def _event(self, kind: str, text: str, **extra: Any) -> None:
        ev = {"time": time.monotonic() - self._t0, "iteration": self.job.committed, "kind": kind,
              "generation": self.job.generation, "text": text, **extra}
        self.events.append(ev)
        logger.info("event=%s generation=%d iteration=%d %s", kind, self.job.generation, self.job.committed, text)
        self.on_event(ev)

    def run(self, timeout: float = 600.0) -> list[IterationRecord]:
        self._t0 = time.monotonic()
        self._faults_seen = 0
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
                self.records.append(rec)
                self.on_iteration(rec)
                if self.observers is not None:
                    self.observers.notify_iteration(rec)
            if self.first + len(self.records) >= self.iterations:
                break
            self._storage_faults()
            due = [it for it in self.repairs if it <= self.job.committed and self.job.committed > 0]
            asked = []
            while not self.repair_requests.empty():
                asked += self.repair_requests.get_nowait()
            if due or asked:
                self.rejoin(sorted({d for it in due for d in self.repairs.pop(it)} | set(asked)))
                last_commit = time.monotonic()
                continue
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
                    # Live workers gave up without any device failing: a race between
                    # generations (a worker still in a superseded rendezvous while its
                    # peers timed out in the new one). Deploy the same plan again.
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
        return self.records

    # ------------------------------------------------------------ checkpoints
    def _unsourceable(self) -> bool:
        """A reconfiguration whose state has no surviving copy (the adapter's
        ``move_state`` said so): deploy the same plan again, restored from a checkpoint.
        Checked twice a second."""
        now = time.monotonic()
        if now - getattr(self, "_last_source_check", 0.0) < 0.5 or self.checkpoint_dir is None:
            return False
        self._last_source_check = now
        failures = self.job.worker_failures()
        lost = {d: t for d, t in failures.items() if "no surviving complete copy" in t}
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
        store = self.job.store
        n = store.add("ckpt/faults", 0)
        while self._faults_seen < n:
            key = f"ckpt/fault/{self._faults_seen + 1}"
            if not store.check([key]):
                return  # counted but not yet posted: next round
            self._faults_seen += 1
            st = json.loads(store.get(key))
            self.storage_faults.append(st)
            nxt = f"at iteration {st['iteration'] + self.checkpoint_every}" if self.checkpoint_every else "never"
            self._event("storage", f"storage fault: checkpoint of iteration {st['iteration']} not written by "
                                   f"device {st['device']} ({st['error'][:160]}); training goes on, "
                                   f"next checkpoint {nxt}", devices=[st["device"]], checkpoint=st["iteration"])

    def _restore_point(self, resume: int) -> tuple[int | None, str]:
        """The newest complete checkpoint of an iteration before ``resume`` (None: none,
        restart from the seed), and what was skipped on the way."""
        if self.checkpoint_dir is None:
            return resume - 1, ""
        deadline = time.monotonic() + (self.checkpoint_grace_s if self.checkpoint_every else 0.0)
        every = max(1, self.checkpoint_every)
        due = (resume // every) * every - 1  # the newest committed iteration due a checkpoint
        while True:
            it, skipped = checkpoints.newest_complete(self.checkpoint_dir, at_most=resume - 1)
            if it is None or it >= due or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # the due one may still be in flight on a writer thread
        note = "; ".join(f"checkpoint of iteration {s.iteration} is not usable: {s.problem}" for s in skipped)
        if note or (it is not None and it < due):
            self._event("checkpoint", (note + "; " if note else "") +
                        (f"falling back to the checkpoint of iteration {it}" if it is not None
                         else "no complete checkpoint: restarting from the initial state"),
                        restore=it, skipped=[s.iteration for s in skipped])
        return it, note

    def _retry(self, failures: dict[int, str]) -> None:
        prev = self.job.message
        resume = self.job.abort()
        restore, fresh = None, False
        if prev is not None and (prev.restore is not None or prev.fresh):
            # The generation retried was a restore (a rejoin: fresh workers hold no
            # state): so is the retry, from the newest complete checkpoint.
            restore = self._restore_point(resume)[0] if resume > 0 else None
            fresh = restore is None
            resume = self.job.committed = 0 if restore is None else restore + 1
        g = self.job.post(self.state.plan, iterations=self.iterations, resume=resume, restore=restore,
                          fresh=fresh, exclude=self.handled_devices)
        self.set_generation(g, self.state.plan, dict(self.state.speeds))
        why = "; ".join(f"device {d}: {t[:80]}" for d, t in sorted(failures.items()))[:300]
        self._event("plan", f"generation {g} (retry {self.retries} of the same plan: workers left the "
                            f"previous one with no device failing: {why})", plan=self.state.plan.to_text(),
                    kind_of_plan="retry", planning_s=0.0, resume=resume)

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
            for d in report.devices:
                self.handled_devices.add(d)
                if d in self.job.alive():
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
            self._deploy(decision, plan_s, decision.kind, from_checkpoint=decision.kind == "restore")
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
        resume = self.job.abort()
        if prev is not None and (prev.restore is not None or prev.fresh) and resume <= prev.resume:
            # The restore being replaced never committed an iteration: workers may not
            # hold the state its plan says (a rejoined worker holds none). Restore again.
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
        where = (f", from the checkpoint of iteration {restore}" if restore is not None
                 else ", from the initial state" if fresh else "")
        self._event("plan", f"generation {g} ({what or kind}, planned in {plan_s * 1e3:.0f} ms{where}): "
                            f"{decision.reason[:200]}", plan=decision.plan.to_text(),
                    kind_of_plan=kind, planning_s=plan_s, resume=resume, **extra)
        return g

    # ------------------------------------------------------------ repairs
    def _offered(self) -> bool:
        """Rejoin the devices offered on ``repaired`` whose failure was handled (a
        device whose loss is not planned yet waits for it). Returns whether it did.

        A rejoin waits until the current generation has committed an iteration: it is
        not urgent, and superseding a generation whose workers are still meeting in
        its rendezvous leaves some of them waiting there for the store timeout."""
        if self.repaired.empty() or self.job.generation not in self.job.committed_in.values():
            return False
        offered: set[int] = set()
        while True:
            try:
                offered.update(self.repaired.get_nowait())
            except queue.Empty:
                break
        if not offered:
            return False
        alive = set(self.job.alive())
        ready = sorted(d for d in offered if d in self.handled_devices and d not in alive)
        waiting = tuple(sorted(d for d in offered if d not in self.handled_devices and d not in alive))
        if waiting:
            self.repaired.put(waiting)
        if not ready:
            return False
        self.rejoin(ready)
        return True

    def rejoin(self, devices: list[int]) -> None:
        """Bring repaired ``devices`` back: start their workers now; once they are
        ready (:attr:`ready`: started up, waiting for a generation) plan them in and
        deploy (:meth:`_joined`). Until then the job goes on without them: a plan
        that named them while they are still starting (seconds on a loaded host) would
        leave the others waiting in its rendezvous."""
        devices = sorted(d for d in devices if d not in self.job.alive() and d not in self._joining)
        if not devices:
            return
        self.job.relaunch(devices)
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
        if not waiting or not self.ready(waiting):
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
