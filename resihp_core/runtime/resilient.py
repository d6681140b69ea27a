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
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from resihp_core.plan import ParallelPlan
from resihp_core.runtime.failover import JobState, remove_state, write_state
from resihp_core.runtime.session import JobSession
from resihp_core.runtime.launcher import LocalJob
from resihp_core.protocol import FailureReport, JobError, ScriptEnded
from resihp_core.protocols.metrics import IterationMetrics
from resihp_core.runtime.control import CheckpointPolicy, ControlLoop, Inbox, JobFailed
from resihp_core.runtime.runconfig import AgentSetup, ResilientConfig, Resume, RunHooks

if TYPE_CHECKING:
    from resihp_core.protocol import PlanUpdate, WorkerProcess
    from resihp_core.runtime.controller import Controller
    from resihp_core.runtime.loop import LoopThread
    from resihp_core.runtime.processes import AgentProcesses
    from resihp_core.runtime.store import StoreClient

__all__ = ["AttachFailed", "ResilientRun", "run_resilient", "start_local_agent", "start_store_host", "ResilientConfig",
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
        proc = subprocess.Popen([sys.executable, "-m", "resihp_core.runtime.storehost", "--host", host,
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

    @property
    def exit_code(self) -> int:
        """The command's exit code for this run (:mod:`resihp_core.errors`)."""
        from resihp_core.errors import EXIT_FAILED, EXIT_JOB_ERROR, EXIT_OK, EXIT_USAGE

        if self.job_error is not None:
            return EXIT_USAGE if self.job_error.phase == "setup" else EXIT_JOB_ERROR
        return EXIT_OK if self.ok else EXIT_FAILED


def run_resilient(run: ResilientConfig) -> ResilientRun:
    """Run the job of ``run`` to ``run.iterations`` iterations, adapting to failures
    (each setting is described on :class:`~resihp_core.runtime.runconfig.ResilientConfig`)."""
    import torch.distributed  # noqa: F401 - imported before the controller's loop runs: a
    # seconds-long import holding the GIL would starve it into declaring agents silent
    from resihp_core.detector.failslow import build_failslow_detector
    from resihp_core.detector.model import WorkloadModel
    from resihp_core.runtime.controller import Controller
    from resihp_core.runtime.loop import LoopThread
    from resihp_core.runtime.netif import INTERFACE_ENV
    from resihp_core.runtime.processes import AgentProcesses

    plan, topology, state, planner, detector = run.plan, run.topology, run.state, run.planner, run.detector
    iterations, supervised, hooks = run.iterations, run.supervised, run.hooks
    agents, listen, secret = run.agents.mode, run.agents.listen, run.agents.secret
    agent_timeout, controller_grace_s = run.agents.timeout_s, run.controller_grace_s
    start, restore, attach = run.resume.start, run.resume.restore, run.resume.attach
    job_json = run.spec.to_json()
    if agents == "external" and not secret:
        raise ValueError("external agents need the job secret: pass secret=")
    if (controller_grace_s > 0 or attach is not None) and not secret:
        raise ValueError("a job that outlives its controller needs its secret kept: pass secret=")
    secret = secret or _secrets.token_hex(16)
    failover = controller_grace_s > 0 or attach is not None
    workdir = Path(run.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    state_dir = Path(run.state_dir) if run.state_dir is not None else workdir
    # The control loop sleeps until one of these wakes it (docs/design.md, "The control loop").
    wake = threading.Event()
    reports: queue.Queue[FailureReport] = Inbox()
    repaired: queue.Queue[Iterable[int]] = run.repair_requests if run.repair_requests is not None else Inbox()
    job: LocalJob | None = None

    def report(r: FailureReport) -> None:
        if supervised:
            reports.put(r)  # the supervisor tells observers, once per (merged) failure
        elif job is not None:
            job.session.failure(r)  # nothing acts on it: observers hear each report
        hooks.on_report(r)

    node_of = {d: node for node, devs in topology.nodes().items() for d in devs}
    nodes = sorted({node_of[d] for d in plan.devices()})
    store: StoreClient | None = None
    watch: StoreClient | None = None  # the control loop's own connection to a store hosted apart
    if attach is not None:
        try:
            store = connect_store(attach.store_address, secret, connect_timeout=5.0)
        except Exception as e:  # noqa: BLE001 - its store host is gone: nothing to attach to
            raise AttachFailed(f"the job store at {attach.store_address} is gone ({e})") from None
        listen = (attach.controller_host, attach.controller_port)
        nodes = sorted(set(attach.nodes) or {node_of[d] for d in attach.devices})
        agents = "external"  # they are running already
    loop = LoopThread("resihp-job").start()
    model = WorkloadModel(plan=plan, predictor=state.predictor, warmup_iterations=detector.warmup_iterations)
    procs = AgentProcesses(None, loop.run, node_of, detector=asdict(detector), launch_timeout=agent_timeout)

    def on_process(msg: WorkerProcess) -> None:  # a worker exited or came up: the loop looks now
        procs.process(msg)
        wake.set()

    def on_node_lost(node: int) -> None:
        procs.node_lost(node)
        wake.set()

    controller = Controller(detector, secret, host=listen[0], port=listen[1],
                            on_report=report,
                            expected_ranks=set(plan.devices()), node_devices=topology.nodes(),
                            failslow=build_failslow_detector(detector, model=model, plan=plan) if supervised else False,
                            on_detection=hooks.on_detection, on_process=on_process, on_node_lost=on_node_lost,
                            on_rejoin=(lambda node, devices: repaired.put(devices)) if supervised else None,
                            # the job's session is the one place observers are notified
                            notify_failures=False, plugins=run.observers,
                            incarnation=_secrets.token_hex(8) if failover else "")
    procs.controller = controller
    agent_procs: dict[int, subprocess.Popen] = {}
    out = ResilientRun([], [], True, logs=workdir)
    store_proc: subprocess.Popen | None = None
    store_address = ""
    attached: PlanUpdate | None = None  # the generation re-attached to
    try:
        if attach is not None:
            try:
                loop.run(controller.start())
            except OSError as e:
                raise AttachFailed(f"cannot listen on the controller's address "
                                   f"{attach.controller_host}:{attach.controller_port} again: {e}") from None
            attached = _reattach(controller, procs, loop, store, attach, nodes, node_of, controller_grace_s)
            store_address = attach.store_address
        else:
            if failover:
                store_proc, store_address = start_store_host(workdir, listen[0] or "127.0.0.1", secret,
                                                             controller_grace_s)
                store = connect_store(store_address, secret)
            loop.run(controller.start())
        hooks.on_listening(controller.address_text, nodes)
        if agents == "local":
            for node in nodes:
                agent_procs[node] = start_local_agent(node, controller.address_text, secret, workdir,
                                                      grace_s=controller_grace_s)
        if attach is None:
            loop.run(controller.wait_for_agents(set(nodes), agent_timeout), timeout=agent_timeout + 5)

        async def _up() -> set[int]:
            return controller.workers_up()

        def ready_devices() -> set[int]:
            return loop.run(_up(), timeout=10)

        def set_generation(g: int, new_plan: ParallelPlan, speeds: Mapping[int, float]) -> None:
            loop.call(lambda: controller.set_generation(g, plan=new_plan, speeds=speeds,
                                                        expected_ranks=set(new_plan.devices())))

        from resihp_core.runtime.session import ENV_GRACE

        env = dict(run.worker_env)
        if run.agents.interface:
            env[INTERFACE_ENV] = run.agents.interface
        if failover:
            env[ENV_GRACE] = f"{max(controller_grace_s, 1.0):g}"
        job = LocalJob(job_json, plan.devices(), worker_module=run.worker_module, workdir=workdir,
                       host=listen[0] or "127.0.0.1", processes=lambda _: procs, secret=secret,
                       env=env or None, store=(store, store_address) if store is not None else None,
                       attach=attached, observers=run.observers, on_event=hooks.on_event)
        if run.config is not None:
            job.session.job_started(run.config, str(state_dir))
        handled: set[int] = set()
        if attached is not None:
            handled = set(attach.handled)  # members not re-attached are reported dead, then planned
            state = state.with_plan(job.plan).with_health(failed=frozenset(handled))
            start = job.committed
        if not supervised:
            handled = set(plan.devices())  # nothing is acted on: process exits are not re-planned
        if failover:
            job.session.on_event = _saving_state(hooks.on_event, job, lambda: ctl.core.handled, state_dir, secret,
                                                 controller, store_address,
                                                 store_proc.pid if store_proc is not None else attach.store_pid,
                                                 iterations, nodes)
        if store is not None:  # hosted apart: a wait blocking in it needs a connection of its own
            watch = connect_store(store_address, secret)
        ctl = ControlLoop(job, planner, state, iterations, reports, repaired, set_generation=set_generation,
                          ready=lambda devices: set(devices) <= ready_devices(),
                          fitted=model.fitted_predictor if supervised else (lambda: None),
                          samples=plan.dp * plan.num_microbatches, phase_of=hooks.phase_of, on_iteration=hooks.on_iteration,
                          checkpoints=CheckpointPolicy(run.spec.checkpoint_dir or None, run.spec.checkpoint_every),
                          move_before_restore=run.move_before_restore, payback=run.payback,
                          repairs=dict(run.repairs), handled=handled, first=start, restore_at_start=restore,
                          adopt=attached is not None, wake=wake, watch_store=watch)
        try:
            hooks.before_run(job, agent_procs)
            out.records = ctl.run(timeout=run.timeout_s)
        finally:
            out.records = out.records or ctl.records
            out.events = ctl.events
            out.final_plan = ctl.plan
            out.extra["first"] = ctl.first
            out.ended = ctl.ended
            out.generation = job.generation
    except AttachFailed:
        raise  # nothing was started or changed: the caller restores from a checkpoint instead
    except JobFailed as e:
        out.ok, out.error, out.job_error = False, str(e), e.error
    except Exception as e:  # noqa: BLE001 - the caller reports it with the logs
        out.ok, out.error = False, f"{type(e).__name__}: {e}"
    finally:
        if watch is not None:
            watch.close()
        if job is not None:
            job.close()
        try:  # every agent is told the job is over: it reaps its workers and exits 0
            loop.run(controller.finish(timeout=10), timeout=15)
        except Exception:  # noqa: BLE001 - best effort; local agents are terminated below
            pass
        for p in agent_procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.terminate()
        for p in agent_procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if job is None and store is not None:  # never got to a job: end the store host here
            with contextlib.suppress(Exception):
                JobSession(store).end_store_host()
        if store_proc is not None:
            try:
                store_proc.wait(10)
            except subprocess.TimeoutExpired:
                store_proc.kill()
                store_proc.wait(5)
        if failover and job is not None and out.ok:
            remove_state(state_dir)  # the job is over: nothing to re-attach to
        try:
            loop.run(controller.stop(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort shutdown
            pass
        loop.stop()
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


def _saving_state(on_event: Callable[[dict], None], job: LocalJob, handled: Callable[[], set[int]], state_dir: Path,
                  secret: str, controller: Controller, store_address: str, store_pid: int, iterations: int,
                  nodes: list[int]) -> Callable[[dict], None]:
    """``on_event`` that also writes the job's state at every plan change (docs/failover.md)."""
    host, port = controller.address

    def save(ev: dict) -> None:
        if ev.get("kind") in ("plan", "attach") and job.message is not None and job.plan is not None:
            out = tuple(sorted(set(handled()) - set(job.message.devices)))
            write_state(state_dir, JobState(
                version=1, controller_host=host, controller_port=port, store_address=store_address,
                store_pid=store_pid, generation=job.generation, committed=min(job.committed, iterations),
                iterations=iterations, plan=job.plan.to_text(), devices=tuple(job.message.devices),
                handled=out, nodes=tuple(nodes)), secret)
        on_event(ev)

    return save
