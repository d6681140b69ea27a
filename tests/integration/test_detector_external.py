"""Slowdowns made from outside the job, as users meet them (docs/detector.md):
a CPU hog pinned to one worker's core, the same load on every worker alike, a worker
stopped half of the time (duty-cycled SIGSTOP), and a 1.5x slowdown of one device of
a small model whose iteration is ~0.3 s.

Real training workers (reference backend, float64), node agents, controller, Scheduler
and supervisor; every run ends with the survivors checked against the fault-free
reference. The machine has 2 cores: each worker of the DP-2 job is pinned to a core of
its own (every thread, ``os.sched_setaffinity``), and a hog (three busy processes, so
it still counts when other jobs share the core) pinned to a worker's core takes most of
that worker's CPU.

Detection is held to its targets (a report within 3 iterations, none for the same
load on every core) on a machine the test does not share with much else: other
processes (not this test's tree: its workers, hogs, agents and controller are its own)
used at most a quarter of the cores' time while it ran (``OutsideLoad``, measured from
/proc; a fresh CI machine running only this suite uses about none). The load average
cannot tell: the test's own job puts it above the 2 cores, and gated on it the targets
were asserted nowhere. On a shared machine (10-30 runnable tasks on 2 cores while this
was written) other jobs' load on each core swings as much as the hog, and only what
holds under any load is asserted: nothing is fail-stopped and training stays exact (as
in tests/integration/test_environment.py; on such a machine a worker the others' load
hits harder for several iterations is itself localised: docs/detector.md "Not covered").

Latency counts iterations from the first one that *started* after the slowdown did,
that one included: the slowdown starts when the supervisor sees iteration k committed,
while the workers are already computing k + 1 (which is then only partly slowed), so
the first fully slowed iteration is k + 2.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import statistics
import threading
import time

import pytest

from resihp_core.faults import fail_at
from resihp_core.job import JobSpec
from resihp_core.plan import parse_plan
from resihp_core.testing.duty import duty_cycle, duty_period
from resihp_core.testing.hogs import CpuHogs
from resihp_core.testing.outside_load import OutsideLoad

from .backend_harness import HEADS, LAYERS, job_spec, tmpdir, uniform
from .test_chaos import SLOW_DETECTOR, _work, run_checked

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ONSET = 10  # warm-up (1 skipped + 3 fitted) and 4 healthy iterations of per-device history before it
SETTLE = 8



def _cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def _worker_pids(job_path: str) -> dict[int, int]:
    """device -> pid of the live training worker of the job at ``job_path``."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if env.get(b"RESIHP_JOB") == job_path.encode() and b"resihp_core.runtime.worker" in cmd:
            out[int(env[b"RESIHP_DEVICE"])] = int(pid)
    return out


def _pin(pid: int, core: int) -> None:
    """Pin every thread of ``pid`` to ``core``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except OSError:  # a thread that ended meanwhile
            pass


def _quiet(outside: OutsideLoad) -> bool:
    """Whether the machine was quiet enough to hold detection to its targets: processes
    outside this test used at most a quarter of its cores' time over the run (module
    docstring). The targets on a shared machine are measured by benchmarks/detector.py
    (docs/detector.md)."""
    return outside.quiet(0.25)


def _machine(loads: list[float], outside: OutsideLoad) -> str:
    asserted = "asserted" if _quiet(outside) else "not asserted (a shared machine)"
    return f"load average {min(loads):.1f}-{max(loads):.1f}, {outside.describe()}; targets {asserted}"


class _Job:
    """The job's path (from ``before_run``) and its workers, each pinned to its own core."""

    def __init__(self) -> None:
        self.path = ""
        self.pids: dict[int, int] = {}
        self.job = None

    def before_run(self, job, agents) -> None:
        self.path = str(job.job_path)
        self.job = job

    def pin(self) -> dict[int, int]:
        cores = _cores()
        self.pids = _worker_pids(self.path)
        for d, pid in self.pids.items():
            _pin(pid, cores[d % len(cores)])
        return self.pids


