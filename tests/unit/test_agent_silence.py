"""How long a node agent may be silent before its node is lost (``detector.agent_silence_s``,
docs/multihost.md "Partition"): configurable for hosts whose scheduling delays starve
agents for seconds, derived from the heartbeat settings by default; a dead agent (its
connection closed) is seen at once whatever the limit."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from resihp_core.config import Config, ConfigError, DetectorConfig, load_config
from resihp_core.protocol import AgentState, WorkerSummary, client_handshake, node_credential, write_msg
from resihp_core.runtime.controller import Controller
from resihp_core.runtime.loop import LoopThread
from resihp_core.protocol import FailureReport
from resihp_core.protocols.events import EventLog, fan_out, only

pytestmark = pytest.mark.timeout(60)
SECRET = "test-secret"


def test_the_limit_is_derived_from_the_heartbeats_unless_set() -> None:
    assert DetectorConfig().agent_silence() == 10.0  # the floor
    assert DetectorConfig(heartbeat_interval_s=0.1, heartbeat_miss_limit=100).agent_silence() == pytest.approx(20.0)
    assert DetectorConfig(heartbeat_miss_limit=50, agent_silence_s=60.0).agent_silence() == 60.0
    assert Controller(DetectorConfig(agent_silence_s=45.0), SECRET).agent_timeout_s == 45.0
    assert Controller(DetectorConfig(agent_silence_s=45.0), SECRET, agent_timeout_s=2.0).agent_timeout_s == 2.0


def test_the_limit_is_read_from_the_configuration_and_checked(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text("[detector]\nagent_silence_s = 90\n")
    assert load_config(good, env={}).detector.agent_silence() == 90.0
    with pytest.raises(ConfigError, match="detector.agent_silence_s"):
        Config.from_dict({"detector": {"agent_silence_s": -1.0}})


def test_a_closed_agent_connection_is_a_lost_node_at_once_under_a_long_limit() -> None:
    got = []
    log = EventLog()
    with LoopThread("test-silence") as lt:
        ctl = Controller(DetectorConfig(agent_silence_s=600.0), SECRET, sink=fan_out(log, only(FailureReport, got.append)),
                         failslow=False)
        lt.run(ctl.start())
        try:
            async def agent_then_gone() -> None:
                reader, writer = await asyncio.open_connection(*ctl.address)
                await client_handshake(reader, writer, node_credential(SECRET, 7), "agent:7")
                await write_msg(writer, AgentState(node=7, time=0.0,
                                                   workers=(WorkerSummary(device=70, rank=70, alive=True),)))
                writer.close()  # the agent's process died: the kernel closes its socket

            lt.run(agent_then_gone())
            # Far below the 600 s limit (the test's own timeout is 60 s): seen by the close.
            rep = log.wait_for_report(lambda r: 70 in r.devices, 50.0)
            assert rep is not None and rep.failure == "fail-stop", got
            assert "closed" in rep.evidence and "silent" not in rep.evidence, rep.evidence
        finally:
            lt.run(ctl.stop())
