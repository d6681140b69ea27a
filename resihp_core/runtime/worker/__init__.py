"""The framework-neutral worker: ``python -m resihp_core.runtime.worker``, or a library.

One worker per device lives across plan generations. For each generation posted in the
job store it rolls back an uncommitted iteration, has the adapter rebuild its
communicators, start fresh / move state / restore a checkpoint, then trains iteration by
iteration, committing each through the store. When a peer dies a collective fails; the
worker records why, drops every reference to the broken groups *outside* the ``except``
block (a live traceback would keep gloo's sockets open and stall other survivors) and
waits for the next generation. The adapter is driven only through the contract in
:mod:`resihp_core.adapter` (``docs/adapters.md``); the job-store keys and ``RESIHP_*``
variables are in ``docs/worker-protocol.md``.

Two ways to use it:

- process mode: ``Worker.from_env().run()`` (what the agents launch);
- library mode, control inverted: a user's training loop calls :meth:`Worker.step`
  ("train one iteration"); it returns once an iteration has committed on every live
  rank, reconfiguring inside the call when the plan changes, and returns None at the
  job's end. A rank the plan leaves out waits inside ``step`` as a standby.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NoReturn, Protocol, runtime_checkable

from resihp_core.adapter import Adapter, AdapterContext, AdapterRegistry, Capabilities, IterationResult, StateLost
from resihp_core.detector.sdc import SdcGuard, SnapshotFingerprint
from resihp_core.job import JobSpec
from resihp_core.plan import ParallelPlan
from resihp_core.protocol import IterationReport, MicroBatchProfile, PlanUpdate, WorkerLeft
from resihp_core.runtime import session
from resihp_core.protocols.checkpoints import CheckpointWrite
from resihp_core.protocols.store import KeyValueStore
from resihp_core.runtime.worker.injector import FaultInjector
from resihp_core.runtime.worker.node_commit import NodeCommit, direct_commit
from resihp_core.runtime.worker.node_watch import AgentFeed

if TYPE_CHECKING:
    from resihp_core.program import Program
    from resihp_core.runtime.heartbeat import WorkerClient
    from resihp_core.runtime.peercopy import PeerCopies

__all__ = ["DeferredStep", "GenerationWatch", "Worker", "main", "end_on_job_error", "end_script"]

AdapterFactory = Callable[[AdapterContext], Adapter]

#: ``RESIHP_COMMIT_OVERLAP=0`` turns the overlapped commit off (process mode commits
#: each iteration before the next starts, as library mode always does).
ENV_COMMIT_OVERLAP = "RESIHP_COMMIT_OVERLAP"


@runtime_checkable
class DeepRollback(Protocol):
    """An adapter that keeps two rollback snapshots (torch_native, deepspeed): the worker
    can then commit an iteration on a background thread while the next one runs, and
    still put back the exact state before either if the commit is refused
    (docs/torch_native.md, "The commit off the critical path")."""

    def keep_snapshots(self, depth: int) -> bool: ...

    def rollback_to(self, iteration: int) -> None: ...


@runtime_checkable
class DeferredStep(Protocol):
    """An adapter whose iteration can stop before its optimizer step (torch_native): a
    worker that runs the adapter's iterations itself (:meth:`Worker.run`,
    :meth:`Worker.step`) then votes on the commit with the gradients reduced and steps
    only an iteration that committed everywhere, as torchft's ``should_commit``
    does. An iteration that does not commit has changed nothing but gradients, so no
    rollback snapshot is taken: the copy of the whole state every iteration is gone,
    for one commit round trip before the step (docs/worker-protocol.md, "The step after
    the commit").

    ``defer_steps(wanted, fingerprints=...)`` is called on entering each generation;
    it returns whether ``run_iteration`` now stops before the step (the adapter may
    refuse a layout); ``rollback`` then drops the gradients."""

    def defer_steps(self, wanted: bool, *, fingerprints: bool) -> bool: ...

    def apply_step(self) -> None: ...


@dataclass
class _Pending:
    """An iteration whose optimizer step this device applied and whose report and
    commit are in flight on the committer thread."""

    iteration: int
    verdict: Future


def _log(event: str, device: int, **kv: Any) -> None:
    extra = "".join(f" {k}={v}" for k, v in kv.items())
    print(f"time={time.time():.3f} event={event} device={device}{extra}", file=sys.stderr, flush=True)


class GenerationWatch:
    """Background thread: notices a newer generation within milliseconds so a worker
    stops mid-iteration (and leaves a superseded rendezvous) instead of finishing
    doomed work. With ``agent`` (process mode) it hears of each generation from its
    node agent, whose one store wait serves the whole node (store connections grow
    with nodes, not ranks; ``node_watch.py``); when the agent refuses, goes away or
    falls silent it blocks in ``store`` on the next generation's plan key itself, as
    it does without an agent. Either way it costs the controller nothing while nothing
    changes.

    :param store: the store to watch directly (a :class:`~resihp_core.runtime.session.LazyConnection`
        is opened only if the worker must watch it itself).
    :param agent: the node agent's feed (optional).
    """

    def __init__(self, store: KeyValueStore, wait_s: float = 30.0, *, agent: AgentFeed | None = None) -> None:
        self.latest = -1
        self._store = store
        self._wait_s = wait_s  # one store request per wait_s while nothing changes
        self.agent = agent
        self.direct = agent is None  # watching the store itself
        self._plan: PlanUpdate | None = None  # the newest plan the agent relayed
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-generation-watch")
        self._thread.start()

    def _seen(self, generation: int) -> None:
        if generation > self.latest:
            with self._changed:
                self.latest = max(self.latest, generation)
                self._changed.notify_all()

    def _relayed(self, plan: PlanUpdate) -> None:
        with self._changed:
            if self._plan is None or plan.generation > self._plan.generation:
                self._plan = plan
            self._changed.notify_all()

    def plan(self, generation: int, timeout_s: float = 5.0) -> PlanUpdate | None:
        """Generation ``generation``'s plan as the agent relays it (it follows the
        notice), waiting up to ``timeout_s`` while the agent's feed is up; None: read
        it from the store."""
        def here() -> PlanUpdate | None:
            p = self._plan
            return p if p is not None and p.generation == generation else None
        with self._changed:
            self._changed.wait_for(lambda: here() is not None or self.direct or (
                self._plan is not None and self._plan.generation > generation), timeout_s)
        return here()

    def wait_newer(self, after: int, timeout_s: float) -> int | None:
        """The newest generation once it is newer than ``after`` (up to ``timeout_s``);
        None when this watch has ended (the job store went away): ask the store."""
        with self._changed:
            self._changed.wait_for(lambda: self.latest > after or not self._thread.is_alive(), timeout_s)
        return self.latest if self._thread.is_alive() or self.latest > after else None

    def _run(self) -> None:
        try:
            if self.agent is not None:
                self.agent.follow(self._seen, self._relayed)
                with self._changed:
                    self.direct = True
                    self._changed.notify_all()
            self._seen(session.latest_generation(self._store))
            while True:
                if session.wait_posted(self._store, self.latest + 1, self._wait_s):
                    self._seen(max(self.latest + 1, session.latest_generation(self._store)))
        except Exception:  # noqa: BLE001 - the job store went away: the job is over
            return
        finally:
            with self._changed:
                self._changed.notify_all()


#: This process's worker, once built: the job-error handler posts through its store and
#: says goodbye through its Detector client (one worker per process).
_current: Worker | None = None


def end_on_job_error(exc: BaseException) -> NoReturn:
    """The top level of a worker process, with the exception that ends it. A job error
    (:func:`resihp_core.errors.classify`) is posted to the controller through the job
    store, the agent is told this exit is expected, and the process exits with
    :data:`~resihp_core.errors.WORKER_EXIT_JOB_ERROR`. A device-kind exception (a CUDA
    or NCCL error, a closed peer) ends the process with status 1, unannounced: the
    device failure it is (docs/errors.md). The traceback goes to the worker's log."""
    from resihp_core.errors import WORKER_EXIT_JOB_ERROR, classify, traceback_tail, user_frame
    from resihp_core.protocol import JobError

    if classify(exc) != "job":
        print(traceback_tail(exc), file=sys.stderr, flush=True)
        _log("device_error", _current.device if _current is not None else -1, exception=type(exc).__name__)
        os._exit(1)
    w = _current
    env = os.environ
    device = w.device if w is not None else int(env.get("RESIHP_DEVICE", "0") or 0)
    training = w is not None and w.msg is not None
    err = JobError(device=device, exc_type=type(exc).__name__[:256], message=str(exc)[:4000],
                   where=user_frame(exc), traceback=traceback_tail(exc), phase="training" if training else "setup",
                   iteration=w.iteration if w is not None else 0,
                   generation=w.msg.generation if w is not None and w.msg is not None else -1)
    print(err.traceback, file=sys.stderr, flush=True)
    _log("job_error", device, exception=err.exc_type, where=repr(err.where))
    try:
        store = w.store if w is not None else session.connect(env["RESIHP_STORE"], 30.0)
        session.put_job_end(store, err)
    except Exception as e:  # noqa: BLE001 - no store (run outside a launcher): the log has it
        _log("job_error_not_posted", device, reason=repr(str(e)[:200]))
    client = w.client if w is not None else None
    try:
        if client is None and env.get("RESIHP_AGENT_ADDR"):
            from resihp_core.runtime.heartbeat import WorkerClient

            client = WorkerClient.from_env(dict(env, RESIHP_RANK=env.get("RESIHP_RANK", str(device)))).start()
        if client is not None:
            client.close(goodbye=True)  # the agent: an expected exit, not a failure
    except Exception:  # noqa: BLE001 - the agent then reports the exit; the controller reads the error
        pass
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(WORKER_EXIT_JOB_ERROR)  # threads blocked in collectives must not hold the exit