class _DetectorLog(logging.Handler):
    """The detector's own account of a run (its ``event=`` lines, the recovery watch's
    per-iteration excess at debug level), kept so that a miss on a machine nobody can
    log into (CI) says why: printed with the test's output."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._logger = logging.getLogger("resihp.detector")
        self._level = self._logger.level

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage()[:400])

    def __enter__(self) -> _DetectorLog:
        self._logger.addHandler(self)
        self._logger.setLevel(logging.DEBUG)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)

    def tail(self, n: int = 40) -> str:
        return "\n    ".join(["detector log (last lines):", *self.lines[-n:]])


def _reports(run):
    return [e for e in run.events if e["kind"] == "failure"]


def _found(detections, device: int):
    return next((d for d in detections if d.report is not None and device in d.report.devices), None)


def _explain(detections) -> list:
    return [(d.iteration, d.action, d.notes[:1], d.verdict and d.verdict.evidence[:160])
            for d in detections if d.action not in ("none", "warmup")]


#: A small model whose iterations (~0.1-0.2 s on a quiet 2-core machine) are what a
#: user's small job has; the harness's tiny one (~0.04 s) is mostly scheduling jitter,
#: against which 1.5x of one device's compute (a few milliseconds) is not a slowdown.
PAUSE_MODEL = dict(vocab_size=64, hidden=96, num_heads=HEADS, ffn_hidden=384, num_layers=LAYERS, dtype="float64")
PAUSE_DATA = dict(source="synthetic", scale=24.0, shape=0.8, min_len=2, max_len=128, token_budget=128)


def _small_job(plan, **kw) -> JobSpec:
    """The reference backend's job of ``plan`` on the small model (PAUSE_MODEL)."""
    return JobSpec(adapter="megatron_ref", adapter_config=PAUSE_MODEL, data=PAUSE_DATA, dp=plan.dp,
                   num_microbatches=plan.num_microbatches, timeout_s=10.0, dump_dir=tmpdir(), **kw)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin a worker apart from its peer")
def test_a_cpu_hog_on_one_workers_core_is_its_fail_slow_the_same_load_on_every_core_is_not():
    """Phase 1 (iterations ONSET .. ONSET + 6): a hog on each worker's core: every
    worker slowed alike, nothing is reported. Phase 2: the hog on device 1's core ends;
    device 0 alone is slowed by its host: reported (cause contention) within 3
    iterations, and the Scheduler moves work away from it."""
    plan = uniform(1, 1, 2, 4)
    job = _Job()
    at: dict[str, int] = {}
    detections = []
    cores = _cores()
    loads: list[float] = []
    outside = OutsideLoad()
    # Three busy processes per worker's core, started (and held) before the job: on a
    # loaded machine each takes seconds to start, and the hogs of both cores must begin
    # together, or the first core is loaded alone for a few iterations (which is a
    # localised slowdown, rightly reported).
    hogs = CpuHogs([cores[d % len(cores)] for d in (0, 1)], per_core=3, seconds=120).start()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        if rec.iteration == 0:
            job.pin()  # before the warm-up the healthy model is fitted on
        if rec.iteration + 1 == ONSET and "all" not in at:
            job.pin()  # threads started since (collectives) follow too
            hogs.release()
            at["all"] = rec.iteration + 2
        if rec.iteration + 1 == ONSET + 6 and "all" in at and "one" not in at:
            hogs.kill([cores[1 % len(cores)]])
            at["one"] = rec.iteration + 2

    # The small model's ~0.15 s iterations (PAUSE_MODEL), not the harness's ~0.03 s: on
    # those, scheduling jitter alone once held one worker 1.3-1.5x its peer for three
    # iterations before any hog ran, and it was reported.
    spec = _small_job(plan)
    try:
        with _DetectorLog() as log:
            run = run_checked(spec, plan, SLOW_DETECTOR, ONSET + 6 + SETTLE, before_run=job.before_run,
                              on_iteration=on_iteration, on_detection=detections.append)
    finally:
        hogs.kill()
    seen = _explain(detections)
    print("detections:", seen, _machine(loads, outside), log.tail(), sep="\n  ")
    assert job.pids and "one" in at, (job.pids, at)
    reports = _reports(run)
    assert not [e for e in reports if e["failure"] != "fail-slow"], reports
    if not _quiet(outside):
        return
    assert not [e for e in reports if e["devices"] != [0]], reports  # device 1 never had its core less to itself
    machine_wide = [d for d in detections if d.report is not None and d.iteration < at["one"]]
    assert machine_wide == [], seen
    found = _found(detections, 0)
    assert found is not None, (seen, _reports(run))
    assert found.report.devices == (0,) and found.report.cause == "contention", found.report
    assert found.iteration - at["one"] + 1 <= 3, (at, seen)
    assert [(e["failure"], e["devices"]) for e in _reports(run)] == [("fail-slow", [0])], _reports(run)
    assert _work(run.final_plan, 0) < _work(plan, 0), run.final_plan.to_text()


