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

import json
import os
import queue
import secrets as _secrets
import subprocess
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal

from resihp_core.config import DetectorConfig
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.runtime.launcher import LocalJob
from resihp_core.runtime.supervisor import IterationRecord, Supervisor

__all__ = ["ResilientRun", "run_resilient", "start_local_agent"]


def start_local_agent(node: int, controller: str, secret: str, workdir: Path,
                      interface: str = "") -> subprocess.Popen:
    """Start node ``node``'s agent as a process of this machine (log: ``agent<node>.log``).

    It dies with this process (parent-death signal, like the workers): an agent that
    lost its controller keeps dialling it to rejoin, which is no use once the
    controller's process is gone."""
    from resihp_core.runtime.processes import spawn_worker

    env = dict(os.environ, RESIHP_SECRET=secret)
    extra = ["--interface", interface] if interface else []
    return spawn_worker("resihp_core.runtime.agent", env, workdir / f"agent{node}.log",
                        ["--node", str(node), "--controller", controller, "--workdir", str(workdir),
                         "--log-level", "INFO", *extra])


@dataclass
class ResilientRun:
    records: list[IterationRecord]
    events: list[dict]
    ok: bool
    error: str = ""
    final_plan: ParallelPlan | None = None
    logs: Path | None = None
    extra: dict = field(default_factory=dict)


