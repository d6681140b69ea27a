"""Fail-stop logic of the node agent, on a fake clock (no sockets)."""

from __future__ import annotations

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.detector.failstop import FailStopMonitor, FailureKind, HangTimeout


def monitor(state: str = "unknown", **kw) -> FailStopMonitor:
    kw.setdefault("hang_min_timeout", 1.0)
    return FailStopMonitor(0.1, 3, process_state=lambda pid: state, **kw)  # type: ignore[arg-type,return-value]


def beat_until(m: FailStopMonitor, device: int, t0: float, t1: float, *, step_every: float | None = 0.1,
               start_step: int = 0) -> float:
    """Beat every 0.1 s from t0 to t1, advancing the step every ``step_every`` seconds."""
    t = t0
    step = start_step
    last_adv = t0
    while t < t1:
        if step_every is not None and t - last_adv >= step_every - 1e-9:
            step += 1
            last_adv = t
        m.beat(device, t, 0, step)
        assert m.check(t) == []
        t += 0.1
    return t


def test_missed_beats_are_declared_after_the_limit() -> None:
    m = monitor()
    m.add(0, 0, 0.0)
    last = beat_until(m, 0, 0.0, 2.0) - 0.1  # time of the last beat
    assert m.check(last + 0.34) == []  # 3 beats missed: within the grace
    failed = m.check(last + 0.36)
    assert [f.kind for f in failed] == [FailureKind.MISSED_BEATS]
    assert m.check(last + 1.0) == []  # reported once


@pytest.mark.parametrize("state,kind", [("alive", FailureKind.HANG), ("stopped", FailureKind.PAUSED),
                                        ("dead", FailureKind.EXIT)])
def test_silence_is_classified_by_the_process_state(state: str, kind: FailureKind) -> None:
    m = monitor(state)
    m.add(0, 0, 0.0, pid=123)
    t = beat_until(m, 0, 0.0, 1.0)
    if state == "alive":  # running but silent: starved, until it outlasts the hang floor (1 s)
        assert m.check(t + 0.5) == []
        (f,) = m.check(t + 1.05)
    else:
        (f,) = m.check(t + 0.5)
    assert f.kind is kind
    if state == "stopped":
        assert "stopped" in f.reason


def test_connection_loss_and_exit_are_immediate() -> None:
    m = monitor()
    m.add(0, 0, 0.0)
    m.add(1, 1, 0.0)
    f = m.connection_lost(0, 0.05)
    assert f is not None and f.kind is FailureKind.DISCONNECT
    f = m.process_exited(1, 0.05, -9)
    assert f is not None and f.kind is FailureKind.EXIT and "signal 9" in f.reason
    assert m.connection_lost(0, 0.06) is None  # once


def test_a_finished_worker_is_never_reported() -> None:
    m = monitor()
    m.add(0, 0, 0.0)
    m.finished(0)
    assert m.connection_lost(0, 0.1) is None
    assert m.check(10.0) == []
    (s,) = m.summaries(10.0)
    assert s.alive and s.reason == "finished"


def test_stalled_progress_is_a_hang_after_the_learned_timeout() -> None:
    m = monitor(hang_min_timeout=0.5)
    m.add(0, 0, 0.0)
    t = beat_until(m, 0, 0.0, 3.0, step_every=0.2)  # steps take 0.2 s
    w = m.workers[0]
    timeout = w.hang.timeout()  # type: ignore[union-attr]
    assert timeout == pytest.approx(max(0.5, 10 * 0.2, 2 * 0.2), rel=0.1)
    last = w.last_progress
    assert last is not None
    # Beats go on, progress does not.
    while t < last + timeout - 0.05:
        m.beat(0, t, 0, w.step)
        assert m.check(t) == []
        t += 0.1
    m.beat(0, t + 0.1, 0, w.step)
    failed = m.check(last + timeout + 0.01)
    assert [f.kind for f in failed] == [FailureKind.HANG]
    assert "progress stuck" in failed[0].reason


