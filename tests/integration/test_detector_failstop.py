"""Fail-stop detection with real processes: a node agent and synthetic workers.

The controller runs in the test process; the agent and the workers are separate
processes (``python -m resihp_core.runtime.agent`` / ``...synthetic``), started and
killed by pid through :class:`SyntheticCluster`.
"""

from __future__ import annotations

import signal
import time

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.testing.synthetic import SyntheticCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

# 1 s of silence to be declared, progress stuck for 3 s at least: with 3 missed beats a
# stalled worker whose beat thread waited 0.35 s for a CPU was reported silent instead
# of stuck on a loaded machine. A stopped process must fall silent (1 s) before its
# progress is taken as stuck (3 s) to be seen as paused.
CFG = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_miss_limit=10, hang_min_timeout_s=3.0)
FAST = ["--alpha", "1e-5", "--microbatches", "4"]  # ~0.15 s iterations


def fail_stop_of(device: int):
    return lambda r: r.failure == "fail-stop" and device in r.devices


def settle(c: SyntheticCluster, seconds: float = 0.8) -> None:
    c.go()
    time.sleep(seconds)
    assert c.events.reports == [], c.events.reports


# How a failure was found is asserted through its evidence (a process exit, a closed
# connection, a stopped process), not through how fast the report came: on a loaded
# 2-core machine the controller's thread may itself wait for a CPU. The reports must
# still come within the waits' deadlines (seconds).


def test_sigkill_of_a_worker_is_reported_within_a_second() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST, 2: FAST + ["--iterations", "3"]}, failslow=False) as c:
        settle(c, 1.0)  # worker 2 has finished 3 iterations and said goodbye meanwhile
        assert c.workers[2].poll() == 0
        c.workers[0].send_signal(signal.SIGKILL)
        rep = c.events.wait_for_report(fail_stop_of(0), 5.0)
        assert rep is not None, c.events.reports
        assert rep.devices == (0,) and rep.generation == 0
        # seen through the process's exit or its closed connection, at once, not
        # through missed heartbeats
        assert "device 0" in rep.evidence and "no heartbeat" not in rep.evidence, rep.evidence
        assert "device 0 (rank 0) exit:" in rep.evidence or "device 0 (rank 0) disconnect:" in rep.evidence, \
            rep.evidence
        time.sleep(0.3)
        assert [r.devices for r in c.events.reports] == [(0,)]  # nothing about 1 or 2


def test_sigstop_of_a_worker_is_reported_as_a_pause() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST}, failslow=False) as c:
        settle(c)
        c.workers[1].send_signal(signal.SIGSTOP)
        rep = c.events.wait_for_report(fail_stop_of(1), 5.0)
        assert rep is not None, c.events.reports
        # missed beats of a process the agent sees stopped (10 of 0.1 s: within the 5 s)
        assert "paused" in rep.evidence and "stopped" in rep.evidence, rep.evidence
        assert rep.paused == (1,)  # fenced, not to be killed while it is stopped
        assert rep.devices == (1,)


def test_stalled_progress_is_reported_as_a_hang() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST + ["--stall-at", "6"]}, failslow=False) as c:
        c.go()
        rep = c.events.wait_for_report(fail_stop_of(1), 20.0)
        assert rep is not None, c.events.reports
        assert "hang" in rep.evidence and "progress stuck" in rep.evidence, rep.evidence
        assert c.workers[1].poll() is None  # the process is alive: a hang, not a crash
        assert [r.devices for r in c.events.reports] == [(1,)]


def test_killing_the_agent_reports_its_whole_node() -> None:
    with SyntheticCluster(CFG, {3: FAST, 4: FAST, 5: FAST}, node=2, failslow=False) as c:
        settle(c)
        c.agent.send_signal(signal.SIGKILL)
        rep = c.events.wait_for_report(lambda r: r.failure == "fail-stop", 5.0)
        assert rep is not None, c.events.reports
        assert rep.devices == (3, 4, 5)
        # lost through its closed connection, at once, not through its silence
        assert "node 2 lost: agent connection closed" in rep.evidence, rep.evidence
