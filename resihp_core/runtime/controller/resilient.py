"""One resilient job: controller, node agents, workers and supervisor wired together
(what ``resihp run``, ``resihp demo``, the end-to-end benchmark and the chaos tests run).

The controller runs here, on a loop thread, with the job store and the supervisor.
Each node of the topology has an agent *process*: started here (``agents="local"``,
one machine emulating several nodes) or started by the user on each host and pointed
at the controller (``agents="external"``: ``resihp agent --controller HOST:PORT --node
N``). Agents launch their node's workers when the job starts; each worker reports to
its agent, agents to the controller, the controller's failure reports go to the
supervisor, which plans with the Scheduler and deploys. With ``supervised=False`` the
same job runs with no Detector and no adaptation (the "no mitigation" baseline).

A node whose agent was cut off and comes back (a healed partition, a restarted agent)
offers its devices again; the supervisor plans them back in. At the end the controller
tells every agent the job is over: they reap their workers and exit with status 0.
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import secrets as _secrets
import subprocess
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Iterable, Mapping

from resihp_core.plan import ParallelPlan
from resihp_core.runtime.failover import JobState, remove_state, write_state
from resihp_core.runtime.session import JobSession
from resihp_core.runtime.controller.launcher import LocalJob
from resihp_core.protocol import FailureReport, JobError, ScriptEnded, WorkerProcess
from resihp_core.protocols.events import (Attached, ControllerEvent, JobEvent, NodeBack, NodeLost, PlanPosted,
                                          event_dicts)
from resihp_core.protocols.metrics import IterationMetrics
from resihp_core.runtime.controller.control import CheckpointPolicy, ControlLoop, Inbox, JobFailed
from resihp_core.runtime.controller.runconfig import AgentSetup, ResilientConfig, Resume, RunHooks

if TYPE_CHECKING:
    from resihp_core.protocol import PlanUpdate
    from resihp_core.runtime.controller import Controller
    from resihp_core.runtime.loop import LoopThread
    from resihp_core.runtime.processes import AgentProcesses
    from resihp_core.runtime.store import StoreClient

__all__ = ["AttachFailed", "ResilientJob", "ResilientRun", "run_resilient", "start_local_agent", "start_store_host", "ResilientConfig",
           "AgentSetup", "Resume", "RunHooks"]


def start_local_agent(node: int, controller: str, secret: str, workdir: Path,
                      interface: str = "", grace_s: float = 0.0) -> subprocess.Popen:
    """Start node ``node``'s agent as a process of this machine (log: ``agent<node>.log``).

    Without a grace period it dies with this process (parent-death signal, like the
    workers): an agent that lost its controller keeps dialling it to rejoin, which is
    no use once the controller's process is gone. With one it outlives this process
    for ``grace_s`` seconds, keeping its workers for a restarted controller, then ends
    them and itself (docs/failover.md)."""
    from resihp_core.runtime.processes import spawn_worker

    env = dict(os.environ, RESIHP_SECRET=secret)
    extra = ["--interface", interface] if interface else []
    args = ["--node", str(node), "--controller", controller, "--workdir", str(workdir), "--log-level", "INFO", *extra]
    if grace_s <= 0:
        return spawn_worker("resihp_core.runtime.agent", env, workdir / f"agent{node}.log", args)
    args += ["--controller-grace", f"{grace_s:g}", "--rejoin-timeout", f"{grace_s:g}"]
    with open(workdir / f"agent{node}.log", "ab") as log:
        return subprocess.Popen([sys.executable, "-m", "resihp_core.runtime.agent", *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT)


class AttachFailed(RuntimeError):
    """A restarted controller found nothing live to re-attach to (docs/failover.md)."""


def start_store_host(workdir: Path, host: str, secret: str, grace_s: float,
                     timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """Start the job store's own process (it outlives this one for ``grace_s``
    seconds; log ``storehost.log``); returns it and its ``host:port``."""
    import time

    addr = workdir / "store.address"
    addr.unlink(missing_ok=True)
    env = dict(os.environ, RESIHP_SECRET=secret)
    with open(workdir / "storehost.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "resihp_core.runtime.controller.storehost", "--host", host,
                                 "--grace", f"{grace_s:g}", "--address-file", str(addr)], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while not addr.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the store host did not start (see {workdir / 'storehost.log'})")
        time.sleep(0.02)
    return proc, addr.read_text().strip()


def connect_store(address: str, secret: str, timeout: float = 300.0, connect_timeout: float = 10.0) -> StoreClient:
    """This controller's connection to a store host (identity ``controller``)."""
    from resihp_core.runtime.store import StoreClient

    return StoreClient(address, secret, "controller", timeout_s=timeout, connect_timeout_s=connect_timeout)


