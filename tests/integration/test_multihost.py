"""Jobs across separate network hosts: network namespaces with their own addresses.

Every "host" is a network namespace on a bridge (:mod:`.netns`), its host name
resolving to 127.0.0.1 and no ``GLOO_SOCKET_IFNAME`` set: the setup in which gloo
used to advertise loopback to remote peers and no job could train. The controller
runs here, in the root namespace, on the bridge's address; one ``resihp agent``
process per host dials it. Each job checks the parameters against the fault-free run
(float64, <= 1e-9), that every agent ends with status 0 and a plain message, and that
no process outlives the job (nothing left in any namespace).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resihp_core.plan import Topology
from resihp_core.protocols.events import observer
from resihp_core.runtime.controller.resilient import AgentSetup, ResilientConfig, RunHooks, run_resilient

from .backend_harness import Finished, check_against_reference, job_spec, read_dumps, tmpdir, uniform
from .netns import Hosts, unavailable
from .test_chaos import DETECTOR, _planner_state

WHY = unavailable()
# Fail-stop scenarios: a fail-slow false alarm on a loaded machine would re-plan the job
# in the middle of the checks, so the slow threshold is out of reach; and 30 missed
# beats (an agent silent 6 s is lost) so that agents starved while six workers import
# torch at once on two loaded cores are not taken for partitioned hosts.
FAILSTOP = dataclasses.replace(DETECTOR, slow_threshold=50.0, heartbeat_miss_limit=30, agent_silence_s=6.0)
PACE = 10.0
pytestmark = [pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(bool(WHY), reason=WHY)]


def _agent_argv(node: int, controller: str, workdir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "resihp_core.runtime.agent", "--node", str(node), "--controller", controller,
            "--workdir", str(workdir), "--log-level", "INFO", "--rejoin-timeout", "60", *extra]


class Cluster:
    """The agents of one job: ``where[node]`` is the host index (None: this host)."""

    def __init__(self, hosts: Hosts, where: dict[int, int | None], workdir: Path) -> None:
        self.hosts, self.where, self.workdir = hosts, where, workdir
        self.secret = secrets.token_hex(16)
        self.env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")}
        self.env.update(RESIHP_SECRET=self.secret, PYTHONUNBUFFERED="1")
        self.agents: dict[int, list[subprocess.Popen]] = {}
        self.address = ""
        self.own: list[subprocess.Popen] = []

    def log(self, node: int, n: int = 0) -> Path:
        return self.workdir / f"node{node}" / f"agent{n}.log"

    def start(self, node: int, controller: str | None = None) -> subprocess.Popen:
        n = len(self.agents.setdefault(node, []))
        work = self.workdir / f"node{node}"
        work.mkdir(parents=True, exist_ok=True)
        argv = _agent_argv(node, controller or self.address, work)
        with open(self.log(node, n), "wb") as out:
            h = self.where[node]
            if h is None:
                p = subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
                self.own.append(p)
            else:
                p = self.hosts.popen(h, argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)
        self.agents[node].append(p)
        return p

    def on_listening(self, address: str, nodes: list[int]) -> None:
        self.address = address
        for node in nodes:
            self.start(node)

    def close(self) -> None:
        for p in self.own:
            if p.poll() is None:
                p.kill()
            p.wait(10)

    def job_processes(self) -> list[int]:
        """Live processes started for this job (its workers carry its job file's path)."""
        out = []
        marker = f"RESIHP_JOB={self.workdir}".encode()
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if marker in f.read():
                        out.append(int(pid))
            except OSError:
                continue
        return out

    def assert_clean_end(self, expect_rc: dict[tuple[int, int], int] | None = None) -> None:
        """Every agent ended (status 0 with the plain message unless ``expect_rc`` says
        otherwise) and nothing of the job runs anymore, in any host."""
        for node, procs in self.agents.items():
            for n, p in enumerate(procs):
                rc = p.wait(30)
                want = (expect_rc or {}).get((node, n), 0)
                text = self.log(node, n).read_text(errors="replace")
                assert rc == want, f"agent {n} of node {node} exited {rc}, not {want}:\n{text[-3000:]}"
                if want == 0:
                    assert "the job finished; exiting" in text and "ERROR" not in text, text[-3000:]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (self.job_processes() or any(
                self.hosts.pids(h.index) for h in self.hosts.hosts)):
            time.sleep(0.1)
        assert not self.job_processes(), "processes of the job outlived it"
        for h in self.hosts.hosts:
            assert not self.hosts.pids(h.index), f"processes left in host {h.index}"


def _when(job, iteration: int, action, deadline_s: float = 120.0) -> None:
    """Run ``action`` on a thread once ``iteration`` iterations are committed."""
    def watch() -> None:
        deadline = time.monotonic() + deadline_s
        while job.committed < iteration and time.monotonic() < deadline:
            time.sleep(0.01)
        action()

    threading.Thread(target=watch, daemon=True).start()


def _events(run) -> str:
    return "\n".join(f"{e['iteration']} {e['kind']} {e['text'][:200]}" for e in run.events)


def _check_parameters(spec, run, iterations: int) -> None:
    dumps = read_dumps(spec)
    assert set(dumps) == set(run.final_plan.devices())
    check_against_reference(Finished(spec, dumps, [r.loss for r in run.records], []), iterations)


def test_hostname_resolves_to_loopback_in_the_hosts():
    """The precondition of the failure fixed here: in every host the host name
    resolves to 127.0.0.1 (so gloo's default would advertise loopback)."""
    with Hosts(1) as hosts:
        out = subprocess.run(hosts.argv(0, [sys.executable, "-c",
                                            "import socket; print(socket.gethostbyname(socket.gethostname()))"]),
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "127.0.0.1", out


def test_two_hosts_and_the_controllers_own_through_a_kill_a_partition_and_its_heal():
    """Three nodes: this host (node 0) and two namespace hosts (nodes 1, 2), two devices
    each, TP1 x PP2 x DP3 (replica r on node r). A worker of node 2 is killed; later
    node 1's link goes down: the controller declares it lost, the job goes on without
    it; the link comes back: node 1's agent has fenced its workers, rejoins, and the
    Scheduler plans its devices back in. Parameters equal the fault-free run."""
    from resihp_core.faults import fail_at, worker_faults

    plan = uniform(1, 2, 3, 3)
    topology = Topology.uniform(3, 2)
    iterations = 16
    killed = 5  # node 2, stage 1 of replica 2
    work = Path(tmpdir())
    # Every device computes PACE times slower from the start (a sleep, no CPU): the job
    # must still run when the healed node's relaunched workers have started up (seconds
    # of imports on a loaded machine) to plan them in.
    pace = [fail_at(d, 0, "slow", factor=PACE) for d in plan.devices()]
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(), checkpoint_dir=tmpdir(),
                    checkpoint_every=1, faults=worker_faults([*pace, fail_at(killed, 2, "kill")]))
    state, planner = _planner_state(plan, topology)
    lost = threading.Event()
    times: dict[str, float] = {}

    def on_event(ev):
        if ev.kind == "failure" and {2, 3} <= set(ev.devices):
            lost.set()

    with Hosts(2) as hosts:
        cluster = Cluster(hosts, {0: None, 1: 0, 2: 1}, work)

        def partition() -> None:
            times["cut"] = time.monotonic()
            hosts.cut(0)
            lost.wait(60)
            times["lost"] = time.monotonic()
            time.sleep(0.5)
            hosts.heal(0)
            times["healed"] = time.monotonic()

        try:
            run = run_resilient(ResilientConfig(
                spec=spec, plan=plan, topology=topology, state=state, planner=planner, detector=FAILSTOP,
                iterations=iterations, workdir=work / "job", timeout_s=180,
                agents=AgentSetup(mode="external", listen=(hosts.address, 0), secret=cluster.secret, timeout_s=60),
                hooks=RunHooks(on_listening=cluster.on_listening, observe=observer(job=on_event),
                               before_run=lambda job, _: _when(job, 5, partition))))
            assert run.ok, f"{run.error}; logs in {run.logs} and {work}"
            cluster.assert_clean_end()
        finally:
            cluster.close()
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert any(e["devices"] == [killed] for e in failures), failures
    cut = [e for e in failures if set(e["devices"]) == {2, 3}]
    assert cut and "node 1 lost" in cut[0]["text"], failures
    assert times["lost"] - times["cut"] < 20, times
    rejoins = [e for e in run.events if e.get("kind_of_plan") == "rejoin"]
    assert rejoins and set(rejoins[0]["devices"]) >= {2, 3}, _events(run)
    print(f"partition at iteration 5, rejoined at iteration {rejoins[0]['iteration']} of {iterations}")
    assert {2, 3} <= set(run.final_plan.devices()), (run.final_plan.to_text(), _events(run))
    healed = cluster.log(1).read_text()
    assert "event=worker_fenced" in healed and "event=rejoined" in healed, healed[-3000:]
    for node in (1, 2):  # workers bound their collectives to the host's own address
        assert f"interface=eth0/{hosts[node - 1].address}" in cluster.log(node).read_text()
    _check_parameters(spec, run, iterations)


def test_an_agent_killed_then_its_host_repaired_is_planned_back_in():
    """Two namespace hosts, TP1 x PP2 x DP2 (replica r on node r). Node 1's agent is
    killed (its workers die with it); the job goes on on node 0; a new agent started on
    the repaired host joins, and node 1's devices are planned back in."""
    from resihp_core.faults import fail_at, worker_faults

    plan = uniform(1, 2, 2, 3)
    topology = Topology.uniform(2, 2)
    iterations = 12
    work = Path(tmpdir())
    pace = [fail_at(d, 0, "slow", factor=PACE) for d in plan.devices()]  # see the test above
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir(), checkpoint_dir=tmpdir(),
                    checkpoint_every=1, faults=worker_faults(pace))
    state, planner = _planner_state(plan, topology)
    lost = threading.Event()

    def on_event(ev):
        if ev.kind == "failure" and {2, 3} <= set(ev.devices):
            lost.set()

    with Hosts(2) as hosts:
        cluster = Cluster(hosts, {0: 0, 1: 1}, work)

        def kill_then_repair() -> None:
            cluster.agents[1][0].send_signal(signal.SIGKILL)
            if lost.wait(60):
                cluster.start(1)  # the repaired host's new agent

        try:
            run = run_resilient(ResilientConfig(
                spec=spec, plan=plan, topology=topology, state=state, planner=planner, detector=FAILSTOP,
                iterations=iterations, workdir=work / "job", timeout_s=180,
                agents=AgentSetup(mode="external", listen=(hosts.address, 0), secret=cluster.secret, timeout_s=60),
                hooks=RunHooks(on_listening=cluster.on_listening, observe=observer(job=on_event),
                               before_run=lambda job, _: _when(job, 2, kill_then_repair))))
            assert run.ok, f"{run.error}; logs in {run.logs} and {work}"
            cluster.assert_clean_end(expect_rc={(1, 0): -signal.SIGKILL})
        finally:
            cluster.close()
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert failures and set(failures[0]["devices"]) == {2, 3}, failures
    rejoins = [e for e in run.events if e.get("kind_of_plan") == "rejoin"]
    assert rejoins and set(rejoins[0]["devices"]) == {2, 3}, _events(run)
    assert {2, 3} <= set(run.final_plan.devices()), (run.final_plan.to_text(), _events(run))
    print(f"agent killed at iteration 2, host rejoined at iteration {rejoins[0]['iteration']} of {iterations}")
    _check_parameters(spec, run, iterations)


