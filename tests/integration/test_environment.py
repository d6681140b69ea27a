"""A burst of CPU load from outside the job is the environment, not a device.

Real training workers (4, TP1 x PP2 x DP2) and agents; at iteration BURST_FROM, busy
processes that belong to no job start competing for this machine's cores and are
stopped BURST_ITERATIONS iterations later. The Detector must report no fail-slow, no
plan changes, and training stays exact. (A real 2x compute slowdown of one device is
still found: tests/integration/test_chaos.py and tests/unit/test_detector_failslow.py.)
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from .backend_harness import uniform
from .test_chaos import SLOW_DETECTOR, _chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

BURST_FROM = 8
BURST_ITERATIONS = 16
ITERATIONS = BURST_FROM + BURST_ITERATIONS + 6
BURNERS = max(2, os.cpu_count() or 2) + 1


@pytest.mark.xfail(strict=False, reason=(
    "open in issue 13: on a quiet 2-core machine a burst of 3 busy processes slowed one "
    "executor's compute 1.69x while its node's measured contention rose only 1.26x, so "
    "the environment filter (25 % margin) let a fail-slow through"))
def test_a_cpu_burst_from_outside_the_job_is_not_a_fail_slow():
    plan = uniform(1, 2, 2, 3)
    burners: list[subprocess.Popen] = []
    seconds: dict[int, float] = {}

    def on_iteration(rec) -> None:
        seconds[rec.iteration] = rec.seconds
        if rec.iteration + 1 == BURST_FROM and not burners:
            code = "import time\nend = time.time() + 120\nwhile time.time() < end: pass\n"
            burners.extend(subprocess.Popen([sys.executable, "-c", code]) for _ in range(BURNERS))
        if rec.iteration + 1 == BURST_FROM + BURST_ITERATIONS:
            for p in burners:
                p.kill()

    try:
        run = _chaos(plan, [], iterations=ITERATIONS, detector=SLOW_DETECTOR, on_iteration=on_iteration)
    finally:
        for p in burners:
            p.kill()
            p.wait(10)
    assert burners, "the burst never started"
    during = statistics.median(seconds[i] for i in range(BURST_FROM + 2, BURST_FROM + BURST_ITERATIONS))
    before = statistics.median(seconds[i] for i in range(3, BURST_FROM))
    assert during > 1.2 * before, f"the burst did not slow training ({before:.3f} s -> {during:.3f} s)"
    slow = [e for e in run.events if e["kind"] == "failure"]
    assert slow == [], slow
    assert not [e for e in run.events if e["kind"] == "plan" and e["generation"] >= 1], run.events