@dataclass
class ResilientRun:
    """How a run went. ``job_events``: what the job did, typed; ``events``: the same as
    JSON objects, as ``events.json`` holds them (:func:`~resihp_core.protocols.events.event_dicts`)."""

    records: list[IterationMetrics]
    events: list[dict]
    ok: bool
    error: str = ""
    final_plan: ParallelPlan | None = None
    logs: Path | None = None
    extra: dict = field(default_factory=dict)
    job_error: JobError | None = None  # the job's own error that ended it (docs/errors.md)
    ended: ScriptEnded | None = None  # the user's script returned before the configured end
    generation: int = -1  # the last plan generation posted (a retry or restore posts one of the same plan)
    job_events: list[JobEvent] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The command's exit code for this run (:mod:`resihp_core.errors`)."""
        from resihp_core.errors import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_OK, EXIT_USAGE

        if self.job_error is not None:
            return EXIT_USAGE if self.job_error.phase == "setup" else EXIT_JOB_ERROR
        return EXIT_OK if self.ok else EXIT_FAILED


class ResilientJob:
    """The composition root of one resilient job: construction builds, in order, the
    job store (a store host of its own when the job may outlive its controller), the
    controller (listening), the node agents, the process host, the job's session with
    its workers and the control loop, each complete; :meth:`close` tears them down in
    reverse. Nothing is wired after construction: the controller publishes to this
    object's router (:meth:`_route`), the session to :meth:`_on_job_event`.

    Construction raises :class:`AttachFailed` when a restarted controller has nothing
    live to re-attach to, and whatever stopped the job's start otherwise (every part
    built so far is closed first)."""

    def __init__(self, run: ResilientConfig) -> None:
        import torch.distributed  # noqa: F401 - imported before the controller's loop runs: a
        # seconds-long import holding the GIL would starve it into declaring agents silent
        from resihp_core.detector.failslow import build_failslow_detector
        from resihp_core.detector.model import WorkloadModel
        from resihp_core.runtime.controller import Controller
        from resihp_core.runtime.loop import LoopThread
        from resihp_core.runtime.processes import AgentProcesses

        self.run_config = run
        self.hooks = run.hooks
        attach = run.resume.attach
        agents = run.agents
        if agents.mode == "external" and not agents.secret:
            raise ValueError("external agents need the job secret: pass secret=")
        self.failover = run.controller_grace_s > 0 or attach is not None
        if self.failover and not agents.secret:
            raise ValueError("a job that outlives its controller needs its secret kept: pass secret=")
        self.secret = agents.secret or _secrets.token_hex(16)
        self.workdir = Path(run.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.state_dir = Path(run.state_dir) if run.state_dir is not None else self.workdir
        self.node_of = {d: node for node, devs in run.topology.nodes().items() for d in devs}
        self.nodes = sorted({self.node_of[d] for d in run.plan.devices()})
        # The control loop sleeps until one of these wakes it (docs/design.md, "The control loop").
        self.wake = threading.Event()
        self.reports: queue.Queue[FailureReport] = Inbox()
        self.repaired: queue.Queue[Iterable[int]] = (run.repair_requests if run.repair_requests is not None
                                                     else Inbox())
        self.store: StoreClient | None = None
        self.watch: StoreClient | None = None  # the control loop's own connection to a store hosted apart
        self.store_proc: subprocess.Popen | None = None
        self.store_address = ""
        self.agent_procs: dict[int, subprocess.Popen] = {}
        self.job: LocalJob | None = None
        self.ctl: ControlLoop | None = None
        self.attached: PlanUpdate | None = None  # the generation re-attached to
        listen = agents.listen
        if attach is not None:
            try:
                self.store = connect_store(attach.store_address, self.secret, connect_timeout=5.0)
            except Exception as e:  # noqa: BLE001 - its store host is gone: nothing to attach to
                raise AttachFailed(f"the job store at {attach.store_address} is gone ({e})") from None
            listen = (attach.controller_host, attach.controller_port)
            self.nodes = sorted(set(attach.nodes) or {self.node_of[d] for d in attach.devices})
        self.loop = LoopThread("resihp-job").start()
        self.model = WorkloadModel(plan=run.plan, predictor=run.state.predictor,
                                   warmup_iterations=run.detector.warmup_iterations)
        self.controller = Controller(
            run.detector, self.secret, host=listen[0], port=listen[1], sink=self._route,
            expected_ranks=set(run.plan.devices()), node_devices=run.topology.nodes(),
            failslow=build_failslow_detector(run.detector, model=self.model, plan=run.plan) if run.supervised else False,
            plugins=run.observers, incarnation=_secrets.token_hex(8) if self.failover else "")
        self.procs = AgentProcesses(self.controller, self.loop.run, self.node_of, detector=asdict(run.detector),
                                    launch_timeout=agents.timeout_s)
        try:
            self._start(listen)
        except BaseException:
            self.close(ok=False)
            raise

    def _start(self, listen: tuple[str, int]) -> None:
        run, attach = self.run_config, self.run_config.resume.attach
        if attach is not None:
            try:
                self.loop.run(self.controller.start())
            except OSError as e:
                raise AttachFailed(f"cannot listen on the controller's address "
                                   f"{attach.controller_host}:{attach.controller_port} again: {e}") from None
            self.attached = _reattach(self.controller, self.procs, self.loop, self.store, attach, self.nodes,
                                      self.node_of, run.controller_grace_s)
            self.store_address = attach.store_address
        else:
            if self.failover:
                self.store_proc, self.store_address = start_store_host(self.workdir, listen[0] or "127.0.0.1",
                                                                       self.secret, run.controller_grace_s)
                self.store = connect_store(self.store_address, self.secret)
            self.loop.run(self.controller.start())
        self.hooks.on_listening(self.controller.address_text, self.nodes)
        if run.agents.mode == "local" and attach is None:
            for node in self.nodes:
                self.agent_procs[node] = start_local_agent(node, self.controller.address_text, self.secret,
                                                           self.workdir, grace_s=run.controller_grace_s)
        if attach is None:
            self.loop.run(self.controller.wait_for_agents(set(self.nodes), run.agents.timeout_s),
                          timeout=run.agents.timeout_s + 5)
        from resihp_core.runtime.netif import INTERFACE_ENV
        from resihp_core.runtime.session import ENV_GRACE

        env = dict(run.worker_env)
        if run.agents.interface:
            env[INTERFACE_ENV] = run.agents.interface
        if self.failover:
            env[ENV_GRACE] = f"{max(run.controller_grace_s, 1.0):g}"
        self.job = LocalJob(run.spec.to_json(), run.plan.devices(), worker_module=run.worker_module,
                            workdir=self.workdir, host=listen[0] or "127.0.0.1", processes=lambda _: self.procs,
                            secret=self.secret, env=env or None,
                            store=(self.store, self.store_address) if self.store is not None else None,
                            attach=self.attached, observers=run.observers, on_event=self._on_job_event)
        if run.config is not None:
            self.job.session.job_started(run.config, str(self.state_dir))
        state, start = run.state, run.resume.start
        handled: set[int] = set()
        if self.attached is not None:
            handled = set(attach.handled)  # members not re-attached are reported dead, then planned
            state = state.with_plan(self.job.plan).with_health(failed=frozenset(handled))
            start = self.job.committed
        if not run.supervised:
            handled = set(run.plan.devices())  # nothing is acted on: process exits are not re-planned
        if self.store is not None:  # hosted apart: a wait blocking in it needs a connection of its own
            self.watch = connect_store(self.store_address, self.secret)
        self.ctl = ControlLoop(
            self.job, run.planner, state, run.iterations, self.reports, self.repaired,
            set_generation=self._set_generation, ready=lambda devices: set(devices) <= self._workers_up(),
            fitted=self.model.fitted_predictor if run.supervised else (lambda: None),
            samples=run.plan.dp * run.plan.num_microbatches, phase_of=self.hooks.phase_of,
            on_iteration=self.hooks.observe,
            checkpoints=CheckpointPolicy(run.spec.checkpoint_dir or None, run.spec.checkpoint_every,
                                         memory_every=run.spec.memory_copy_every),
            move_before_restore=run.move_before_restore, payback=run.payback, repairs=dict(run.repairs),
            handled=handled, first=start, restore_at_start=run.resume.restore, adopt=self.attached is not None,
            wake=self.wake, watch_store=self.watch)

    # ------------------------------------------------------------ routing
    def _route(self, event: ControllerEvent) -> None:
        """The controller's sink (on its loop): each event to the part that acts on it,
        then to the run's observer."""
        if isinstance(event, FailureReport):
            if self.run_config.supervised:
                self.reports.put(event)  # the supervisor tells observers, once per (merged) failure
            elif self.job is not None:
                self.job.session.failure(event)  # nothing acts on it: observers hear each report
        elif isinstance(event, WorkerProcess):  # a worker exited or came up: the loop looks now
            self.procs.process(event)
            self.wake.set()
        elif isinstance(event, NodeLost):
            self.procs.node_lost(event.node)
            self.wake.set()
        elif isinstance(event, NodeBack) and self.run_config.supervised:
            self.repaired.put(event.devices)
        self.hooks.observe(event)

    def _on_job_event(self, event: JobEvent) -> None:
        """The session's events (on the supervisor's thread): the job's state for a
        restarted controller at every plan change (docs/failover.md), then the observer."""
        if self.failover and isinstance(event, (PlanPosted, Attached)):
            self._save_state()
        self.hooks.observe(event)

    def _save_state(self) -> None:
        job, run = self.job, self.run_config
        if job is None or job.message is None or job.plan is None or self.ctl is None:
            return
        host, port = self.controller.address
        attach = run.resume.attach
        out = tuple(sorted(set(self.ctl.core.handled) - set(job.message.devices)))
        write_state(self.state_dir, JobState(
            version=1, controller_host=host, controller_port=port, store_address=self.store_address,
            store_pid=self.store_proc.pid if self.store_proc is not None else attach.store_pid,
            generation=job.generation, committed=min(job.committed, run.iterations), iterations=run.iterations,
            plan=job.plan.to_text(), devices=tuple(job.message.devices), handled=out,
            nodes=tuple(self.nodes)), self.secret)

    def _workers_up(self) -> set[int]:
        async def up() -> set[int]:
            return self.controller.workers_up()

        return self.loop.run(up(), timeout=10)

    def _set_generation(self, g: int, plan: ParallelPlan, speeds: Mapping[int, float]) -> None:
        self.loop.call(lambda: self.controller.set_generation(g, plan=plan, speeds=speeds,
                                                              expected_ranks=set(plan.devices())))

    # ------------------------------------------------------------ running
    def run(self) -> ResilientRun:
        """Train to the configured iterations, adapting to failures."""
        assert self.job is not None and self.ctl is not None
        out = ResilientRun([], [], True, logs=self.workdir)
        try:
            self.hooks.before_run(self.job, self.agent_procs)
            out.records = self.ctl.run(timeout=self.run_config.timeout_s)
        except JobFailed as e:
            out.ok, out.error, out.job_error = False, str(e), e.error
        except Exception as e:  # noqa: BLE001 - the caller reports it with the logs
            out.ok, out.error = False, f"{type(e).__name__}: {e}"
        finally:
            out.records = out.records or self.ctl.records
            out.job_events = list(self.ctl.events)
            out.events = event_dicts(out.job_events)
            out.final_plan = self.ctl.plan
            out.extra["first"] = self.ctl.first
            out.ended = self.ctl.ended
            out.generation = self.job.generation
        return out

    def close(self, *, ok: bool) -> None:
        """Tear down in reverse: the control loop's store connection, the job (its
        workers), the agents (told the job is over: they reap their workers and exit
        0), the store host, the controller, its loop. ``ok``: the job ended well (a
        restarted controller has nothing to re-attach to)."""
        if self.watch is not None:
            self.watch.close()
        if self.job is not None:
            self.job.close()
        try:
            self.loop.run(self.controller.finish(timeout=10), timeout=15)
        except Exception:  # noqa: BLE001 - best effort; local agents are terminated below
            pass
        _reap(self.agent_procs.values())
        if self.job is None and self.store is not None:  # never got to a job: end the store host here
            with contextlib.suppress(Exception):
                JobSession(self.store).end_store_host()
        if self.store_proc is not None:
            try:
                self.store_proc.wait(10)
            except subprocess.TimeoutExpired:
                self.store_proc.kill()
                self.store_proc.wait(5)
        if self.failover and self.job is not None and ok:
            remove_state(self.state_dir)  # the job is over: nothing to re-attach to
        try:
            self.loop.run(self.controller.stop(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort shutdown
            pass
        self.loop.stop()


def _reap(procs: Iterable[subprocess.Popen]) -> None:
    procs = list(procs)
    for p in procs:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def run_resilient(run: ResilientConfig) -> ResilientRun:
    """Run the job of ``run`` to ``run.iterations`` iterations, adapting to failures
    (each setting is described on :class:`~resihp_core.runtime.controller.runconfig.ResilientConfig`).
    A job that could not start is a failed run; :class:`AttachFailed` is raised (nothing
    was started or changed: the caller restores from a checkpoint instead)."""
    try:
        job = ResilientJob(run)
    except AttachFailed:
        raise
    except Exception as e:  # noqa: BLE001 - the caller reports it with the logs
        return ResilientRun([], [], False, error=f"{type(e).__name__}: {e}", logs=Path(run.workdir))
    out = ResilientRun([], [], False, logs=job.workdir)
    try:
        out = job.run()
    finally:
        job.close(ok=out.ok)
    return out


def _reattach(controller: Controller, procs: AgentProcesses, loop: LoopThread, store: StoreClient,
              attach: JobState, nodes: list[int], node_of: dict[int, int], grace_s: float) -> PlanUpdate:
    """Wait for the job's agents to dial back and report their live workers; returns
    the generation they are in. :class:`AttachFailed` if no agent came back."""
    import time

    from resihp_core.protocol import WorkerProcess

    msg = JobSession(store).latest()
    if msg is None:
        raise AttachFailed("the job store holds no plan")
    g = msg.generation
    if msg.stop:
        raise AttachFailed(f"the job's last generation ({g}) is its stop: the job is over")
    wait_s = max(10.0, grace_s)
    try:
        loop.run(controller.wait_for_agents(set(nodes), wait_s), timeout=wait_s + 5)
    except TimeoutError:
        pass
    up = controller.connected_nodes()  # called off the loop: a set copy of a dict's keys
    if not up:
        raise AttachFailed(f"no agent of nodes {nodes} dialled back within {wait_s:.0f} s")
    members = set(msg.devices)
    deadline = time.monotonic() + 10.0
    while not members <= set(procs.alive()) and time.monotonic() < deadline:
        time.sleep(0.05)
    for d in sorted(members - set(procs.alive())):  # not re-attached: the supervisor plans without it
        procs.process(WorkerProcess(node=node_of.get(d, 0), device=d, error="not re-attached after a controller restart"))
    if not set(procs.alive()) & members:
        raise AttachFailed("no worker of the job is alive")
    return msg
