"""Across hosts: which interface workers bind to, the loopback check, the agent's
lifecycle (job end, fence and rejoin after losing the controller), and report phases
that start at detected failures."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from resihp_core.config import DetectorConfig
from resihp_core.protocol import LaunchWorkers
from resihp_core.runtime.agent import NodeAgent
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.loop import LoopThread
from resihp_core.runtime.netif import (
    Interface,
    check_collective_addresses,
    collective_env,
    interface_addresses,
    select_interface,
)
from resihp_core.runtime.processes import AgentProcesses
from resihp_core.protocol import FailureReport, WorkerProcess
from resihp_core.protocols.events import EventLog, Failure, NodeBack, NodeLost, PlanPosted, fan_out, only

SECRET = "test-secret"
CFG = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=3, hang_min_timeout_s=5.0)
TABLE = {"lo": ["127.0.0.1", "::1"], "eth0": ["10.1.2.3", "fe80::1"], "ib0": ["fd00::7"]}

pytestmark = pytest.mark.timeout(60)


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


# ------------------------------------------------------------------ interface selection
def test_the_interface_that_reaches_the_controller_is_chosen_by_default() -> None:
    assert select_interface(local_address="10.1.2.3", environ={}, addresses=TABLE) == Interface("eth0", "10.1.2.3")
    assert select_interface(local_address="::ffff:10.1.2.3", environ={}, addresses=TABLE) is None
    assert select_interface(local_address="fd00::7", environ={}, addresses=TABLE) == Interface("ib0", "fd00::7")
    assert select_interface(environ={}, addresses=TABLE) is None  # a Unix-socket controller: library default


def test_the_users_choice_wins_and_a_bad_one_is_named() -> None:
    env = {"GLOO_SOCKET_IFNAME": "lo"}
    assert select_interface("eth0", local_address="127.0.0.1", environ=env, addresses=TABLE).name == "eth0"
    assert select_interface("10.1.2.3", environ={}, addresses=TABLE) == Interface("eth0", "10.1.2.3")
    assert select_interface(local_address="10.1.2.3", environ=env, addresses=TABLE) == Interface("lo", "127.0.0.1")
    with pytest.raises(ValueError, match="no interface 'wlan9'.*eth0"):
        select_interface(environ={"GLOO_SOCKET_IFNAME": "wlan9"}, addresses=TABLE)
    with pytest.raises(ValueError, match="'10.9.9.9' is neither an interface nor an address"):
        select_interface("10.9.9.9", environ={}, addresses=TABLE)


def test_worker_environment_binds_gloo_and_nccl_but_keeps_the_users_settings() -> None:
    env = collective_env(Interface("eth0", "10.1.2.3"), environ={"NCCL_SOCKET_IFNAME": "ib0"})
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "RESIHP_HOST_ADDR": "10.1.2.3"}


def test_this_hosts_interfaces_are_listed() -> None:
    table = interface_addresses()
    assert "127.0.0.1" in table.get("lo", [])


def test_a_loopback_peer_in_a_multi_host_job_is_an_error_that_names_the_node() -> None:
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    check_collective_addresses({0: "127.0.0.1", 1: "127.0.0.1", 2: "127.0.0.1"}, node_of)  # one host: fine
    check_collective_addresses({0: "10.0.0.1", 2: "10.0.0.2", 3: ""}, node_of)  # all routable: fine
    with pytest.raises(ValueError, match=r"node\(s\) \[0\] would give their peers the loopback address "
                                         r"127.0.0.1.*node\(s\) \[1\].*runtime.interface"):
        check_collective_addresses({0: "127.0.0.1", 2: "10.0.0.2"}, node_of)


# ------------------------------------------------------------------ agent lifecycle
@pytest.fixture
def hub(tmp_path: Path):
    with LoopThread("test-lifecycle") as lt:
        rejoined: list[tuple[int, tuple[int, ...]]] = []
        procs = AgentProcesses(None, lt.run, {0: 0, 1: 0})
        log = EventLog()
        ctl = Controller(CFG, SECRET, failslow=False,
                         sink=fan_out(log, only(WorkerProcess, procs.process),
                                      only(NodeLost, lambda e: procs.node_lost(e.node)),
                                      only(NodeBack, lambda e: rejoined.append((e.node, e.devices)))))
        procs.controller = ctl
        lt.run(ctl.start())
        try:
            yield lt, ctl, procs, rejoined, log
        finally:
            lt.run(ctl.stop())


def test_a_finished_job_ends_its_agents_plainly(hub, tmp_path: Path) -> None:
    lt, ctl, procs, rejoined, log = hub
    agent = NodeAgent(0, ctl.address_text, SECRET, CFG, workdir=tmp_path, rejoin_timeout=30)
    lt.run(agent.start())
    lt.run(ctl.wait_for_agents({0}, 5.0))
    lt.run(ctl.send(0, LaunchWorkers(devices=(0,), module="resihp_core.testing.synthetic", job="{}", store_port=1)))
    assert wait_for(lambda: procs.alive() == [0])
    worker = agent.children[0].pid
    assert lt.run(ctl.finish(timeout=5)) == []  # every agent left
    lt.run(agent.wait_closed(), timeout=5)
    assert agent.job_finished and agent.controller_lost is False and agent.rejoins == 0
    assert not psutil.pid_exists(worker) or psutil.Process(worker).status() == psutil.STATUS_ZOMBIE
    assert ctl.nodes[0].finished and log.reports == []  # leaving at the end is no failure


def test_an_agent_that_lost_the_controller_fences_its_workers_and_offers_its_devices(hub, tmp_path: Path) -> None:
    lt, ctl, procs, rejoined, log = hub
    agent = NodeAgent(0, ctl.address_text, SECRET, CFG, workdir=tmp_path, rejoin_timeout=30)
    lt.run(agent.start())
    lt.run(ctl.wait_for_agents({0}, 5.0))
    procs.launch([0, 1], module="resihp_core.testing.synthetic", job_path=Path("unused"), job_json="{}", store="127.0.0.1:1", env={})
    stale = [agent.children[d].pid for d in (0, 1)]
    assert procs.addresses == {0: "127.0.0.1", 1: "127.0.0.1"}  # bound where the agent meets the controller
    assert psutil.Process(stale[0]).environ()["GLOO_SOCKET_IFNAME"] == "lo"
    lt.call(lambda: ctl._conns[0].transport.abort())  # the controller cut the node off
    assert wait_for(lambda: agent.rejoins == 1)
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in stale)
    assert wait_for(lambda: (0, (0, 1)) in rejoined)  # offered again, once back
    assert wait_for(lambda: procs.dead() == [0, 1] and procs.exits[0] == -9), (procs.dead(), procs.exits)  # fenced ends told
    assert ctl.nodes[0].connected
    lt.run(agent.stop())


def test_a_lost_nodes_report_is_queued_before_its_workers_count_as_dead(tmp_path: Path) -> None:
    """The supervisor reads the dead workers after the queued reports: a lost node's
    report must be there first, or the failure is told as "worker process exited"."""
    seen: list[tuple[str, int]] = []
    with LoopThread("test-lost-order") as lt:
        procs = AgentProcesses(None, lt.run, {0: 0})
        log = EventLog()
        ctl = Controller(CFG, SECRET, failslow=False, sink=fan_out(
            log, only(WorkerProcess, procs.process),
            only(FailureReport, lambda r: seen.append(("report", len(procs.dead())))),
            only(NodeLost, lambda e: (procs.node_lost(e.node), seen.append(("dead", len(procs.dead())))))))
        procs.controller = ctl
        lt.run(ctl.start())
        agent = NodeAgent(0, ctl.address_text, SECRET, CFG, workdir=tmp_path, rejoin_timeout=30)
        try:
            lt.run(agent.start())
            lt.run(ctl.wait_for_agents({0}, 5.0))
            procs.launch([0], module="resihp_core.testing.synthetic", job_path=Path("unused"), job_json="{}",
                         store="127.0.0.1:1", env={})
            lt.call(lambda: ctl._conns[0].transport.abort())
            assert wait_for(lambda: len(seen) >= 2), seen
            assert seen[:2] == [("report", 0), ("dead", 1)], seen
            assert "node 0 lost" in log.reports[0].evidence
        finally:
            lt.run(agent.stop())
            lt.run(ctl.stop())


def test_a_refused_agent_does_not_try_again(hub, tmp_path: Path) -> None:
    lt, ctl, procs, rejoined, log = hub
    first = NodeAgent(0, ctl.address_text, SECRET, CFG, workdir=tmp_path / "a")
    lt.run(first.start())
    lt.run(ctl.wait_for_agents({0}, 5.0))
    dup = NodeAgent(0, ctl.address_text, SECRET, CFG, workdir=tmp_path / "b", rejoin_timeout=30)
    lt.run(dup.start())
    lt.run(dup.wait_closed(), timeout=5)
    assert "duplicate-node" in dup.refused and dup.rejoins == 0
    lt.run(first.stop())


# ------------------------------------------------------------------ report phases
def test_report_phases_start_at_detected_failures_as_well_as_injected_ones() -> None:
    from resihp_core.runtime.controller.jobs import phases
    from resihp_core.faults import fail_at

    phase_of = phases([fail_at(3, 4, "kill")])
    assert [phase_of(i, 0) for i in range(4)] == ["1 healthy"] * 4
    phase_of.event(Failure(text="", iteration=4, failure="fail-stop", devices=(3,)))  # the injected one
    assert phase_of(4, 0) == "2 after kill on device 3"
    assert phase_of(5, 1) == "2 after kill on device 3, adapted"
    phase_of.event(Failure(text="", iteration=7, failure="fail-stop", devices=(4, 5)))  # a partition
    assert phase_of(6, 1) == "2 after kill on device 3, adapted"
    assert phase_of(7, 1) == "3 after detected fail-stop of devices [4, 5]"
    assert phase_of(8, 2) == "3 after detected fail-stop of devices [4, 5], adapted"
    phase_of.event(PlanPosted(text="", plan="", kind_of_plan="rejoin", iteration=10, devices=(4, 5)))
    assert phase_of(10, 3) == "4 after rejoin of devices [4, 5]"
