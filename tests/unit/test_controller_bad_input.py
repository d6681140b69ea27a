"""Bad input from an authenticated agent: a malformed frame or a forged message is
refused and counted, and the controller goes on serving the other agents.

Real loopback sockets; controller and raw agent connections in this process (one
background loop).
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time

import msgspec
import pytest

from resihp_core.config import DetectorConfig
from resihp_core.plugins import Plugins
from resihp_core.protocol import (
    AgentState,
    FailureReport,
    IterationProfile,
    NodeRejoin,
    ProfileBatch,
    WorkerSummary,
    client_handshake,
    encode,
    node_credential,
    write_msg,
)
from resihp_core.protocol.framing import MAX_FRAME_BYTES
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.loop import LoopThread
from resihp_core.protocols.events import only

SECRET = "bad-input-test-secret"
CFG = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=3, hang_min_timeout_s=0.5)
TOPOLOGY = {0: (0, 1), 1: (2, 3), 2: (4, 5)}

pytestmark = pytest.mark.timeout(60)


def wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


async def _conn(ctl: Controller, node: int):
    reader, writer = await asyncio.open_connection(*ctl.address)
    await client_handshake(reader, writer, node_credential(SECRET, node), f"agent:{node}", timeout=5)
    return reader, writer


async def _raw(writer: asyncio.StreamWriter, data: bytes) -> None:
    writer.write(data)
    await writer.drain()


def _frame(payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + payload


def _wrong_types() -> bytes:
    """A well-formed msgpack ``AgentState`` whose worker's device is a string."""
    msg = msgspec.msgpack.decode(encode(AgentState(node=0, time=1.0, workers=(
        WorkerSummary(device=0, rank=0, alive=True),))))
    msg["workers"][0]["device"] = "zero"
    return msgspec.msgpack.encode(msg)


@pytest.mark.parametrize("bad", [
    _frame(b"\xc1\xc1\xc1"),  # not msgpack
    _frame(msgspec.msgpack.encode({"kind": "no-such-message"})),  # unknown kind
    _frame(_wrong_types()),  # a known kind with fields of the wrong type
    struct.pack(">I", MAX_FRAME_BYTES + 1) + b"x" * 16,  # a header above the frame limit
])
def test_a_malformed_frame_is_refused_counted_and_the_controller_serves_on(bad: bytes, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="resihp.controller")
    got: list[FailureReport] = []
    with LoopThread("test-bad-input") as lt:
        ctl = Controller(CFG, SECRET, sink=only(FailureReport, got.append), plugins=Plugins(autoload=False, builtins=[]),
                         failslow=False, node_devices=TOPOLOGY)
        lt.run(ctl.start())
        try:
            r0, w0 = lt.run(_conn(ctl, 0))
            lt.run(_raw(w0, bad))
            assert wait_for(lambda: ctl.malformed == 1)
            assert wait_for(lambda: not ctl.nodes[0].connected)  # refused: its connection closed
            assert "event=malformed_message node=0" in caplog.text
            assert got == []  # nothing of it reached the planner
            # Another agent is served as before.
            _, w1 = lt.run(_conn(ctl, 1))
            lt.run(write_msg(w1, AgentState(node=1, time=1.0, workers=(
                WorkerSummary(device=2, rank=2, alive=False, reason="exit code -9"),))))
            assert wait_for(lambda: [r.devices for r in got] == [(2,)])
            lt.call(w1.close)
        finally:
            lt.run(ctl.stop())


def _profile(device: int) -> IterationProfile:
    return IterationProfile(rank=device, device=device, generation=0, iteration=1, stage=0, replica=0,
                            microbatches=(), comm_s=0.0, iteration_s=1.0)


def test_forged_messages_for_another_node_are_refused_and_counted(caplog) -> None:
    got: list[FailureReport] = []
    with LoopThread("test-forged") as lt:
        ctl = Controller(CFG, SECRET, sink=only(FailureReport, got.append), plugins=Plugins(autoload=False, builtins=[]),
                         failslow=False, node_devices=TOPOLOGY)
        lt.run(ctl.start())
        try:
            _, w = lt.run(_conn(ctl, 1))
            forged = [
                AgentState(node=2, time=1.0, workers=(WorkerSummary(device=4, rank=4, alive=False, reason="x"),)),
                AgentState(node=1, time=1.0, workers=(WorkerSummary(device=4, rank=4, alive=False, reason="x"),)),
                NodeRejoin(node=2, devices=(4, 5)),
                FailureReport(generation=0, failure="fail-stop", devices=(5,)),
                # a node's profile batch that smuggles in another node's device
                ProfileBatch((_profile(2), _profile(4))),
            ]

            async def send() -> None:
                for m in forged:
                    await write_msg(w, m)

            lt.run(send())
            assert wait_for(lambda: ctl.rejected == len(forged))
            assert got == [] and ctl.nodes[1].connected  # refused, counted; the agent stays
            assert 2 not in ctl.nodes
            lt.call(w.close)
        finally:
            lt.run(ctl.stop())