def end_script() -> None:
    """The user's training script returned (a ``resihp launch`` worker): before the job's
    end, its loop ended early; say so (the job ends normally, docs/errors.md) and tell
    the agent this exit is expected."""
    w = _current
    if w is None or w.finished:
        return
    from resihp_core.protocol import ScriptEnded

    _log("script_ended", w.device, iteration=w.iteration)
    try:
        session.put_job_end(w.store, ScriptEnded(device=w.device, iteration=w.iteration))
    except Exception as e:  # noqa: BLE001 - the job store is gone: the job is over anyway
        _log("script_end_not_posted", w.device, reason=repr(str(e)[:200]))
    if w.client is not None:
        w.client.close(goodbye=True)


def registry_factory(name: str) -> AdapterFactory:
    """Create adapter ``name`` through the plugin registry (entry points included), or
    from a ``module:Class`` target directly (an adapter under development)."""

    def make(ctx: AdapterContext) -> Adapter:
        if ":" in name:
            from resihp_core.adapter import AdapterSpec

            cls = AdapterSpec(name, name, Capabilities()).load()
            return AdapterRegistry._checked(name, cls(ctx))
        from resihp_core.plugins import Plugins

        return Plugins().adapters().create(name, ctx)

    return make


class Worker:
    """The generation loop of one device, driving one adapter.

    :param factory: builds the adapter from the context (default: the registry entry
        named by ``job.adapter``).
    :param watch: notices superseded generations mid-iteration (optional).
    :param client: the Detector's heartbeat client (optional).
    """

    def __init__(self, device: int, store: KeyValueStore, job: JobSpec, *, factory: AdapterFactory | None = None,
                 watch: GenerationWatch | None = None, client: WorkerClient | None = None) -> None:
        self.device, self.store, self.job, self.client = device, store, job, None
        self.faults = FaultInjector(device, job.faults)
        latest: Callable[[], int] = ((lambda: watch.latest) if watch is not None
                                     else (lambda: session.latest_generation(store)))
        self._latest = latest  # with a watch: no store round trip per iteration
        self.watch = watch
        # The adapter rendezvouses through a fenced view of the store: a wait in a
        # superseded generation's rendezvous ends at once (docs/worker-protocol.md).
        fenced = session.generation_fenced(store, latest, patience_s=job.timeout_s * 6)
        self.ctx = AdapterContext(device=device, job=job, store=fenced, faults=self.faults)
        if watch is not None:
            self.ctx.superseded = lambda: watch.latest > self.ctx.generation
        self.adapter = (factory or registry_factory(job.adapter))(self.ctx)
        self.sdc = SdcGuard.for_adapter(self.adapter, device)  # None: no fingerprints (docs/sdc.md)
        if client is not None:
            self.attach(client)
        self.plan: ParallelPlan | None = None  # the plan whose layout the adapter's state has
        self.msg: PlanUpdate | None = None
        self.iteration = 0  # iterations whose optimizer step this worker applied
        self.active = False  # in a generation, as an executor, able to run iterations
        self.finished = False  # the job's stop was seen: every iteration it runs is done
        self.program: Program | None = None
        self._seen = -1
        self._pending: _Pending | None = None  # process mode: the commit in flight
        self._may_defer = False  # run() or step(): the step may follow the commit (DeferredStep)
        self.deferred = False  # this generation steps after the commit
        # The iteration whose rollback snapshot was taken right after the step before it,
        # with that step's fingerprint (:class:`SnapshotFingerprint`): its start takes none.
        self._snapped: int | None = None
        self._commit_store: KeyValueStore | None = None  # its own store connection (overlap_commits)
        self._committer: ThreadPoolExecutor | None = None
        self.node_commit: NodeCommit | None = None  # commits through the node agent (from_env)
        self.peers: PeerCopies | None = None  # memory copies on peers (keep_peer_copies)
        # A store hosted outside the controller: hold each commit while it is away
        # (docs/failover.md); the agent ends this worker when its grace period is over.
        grace = float(os.environ.get(session.ENV_GRACE, "0") or 0)
        self.hold_s = 2 * grace + 30 if grace > 0 else 0.0  # a backstop: the agent and the store host end it first
        session.put_pid(store, device, os.getpid())
        global _current
        _current = self

    def attach(self, client: WorkerClient) -> None:
        """Send heartbeats (progress per primitive) and profiles through ``client``."""
        self.client = client
        self.ctx.beat = client.beat

    # ------------------------------------------------------------------ factories
    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, *, factory: AdapterFactory | None = None) -> Worker:
        """The worker of this process, from ``RESIHP_STORE``, ``RESIHP_DEVICE`` and
        ``RESIHP_JOB`` (and ``RESIHP_AGENT_ADDR`` for the Detector's heartbeats)."""
        env = dict(os.environ if env is None else env)
        missing = [k for k in ("RESIHP_STORE", "RESIHP_DEVICE", "RESIHP_JOB") if not env.get(k)]
        if missing:
            raise RuntimeError(f"not started by a ResiHP launcher: {', '.join(missing)} not set "
                               "(see docs/worker-protocol.md)")
        device = int(env["RESIHP_DEVICE"])
        with open(env["RESIHP_JOB"]) as f:
            job = JobSpec.from_json(f.read())
        timeout = max(30.0, job.timeout_s * 3)
        store = session.connect(env["RESIHP_STORE"], timeout)
        # Through the agent (one store wait per node); its own store connection only as a fallback.
        watch = GenerationWatch(session.LazyConnection(lambda: session.connect(env["RESIHP_STORE"], timeout)),
                                agent=AgentFeed.from_env(env, device))
        worker = cls(device, store, job, factory=factory, watch=watch)
        worker.node_commit = NodeCommit.from_env(env, device)
        if env.get(ENV_COMMIT_OVERLAP, "1") != "0":
            def own() -> KeyValueStore:
                return session.connect(env["RESIHP_STORE"], timeout)

            # Through the agent the commit thread needs a store of its own only as a fallback.
            worker.overlap_commits(session.LazyConnection(own) if worker.node_commit is not None else own())
        if job.memory_copy_every and worker.adapter.capabilities.memory_copy:
            from resihp_core.runtime.peercopy import PeerCopies

            worker.keep_peer_copies(PeerCopies.from_env(device, session.connect(env["RESIHP_STORE"], timeout), env,
                                                        timeout_s=timeout))
        if env.get("RESIHP_AGENT_ADDR"):
            # Heartbeats start only now: creating the adapter imports its framework, which
            # holds the GIL for seconds and would starve the beat thread into a "hang".
            from resihp_core.runtime.heartbeat import WorkerClient

            env.setdefault("RESIHP_RANK", str(device))
            worker.attach(WorkerClient.from_env(env).start())
        return worker

    # ------------------------------------------------------------------ the loop
    def overlap_commits(self, store: KeyValueStore) -> None:
        """Process mode (:meth:`run`): report and commit each iteration on a background
        thread over ``store`` (a connection of its own) while the next iteration runs,
        if the adapter keeps two snapshots (:class:`DeepRollback`); its verdict is
        awaited before the next commit, a fault, a new generation or the end."""
        self._commit_store = store

    def keep_peer_copies(self, peers: PeerCopies) -> None:
        """Hand each committed snapshot due by ``job.memory_copy_every`` to ``peers``
        (this rank's own holder, and its buddy's on another node), and read them back at
        a restore from memory (docs/checkpoints.md, "Memory copies on peers")."""
        self.peers = peers

    def run(self) -> None:
        """Process mode: train until the job stops. Each generation steps after the
        commit where the adapter can (:class:`DeferredStep`); otherwise the commit
        overlaps the next iteration (:class:`DeepRollback`), or runs in line."""
        a = self.adapter
        self._may_defer = self.peers is None  # memory copies are taken from the rollback snapshot
        if self._commit_store is not None and isinstance(a, DeepRollback) and a.keep_snapshots(2):
            self._committer = ThreadPoolExecutor(1, thread_name_prefix="resihp-commit")
        try:
            while self.next_iteration() is not None:
                if self.deferred:
                    self._deferred_iteration()
                elif self._committer is not None:
                    self._overlapped_iteration()
                else:
                    self._one_iteration()
        finally:
            if self._committer is not None:
                self._committer.shutdown(wait=False)
                self._committer = None

    def step(self) -> IterationResult | None:
        """Run until one more iteration commits everywhere (entering plan generations as
        they come) and return its result; None when the job has stopped. The step
        follows the commit where the adapter can (:class:`DeferredStep`)."""
        self._may_defer = self.peers is None
        while self.next_iteration() is not None:
            result = self._deferred_iteration() if self.deferred else self._one_iteration()
            if result is not None:
                return result
        return None

    def next_iteration(self) -> int | None:
        """Enter plan generations until this device can run an iteration and return its
        index; None when the job has stopped. With :meth:`begin_iteration`,
        :meth:`end_iteration` and :meth:`abandon_iteration` it lets a user's own loop
        body run the iteration in place of ``Adapter.run_iteration`` (the torch_native
        adapter's loop mode, docs/torch_native.md), on the same commit and restore path."""
        # A snapshot taken ahead holds the state only if nothing below changes it first.
        ahead, self._snapped = self._snapped, None
        while True:
            if not self.active:
                if not self._enter_next():
                    return None
                ahead = None
                continue
            if self._pending is not None and (self.iteration + 1 >= self.msg.iterations or self._superseded()
                                              or self._fault_due(self.iteration + 1)):
                # The commit in flight first: the job's end, a new generation and an
                # injected fault see every iteration before them settled.
                if not self._settle():
                    self.adapter.release()
                    self.active = False
                ahead = None
                continue
            nxt = self.iteration + (self._pending is not None)
            if nxt >= self.msg.iterations or self._superseded():
                self.active = False  # wait for the next generation (or the stop)
                ahead = None
                continue
            self._snapped = ahead if ahead == nxt else None
            return nxt

    def _fault_due(self, i: int) -> bool:
        return any(int(f["iteration"]) == i for f in self.faults.faults)

    def _settle(self) -> bool:
        """Wait for the verdict of the commit in flight: True if it committed everywhere
        (the iteration count advances); else the state goes back to that iteration's
        start (two snapshots back if the next iteration already stepped), False."""
        p, self._pending = self._pending, None
        if p.verdict.result() == session.CommitResult.COMMITTED:
            self.iteration = p.iteration + 1
            return True
        self.adapter.rollback_to(p.iteration)
        self.iteration = p.iteration
        return False

    def _commit_in_background(self, report: IterationReport, executors: int, fingerprint: str | None) -> str:
        return self._commit(self._commit_store, report, executors, fingerprint)

    def _commit(self, store: KeyValueStore, report: IterationReport, executors: int,
                fingerprint: str | None = None) -> str:
        """Post the report and the SDC ``fingerprint`` and commit, in one store request
        (through the node agent where it takes commits): the fingerprint is posted
        before this device adds itself to the count (docs/sdc.md)."""
        check = self._sdc_check(store, report.generation, report.iteration)
        timeout_s = self.job.timeout_s * 6
        if self.node_commit is not None:
            return self.node_commit.commit(store, report, executors, timeout_s=timeout_s, hold_s=self.hold_s,
                                           check=check, fingerprint=fingerprint)
        return direct_commit(store, report, executors, timeout_s=timeout_s, hold_s=self.hold_s, check=check,
                             fingerprint=fingerprint)

    def _overlapped_iteration(self) -> None:
        """One iteration whose report and commit leave on the committer thread; the one
        before it must have committed before this one's commit is sent."""
        i = self.begin_iteration()
        result = self._run_adapter_iteration(i)
        if isinstance(result, str):
            # Back to this iteration's start if the one before committed, else (settle
            # rolled back) to that one's.
            if self._pending is None or self._settle():
                self.adapter.rollback()
            self._left(self.msg.generation, result, "generation_left", iteration=self.iteration)
            return
        a = self.adapter
        ahead = self.sdc is not None and isinstance(a, SnapshotFingerprint)
        before = self._before_commit(result, i, fingerprint=not ahead)
        if before is None:
            return
        report, fingerprint = before
        if self._pending is not None and not self._settle():
            self.adapter.release()
            self.active = False
            return
        executors = len(self.plan.devices())
        if ahead:
            # The next iteration's rollback snapshot now, with this step's fingerprint
            # read during its copy (the state is the same until that iteration starts;
            # both snapshots kept cover a refusal of either commit). It goes with the commit.
            taken = a.snapshot_fingerprint()
            self._snapped = i + 1
            fingerprint = self.sdc.prepare(i, loss=result.loss, plan=self.plan, taken=(taken,))
        self._pending = _Pending(i, self._committer.submit(self._commit_in_background, report, executors,
                                                           fingerprint))

    def _deferred_iteration(self) -> IterationResult | None:
        """One iteration voted on before its optimizer step (:class:`DeferredStep`): the
        report, the SDC fingerprint of the state the step will read, and the commit;
        the step only once the iteration committed everywhere, then a due checkpoint
        (of committed state: its failure leaves the generation with nothing to undo).
        Its result once committed, else None."""
        a = self.adapter
        i = self.begin_iteration()
        result = self._run_adapter_iteration(i)
        if isinstance(result, str):
            self.abandon_iteration(result)  # drops the gradients: the state is i's start
            return None
        g = self.msg.generation
        if self.client is not None and i > self.msg.resume and (prof := a.profile()) is not None:
            self.client.send_profile(self._with_cpu_wait(prof))
        self._checkpoint_reports()
        fingerprint = self.sdc.prepare(i, loss=result.loss, plan=self.plan) if self.sdc is not None else None
        if (self._commit(self.store, self._report(result), len(self.plan.devices()), fingerprint)
                != session.CommitResult.COMMITTED):
            a.rollback()
            a.release()
            self.active = False
            return None
        a.apply_step()
        self.iteration = i + 1
        if self._checkpoint_due(i):
            failed = None
            try:
                a.save_checkpoint(i)
            except Exception as e:  # noqa: BLE001 - a peer died while gathering shards
                failed = f"{type(e).__name__}: {e}"
            if failed is not None:
                self._left(g, failed, "checkpoint_failed", iteration=i)
        return result

    def _superseded(self) -> bool:
        # Newer only: the watch starts at -1 before its first answer. A generation posted
        # after this check is still caught by the commit (it aborts the iteration).
        return self._latest() > self.msg.generation

    def _enter_next(self) -> bool:
        """Wait for a newer generation and enter it; False when it is the stop. With a
        watch it waits on the watch and takes the plan its agent relayed (no store
        request unless the plan did not come)."""
        w = self.watch
        g: int | None = None
        while w is not None and (g := w.wait_newer(self._seen, 2.0)) is not None and g <= self._seen:
            pass
        if g is None:  # no watch, or it ended: the store itself
            while (g := session.wait_generation(self.store, self._seen, 2.0)) <= self._seen:
                pass
        self._seen = g
        msg = (w.plan(g) if w is not None else None) or session.read_plan(self.store, g)
        self.ctx.generation = g
        if msg.stop:
            self._finish()
            return False
        if self.device not in msg.devices:
            return True  # excluded but alive: wait to be brought back
        self.msg = msg
        self.active = self._reconfigure(msg)
        return True

    def _reconfigure(self, msg: PlanUpdate) -> bool:
        """Enter generation ``msg``: True if this device runs iterations in it."""
        g, dev, a = msg.generation, self.device, self.adapter
        t0 = time.perf_counter()
        _log("generation_entered", dev, generation=g)
        plan = msg.parsed_plan()
        if self.iteration > msg.resume:
            a.rollback()  # stepped an iteration that did not commit everywhere
        self.iteration = msg.resume
        t1 = time.perf_counter()
        if self.client is not None:
            self.client.set_generation(g, dev)  # the Detector keys workers by device id
        moved, failed, lost, t2 = 0, None, False, t1
        moving = msg.restore is None and self.plan is not None and not msg.fresh
        try:
            if moving:  # state lost: every device leaves before the rendezvous, together
                a.check_move(self.plan, plan, list(msg.devices))
            a.rebuild_communicators(plan, g, list(msg.devices))
            t2 = time.perf_counter()
            if msg.restore is not None and msg.memory_holders is not None:
                if self.peers is None:
                    raise OSError(f"device {dev} keeps no memory copies: cannot restore iteration {msg.restore} "
                                  "from memory")
                a.load_memory_copy(msg.restore, plan, self.peers.reader(msg.restore, msg.memory_holders))
            elif msg.restore is not None:
                a.load_checkpoint(msg.restore, plan)
            elif not moving:
                a.start_fresh(plan)
            else:
                moved = a.move_state(self.plan, plan, list(msg.devices))
        except Exception as e:  # noqa: BLE001 - a peer died during the reconfiguration itself
            # A checkpoint that cannot be read is the storage's fault, not the job's: the
            # supervisor restores again, from the newest checkpoint that verifies.
            spoiled = self._spoiled_checkpoint(msg) if msg.restore is not None else None
            storage = msg.restore is not None and (isinstance(e, OSError) or spoiled is not None)
            if not storage and self._is_job_error(e):
                raise  # the adapter refused the job, or the user's code raised: the job ends
            failed = f"{type(e).__name__}: {e}" + (f" ({spoiled})" if spoiled else "")
            lost = storage or isinstance(e, StateLost)  # the typed signal: restore from a checkpoint
        if failed is not None:
            # Outside the except block (no traceback pins the groups). The state is the
            # previous generation's (move_state puts it back on failure): wait for the
            # generation the Scheduler makes of this new failure.
            self._left(g, failed, "reconfiguration_failed", state_lost=lost)
            return False
        self.plan = plan
        if isinstance(a, DeferredStep):
            self.deferred = a.defer_steps(self._may_defer, fingerprints=self.sdc is not None)
        t3 = time.perf_counter()
        comm = a.communicator_report()
        if comm:
            _log("communicators", dev, generation=g, **comm)
        timings = {"seconds": t3 - t0, "rebuild_s": t2 - t1, "state_s": t3 - t2, "bytes_received": moved, **comm}
        _log("generation_ready", dev, generation=g, step_after_commit=int(self.deferred),
             **{k: f"{v:.3f}" if isinstance(v, float) else v for k, v in timings.items()})
        session.put_ready(self.store, g, dev, timings)
        if a.where is None:
            return False  # a standby: wait for a plan that uses it
        from resihp_core.predictor.schedules import emit_programs

        self.program = {(p.replica, p.stage): p for p in emit_programs(plan)}[a.where[:2]]
        return True

    def _spoiled_checkpoint(self, msg: PlanUpdate) -> str | None:
        """Why checkpoint ``msg.restore`` no longer verifies, or None. A load that fails on
        a checkpoint the supervisor verified is the storage's fault when the files changed
        since (whatever the framework raised on reading them: ``torch.load``'s
        ``RuntimeError``, a hash check's own error); on a checkpoint that still verifies it
        is the adapter's or the job's, and is classified as such."""
        from resihp_core import checkpoints

        root = self.job.checkpoint_dir
        if msg.restore is None or msg.memory_holders is not None or not root:
            return None
        return checkpoints.verify(root, msg.restore).problem

    def _left(self, generation: int, reason: str, event: str, *, state_lost: bool = False, **kv: Any) -> None:
        session.put_left(self.store, WorkerLeft(generation=generation, device=self.device, reason=reason[:500],
                                                 error=reason.partition(":")[0][:100], state_lost=state_lost))
        _log(event, self.device, generation=generation, reason=repr(reason[:200]), **kv)
        self.adapter.release()
        self.active = False

    def _one_iteration(self) -> IterationResult | None:
        result = self._run_adapter_iteration(self.begin_iteration())
        if isinstance(result, str):
            self.abandon_iteration(result)
            return None
        return self.end_iteration(result)

    def _run_adapter_iteration(self, i: int) -> IterationResult | str:
        """The adapter's iteration ``i``, or why it failed (a peer died: any collective
        may raise). The reason is handled by the caller outside this except block, so no
        traceback pins the broken groups while it rolls back."""
        try:
            return self.adapter.run_iteration(self.program, i)
        except Exception as e:  # noqa: BLE001
            if self._is_job_error(e):
                raise  # the job's own error ends the job (docs/errors.md)
            return f"{type(e).__name__}: {e}"

    def _is_job_error(self, e: BaseException) -> bool:
        """``e`` is the job's own error, not the echo of a peer's failure: of the job
        kind (:func:`resihp_core.errors.classify`) while this generation is current."""
        from resihp_core.errors import classify

        return classify(e) == "job" and not self._superseded()

    def begin_iteration(self) -> int:
        """Injected faults due now, the rollback snapshot; the iteration's index."""
        i = self.iteration + (self._pending is not None)
        self.faults.at_iteration(i)
        if self._snapped != i and not self.deferred:
            self.adapter.snapshot()
        self._snapped = None
        every = self.job.memory_copy_every
        if self.peers is not None and every and self._pending is None and i > 0 and i % every == 0:
            # The snapshot holds iteration i - 1, committed everywhere: its pieces go to
            # this rank's holder and its buddy on a background thread.
            copy = self.adapter.memory_copy()
            if copy is not None:
                self.peers.offer(i - 1, self.msg.generation, copy, self.msg.devices, self.plan,
                                 wait_s=self.job.timeout_s * 6, stop=self._superseded)
        return i

    def abandon_iteration(self, reason: str) -> None:
        """The iteration failed (a peer died): roll back and leave the generation."""
        self.adapter.rollback()
        self._left(self.msg.generation, reason, "generation_left", iteration=self.iteration)

    def end_iteration(self, result: IterationResult) -> IterationResult | None:
        """Profile, checkpoint, report and commit an iteration whose optimizer step this
        device applied; its result once committed everywhere, else None (rolled back)."""
        a, i = self.adapter, self.iteration
        before = self._before_commit(result, i)
        if before is None:
            return None
        verdict = self._commit(self.store, before[0], len(self.plan.devices()), before[1])
        if verdict != session.CommitResult.COMMITTED:
            a.rollback()
            a.release()
            self.active = False
            return None
        self.iteration = i + 1
        return result

    def _before_commit(self, result: IterationResult, i: int, fingerprint: bool = True
                       ) -> tuple[IterationReport, str | None] | None:
        """Profile and checkpoint an iteration that stepped; its report and the SDC
        fingerprint to commit with it, or None if a peer died while the checkpoint
        gathered (rolled back, generation left). A due checkpoint waits for the commit
        in flight (it is written of committed state). ``fingerprint``: take the SDC
        fingerprint here (the caller takes it otherwise)."""
        a, g = self.adapter, self.msg.generation
        failed = None
        # The first iteration of a generation carries one-time costs (allocator, first
        # touch, fresh sockets): the Detector's healthy model starts after it.
        if self.client is not None and i > self.msg.resume and (prof := a.profile()) is not None:
            self.client.send_profile(self._with_cpu_wait(prof))
        if self._checkpoint_due(i):
            if self._pending is not None and not self._settle():
                a.release()
                self.active = False
                return None
            # Before the commit: the copy for the writer is taken now; the files are
            # written in the background and the supervisor restores only from complete
            # ones (docs/checkpoints.md). Raising here means a peer died while gathering.
            try:
                a.save_checkpoint(i)
            except Exception as e:  # noqa: BLE001 - a peer died while gathering shards
                failed = f"{type(e).__name__}: {e}"
            if failed is not None:
                a.rollback()
                self._left(g, failed, "checkpoint_failed", iteration=i)
                return None
        self._checkpoint_reports()
        text = self.sdc.prepare(i, loss=result.loss, plan=self.plan) if self.sdc is not None and fingerprint else None
        return self._report(result), text

    def _sdc_check(self, store: KeyValueStore, generation: int, iteration: int) -> Callable[[], bool] | None:
        """The fingerprint comparison the last executor runs before its verdict."""
        if self.sdc is None:
            return None
        return self.sdc.check(store, generation, iteration, self.plan.devices())

    def _with_cpu_wait(self, prof: Any) -> Any:
        """The profile with the time this thread waited for a CPU (the environment's
        share of its wall time; detector/environment.py), unless the adapter set it, and
        the CPUs it may run on (docs/detector.md "Pinned or unpinned")."""
        import msgspec

        from resihp_core.detector.environment import allowed_cpus

        cpus = prof.cpus or allowed_cpus()
        if prof.cpu_wait_s or prof.compute_wait_s:
            return msgspec.structs.replace(prof, cpus=cpus)
        meter = self.faults.cpu_wait
        return msgspec.structs.replace(prof, cpu_wait_s=meter.iteration_s(), compute_wait_s=meter.compute_s, cpus=cpus)

    def _checkpoint_due(self, i: int) -> bool:
        every = self.job.checkpoint_every
        return bool(every and self.job.checkpoint_dir and self.adapter.capabilities.checkpoint
                    and ((i + 1) % every == 0 or i + 1 == self.msg.iterations))

    def _checkpoint_reports(self) -> None:
        """Post this worker's finished checkpoint writes; a failed one is a storage
        fault (:func:`~resihp_core.runtime.session.put_storage_fault`): reported, never fatal."""
        for st in self.adapter.checkpoint_status():
            if not isinstance(st, CheckpointWrite):
                raise TypeError(f"adapter {self.adapter.name!r}: checkpoint_status() must return "
                                f"resihp_core.protocols.CheckpointWrite records, got {type(st).__name__}")
            if st.error:
                session.put_storage_fault(self.store, session.StorageFault(
                    device=self.device, iteration=st.iteration, error=st.error))
                _log("checkpoint_write_failed", self.device, iteration=st.iteration, reason=repr(st.error[:200]))
            else:
                _log("checkpoint_written", self.device, iteration=st.iteration, bytes=st.bytes,
                     seconds=f"{st.seconds:.3f}")

    def _report(self, r: IterationResult) -> IterationReport:
        replica, stage, tp_rank = self.adapter.where
        first = tp_rank == 0  # one member of a TP group speaks for it
        mbs = tuple(MicroBatchProfile(owner=o, mb=j, forward_s=f, backward_s=r.backward_s.get((o, j), 0.0))
                    for (o, j), f in r.forward_s.items())
        return IterationReport(
            generation=self.msg.generation, iteration=r.iteration, device=self.device,
            replica=replica, stage=stage, loss=r.loss if first else 0.0,
            computed=tuple(r.computed) if first else (), iteration_s=r.iteration_s, comm_s=r.comm_s,
            forward_s=sum(r.forward_s.values()), backward_s=sum(r.backward_s.values()), microbatches=mbs,
        )

    def _finish(self) -> None:
        """The job's end: close the Detector client, dump state if asked, release."""
        self.finished = True
        if self.peers is not None:
            self.peers.close()
        if self.client is not None:
            self.client.close()
        if self.node_commit is not None:
            _log("commits", self.device, through_agent=self.node_commit.through_agent, direct=self.node_commit.direct)
            self.node_commit.close()
        w = self.watch
        if w is not None and w.agent is not None:  # through the agent, or why the worker watched the store itself
            _log("generation_watch", self.device, notices=w.agent.notices, direct=w.direct,
                 ended=repr(w.agent.ended[:80]))
        if self.job.dump_dir and self.adapter.where is not None and self.plan is not None:
            import torch

            try:  # the framework's own complete state, for the conformance kit
                full: dict[str, Any] | None = self.adapter.full_state()
            except NotImplementedError:
                full = None
            torch.save({"where": self.adapter.where, "iteration": self.iteration, "plan": self.plan.to_text(),
                        "state": self.adapter.held_state(), "full": full},
                       os.path.join(self.job.dump_dir, f"device{self.device}.pt"))
        self.adapter.close()  # the adapter finishes its queued checkpoint writes here


def main() -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread's stack
    try:
        worker = Worker.from_env()
        # Everything imported so far lives for the whole process: keep it out of the
        # collections that release broken process groups (0.4 s -> milliseconds).
        gc.freeze()
        worker.run()
    except Exception as e:  # noqa: BLE001 - the job's own error ends the job, a device's the process
        end_on_job_error(e)
    return 0

