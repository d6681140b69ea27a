"""One resilient job on this machine: controller, node agents, workers and supervisor
wired together (what ``resihp demo``, the end-to-end benchmark and the chaos tests run).

Agents emulate nodes of the topology; each worker reports to its node's agent, agents
to the controller, the controller's failure reports go to the supervisor, which plans
with the Scheduler and deploys. With ``supervised=False`` the same job runs with no
Detector and no adaptation (the "no mitigation" baseline).
"""

from __future__ import annotations

import queue
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from resihp_core.config import DetectorConfig
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.runtime.launcher import LocalJob
from resihp_core.runtime.supervisor import IterationRecord, Supervisor

__all__ = ["ResilientRun", "run_resilient"]


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
                  worker_module: str = "resihp_adapters.megatron_ref.worker",
                  supervised: bool = True, timeout: float = 900.0,
                  phase_of: Callable[[int, int], str] = lambda i, g: "running",
                  on_event: Callable[[dict], None] = lambda ev: None,
                  on_iteration: Callable[[IterationRecord], None] = lambda rec: None,
                  on_report: Callable[[Any], None] = lambda r: None,
                  on_detection: Callable[[Any], None] | None = None,
                  before_run: Callable[[LocalJob, dict], None] = lambda job, agents: None) -> ResilientRun:
    from resihp_core.detector.failslow import build_failslow_detector
    from resihp_core.detector.model import WorkloadModel
    from resihp_core.runtime.agent import NodeAgent
    from resihp_core.runtime.controller import Controller
    from resihp_core.runtime.loop import LoopThread

    secret = secrets.token_hex(16)
    reports: queue.Queue = queue.Queue()

    def report(r: Any) -> None:
        reports.put(r)
        on_report(r)

    loop = LoopThread("resihp-job").start()
    model = WorkloadModel(plan=plan, predictor=state.predictor, warmup_iterations=detector.warmup_iterations)
    controller = Controller(detector, secret, on_report=report if supervised else (lambda r: None),
                            expected_ranks=set(plan.devices()),
                            failslow=build_failslow_detector(detector, model=model, plan=plan) if supervised else False,
                            on_detection=on_detection)
    loop.run(controller.start())
    agents: dict[int, Any] = {}
    node_of: dict[int, int] = {}
    for node, devs in topology.nodes().items():
        agent = NodeAgent(node, controller.address, secret, detector)
        loop.run(agent.start())
        agents[node] = agent
        node_of.update({d: node for d in devs})

    def env_for(device: int) -> dict[str, str]:
        return {"RESIHP_AGENT_ADDR": agents[node_of[device]].worker_address, "RESIHP_SECRET": secret,
                "RESIHP_RANK": str(device), "RESIHP_HEARTBEAT_INTERVAL": str(detector.heartbeat_interval_s)}

    def on_spawn(device: int, pid: int) -> None:
        loop.call(agents[node_of[device]].watch_pid, device, pid)

    def set_generation(g: int, new_plan: ParallelPlan) -> None:
        loop.call(lambda: controller.set_generation(g, plan=new_plan, expected_ranks=set(new_plan.devices())))

    job = LocalJob(job_json, plan.devices(), worker_module=worker_module, workdir=workdir,
                   env_for=env_for, on_spawn=on_spawn)
    sup = Supervisor(job, planner, state, iterations, reports, set_generation=set_generation,
                     samples=plan.dp * plan.num_microbatches, phase_of=phase_of,
                     on_event=on_event, on_iteration=on_iteration)
    if not supervised:
        sup.reports = queue.Queue()  # nothing is acted on: the controller reports nowhere
        sup.handled_devices = set(plan.devices())  # and process exits are not re-planned
    out = ResilientRun([], [], True, logs=Path(workdir))
    try:
        before_run(job, agents)
        out.records = sup.run(timeout=timeout)
    except Exception as e:  # noqa: BLE001 - the caller reports it with the logs
        out.ok, out.error = False, f"{type(e).__name__}: {e}"
        out.records = sup.records
    finally:
        out.events = sup.events
        out.final_plan = sup.state.plan
        job.close()
        for agent in agents.values():
            try:
                loop.run(agent.stop(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort shutdown
                pass
        try:
            loop.run(controller.stop(), timeout=5)
        except Exception:  # noqa: BLE001
            pass
        loop.stop()
    return out