#: Opt-in (docs/detector.md "Tests"): three jobs of ~20 iterations, ~15 s each on a
#: quiet 2-core machine, over CI's budget.
NEIGHBOUR_OPT_IN = "RESIHP_NEIGHBOUR_TESTS"


@pytest.mark.skipif(os.environ.get(NEIGHBOUR_OPT_IN) != "1", reason=f"opt-in: {NEIGHBOUR_OPT_IN}=1")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to pin a worker apart from its peer")
@pytest.mark.parametrize("outside_per_core", [0, 1, 2])
def test_a_noisy_neighbour_on_one_workers_core_is_reported_within_3_iterations_on_a_busy_host(outside_per_core):
    """Issue #33's noisy neighbour on a busy host. ``outside_per_core`` busy processes
    per core, not pinned (other users' jobs: the scheduler places them), run from before
    the job to its end: load every rank bears, never reported. At the onset worker 0 is
    pinned (every thread, as ``taskset -a -p``) to a core shared with two busy loops
    pinned there, its peer left free on every core. Where that slowed worker 0 by 1.3x
    or more beyond its peer (measured by the OS: each worker's time on a CPU or waiting
    for one, ``/proc/PID/schedstat``, from the onset on; with busy processes added the
    scheduler may balance them onto the peer's core, and then both bear the neighbour's
    load alike), worker 0 is reported, cause ``contention``, within 3 iterations.
    Asserted when processes outside the test took at most a quarter of the cores' time
    (module docstring); the load it added, the one it measured and the slowdown are
    printed."""
    plan = uniform(1, 1, 2, 4)
    job = _Job()
    at: dict[str, int] = {}
    detections = []
    cores = _cores()
    loads: list[float] = []
    outside = OutsideLoad()
    pids: dict[int, int] = {}
    times: dict[str, dict[int, float]] = {}
    busy = CpuHogs(None, per_core=outside_per_core * len(cores), seconds=120) if outside_per_core else None
    neighbour = CpuHogs([cores[0]], per_core=2, seconds=120).start()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        if rec.iteration + 1 == ONSET and "onset" not in at:
            pids.update(_worker_pids(job.path))
            _pin(pids[0], cores[0])
            neighbour.release()
            at["onset"] = rec.iteration + 2
            times["onset"] = {d: _on_or_waiting_for_cpu(pid) for d, pid in pids.items()}
        if rec.iteration + 1 == ONSET + SETTLE - 1 and "onset" in times and "end" not in times:
            times["end"] = {d: _on_or_waiting_for_cpu(pid) for d, pid in pids.items()}

    spec = job_spec(dp=plan.dp, m=plan.num_microbatches, dump_dir=tmpdir())
    try:
        if busy is not None:
            busy.start().release()
        run = run_checked(spec, plan, SLOW_DETECTOR, ONSET + SETTLE, before_run=job.before_run,
                          on_iteration=on_iteration, on_detection=detections.append)
    finally:
        neighbour.kill()
        if busy is not None:
            busy.kill()
    seen = _explain(detections)
    spent = {d: times["end"][d] - times["onset"][d] for d in pids} if "end" in times else {}
    slowed = spent[0] / spent[1] if spent and spent[1] > 0 else 0.0
    print(f"outside load added: {outside_per_core} busy process(es) per core ({len(cores)} cores); worker 0 "
          f"on or waiting for a CPU {slowed:.2f}x its peer after the onset;", "detections:", seen,
          _machine(loads, outside))
    reports = _reports(run)
    assert "onset" in at and spent and not [e for e in reports if e["failure"] != "fail-slow"], (reports, times)
    if not _quiet(outside):
        return
    early = [d for d in detections if d.report is not None and d.iteration < at["onset"]]
    assert early == [], seen  # the outside load every rank bears
    if slowed < 1.3:
        return  # the scheduler spread the neighbour's load over both workers: nothing to find
    found = _found(detections, 0)
    assert found is not None, (seen, reports)
    assert found.report.devices == (0,) and found.report.cause == "contention", found.report
    assert found.iteration - at["onset"] + 1 <= 3, (at, seen)
    assert not [e for e in reports if e["devices"] != [0]], reports


