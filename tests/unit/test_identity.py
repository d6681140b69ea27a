"""Identity: per-node credentials, node ids checked against the topology, a node may only
speak about its own devices, and agents refuse a controller that cannot prove the secret.

Real loopback sockets, controller and agent in this process (one background loop).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.plugins import Plugins
from resihp_core.protocol import (
    AgentState,
    AuthError,
    AuthResult,
    Challenge,
    FailureReport,
    Hello,
    LaunchWorkers,
    WorkerProcess,
    WorkerSummary,
    client_handshake,
    node_credential,
    read_msg,
    write_msg,
)
from resihp_core.runtime.agent import NodeAgent
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.loop import LoopThread
from resihp_core.protocols.events import only

SECRET = "identity-test-secret"
CFG = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=3, hang_min_timeout_s=0.5)
TOPOLOGY = {0: (0, 1), 1: (2, 3)}

pytestmark = pytest.mark.timeout(60)


def wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def job():
    got: list[FailureReport] = []
    with LoopThread("test-identity") as lt:
        ctl = Controller(CFG, SECRET, sink=only(FailureReport, got.append), plugins=Plugins(autoload=False, builtins=[]),
                         failslow=False, node_devices=TOPOLOGY)
        lt.run(ctl.start())
        try:
            yield lt, ctl, got
        finally:
            lt.run(ctl.stop())


async def _agent_conn(ctl: Controller, node: int, key: str):
    reader, writer = await asyncio.open_connection(*ctl.address)
    await client_handshake(reader, writer, key, f"agent:{node}", timeout=5)
    return reader, writer


def test_a_node_claiming_another_nodes_devices_is_rejected(job, caplog) -> None:
    lt, ctl, got = job
    caplog.set_level(logging.WARNING, logger="resihp.controller")
    _, w = lt.run(_agent_conn(ctl, 1, node_credential(SECRET, 1)))

    async def send(*msgs) -> None:
        for m in msgs:
            await write_msg(w, m)

    dead0 = WorkerSummary(device=0, rank=0, alive=False, reason="exit code -9")
    lt.run(send(
        AgentState(node=1, time=1.0, workers=(dead0,)),  # node 1 reports node 0's device dead
        WorkerProcess(node=1, device=1, returncode=-9),
        FailureReport(generation=0, failure="fail-stop", devices=(0,)),
        FailureReport(generation=0, failure="fail-slow", devices=(2,), throughput={1: 0.5}),
    ))
    assert wait_for(lambda: ctl.rejected == 4)
    assert got == [] and 0 not in ctl.nodes[1].devices
    assert "event=identity_violation node=1" in caplog.text and "foreign_devices=[0]" in caplog.text
    # Its own device is accepted: the check is about ownership, not a blanket refusal.
    lt.run(send(AgentState(node=1, time=2.0, workers=(WorkerSummary(device=2, rank=2, alive=False, reason="x"),))))
    assert wait_for(lambda: [r.devices for r in got] == [(2,)])
    lt.call(w.close)


def test_an_out_of_range_node_id_is_rejected_even_with_a_valid_key(job, caplog) -> None:
    lt, ctl, got = job
    caplog.set_level(logging.WARNING, logger="resihp.controller")
    with pytest.raises(AuthError, match="not in the job's topology"):
        lt.run(_agent_conn(ctl, 9, node_credential(SECRET, 9)))
    # Node 0's credential cannot authenticate as node 1, nor the raw job secret as anyone.
    with pytest.raises(AuthError):
        lt.run(_agent_conn(ctl, 1, node_credential(SECRET, 0)))
    with pytest.raises(AuthError):
        lt.run(_agent_conn(ctl, 0, SECRET))
    assert ctl.nodes == {}
    assert "event=auth_refused" in caplog.text
    # The right credential for a node of the job works.
    _, w = lt.run(_agent_conn(ctl, 0, node_credential(SECRET, 0)))
    assert wait_for(lambda: 0 in ctl.nodes)
    lt.call(w.close)


def test_an_agent_with_its_node_credential_only_joins(job) -> None:
    lt, ctl, got = job
    agent = NodeAgent(1, ctl.address_text, "", CFG, credential=node_credential(SECRET, 1))
    lt.run(agent.start())
    try:
        assert wait_for(lambda: 1 in ctl.nodes and ctl.nodes[1].connected)
    finally:
        lt.run(agent.stop())


def test_an_agent_refuses_a_controller_without_the_secret(tmp_path: Path) -> None:
    """A rogue controller answers the handshake without knowing the secret, claims
    success and orders a launch: the agent stops at the bad proof and launches nothing."""
    seen: dict[str, object] = {}

    async def rogue(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = await read_msg(reader, 5)
        assert isinstance(hello, Hello)
        await write_msg(writer, Challenge(b"r" * 32, b"\x00" * 32))
        await write_msg(writer, AuthResult(True))
        await write_msg(writer, LaunchWorkers(devices=(0,), module="resihp_core.runtime.synthetic",
                                              job="{}", store_port=1))
        try:
            seen["after"] = await read_msg(reader, 5)  # the agent's AuthResponse, if it sent one
        except Exception as e:  # noqa: BLE001
            seen["after"] = e
        writer.close()

    with LoopThread("test-rogue") as lt:
        server = lt.run(asyncio.start_server(rogue, "127.0.0.1", 0))
        port = server.sockets[0].getsockname()[1]
        agent = NodeAgent(0, ("127.0.0.1", port), SECRET, CFG, workdir=tmp_path, connect_timeout=5)
        with pytest.raises(AuthError, match="mutual authentication failed"):
            lt.run(agent.start())
        assert wait_for(lambda: "after" in seen)
        assert seen["after"] is None  # the agent hung up without proving anything
        assert agent.children == {} and not (tmp_path / "job.json").exists()

        # A real controller with another secret: refused the same way.
        other = Controller(CFG, "another-secret", plugins=Plugins(autoload=False, builtins=[]), failslow=False)
        lt.run(other.start())
        try:
            agent2 = NodeAgent(0, other.address_text, SECRET, CFG, workdir=tmp_path, connect_timeout=5)
            with pytest.raises(AuthError):
                lt.run(agent2.start())
            assert other.nodes == {}
        finally:
            lt.run(other.stop())
            server.close()