def test_a_worker_waiting_for_its_commit_verdict_is_not_hung() -> None:
    """Its agent says it waits for the job's verdict (a silent peer holds the count):
    stalled progress is no hang then, and its clock restarts with the verdict."""
    m = monitor(hang_min_timeout=0.5)
    m.add(0, 0, 0.0)
    t = beat_until(m, 0, 0.0, 3.0, step_every=0.2)
    w = m.workers[0]
    timeout = w.hang.timeout()  # type: ignore[union-attr]
    m.commit_wait(0, t, True)
    end = t + 3 * timeout
    while t < end:  # beats go on, progress does not: waiting, not hung
        m.beat(0, t, w.iteration, w.step)
        assert m.check(t) == []
        t += 0.1
    m.commit_wait(0, t, False)
    verdict_at = t
    while t < verdict_at + timeout - 0.05:  # the clock restarted with the verdict
        m.beat(0, t, w.iteration, w.step)
        assert m.check(t) == []
        t += 0.1
    m.beat(0, verdict_at + timeout + 0.05, w.iteration, w.step)
    assert [f.kind for f in m.check(verdict_at + timeout + 0.05)] == [FailureKind.HANG]  # stalled after it


def test_a_gap_seen_before_does_not_trigger() -> None:
    ht = HangTimeout(factor=10, min_timeout=0.1)
    for _ in range(50):
        ht.observe(0.01)
    ht.observe(3.0)  # an optimizer step or a checkpoint once took 3 s
    assert ht.timeout() >= 6.0