def _on_or_waiting_for_cpu(pid: int) -> float:
    """Seconds ``pid``'s main (training) thread has run on a CPU or waited for one
    (the first two fields of ``/proc/PID/schedstat``)."""
    with open(f"/proc/{pid}/schedstat") as f:
        run, wait = f.read().split()[:2]
    return (int(run) + int(wait)) / 1e9


def test_a_worker_stopped_half_of_the_time_is_reported_within_3_iterations():
    plan = uniform(1, 1, 2, 4)
    job = _Job()
    stop = threading.Event()
    at: dict[str, float] = {}
    detections = []
    seconds: dict[int, float] = {}
    stopped: list[float] = []  # seconds the worker was stopped, and the cycle's wall time

    def duty(pid: int, period: float) -> None:
        stopped[:] = duty_cycle(pid, stop, period)  # like a throttled or preempted process

    thread: list[threading.Thread] = []
    loads: list[float] = []
    outside = OutsideLoad()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        seconds.setdefault(rec.iteration, rec.seconds)
        if rec.iteration + 1 == ONSET and not thread:
            pid = _worker_pids(job.path)[1]
            at["period"] = duty_period(statistics.median(seconds[i] for i in range(4, ONSET - 1) if i in seconds))
            thread.append(threading.Thread(target=duty, args=(pid, at["period"]), daemon=True))
            thread[0].start()
            at["onset"] = rec.iteration + 2

    # The small model's ~0.15 s iterations (PAUSE_MODEL), not the harness's
    # ~0.05 s: a stop cycle of a quarter of those is a few milliseconds, near the
    # scheduler's own jitter, and the slowdown it makes is not the same in each iteration.
    spec = _small_job(plan)
    try:
        with _DetectorLog() as log:
            run = run_checked(spec, plan, SLOW_DETECTOR, ONSET + SETTLE, before_run=job.before_run,
                              on_iteration=on_iteration, on_detection=detections.append)
    finally:
        stop.set()
        for t in thread:
            t.join(5)
    seen = _explain(detections)
    print("detections:", seen, "iteration seconds:", {i: round(s, 3) for i, s in sorted(seconds.items())},
          f"stop cycle {at.get('period', 0):.3f} s, stopped {stopped[0] if stopped else 0:.1f} s of "
          f"{stopped[1] if stopped else 0:.1f} s", _machine(loads, outside), log.tail(), sep="\n  ")
    assert not [e for e in _reports(run) if e["failure"] != "fail-slow"], _reports(run)
    if not _quiet(outside):
        return
    found = _found(detections, 1)
    assert found is not None, (seen, _reports(run))
    assert found.report.devices == (1,), found.report
    assert found.iteration - at["onset"] + 1 <= 3, (at, seen)
    assert [e["failure"] for e in _reports(run)] == ["fail-slow"], _reports(run)


def test_a_1_5x_slowdown_of_one_device_of_a_small_model_is_reported_within_3_iterations():
    """The reference backend with a small model: ~0.15-0.3 s iterations. Reported within
    3 iterations, unless the job told its user, before the slowdown, that its iterations
    vary too much to find slowdowns under 1.5x (docs/detector.md "Short or noisy
    iterations": a job that cannot be judged says so rather than stay silent)."""
    plan = uniform(1, 1, 2, 4)
    detections = []
    seconds: dict[int, float] = {}
    loads: list[float] = []
    outside = OutsideLoad()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        seconds.setdefault(rec.iteration, rec.seconds)

    spec = _small_job(plan, faults=[fail_at(1, ONSET, "slow", factor=1.5).to_dict()])
    with _DetectorLog() as log:
        run = run_checked(spec, plan, SLOW_DETECTOR, ONSET + SETTLE, on_detection=detections.append,
                          on_iteration=on_iteration)
    seen = _explain(detections)
    notices = [(d.iteration, d.notice) for d in detections if d.notice]
    print(f"detections: {seen}", f"notices: {notices}",
          f"iteration seconds: { {i: round(s, 3) for i, s in sorted(seconds.items())} }", _machine(loads, outside),
          log.tail(), sep="\n  ")
    assert not [e for e in _reports(run) if e["failure"] != "fail-slow"], _reports(run)
    if not _quiet(outside):
        return
    found = _found(detections, 1)
    if found is None:
        bars = [float(m.group(1)) for it, text in notices if it <= ONSET + 1
                for m in [re.search(r"under ([0-9.]+)x", text)] if m]
        assert bars and bars[0] >= 1.5, ("missed, and the job never said it cannot see 1.5x", seen, notices)
        return
    assert found.report.devices == (1,) and found.report.cause == "compute", found.report
    assert found.iteration - ONSET + 1 <= 3, seen
    assert [e["failure"] for e in _reports(run)] == ["fail-slow"], _reports(run)