def test_a_peer_given_a_loopback_address_is_a_clear_error():
    """The controller listens on every address; node 0's agent dials it on 127.0.0.1,
    node 1's from another host: node 0's workers would be reachable only on loopback.
    The job stops before training with an error that names the node and the fix."""
    plan = uniform(1, 2, 1, 2)
    topology = Topology.uniform(2, 1)
    work = Path(tmpdir())
    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir())
    state, planner = _planner_state(plan, topology)
    with Hosts(1) as hosts:
        cluster = Cluster(hosts, {0: None, 1: 0}, work)

        def on_listening(address: str, nodes: list[int]) -> None:
            port = address.rsplit(":", 1)[1]
            cluster.address = address
            cluster.start(0, f"127.0.0.1:{port}")
            cluster.start(1, f"{hosts.address}:{port}")

        try:
            run = run_resilient(ResilientConfig(
                spec=spec, plan=plan, topology=topology, state=state, planner=planner, detector=FAILSTOP,
                iterations=4, workdir=work / "job", timeout_s=60,
                agents=AgentSetup(mode="external", listen=("0.0.0.0", 0), secret=cluster.secret, timeout_s=60),
                hooks=RunHooks(on_listening=on_listening)))
            cluster.assert_clean_end()
        finally:
            cluster.close()
    assert not run.ok
    assert "node(s) [0] would give their peers the loopback address 127.0.0.1" in run.error, run.error
    assert "runtime.interface" in run.error
