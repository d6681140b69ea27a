"""Worker processes launched by node agents: start, signal, exit and node loss are seen
by the controller's process host; workers die with the process that launched them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from resihp_core.config import DetectorConfig
from resihp_core.protocol import LaunchWorkers, ProtocolError, SignalWorker, WorkerProcess, decode, encode
from resihp_core.runtime.agent import NodeAgent
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.loop import LoopThread
from resihp_core.runtime.processes import AgentProcesses
from resihp_core.protocol import FailureReport
from resihp_core.protocols.events import NodeLost, fan_out, only

SECRET = "test-secret"
CFG = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=3, hang_min_timeout_s=5.0)
SLEEPER = ("timeit", ["-n1", "-r1", "import time; time.sleep(60)"])

pytestmark = pytest.mark.timeout(60)


def wait_for(pred, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def test_launcher_messages_are_validated() -> None:
    ok = LaunchWorkers(devices=(0, 1), module="resihp_core.runtime.worker", job="{}", store_port=29500,
                       env={"RESIHP_X": "1"}, detector={"heartbeat_interval_s": 0.05})
    assert decode(encode(ok)) == ok
    for bad in (dict(module="os; rm -rf /"), dict(module="-m"), dict(store_port=0), dict(env={"lower": "x"})):
        msg = LaunchWorkers(**{**dict(devices=(0,), module="m", job="{}", store_port=1), **bad})
        with pytest.raises(ProtocolError):
            decode(encode(msg))
    with pytest.raises(ProtocolError):
        decode(encode(SignalWorker(device=0, signal="SIGSEGV")))  # type: ignore[arg-type]
    assert decode(encode(WorkerProcess(node=1, device=3, pid=7, returncode=-9))).returncode == -9


@pytest.fixture
def cluster(tmp_path: Path):
    """A controller and two agents on a loop thread, with an AgentProcesses host."""
    with LoopThread("test-processes") as lt:
        procs = AgentProcesses(None, lt.run, {0: 0, 1: 0, 2: 1}, detector={"heartbeat_miss_limit": 5})
        reports = []
        ctl = Controller(CFG, SECRET, failslow=False, sink=fan_out(
            only(FailureReport, reports.append), only(WorkerProcess, procs.process),
            only(NodeLost, lambda e: procs.node_lost(e.node))))
        procs.controller = ctl
        lt.run(ctl.start())
        agents = [NodeAgent(n, ctl.address_text, SECRET, CFG, workdir=tmp_path / f"node{n}") for n in (0, 1)]
        for a in agents:
            lt.run(a.start())
        lt.run(ctl.wait_for_agents({0, 1}, 5.0))
        try:
            yield lt, ctl, agents, procs, reports
        finally:
            for a in agents:
                lt.run(a.stop())
            lt.run(ctl.stop())


def _launch(procs: AgentProcesses, devices, module: str = "resihp_core.testing.synthetic") -> None:
    procs.launch(devices, module=module, job_path=Path("unused"), job_json='{"job": 1}', store="127.0.0.1:29999",
                 env={"RESIHP_EXTRA": "yes"})


def test_agents_launch_signal_and_report_their_workers(cluster, tmp_path: Path) -> None:
    lt, ctl, agents, procs, reports = cluster
    _launch(procs, [0, 1, 2])
    assert procs.alive() == [0, 1, 2] and procs.dead() == []
    # each agent started its own devices, in its own folder, with the controller's detector settings
    assert set(agents[0].children) == {0, 1} and set(agents[1].children) == {2}
    assert (tmp_path / "node0" / "job.json").read_text() == '{"job": 1}'
    assert agents[0].config.heartbeat_miss_limit == 5
    env = psutil.Process(agents[0].children[0].pid).environ()
    assert env["RESIHP_STORE"] == "127.0.0.1:29999" and env["RESIHP_EXTRA"] == "yes"
    assert env["RESIHP_AGENT_ADDR"] == agents[0].worker_address and env["RESIHP_DEVICE"] == "0"
    assert wait_for(lambda: set(ctl.nodes[0].workers()) == {0, 1})  # the synthetic workers beat

    procs.kill(1)  # fencing goes controller -> agent -> SIGKILL
    assert procs.dead() == [1] and procs.exits[1] == -signal.SIGKILL
    assert wait_for(lambda: any(r.devices == (1,) for r in reports))

    procs.signal(2, signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(agents[1].children[2].pid).status() == psutil.STATUS_STOPPED)
    procs.kill(2)  # a stopped worker is killed too
    assert 2 in procs.dead()


def test_a_worker_that_cannot_start_and_a_lost_node_are_dead(cluster) -> None:
    lt, ctl, agents, procs, reports = cluster
    _launch(procs, [0, 2], module="no_such_module_anywhere")
    assert wait_for(lambda: procs.dead() == [0, 2])
    assert procs.exits[0] == 1  # python -m: no module
    lt.call(lambda: ctl.set_generation(1))  # as the supervisor does before relaunching
    _launch(procs, [0, 1, 2])
    assert procs.alive() == [0, 1, 2]
    agents[1]._ctl_writer.transport.abort()  # type: ignore[union-attr]  # as if node 1 vanished
    assert wait_for(lambda: procs.dead() == [2])
    assert procs.exits[2] is None  # nobody could tell its exit status
    assert wait_for(lambda: any(set(r.devices) == {2} and "node 1 lost" in r.evidence for r in reports))
    assert procs.alive() == [0, 1]
    with pytest.raises(ConnectionError, match="node 1"):
        lt.run(ctl.send(1, SignalWorker(device=2, signal="SIGKILL")))


def test_launching_onto_a_missing_agent_names_the_node(tmp_path: Path) -> None:
    with LoopThread("test-processes") as lt:
        procs = AgentProcesses(None, lt.run, {0: 0, 1: 3})
        ctl = Controller(CFG, SECRET, failslow=False, sink=only(WorkerProcess, procs.process))
        procs.controller = ctl
        lt.run(ctl.start())
        try:
            with pytest.raises(ConnectionError, match="node 3"):
                _launch(procs, [1])
            with pytest.raises(ValueError, match="device 9"):
                _launch(procs, [9])
            with pytest.raises(TimeoutError, match=r"node\(s\) \[0\]"):
                lt.run(ctl.wait_for_agents({0}, 0.2))
        finally:
            lt.run(ctl.stop())


def test_workers_die_with_the_process_that_launched_them(tmp_path: Path) -> None:
    code = ("import sys, time; from resihp_core.runtime.processes import spawn_worker; "
            f"p = spawn_worker({SLEEPER[0]!r}, dict(__import__('os').environ), {str(tmp_path / 'w.log')!r}, {SLEEPER[1]!r}); "
            "print(p.pid, flush=True); time.sleep(60)")
    launcher = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(launcher.stdout.readline())
        assert wait_for(lambda: "timeit" in " ".join(psutil.Process(child).cmdline()))
        launcher.kill()
        launcher.wait(10)

        def gone() -> bool:
            try:
                return psutil.Process(child).status() == psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return True

        assert wait_for(gone, 10.0)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(10)
        try:
            os.kill(child, signal.SIGKILL)
        except (ProcessLookupError, UnboundLocalError, NameError):
            pass
