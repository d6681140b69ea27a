"""A burst of CPU load from outside the job is the environment, not a device; a real
device slowdown in the same job is still found within 3 iterations.

Real training workers and agents. In the first test (TP1 x PP2 x DP2), at iteration
BURST_FROM busy processes that belong to no job start competing for this machine's
cores and are stopped BURST_ITERATIONS iterations later: the Detector must report no
fail-slow, no plan changes, and training stays exact. What tells the two apart is each
worker's own run delay (time runnable but waiting for a CPU, docs/design.md "Device or
environment"): the burst lengthens it, an injected device slowdown does not. The second
test slows one device's compute 2x (the FaultInjector's way: time off the CPU) and wants
it reported within 3 iterations, onset included, with no other failure.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from resihp_core.faults import fail_at
from resihp_core.job import JobSpec
from resihp_core.testing.outside_load import OutsideLoad

from .backend_harness import HEADS, LAYERS, tmpdir, uniform
from .test_chaos import SLOW_DETECTOR, _chaos, run_checked

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

BURST_FROM = 8
BURST_ITERATIONS = 16
ITERATIONS = BURST_FROM + BURST_ITERATIONS + 6
BURNERS = max(2, os.cpu_count() or 2) + 1


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

    detections = []
    try:
        run = _chaos(plan, [], iterations=ITERATIONS, detector=SLOW_DETECTOR, on_iteration=on_iteration,
                     on_detection=detections.append)
    finally:
        for p in burners:
            p.kill()
            p.wait(10)
    assert burners, "the burst never started"
    during = statistics.median(seconds[i] for i in range(BURST_FROM + 2, BURST_FROM + BURST_ITERATIONS))
    before = statistics.median(seconds[i] for i in range(3, BURST_FROM))
    assert during > 1.2 * before, f"the burst did not slow training ({before:.3f} s -> {during:.3f} s)"
    slow = [e for e in run.events if e["kind"] == "failure"]
    verified = [(d.iteration, d.action, d.verdict.evidence[:200]) for d in detections if d.verdict is not None]
    print("verifications:", verified)
    assert slow == [], (slow, verified)
    assert not [e for e in run.events if e["kind"] == "plan" and e["generation"] >= 1], run.events


ONSET = 14
# Compute must be most of an iteration for a 2x compute slowdown to show in the
# iteration time (the detector's 25 % filter); the harness's tiny model is mostly
# framework overhead, so this test uses a wider one.
WIDE = dict(vocab_size=64, hidden=160, num_heads=HEADS, ffn_hidden=640, num_layers=LAYERS, dtype="float64")
WIDE_DATA = dict(source="synthetic", scale=24.0, shape=0.8, min_len=2, max_len=128, token_budget=128)


def _wide_run(plan, faults, iterations, **run_kw):
    """``test_chaos._chaos`` with the wider model (no checkpoints)."""
    spec = JobSpec(adapter="megatron_ref", adapter_config=WIDE, data=WIDE_DATA, dp=plan.dp,
                   num_microbatches=plan.num_microbatches, timeout_s=10.0, dump_dir=tmpdir(),
                   faults=[f.to_dict() for f in faults])
    return run_checked(spec, plan, SLOW_DETECTOR, iterations, **run_kw)


def test_a_2x_compute_slowdown_of_one_device_is_found_within_3_iterations():
    # One pipeline (TP1 x PP2 x DP1): the slow stage is the critical path. (With a second
    # replica on an oversubscribed machine, the slow device's time off the CPU overlaps
    # the other replica's waiting for it, and the iteration hardly slows.)
    plan = uniform(1, 2, 1, 4)
    device = plan.group(0, 1)[0]
    detections = []
    loads = []
    outside = OutsideLoad()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()

    run = _wide_run(plan, [fail_at(device, ONSET, "slow", factor=2.0)], ONSET + 8, on_detection=detections.append,
                    on_iteration=on_iteration)
    seen = [(d.iteration, d.action, d.ratio and round(d.ratio, 2), d.verdict and d.verdict.evidence[:160])
            for d in detections if d.action not in ("none", "warmup")]
    reports = [(e["failure"], tuple(e["devices"]), e["cause"]) for e in run.events if e["kind"] == "failure"]
    print("reports:", reports, "detections:", seen, f"load average {min(loads):.1f}-{max(loads):.1f},",
          outside.describe())
    # No other device is ever blamed. Latency and throughput are held to their targets
    # on a machine the job does not share with much else: processes outside this test
    # took at most a quarter of its cores' time (the load average counts the job's own
    # workers too; tests/integration/test_detector_external.py). On a shared machine
    # (10-30 runnable tasks on 2 cores here) the others' load swings as much as the
    # slowdown, and a device slowing while its worker also waits long for a CPU is put
    # down to the environment until the contention eases: such a run may end before
    # the report.
    assert set(reports) <= {("fail-slow", (device,), "compute")}, (reports, seen)
    if not outside.quiet(0.25):
        return
    assert len(reports) == 1, seen
    found = next(d for d in detections if d.report is not None)
    latency = found.iteration - ONSET + 1  # in iterations, the onset included
    assert latency <= 3, seen
    # About half. Its stage has no other replica to take the machine's drift since the
    # warm-up out of the estimate (docs/detector.md "DP-only jobs"), so a machine a little
    # slower than in the warm-up lowers it (compute ~2.9x the warm-up's for the 2x
    # slowdown gives 0.34).
    assert 0.3 <= found.report.throughput[device] <= 0.65, found.report
