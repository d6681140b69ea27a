"""The job's typed events: the JSON form events.json holds, the controller's sinks, and
a run's observer (resihp_core/protocols/events.py)."""

from __future__ import annotations

import threading

import msgspec
import pytest

from resihp_core.detector import Detection
from resihp_core.protocol import FailureReport, WorkerProcess
from resihp_core.protocols.events import (EventLog, Failure, IterationMetrics, JobEvent, NodeLost, PlanPosted,
                                          Replanned, decode_events, encode_events, event_dicts, fan_out, observer,
                                          only)


def test_job_events_round_trip_through_their_json_form_named_by_kind() -> None:
    events: list[JobEvent] = [
        PlanPosted(text="generation 1 (dp)", plan="resihp-plan v1", kind_of_plan="dp", resume=3, restore=None,
                   iteration=3, generation=1, devices=(1,)),
        Failure(text="fail-stop of devices [1]", failure="fail-stop", cause="unknown", devices=(1,)),
        Replanned(text="kept", pays=False, gain_s=0.5, cost_s=2.0, horizon=14),
    ]
    back = decode_events(encode_events(events))
    assert back == events and [e.kind for e in back] == ["plan", "failure", "replan"]
    dicts = event_dicts(events)
    assert dicts[0]["kind"] == "plan" and dicts[0]["devices"] == [1] and dicts[1]["failure"] == "fail-stop"


def test_a_hostile_events_file_is_refused_naming_the_field() -> None:
    with pytest.raises(msgspec.ValidationError, match="kind"):
        decode_events(b'[{"kind": "reboot", "text": "x"}]')
    with pytest.raises(msgspec.ValidationError, match="iteration"):
        decode_events(b'[{"kind": "failure", "text": "x", "failure": "fail-stop", "iteration": "three"}]')


def test_sinks_compose_and_one_that_raises_does_not_stop_the_others() -> None:
    got: list[FailureReport] = []
    log = EventLog()

    def broken(event: object) -> None:
        raise RuntimeError("an observer's bug")

    sink = fan_out(broken, only(FailureReport, got.append), log)
    report = FailureReport(generation=0, failure="fail-stop", devices=(2,), evidence="test")
    sink(NodeLost(1))
    sink(report)
    assert got == [report] and log.reports == [report] and log.of(NodeLost) == [NodeLost(1)] and len(log) == 2


def test_the_event_log_wakes_a_waiter_when_the_event_arrives() -> None:
    log = EventLog()
    report = FailureReport(generation=0, failure="fail-slow", devices=(3,), evidence="test")
    threading.Timer(0.05, log, args=(report,)).start()
    assert log.wait_for_report(lambda r: r.failure == "fail-slow", timeout=5.0) == report
    assert log.wait_for(WorkerProcess, timeout=0.05) is None


def test_an_observer_routes_each_kind_to_its_function() -> None:
    seen: dict[str, list[object]] = {"job": [], "iteration": [], "detection": []}
    observe = observer(job=seen["job"].append, iteration=seen["iteration"].append,
                       detection=seen["detection"].append)
    plan = PlanPosted(text="initial", plan="p")
    metrics = IterationMetrics(iteration=0, loss=1.0, seconds=0.1, samples=8, generation=0, phase="running")
    detection = Detection(iteration=4, measured=0.2)
    for ev in (plan, metrics, detection, NodeLost(0)):
        observe(ev)
    assert seen == {"job": [plan], "iteration": [metrics], "detection": [detection]}