# ------------------------------------------------------------------ paused workers
PAUSE_S = 15.0
# PAUSE_MODEL (above): its iteration (~0.15-0.2 s on a quiet 2-core machine) is long next
# to the resumed worker's health check (FailStopMonitor.resume_check_s, 0.3 s here) and
# the re-plan: with the harness's tiny model (~0.03-0.07 s) those alone take 6-10
# iterations, so "planned back in within 3 iterations" would measure the model size.


def test_a_worker_stopped_for_15_s_is_fenced_not_killed_and_planned_back_in_when_it_resumes():
    """SIGSTOP of one worker of a DP-2 job for 15 s (a long GC pause, a debugger, a
    preempting host): the job goes on without it, the same process is planned back in
    within 3 iterations of its SIGCONT, and training stays exact (every survivor,
    the paused one included, equals the fault-free run)."""
    from .test_chaos import DETECTOR

    plan = uniform(1, 1, 2, 4)
    job = _Job()
    at: dict[str, float] = {}
    pids: dict[str, int] = {}
    events: list[dict] = []
    # Room after SIGCONT: a quick job reaches the forced resume (iterations - 20) before
    # 15 s; CI once saw no rejoin within the 11 iterations left of an earlier setting.
    iterations = 60
    stopped: list[int] = []
    detections = []
    seconds: dict[int, float] = {}

    loads: list[float] = []
    outside = OutsideLoad()

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        seconds.setdefault(rec.iteration, rec.seconds)
        if rec.iteration + 1 == 4 and not stopped:
            pids["before"] = _worker_pids(job.path)[1]
            os.kill(pids["before"], signal.SIGSTOP)
            stopped.append(pids["before"])
            at["stopped"], at["stop_time"] = rec.iteration, time.monotonic()
        elif stopped and "resumed" not in at and (time.monotonic() - at["stop_time"] >= PAUSE_S
                                                  or rec.iteration >= iterations - 20):
            os.kill(stopped[0], signal.SIGCONT)
            at["cont_time"] = time.monotonic()
            # Iterations committed when it resumed (the job may be ahead of ``rec``).
            at["resumed"] = max(rec.iteration + 1, job.job.committed)
            at["paused_s"] = time.monotonic() - at["stop_time"]
        if rec.iteration == iterations - 1:
            pids["after"] = _worker_pids(job.path).get(1, -1)

    def on_event(e) -> None:
        events.append(e)
        if e.kind == "plan" and "rejoin of devices [1]" in e.text and "cont_time" in at:
            at.setdefault("rejoin_after_s", time.monotonic() - at["cont_time"])

    spec = _small_job(plan, checkpoint_dir=tmpdir(), checkpoint_every=1)
    try:
        run = run_checked(spec, plan, DETECTOR, iterations, before_run=job.before_run, on_iteration=on_iteration,
                          on_event=on_event, on_detection=detections.append)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
    print("events:", [(e.iteration, e.kind, e.text[:100]) for e in events], at)
    print("detections:", _explain(detections), _machine(loads, outside))
    print("iteration seconds:", {i: round(s, 3) for i, s in sorted(seconds.items())})
    assert "resumed" in at and at["paused_s"] >= 5.0, at  # longer than any hang timeout of old
    failures = [e for e in run.events if e["kind"] == "failure"]
    assert [(e["failure"], e["devices"]) for e in failures if e["failure"] == "fail-stop"] == [("fail-stop", [1])], \
        failures
    # The job went on without it meanwhile: iterations committed while it was stopped.
    fenced = next(e for e in run.events if e["kind"] == "plan" and e["generation"] >= 1)
    assert fenced["iteration"] < at["resumed"], run.events
    assert any(r.generation == fenced["generation"] for r in run.records)
    # Back in: a later generation whose plan gives it work, posted within 3 iterations of
    # SIGCONT (both counted in iterations committed).
    back = [e for e in run.events if e["kind"] == "plan" and "rejoin of devices [1]" in e["text"]]
    assert back, run.events
    # Nothing but the pause is reported (issue #33 item 4): not the paused device as slow
    # (it is a fail-stop, fenced), before or after its rejoin, and not its healthy peer,
    # whose model the rejoin's warm-up refits (docs/detector.md "Paused workers come
    # back"). Held in the 3 of 3 runs completed beside other jobs taking 1.4-1.6 of 2 cores.
    assert not [e for e in failures if e["failure"] == "fail-slow"], failures
    if _quiet(outside):
        assert back[0]["iteration"] - at["resumed"] <= 3, (back[0], at)
    assert _work(parse_plan(back[0]["plan"]), 1) > 0, back[0]["plan"]  # the plan that took it back gives it work
    assert pids["after"] == pids["before"], pids  # the same process: never killed


