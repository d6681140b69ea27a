"""Worker client, node agent and controller over real loopback sockets, in one process.

Everything runs on one background event loop (:class:`LoopThread`); workers are
:class:`WorkerClient` s in this process, so these tests are fast and need no
subprocesses (the multi-process ones are in ``tests/integration``).
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.detector import Detection, DetectorStats
from resihp_core.hookspecs import hookimpl
from resihp_core.plugins import Plugins
from resihp_core.protocols.events import EventLog, fan_out, only
from resihp_core.protocol import (
    AuthError,
    FailureReport,
    IterationProfile,
    MicroBatchProfile,
    client_handshake,
    node_credential,
)
from resihp_core.runtime.agent import NodeAgent, process_state
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.heartbeat import (
    WorkerClient,
    format_address,
    parse_address,
    parse_worker_identity,
    worker_identity,
)
from resihp_core.runtime.loop import LoopThread

SECRET = "test-secret"
# 0.5 s of silence before a fail-stop: with 0.15 s a beat thread starved for a moment on
# the loaded 2-core machine (load 25) was reported as a hang, in the goodbye and stalled
# progress tests. What is immediate (a closed connection) is asserted by its evidence,
# never by a wall-clock bound (load only delays it).
CFG = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=10, hang_min_timeout_s=1.0,
                     agent_silence_s=3.0)

pytestmark = pytest.mark.timeout(60)


class Observer:
    def __init__(self) -> None:
        self.reports: list[FailureReport] = []

    @hookimpl
    def resihp_failure_reported(self, report: FailureReport) -> None:
        self.reports.append(report)


class RecordingDetector:
    """A FailSlowDetector that records what the controller hands it."""

    def __init__(self) -> None:
        self.stats = DetectorStats()
        self.seen: list[tuple[int, tuple[int, ...]]] = []
        self.resets: list[int] = []

    def observe(self, iteration, profiles) -> Detection:
        self.seen.append((iteration, tuple(sorted(profiles))))
        return Detection(iteration, max(p.iteration_s for p in profiles.values()))

    def reset(self, generation, *, plan=None, speeds=None) -> None:
        self.resets.append(generation)


@pytest.fixture
def stack():
    """A controller and one agent on a background loop; yields (loop, ctl, agent, observer, detector)."""
    obs = Observer()
    plugins = Plugins(autoload=False, builtins=[])
    plugins.register(obs, "observer")
    det = RecordingDetector()
    got: list[FailureReport] = []
    log = EventLog()
    with LoopThread("test-runtime") as lt:
        # as the stand-alone controller does: reports to the observer plugins too
        ctl = Controller(CFG, SECRET, sink=fan_out(log, only(FailureReport, got.append),
                                                   only(FailureReport, plugins.notify_failure)),
                         plugins=plugins, failslow=det)
        lt.run(ctl.start())
        agent = NodeAgent(0, ctl.address_text, SECRET, CFG)
        lt.run(agent.start())
        try:
            yield lt, ctl, agent, obs, det, got, log
        finally:
            lt.run(agent.stop())
            lt.run(ctl.stop())


def client(agent: NodeAgent, device: int, rank: int | None = None, **kw) -> WorkerClient:
    assert agent.worker_address is not None
    return WorkerClient(agent.worker_address, node_credential(SECRET, agent.node), rank=device if rank is None else rank, device=device,
                        interval=CFG.heartbeat_interval_s, **kw).start()


def wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


def profile(rank: int, it: int, t: float = 0.1) -> IterationProfile:
    mb = MicroBatchProfile(owner=rank, mb=0, forward_s=t / 3, backward_s=2 * t / 3, doc_lengths=(100, 28))
    return IterationProfile(rank=rank, device=rank, generation=0, iteration=it, stage=0, replica=rank,
                            microbatches=(mb,), comm_s=0.0, iteration_s=t)


# ------------------------------------------------------------------ addressing helpers
def test_addresses_and_identities() -> None:
    assert parse_address("127.0.0.1:80") == ("127.0.0.1", 80)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("unix:/tmp/x.sock") == "/tmp/x.sock"
    assert format_address(("h", 1)) == "h:1" and format_address("/p") == "unix:/p"
    for bad in ("nohost", ":80", "h:", "unix:"):
        with pytest.raises(ValueError):
            parse_address(bad)
    assert parse_worker_identity(worker_identity(3, 7, 99)) == (3, 7, 99)
    with pytest.raises(ValueError):
        parse_worker_identity("agent:1")


def test_process_state_of_this_process_and_a_gone_one() -> None:
    import os

    assert process_state(os.getpid()) == "alive"
    assert process_state(2**22 + 12345) == "dead"


# ------------------------------------------------------------------ fail-stop
def test_a_worker_that_says_goodbye_is_not_reported(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    w = client(agent, 0)
    assert wait_for(lambda: 0 in ctl.nodes.get(0, None).workers() if 0 in ctl.nodes else False)
    w.beat(1, 2)
    time.sleep(0.2)
    w.close()
    time.sleep(0.3)
    assert got == [] and obs.reports == []
    assert ctl.nodes[0].workers()[0].reason == "finished"


def test_a_dropped_worker_connection_is_reported_at_once(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    w = client(agent, 3, rank=1)
    assert wait_for(lambda: 0 in ctl.nodes and 3 in ctl.nodes[0].workers())
    w.close(goodbye=False)  # as if the process died: the socket closes, no goodbye
    rep = log.wait_for_report(lambda r: r.failure == "fail-stop", 5.0)
    assert rep is not None and rep.devices == (3,)
    assert "disconnect" in rep.evidence  # the closed connection, not the missed beats
    assert wait_for(lambda: obs.reports == [rep]) and got == [rep]


def test_a_fail_stop_is_reported_once_across_generations_until_the_device_lives_again(stack) -> None:
    """A new generation does not report (or log) a dead device again; a relaunched
    worker of it that dies is a new failure."""
    lt, ctl, agent, obs, det, got, log = stack
    w = client(agent, 3, rank=1)
    assert wait_for(lambda: 0 in ctl.nodes and 3 in ctl.nodes[0].workers())
    w.close(goodbye=False)
    assert log.wait_for_report(lambda r: r.devices == (3,), 5.0) is not None
    for g in (1, 2):
        lt.call(ctl.set_generation, g)
        time.sleep(0.3)  # several agent states, each still naming device 3 dead
    assert [r.devices for r in got] == [(3,)]
    again = client(agent, 3, rank=1)  # relaunched
    assert wait_for(lambda: ctl.nodes[0].workers()[3].alive)
    again.close(goodbye=False)
    assert wait_for(lambda: [r.devices for r in got] == [(3,), (3,)])
    assert got[1].generation == 2


def test_a_silent_worker_misses_beats(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    w = client(agent, 1)
    assert wait_for(lambda: 0 in ctl.nodes and 1 in ctl.nodes[0].workers())
    w.pause()  # connection open, nothing sent
    try:
        rep = log.wait_for_report(lambda r: 1 in r.devices, 3.0)
        assert rep is not None
        # This process is alive, so silence is a hang.
        assert "hang" in rep.evidence and "no heartbeat" in rep.evidence
    finally:
        w.close(goodbye=False)


def test_stalled_progress_is_a_hang(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    w = client(agent, 2)
    for step in range(20):
        w.beat(0, step)
        time.sleep(0.05)
    rep = log.wait_for_report(lambda r: 2 in r.devices, 10.0)  # beats go on, progress does not
    w.close(goodbye=False)
    assert rep is not None and "progress stuck" in rep.evidence, rep


def test_a_wrong_secret_is_refused_and_reports_nothing(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    assert agent.worker_address is not None
    with pytest.raises(AuthError):
        WorkerClient(agent.worker_address, "wrong", rank=9, device=9).start()
    time.sleep(0.2)
    assert got == [] and 9 not in agent.monitor.workers


def test_an_agent_connection_lost_reports_the_whole_node(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    a2 = NodeAgent(5, ctl.address_text, SECRET, CFG)
    lt.run(a2.start())
    ws = [WorkerClient(a2.worker_address, node_credential(SECRET, a2.node), rank=d, device=d, interval=0.05).start() for d in (50, 51)]
    assert wait_for(lambda: 5 in ctl.nodes and set(ctl.nodes[5].workers()) == {50, 51})
    a2._ctl_writer.transport.abort()  # type: ignore[union-attr]  # as if the agent died
    rep = log.wait_for_report(lambda r: set(r.devices) == {50, 51}, 5.0)
    assert rep is not None and "node 5 lost" in rep.evidence
    assert "silent" not in rep.evidence  # its connection closed: not the agent timeout
    for w in ws:
        w.close(goodbye=False)
    lt.run(a2.stop())


def test_an_agent_leaving_on_purpose_is_not_reported(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    a2 = NodeAgent(6, ctl.address_text, SECRET, CFG)
    lt.run(a2.start())
    w = WorkerClient(a2.worker_address, node_credential(SECRET, a2.node), rank=60, device=60, interval=0.05).start()
    assert wait_for(lambda: 6 in ctl.nodes and 60 in ctl.nodes[6].workers())
    w.close()
    lt.run(a2.stop())
    time.sleep(0.3)
    assert got == []
    assert ctl.nodes[6].finished


def test_a_silent_agent_is_lost_after_the_timeout(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack

    async def mute_agent() -> asyncio.StreamWriter:
        reader, writer = await asyncio.open_connection(*ctl.address)
        await client_handshake(reader, writer, node_credential(SECRET, 7), "agent:7")
        from resihp_core.protocol import AgentState, WorkerSummary, write_msg

        await write_msg(writer, AgentState(node=7, time=0.0, workers=(WorkerSummary(device=70, rank=70, alive=True),)))
        return writer  # and then nothing, without closing: a partitioned node

    t0 = time.monotonic()  # before its last message: the timeout runs from after it
    writer = lt.run(mute_agent())
    rep = log.wait_for_report(lambda r: r.devices == (70,), 5.0)
    assert rep is not None and "silent" in rep.evidence
    assert time.monotonic() - t0 >= ctl.agent_timeout_s - 0.1  # not before its timeout (load only delays it)
    lt.call(writer.close)


def test_duplicate_agents_and_bad_identities_are_refused(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    dup = NodeAgent(0, ctl.address_text, SECRET, CFG)
    lt.run(dup.start())  # authenticated, then told it is a duplicate and disconnected
    assert wait_for(lambda: dup.controller_lost is not False)
    lt.run(dup.stop())
    assert 0 in ctl.nodes and ctl.nodes[0].connected  # the first agent is untouched
    assert got == []
    bad = NodeAgent(1, ctl.address_text, "wrong-secret", CFG)
    with pytest.raises(AuthError):
        lt.run(bad.start())


# ------------------------------------------------------------------ fail-slow plumbing
def test_profiles_are_gathered_per_iteration_and_handed_over(stack) -> None:
    lt, ctl, agent, obs, det, got, log = stack
    ws = [client(agent, d) for d in (0, 1)]
    assert wait_for(lambda: 0 in ctl.nodes and set(ctl.nodes[0].workers()) == {0, 1})
    for it in range(3):
        for w in ws:
            w.send_profile(profile(w.rank, it))
    assert wait_for(lambda: len(det.seen) == 3)
    assert det.seen == [(0, (0, 1)), (1, (0, 1)), (2, (0, 1))]
    # A dead rank no longer holds iterations back.
    ws[1].close(goodbye=False)
    assert log.wait_for_report(lambda r: r.devices == (1,), 3.0) is not None
    ws[0].send_profile(profile(0, 3))
    assert wait_for(lambda: len(det.seen) == 4) and det.seen[-1] == (3, (0,))
    lt.call(ctl.set_generation, 1)
    assert wait_for(lambda: det.resets == [1])
    ws[0].send_profile(profile(0, 4))  # generation 0 profile after the switch: ignored
    time.sleep(0.2)
    assert len(det.seen) == 4
    ws[0].close()


def test_controller_default_detector_comes_from_the_config() -> None:
    from resihp_core.detector.failslow import WorkloadAwareDetector

    with LoopThread() as lt:
        ctl = Controller(CFG, SECRET, plugins=Plugins(autoload=False))
        lt.run(ctl.start())
        assert isinstance(ctl.failslow, WorkloadAwareDetector)
        lt.run(ctl.stop())


def test_the_worker_client_survives_its_agent_going_away() -> None:
    """The training side never sees an exception: it keeps beating into the void."""
    lost = threading.Event()
    with LoopThread() as lt:
        agent = NodeAgent(0, None, SECRET, CFG)
        lt.run(agent.start())
        w = WorkerClient(agent.worker_address, node_credential(SECRET, 0), rank=0, device=0, interval=0.02,
                         on_agent_lost=lambda e: lost.set()).start()
        lt.run(agent.stop())
        for i in range(50):
            w.beat(i, 0)
            w.send_profile(profile(0, i))
            time.sleep(0.01)
        assert lost.wait(3.0)
        w.close()
