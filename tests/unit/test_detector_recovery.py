"""A slowed device verified healthy again (detector/recovery.py): reported with
throughput 1.0 after k iterations at full speed, whether the detector reported it in
this generation or the plan was made with its speed; never while it stays slow."""

from __future__ import annotations

import pytest

from resihp_core.detector.recovery import RecoveryWatch
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
    near, far = {0: -0.6}, {0: -0.1}  # log(0.5) = -0.69: halfway is -0.35
    assert w.update({0: 0.5}, near) == [] and w.update({0: 0.5}, near) == []
    assert w.update({0: 0.5}, far) == [] and w.runs() == {0: 0}
    assert [w.update({0: 0.5}, near) for _ in range(3)] == [[], [], [0]]
    with pytest.raises(ValueError, match="RecoveryWatch.k"):
        RecoveryWatch(k=0)