def test_a_worker_stopped_half_of_the_time_then_let_run_gets_its_original_layout_back():
    """The duty cycle of the test above for 10 iterations, then the worker runs freely:
    it is reported slow, then healthy again after 5 iterations at full speed
    (docs/detector.md "Acting on a slowdown"), and the plan returns to the layout the
    job started with. Asserted when the machine was quiet (module docstring)."""
    plan = uniform(1, 1, 2, 4)
    job = _Job()
    stop = threading.Event()
    at: dict[str, float] = {}
    seconds: dict[int, float] = {}
    loads: list[float] = []
    outside = OutsideLoad()
    thread: list[threading.Thread] = []
    cycle = 10

    def on_iteration(rec) -> None:
        loads.append(os.getloadavg()[0])
        outside.sample()
        seconds.setdefault(rec.iteration, rec.seconds)
        if rec.iteration + 1 == ONSET and not thread:
            pid = _worker_pids(job.path)[1]
            period = duty_period(statistics.median(seconds[i] for i in range(4, ONSET - 1) if i in seconds))
            thread.append(threading.Thread(target=duty_cycle, args=(pid, stop, period), daemon=True))
            thread[0].start()
            at["onset"] = rec.iteration + 2
        if rec.iteration + 1 == ONSET + cycle and "end" not in at:
            stop.set()
            at["end"] = rec.iteration + 2

    # The small model's ~0.15 s iterations, not the harness's ~0.05 s: on those a few
    # milliseconds of scheduling jitter are a third of a micro-batch, and after the
    # return the healthy layout was reported slow again for such noise.
    spec = _small_job(plan)
    try:
        with _DetectorLog() as log:
            run = run_checked(spec, plan, SLOW_DETECTOR, ONSET + cycle + 25, before_run=job.before_run,
                              on_iteration=on_iteration)
    finally:
        stop.set()
        for t in thread:
            t.join(5)
    events = [(e["iteration"], e["kind"], e["text"][:220]) for e in run.events
              if e["kind"] in ("failure", "recovered", "replan", "plan")]
    print("events:", *events, _machine(loads, outside), f"cycle {at}", log.tail(60), sep="\n  ")
    assert not [e for e in _reports(run) if e["failure"] != "fail-slow"], _reports(run)
    if not _quiet(outside):
        return
    slow = [e for e in _reports(run) if e["devices"] == [1]]
    back = [e for e in run.events if e["kind"] == "recovered" and e["devices"] == [1]]
    # Healthy again only after the cycle ended: 5 iterations at full speed, the one in
    # which it ended counting when little of it was stopped (events carry the count of
    # iterations committed when they happened).
    assert slow and back and back[0]["iteration"] >= at["end"] + 2, events
    final = run.final_plan
    assert (final.tp_groups, final.layer_ranges, final.migrations) == (plan.tp_groups, plan.layer_ranges,
                                                                       plan.migrations), events
