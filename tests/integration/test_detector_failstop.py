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

CFG = DetectorConfig(heartbeat_interval_s=0.1, heartbeat_miss_limit=3, hang_min_timeout_s=1.0)
FAST = ["--alpha", "1e-5", "--microbatches", "4"]  # ~0.15 s iterations


def fail_stop_of(device: int):
    return lambda r: r.failure == "fail-stop" and device in r.devices


def settle(c: SyntheticCluster, seconds: float = 0.8) -> None:
    c.go()
    time.sleep(seconds)
    assert c.controller.reports == [], c.controller.reports


def test_sigkill_of_a_worker_is_reported_within_a_second() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST, 2: FAST + ["--iterations", "3"]}, failslow=False) as c:
        settle(c, 1.0)  # worker 2 has finished 3 iterations and said goodbye meanwhile
        assert c.workers[2].poll() == 0
        t0 = time.monotonic()
        c.workers[0].send_signal(signal.SIGKILL)
        rep = c.controller.wait_for_report(fail_stop_of(0), 5.0)
        latency = time.monotonic() - t0
        assert rep is not None, c.controller.reports
        assert latency < 1.0, latency
        assert rep.devices == (0,) and rep.generation == 0
        assert "device 0" in rep.evidence
        time.sleep(0.3)
        assert [r.devices for r in c.controller.reports] == [(0,)]  # nothing about 1 or 2


def test_sigstop_of_a_worker_is_reported_as_a_pause() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST}, failslow=False) as c:
        settle(c)
        t0 = time.monotonic()
        c.workers[1].send_signal(signal.SIGSTOP)
        rep = c.controller.wait_for_report(fail_stop_of(1), 5.0)
        assert rep is not None
        assert "paused" in rep.evidence and "stopped" in rep.evidence, rep.evidence
        assert rep.paused == (1,)  # fenced, not to be killed while it is stopped
        assert time.monotonic() - t0 < 1.5  # 3 missed beats of 0.1 s, plus slack
        assert rep.devices == (1,)


def test_stalled_progress_is_reported_as_a_hang() -> None:
    with SyntheticCluster(CFG, {0: FAST, 1: FAST + ["--stall-at", "6"]}, failslow=False) as c:
        c.go()
        rep = c.controller.wait_for_report(fail_stop_of(1), 10.0)
        assert rep is not None, c.controller.reports
        assert "hang" in rep.evidence and "progress stuck" in rep.evidence, rep.evidence
        assert c.workers[1].poll() is None  # the process is alive: a hang, not a crash
        assert [r.devices for r in c.controller.reports] == [(1,)]


def test_killing_the_agent_reports_its_whole_node() -> None:
    with SyntheticCluster(CFG, {3: FAST, 4: FAST, 5: FAST}, node=2, failslow=False) as c:
        settle(c)
        t0 = time.monotonic()
        c.agent.send_signal(signal.SIGKILL)
        rep = c.controller.wait_for_report(lambda r: r.failure == "fail-stop", 5.0)
        assert rep is not None
        assert time.monotonic() - t0 < 1.0
        assert rep.devices == (3, 4, 5)
        assert "node 2 lost" in rep.evidence
