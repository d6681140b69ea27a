"""A slowed device verified healthy again (detector/recovery.py): reported with
throughput 1.0 after k iterations at full speed, whether the detector reported it in
this generation or the plan was made with its speed; never while it stays slow."""

from __future__ import annotations

import dataclasses
import math

import pytest

from resihp_core.detector.recovery import RecoveryWatch
from resihp_core.plan import Migration, ParallelPlan
from test_detector_localise import Job, detector


def test_a_device_slowed_then_healthy_again_is_reported_back_after_k_iterations() -> None:
    job = Job(scale=0.3, seed=5)
    det = detector()
    reports = []
    for it in range(80):
        job.slow = {2: 2.0} if 30 <= it < 50 else {}
        d = det.observe(it, job.iteration(it))
        if d.report is not None:
            reports.append((it, d.report))
    slow = [(it, r) for it, r in reports if r.throughput[2] < 1.0]
    back = [(it, r) for it, r in reports if r.throughput.get(2) == 1.0]
    assert slow and slow[0][0] <= 32 and slow[0][1].devices == (2,)
    assert len(back) == 1, reports
    it, r = back[0]
    assert r.devices == (2,) and "healthy again" in r.evidence
    assert 50 + det.recovery.k - 1 <= it <= 50 + det.recovery.k + 2  # k iterations at full speed, not before
    assert not [x for x in reports if x[0] > it]  # and nothing after it


def test_a_device_planned_around_with_its_speed_is_reported_back_and_not_while_slow() -> None:
    job = Job(scale=0.3, seed=6)
    det = detector()
    det.reset(1, speeds={1: 0.5})  # the new generation's plan knows device 1 at half speed
    job.slow = {1: 2.0}
    dets = [det.observe(it, job.iteration(it)) for it in range(40)]
    assert not [d for d in dets if d.report is not None]  # slow as known: nothing to say
    job.slow = {}
    dets = [det.observe(it, job.iteration(it)) for it in range(40, 55)]
    back = [d for d in dets if d.report is not None]
    assert len(back) == 1 and back[0].report.throughput == {1: 1.0} and back[0].action == "recovered"
    assert back[0].iteration == 40 + det.recovery.k - 1


def test_the_watch_needs_k_in_a_row() -> None:
    w = RecoveryWatch(k=3)
    near, far = {0: -0.6}, {0: -0.1}  # log(0.5) = -0.69: the bar is -0.22
    assert w.update({0: 0.5}, near) == [] and w.update({0: 0.5}, near) == []
    assert w.update({0: 0.5}, far) == [] and w.runs() == {0: 0}
    assert [w.update({0: 0.5}, near) for _ in range(3)] == [[], [], [0]]
    with pytest.raises(ValueError, match="RecoveryWatch.k"):
        RecoveryWatch(k=0)


def test_a_device_back_at_full_speed_in_a_layout_that_costs_it_more_counts() -> None:
    """Known at p = 0.5 and back at full speed, a device left with fewer micro-batches
    computes each ~1.38x slower than the model's peer-based estimate: its excess reads
    log(1.38 * 0.5) = -0.37, not log(0.5) = -0.69, around the plain halfway bar of
    -0.35, where it would not stay five iterations in a row. It counts; a device still
    as slow as known (excess about 0, noise 0.15) does not."""
    w = RecoveryWatch(k=3)
    assert w.bar(0.5) == pytest.approx(0.5 * math.log(0.65))
    assert [w.update({0: 0.5}, {0: math.log(1.38 * 0.5)}) for _ in range(3)] == [[], [], [0]]
    assert [w.update({0: 0.5}, {0: -0.15}) for _ in range(5)] == [[]] * 5
    # Near the watch's limit the bar keeps a quarter of log p below 0.
    assert w.bar(0.85) == pytest.approx(0.25 * math.log(0.85)) and w.bar(0.85) < 0
    with pytest.raises(ValueError, match="RecoveryWatch.allowance"):
        RecoveryWatch(allowance=0.9)


def test_a_known_slow_device_back_at_full_speed_is_no_reference_for_its_peers() -> None:
    """DP 2, device 1 known at half speed and so (a duty-cycled worker), then back at
    full speed while the machine's load slows both 1.3x: device 1 reads faster than
    known, and against it device 0 looked 2x slow, found in 3 iterations, before device
    1's k = 5 at full speed: CI reported the healthy device instead of planning back
    (test_detector_external)."""
    job = Job(ranks=2, scale=0.3, seed=7)
    det = detector()
    det.reset(1, speeds={1: 0.5})
    job.slow = {1: 2.0}
    dets = [det.observe(it, job.iteration(it)) for it in range(20)]
    job.slow = {0: 1.3, 1: 1.3}
    dets += [det.observe(it, job.iteration(it)) for it in range(20, 40)]
    assert not [d.report for d in dets if d.report is not None and 0 in d.report.devices]
    back = [d for d in dets if d.action == "recovered"]
    assert [d.iteration for d in back] == [20 + det.recovery.k - 1], [(d.iteration, d.action) for d in dets]