def run_resilient(job_json: str, plan: ParallelPlan, topology: Topology, state: Any, planner: Any,
                  detector: DetectorConfig, iterations: int, workdir: Path, *,
                  worker_module: str = "resihp_core.runtime.worker",
                  supervised: bool = True, timeout: float = 900.0,
                  agents: Literal["local", "external"] = "local",
                  listen: tuple[str, int] = ("127.0.0.1", 0), secret: str = "",
                  agent_timeout: float = 60.0, interface: str = "",
                  repairs: dict[int, tuple[int, ...]] | None = None,
                  phase_of: Callable[[int, int], str] = lambda i, g: "running",
                  on_event: Callable[[dict], None] = lambda ev: None,
                  on_iteration: Callable[[IterationRecord], None] = lambda rec: None,
                  on_report: Callable[[Any], None] = lambda r: None,
                  on_detection: Callable[[Any], None] | None = None,
                  on_listening: Callable[[str, list[int]], None] = lambda address, nodes: None,
                  before_run: Callable[[LocalJob, dict], None] = lambda job, agents: None,
                  observers: Any = None, start: int = 0, restore: int | None = None,
                  repair_requests: queue.Queue | None = None) -> ResilientRun:
    """Run the job to ``iterations`` iterations, adapting to failures.

    :param agents: ``"local"`` starts one agent process per node here; ``"external"``
        waits up to ``agent_timeout`` seconds for agents started elsewhere.
    :param listen: the controller's address (``(host, 0)``: any free port).
    :param interface: the interface name or address every node's workers bind their
        collectives to (``runtime.interface``); default: each agent's choice (the
        interface it reaches the controller on).
    :param secret: the job secret agents authenticate with (default: a fresh one;
        external agents need it given).
    :param repairs: iteration -> devices whose workers are started again (repaired)
        once that many iterations are committed; the Scheduler brings them back.
    :param on_listening: called with the controller's address and the nodes whose
        agents it waits for, once it listens.
    :param before_run: called with the job and ``{node: agent process}`` (local agents)
        before the first plan is posted; chaos tests use it to kill an agent.
    :param observers: the plugin facade whose observer hooks the supervisor fires.
    :param start: resume a job: the first iteration to train (``restore`` + 1).
    :param restore: resume a job: the complete checkpoint the first generation loads.
    :param repair_requests: a queue another thread puts lists of repaired devices on;
        the supervisor starts their workers again and plans them back in. It is the
        supervisor's one queue of repaired devices: healed nodes offer theirs on it too.
    """
    import torch.distributed  # noqa: F401 - imported before the controller's loop runs: a
    # seconds-long import holding the GIL would starve it into declaring agents silent
    from resihp_core.detector.failslow import build_failslow_detector
    from resihp_core.detector.model import WorkloadModel
    from resihp_core.runtime.controller import Controller
    from resihp_core.runtime.loop import LoopThread
    from resihp_core.runtime.netif import INTERFACE_ENV
    from resihp_core.runtime.processes import AgentProcesses

    if agents == "external" and not secret:
        raise ValueError("external agents need the job secret: pass secret=")
    secret = secret or _secrets.token_hex(16)
    spec = json.loads(job_json)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    reports: queue.Queue = queue.Queue()
    repaired: queue.Queue = repair_requests if repair_requests is not None else queue.Queue()

    def report(r: Any) -> None:
        reports.put(r)
        on_report(r)

    node_of = {d: node for node, devs in topology.nodes().items() for d in devs}
    nodes = sorted({node_of[d] for d in plan.devices()})
    loop = LoopThread("resihp-job").start()
    model = WorkloadModel(plan=plan, predictor=state.predictor, warmup_iterations=detector.warmup_iterations)
    procs = AgentProcesses(None, loop.run, node_of, detector=asdict(detector), launch_timeout=agent_timeout)
    controller = Controller(detector, secret, host=listen[0], port=listen[1],
                            on_report=report if supervised else (lambda r: None),
                            expected_ranks=set(plan.devices()), node_devices=topology.nodes(),
                            failslow=build_failslow_detector(detector, model=model, plan=plan) if supervised else False,
                            on_detection=on_detection, on_process=procs.process, on_node_lost=procs.node_lost,
                            on_rejoin=(lambda node, devices: repaired.put(devices)) if supervised else None,
                            # the supervisor notifies observers of each failure once
                            notify_failures=not supervised, plugins=observers)
    procs.controller = controller
    agent_procs: dict[int, subprocess.Popen] = {}
    job: LocalJob | None = None
    out = ResilientRun([], [], True, logs=workdir)
    try:
        loop.run(controller.start())
        on_listening(controller.address_text, nodes)
        if agents == "local":
            for node in nodes:
                agent_procs[node] = start_local_agent(node, controller.address_text, secret, workdir)
        loop.run(controller.wait_for_agents(set(nodes), agent_timeout), timeout=agent_timeout + 5)

        async def _up() -> set[int]:
            return controller.workers_up()

        def ready_devices() -> set[int]:
            return loop.run(_up(), timeout=10)

        def set_generation(g: int, new_plan: ParallelPlan, speeds: dict[int, float]) -> None:
            loop.call(lambda: controller.set_generation(g, plan=new_plan, speeds=speeds,
                                                        expected_ranks=set(new_plan.devices())))

        job = LocalJob(job_json, plan.devices(), worker_module=worker_module, workdir=workdir,
                       host=listen[0] or "127.0.0.1", processes=lambda _: procs, secret=secret,
                       env={INTERFACE_ENV: interface} if interface else None)
        sup = Supervisor(job, planner, state, iterations, reports, set_generation=set_generation,
                         samples=plan.dp * plan.num_microbatches, phase_of=phase_of,
                         on_event=on_event, on_iteration=on_iteration, repairs=dict(repairs or {}),
                         repaired=repaired, ready=lambda devices: set(devices) <= ready_devices(),
                         observers=observers, fitted=model.fitted_predictor if supervised else (lambda: None),
                         checkpoint_dir=spec.get("checkpoint_dir") or None,
                         checkpoint_every=int(spec.get("checkpoint_every") or 0), first=start,
                         restore_at_start=restore)
        if not supervised:
            sup.reports = queue.Queue()  # nothing is acted on: the controller reports nowhere
            sup.handled_devices = set(plan.devices())  # and process exits are not re-planned
        try:
            before_run(job, agent_procs)
            out.records = sup.run(timeout=timeout)
        finally:
            out.records = out.records or sup.records
            out.events = sup.events
            out.final_plan = sup.state.plan
    except Exception as e:  # noqa: BLE001 - the caller reports it with the logs
        out.ok, out.error = False, f"{type(e).__name__}: {e}"
    finally:
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
        try:
            loop.run(controller.stop(), timeout=5)
        except Exception:  # noqa: BLE001 - best effort shutdown
            pass
        loop.stop()
    return out