def test_the_hang_timeout_follows_every_new_gap() -> None:
    """The timeout is asked for many times per beat and kept until the next gap: it is
    what the gaps seen so far give, after every one (the window forgets the oldest)."""
    import random

    rng = random.Random(3)
    ht = HangTimeout(factor=4, min_timeout=0.05, window=8)
    seen: list[float] = []
    for _ in range(200):
        g = rng.choice([0.01, 0.02, 0.5, rng.uniform(0, 2)])
        ht.observe(g)
        seen = (seen + [g])[-8:]
        want = max(0.05, 4 * sorted(seen)[len(seen) // 2], 2 * max(seen))
        assert ht.timeout() == want and ht.timeout() == want


def test_no_hang_before_any_progress() -> None:
    m = monitor(hang_min_timeout=0.2)
    m.add(0, 0, 0.0)
    t = 0.0
    while t < 5.0:
        m.beat(0, t, 0, 0)  # alive, never advancing (still starting up)
        assert m.check(t) == []
        t += 0.1


def test_a_new_generation_restarts_progress() -> None:
    m = monitor(hang_min_timeout=0.5)
    m.add(0, 0, 0.0)
    t = beat_until(m, 0, 0.0, 2.0)
    m.beat(0, t, 0, 0, generation=1)
    w = m.workers[0]
    assert (w.generation, w.step, w.last_progress) == (1, 0, None)
    # reconfiguring (no steps, beats going on) for longer than the timeout is no hang...
    for k in range(1, 60):
        m.beat(0, t + 0.1 * k, 0, 0, generation=1)
        assert m.check(t + 0.1 * k) == []
    # ...but once the generation steps, a stall is one again
    t += 6.0
    for step in range(1, 20):
        m.beat(0, t + 0.1 * step, 0, step, generation=1)
        assert m.check(t + 0.1 * step) == []
    t += 2.0
    failures = []
    for k in range(1, 80):
        m.beat(0, t + 0.1 * k, 0, 19, generation=1)
        failures += m.check(t + 0.1 * k)
    assert [f.kind.value for f in failures] == ["hang"] and w.generation == 1


def test_summaries_and_deadline() -> None:
    m = monitor()
    m.add(3, 7, 0.0)
    m.add(1, 2, 0.0)
    m.beat(3, 0.05, 4, 5)
    m.connection_lost(1, 0.06)
    s1, s3 = m.summaries(0.1)
    assert (s1.device, s1.alive) == (1, False) and "disconnect" in s1.reason
    assert (s3.device, s3.rank, s3.iteration, s3.step, s3.alive) == (3, 7, 4, 5, True)
    assert s3.last_beat_age_s == pytest.approx(0.05)
    assert m.next_deadline(0.1) <= 0.05 + m.silence_limit


def test_from_config() -> None:
    m = FailStopMonitor.from_config(DetectorConfig(heartbeat_interval_s=0.2, heartbeat_miss_limit=5))
    assert m.silence_limit == pytest.approx((5 + 0.5) * 0.2)
    with pytest.raises(ValueError):
        FailStopMonitor(0.0, 3)


# ------------------------------------------------------------------ paused workers
class Proc:
    """A fake process whose state the test sets."""

    def __init__(self) -> None:
        self.state = "alive"

    def __call__(self, pid: int) -> str:
        return self.state


def paused_monitor(**kw) -> tuple[FailStopMonitor, Proc]:
    proc = Proc()
    m = FailStopMonitor(0.1, 3, hang_min_timeout=1.0, process_state=proc, resume_check_s=1.0, **kw)  # type: ignore[arg-type]
    m.add(0, 0, 0.0, pid=123)
    return m, proc


def test_a_stopped_worker_is_fenced_not_killed_and_comes_back_after_its_health_check() -> None:
    m, proc = paused_monitor(max_pause_s=60.0)
    t = beat_until(m, 0, 0.0, 1.0)
    proc.state = "stopped"
    (f,) = m.check(t + 0.5)
    assert f.kind is FailureKind.PAUSED and not f.after_pause and "stopped" in f.reason
    assert not m.workers[0].alive  # fenced: the controller plans without it
    assert m.check(t + 20.0) == [] and m.take_resumed() == []  # stopped 20 s: still a pause
    proc.state = "alive"  # SIGCONT: it beats again ...
    t = t + 20.0
    for i in range(5):
        m.beat(0, t + 0.1 * i, 0, 10)
        assert m.check(t + 0.1 * i) == []
    assert m.take_resumed() == []  # ... but the health check wants a steady second of beats
    for i in range(5, 12):
        m.beat(0, t + 0.1 * i, 0, 10)
        assert m.check(t + 0.1 * i) == []
    assert m.take_resumed() == [0] and m.workers[0].alive
    assert m.take_resumed() == []
    # Healthy again: the usual rules apply (a second stop is a second pause).
    proc.state = "stopped"
    (f,) = m.check(t + 3.0)
    assert f.kind is FailureKind.PAUSED


def test_a_pause_longer_than_allowed_is_a_hang_the_agent_kills() -> None:
    m, proc = paused_monitor(max_pause_s=30.0)
    t = beat_until(m, 0, 0.0, 1.0)
    proc.state = "stopped"
    (f,) = m.check(t + 0.5)
    assert f.kind is FailureKind.PAUSED
    assert m.check(t + 30.0) == []
    (f,) = m.check(t + 31.0)
    assert f.kind is FailureKind.HANG and f.after_pause and "30 s" in f.reason
    assert m.check(t + 40.0) == []  # reported once


def test_a_worker_running_and_silent_after_a_pause_is_a_hang() -> None:
    m, proc = paused_monitor()
    t = beat_until(m, 0, 0.0, 1.0)
    proc.state = "stopped"
    assert [f.kind for f in m.check(t + 0.5)] == [FailureKind.PAUSED]
    proc.state = "alive"  # resumed, but no beat comes: a real hang ...
    # ... once it has been silent for the limit *while running*: seen running at t + 1.0,
    # its last beat 1 s old (the pause) is no hang yet (its beat thread was not
    # scheduled yet: a resumed worker was killed so in CI).
    assert m.check(t + 1.0) == []
    assert m.check(t + 1.0 + m.silence_limit * 0.9) == []
    (f,) = m.check(t + 1.0 + m.silence_limit * 1.1)
    assert f.kind is FailureKind.HANG and f.after_pause
    # A worker alive, running and silent with no pause before is a hang once its silence
    # outlasts the hang floor (1 s here; before it, a starved beat thread), killed by
    # the supervisor after the usual report.
    m2, proc2 = paused_monitor()
    t = beat_until(m2, 0, 0.0, 1.0)
    assert m2.check(t + 0.5) == []
    (f,) = m2.check(t + 1.05)
    assert f.kind is FailureKind.HANG and not f.after_pause


def test_a_paused_worker_that_exits_or_stops_beating_during_its_check_is_not_offered() -> None:
    m, proc = paused_monitor()
    t = beat_until(m, 0, 0.0, 1.0)
    proc.state = "stopped"
    m.check(t + 0.5)
    proc.state = "alive"
    m.beat(0, t + 1.0, 0, 10)
    m.check(t + 1.0)
    proc.state = "stopped"  # stopped again during the check: a pause again, the check restarts
    assert m.check(t + 1.5) == []
    proc.state = "alive"
    m.beat(0, t + 2.0, 0, 10)
    m.check(t + 2.0)
    assert m.workers[0].resumed_at == pytest.approx(t + 2.0)
    (f,) = [f for f in [m.process_exited(0, t + 2.2, -9)] if f]
    assert f.kind is FailureKind.EXIT
    assert m.check(t + 5.0) == [] and m.take_resumed() == []