def _moved_job(seed: int) -> tuple[Job, ParallelPlan]:
    """DP 2 after the re-plan of a duty-cycled device 1 reported at p = 0.46: two of its
    four micro-batches moved to device 0 (test_detector_external's duty cycle)."""
    plan = ParallelPlan.uniform(tp=1, pp=1, dp=2, num_layers=4, num_microbatches=4, num_heads=4)
    plan = dataclasses.replace(plan, generation=1, migrations=(Migration(0, 1, 2, 0), Migration(0, 1, 3, 0)))
    job = Job(ranks=2, scale=0.3, seed=seed)
    job.work = {r: plan.work(r, 0) for r in range(2)}
    return job, plan


@pytest.mark.parametrize("p, warm, slow, healthy", [(0.46, 1.3, 2.17, 1.0), (0.6, 1.35 / 0.6, 1.35 / 0.6, 1.35)],
                         ids=["lighter-than-known-in-warm-up", "each-micro-batch-slower-in-the-new-layout"])
def test_a_known_slow_device_back_at_full_speed_is_reported_back(p: float, warm: float, slow: float,
                                                                 healthy: float) -> None:
    """Device 1 known at ``p``: ``warm`` times slow through the new generation's warm-up,
    then ``slow``, then ``healthy`` from iteration 10. Lighter than known in the warm-up
    (its cycle ending, or its stops falling while it waited for device 0): its own
    warm-up with p divided out made 1.3x its "slow" level, so full speed never read near
    healthy (CI: never reported back, the plan never returned); its peer's cost is the
    healthy one. Each micro-batch 1.35x slower in the new layout (fewer of them than its
    peer's): its peer's cost would make that healthy speed look still slow; its own
    warm-up at p holds it."""
    job, plan = _moved_job(8)
    det = detector()
    det.reset(1, plan=plan, speeds={1: p})
    dets = []
    for it in range(30):
        job.slow = {1: warm if it < 4 else slow if it < 10 else healthy}
        dets.append(det.observe(it, job.iteration(it)))
    reports = [(d.iteration, d.report.devices, d.report.throughput) for d in dets if d.report is not None]
    assert reports == [(10 + det.recovery.k - 1, (1,), {1: 1.0})], reports


def test_a_healthy_device_is_not_verified_against_a_known_slow_peer_back_at_full_speed() -> None:
    """Device 1's slowdown ends and the machine slows both devices 1.5x at once: within
    the k iterations before device 1 is reported back, verification must not compare
    device 0 with it (it reads 0.69x its slow prediction, device 0 1.5x its healthy one:
    CI reported the healthy device 0 at compute 1.50x)."""
    job, plan = _moved_job(9)
    det = detector()
    det.reset(1, plan=plan, speeds={1: 0.46})
    dets = []
    for it in range(30):
        job.slow = {1: 2.17} if it < 8 else {0: 1.5, 1: 1.5}
        dets.append(det.observe(it, job.iteration(it)))
    reports = [(d.iteration, d.report.devices, d.report.throughput) for d in dets if d.report is not None]
    assert reports == [(8 + det.recovery.k - 1, (1,), {1: 1.0})], [(d.iteration, d.action) for d in dets]


def test_a_known_slow_peer_running_as_slow_as_known_is_still_a_reference() -> None:
    """Device 1 stays slow as known while device 0 slows 2x: device 0 is compared with
    it (its compute over its slow prediction is 1) and reported."""
    job, plan = _moved_job(11)
    det = detector()
    det.reset(1, plan=plan, speeds={1: 0.46})
    dets = []
    for it in range(25):
        job.slow = {1: 2.17, 0: 2.0 if it >= 10 else 1.0}
        dets.append(det.observe(it, job.iteration(it)))
    reports = [(d.iteration, d.report.devices) for d in dets if d.report is not None]
    assert reports and reports[0][1] == (0,) and reports[0][0] <= 12, [(d.iteration, d.action) for d in dets]


def test_a_device_slower_than_its_peer_when_healthy_is_reported_back_at_its_own_healthy_speed() -> None:
    """Device 1 computes 1.3x slower than device 0 when healthy (a busier core); known
    at p = 0.7 of that, it ran at its healthy speed through the new generation's warm-up,
    then slow, then healthy again: reported back. Its healthy cost is its peer's times
    the 1.3 its last healthy fit measured, not its peer's alone (against which it would
    read 0.91 of its slow prediction, short of the watch's bar)."""
    job, plan = _moved_job(10)
    det = detector()
    job.work, job.slow = {}, {1: 1.3}
    for it in range(10):
        det.observe(it, job.iteration(it))
    job.work = {r: plan.work(r, 0) for r in range(2)}
    det.reset(1, plan=plan, speeds={1: 0.7})
    dets = []
    for it in range(10, 35):
        job.slow = {1: 1.3 / 0.7 if 14 <= it < 20 else 1.3}
        dets.append(det.observe(it, job.iteration(it)))
    reports = [(d.iteration, d.report.devices, d.report.throughput) for d in dets if d.report is not None]
    assert reports == [(20 + det.recovery.k - 1, (1,), {1: 1.0})], reports
