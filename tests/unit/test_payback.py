"""Re-plans that pay back (runtime/controller/payback.py), driven through the supervisor with an
injected clock and no processes: a fail-slow re-plan is deployed only when its
predicted gain over the horizon beats the reconfiguration cost measured on the job,
and the plan returns to the original layout once the device is healthy again."""

from __future__ import annotations

from dataclasses import replace

import pytest

from resihp_core.protocol import FailureReport
from resihp_core.runtime.controller.payback import PaybackRule, ReconfigurationMeter, origin_candidate, worker_timing
from resihp_core.runtime.controller.supervisor import (
    Committed, Deploy, Deployed, Emit, Phase, PlanFailure, Planned, Reconfigured, Supervisor,
)
from resihp_core.scheduler.planner import Planner
from test_supervisor import DEVICES, PLAN, STATE, Clock, of, tick

PLANNER = Planner(stages=None)


def slow(p: float = 0.5, generation: int = 0) -> FailureReport:
    return FailureReport(generation=generation, failure="fail-slow", devices=(2,), cause="compute",
                         throughput={2: p})


def healthy_again(generation: int) -> FailureReport:
    return FailureReport(generation=generation, failure="fail-slow", devices=(2,), cause="compute",
                         throughput={2: 1.0}, evidence="healthy again")


def job(iterations: int | None, clock: Clock, rule: PaybackRule | None = PaybackRule(default_cost_s=2.0),
        commits: int = 6, step: float = 0.2) -> Supervisor:
    """Generation 0 on every device, ``commits`` iterations committed ``step`` s apart."""
    sup = Supervisor(STATE, clock=clock, payback=rule, iterations=iterations)
    sup.handle(Deployed(0, DEVICES, 0))
    for i in range(commits):
        clock.now += step
        sup.handle(Committed(i, 0))
    assert sup.phase is Phase.RUNNING
    return sup


def plan_report(sup: Supervisor, report: FailureReport) -> list:
    """Feed ``report``, let the supervisor ask, answer with the real planner."""
    sup.handle(report)
    asked = of(sup.handle(tick()), PlanFailure)
    assert len(asked) == 1
    return sup.handle(Planned(PLANNER.plan(asked[0].state, asked[0].report), 0.01))


def replan_events(actions: list) -> list[Emit]:
    return [a for a in of(actions, Emit) if a.kind == "replan"]


def test_a_re_plan_that_cannot_pay_back_in_the_iterations_left_keeps_the_plan() -> None:
    # 0.2 s/it measured, the re-plan predicts 30 % less: 0.06 s/it x 14 iterations left
    # saves under 1 s, less than the 2 s a reconfiguration costs.
    sup = job(iterations=20, clock=Clock())
    acts = plan_report(sup, slow())
    assert not of(acts, Deploy)
    (ev,) = replan_events(acts)
    assert "does not pay back" in ev.text and "14 left" in ev.text and ev.event.pays is False
    assert ev.event.gain_s < ev.event.cost_s == pytest.approx(2.0)
    assert sup.phase is Phase.RUNNING and sup.state.plan == PLAN
    assert dict(sup.state.speeds) == {2: 0.5}  # the speed is known; the layout stays

    # Without the rule the same report is deployed (what the rule prevents).
    bare = job(iterations=20, clock=Clock(), rule=None)
    assert of(plan_report(bare, slow()), Deploy)


def test_a_re_plan_that_pays_back_over_the_horizon_is_deployed_and_says_why() -> None:
    sup = job(iterations=1000, clock=Clock())
    acts = plan_report(sup, slow())
    (dep,) = of(acts, Deploy)
    assert dep.decision.plan.layer_ranges != PLAN.layer_ranges
    (ev,) = replan_events(acts)
    assert ev.event.pays is True and ev.event.horizon == 100 and ev.event.gain_s > 2.0
    assert "pays back" in dep.decision.reason and "default" in dep.decision.reason


def test_before_a_re_plan_is_measured_the_workers_own_timing_stands_in_for_the_default() -> None:
    # The job of the first test (0.2 s/it, 14 iterations left, a re-plan saving under
    # 1 s): its workers entered generation 0 in 0.05 s, so a re-plan is estimated at
    # 0.05 s + the 0.2 s iteration it aborts, and it pays back.
    sup = job(iterations=20, clock=Clock())
    sup.handle(Reconfigured(0, 0.05))
    acts = plan_report(sup, slow())
    (ev,) = replan_events(acts)
    assert of(acts, Deploy) and ev.event.pays is True
    assert ev.event.cost_s == pytest.approx(0.25) and "estimated" in ev.text and "0.05 s" in ev.text

    # The default caps the estimate: a timing above it changes nothing, and 0 stays free.
    slow_workers = job(iterations=20, clock=Clock())
    slow_workers.handle(Reconfigured(0, 30.0))
    (ev,) = replan_events(plan_report(slow_workers, slow()))
    assert ev.event.pays is False and ev.event.cost_s == pytest.approx(2.0) and "default" in ev.text
    free = job(iterations=20, clock=Clock(), rule=PaybackRule(default_cost_s=0.0))
    free.handle(Reconfigured(0, 0.05))
    (ev,) = replan_events(plan_report(free, slow()))
    assert ev.event.cost_s == 0.0 and ev.event.pays is True


def test_the_workers_timing_is_the_fastest_rebuild_and_the_slowest_state_and_ignores_bad_fields() -> None:
    ready = {0: {"rebuild_s": 0.43, "state_s": 0.007, "comm_path": "rebuild"},  # waited for device 1 to arrive
             1: {"rebuild_s": 0.005, "state_s": 0.004},
             2: {"rebuild_s": 0.06, "state_s": 0.02}}
    assert worker_timing(ready) == pytest.approx(0.005 + 0.02)
    hostile = {0: {"rebuild_s": "0.001", "state_s": float("nan")}, 1: {"rebuild_s": -1, "state_s": True},
               2: {"rebuild_s": float("inf"), "state_s": [0.1]}, 3: {"rebuild_s": 0.2, "state_s": 0.3}}
    assert worker_timing(hostile) == pytest.approx(0.5)
    assert worker_timing({}) is None and worker_timing({0: {"rebuild_s": "x", "state_s": None}}) is None


def test_the_reconfiguration_cost_is_measured_on_the_job_and_then_decides() -> None:
    clock = Clock()
    sup = job(iterations=1000, clock=clock)
    (dep,) = of(plan_report(sup, slow()), Deploy)
    clock.now += 0.4  # planning and the post
    sup.handle(Deployed(1, DEVICES, 6))
    clock.now += 4.6  # reconfiguring: the first commit of generation 1 is 5 s after the last of generation 0
    sup.handle(Committed(6, 1))
    for i in range(7, 12):
        clock.now += 0.15
        sup.handle(Committed(i, 1))
    assert sup.meter.cost_s() == pytest.approx(5.0 - 0.15)
    # A further slowdown of the same device: the planner would gain about 0.015 s/it x
    # 100, under the measured cost, where the default 2 s would have let it through.
    acts = plan_report(sup, slow(0.25, generation=1))
    (ev,) = replan_events(acts)
    assert "measured" in ev.text and ev.event.cost_s == pytest.approx(4.85)
    assert bool(of(acts, Deploy)) == (ev.event.gain_s > 4.85)


def test_the_plan_returns_to_the_original_layout_when_the_device_is_healthy_again() -> None:
    clock = Clock()
    sup = job(iterations=1000, clock=clock)
    (dep,) = of(plan_report(sup, slow()), Deploy)
    moved = dep.decision.plan
    assert moved.layer_ranges != PLAN.layer_ranges
    sup.handle(Deployed(1, DEVICES, 6))
    for i in range(6, 12):
        clock.now += 0.15
        sup.handle(Committed(i, 1))
    acts = plan_report(sup, healthy_again(generation=1))
    (back,) = of(acts, Deploy)
    assert back.decision.plan.layer_ranges == PLAN.layer_ranges and back.decision.plan.tp_groups == PLAN.tp_groups
    assert back.what == "return to the better layout"
    assert "healthy again" in replan_events(acts)[0].text and not sup.state.speeds


def test_the_original_layout_is_preferred_when_it_is_as_fast_as_the_planners_answer() -> None:
    moved = PLANNER.plan(STATE, slow())
    healthy = moved.state.with_health(speeds={})
    # A planner that, with every device healthy, would keep the moved layout:
    stay = replace(moved, state=healthy, predicted_time=healthy.evaluator.time(moved.plan))
    back = origin_candidate(stay)
    assert back is not None and back.plan.layer_ranges == PLAN.layer_ranges
    assert back.predicted_time <= stay.predicted_time
    assert origin_candidate(moved) is None  # a device still slow: not the original


def test_the_meter_measures_only_re_plans_and_survives_batched_commits() -> None:
    m = ReconfigurationMeter(steady_iterations=3)
    m.deployed(replan=False)
    for t in (1.0, 1.2, 1.4):
        m.committed(t)
    assert m.cost_s() is None  # the first generation's start-up is not a reconfiguration
    m.deployed(replan=True)
    for t in (4.0, 4.4, 4.4, 4.8):  # two commits taken in one round of the control loop
        m.committed(t)
    assert m.cost_s() == pytest.approx((4.0 - 1.4) - 0.8 / 3)


def test_the_rule_refuses_bad_settings_by_name() -> None:
    with pytest.raises(ValueError, match="horizon_iterations"):
        PaybackRule(horizon_iterations=0)
    with pytest.raises(ValueError, match="default_cost_s"):
        PaybackRule(default_cost_s=-1)


def test_a_slow_link_no_layout_moves_traffic_off_is_said_plainly() -> None:
    sup = job(iterations=1000, clock=Clock())
    link = FailureReport(generation=0, failure="fail-slow", devices=(0, 1, 2, 3), cause="communication",
                         throughput={d: 0.5 for d in DEVICES})
    acts = plan_report(sup, link)  # every device's link alike: no plan runs around it
    assert not of(acts, Deploy)
    (ev,) = replan_events(acts)
    # Each node's interface is slow (every device of both nodes named): the event names
    # each link, what still crosses it and why (scheduler/links.py).
    for node, devs in ((0, [0, 1]), (1, [2, 3])):
        assert (f"the link of node {node} (devices {devs}, 0.5 of its bandwidth) still carries the pipeline "
                "boundary of replica 0 between stages 0 and 1") in ev.text
    assert ev.text.count("every node the plan uses has a slow link") == 2, ev.text
    assert "nothing to reconfigure" in ev.text and dict(sup.state.link_speeds) == {d: 0.5 for d in DEVICES}


def test_a_slow_link_whose_re_plan_does_not_pay_back_is_still_named() -> None:
    """The planner answers a slow link with another layout (here: device 2's work moved,
    as for a compute slowdown), but too few iterations are left for it to pay back: the
    event still names the link and what the planner found about it."""
    sup = job(iterations=8, clock=Clock())
    link = FailureReport(generation=0, failure="fail-slow", devices=(2, 3), cause="communication",
                         throughput={2: 0.05, 3: 0.05})
    sup.handle(link)
    (asked,) = of(sup.handle(tick()), PlanFailure)
    said = PLANNER.plan(asked.state, asked.report)
    other = PLANNER.plan(STATE, slow(0.3)).plan
    assert other.layer_ranges != said.plan.layer_ranges or other.to_text() != said.plan.to_text()
    acts = sup.handle(Planned(replace(said, plan=other, predicted_time=said.predicted_time * 0.98), 0.01))
    assert not of(acts, Deploy)
    (ev,) = replan_events(acts)
    assert "does not pay back" in ev.text and "the link of node 1 (devices [2, 3]" in ev.text, ev.text


def test_a_workers_ready_timings_that_are_not_a_json_object_are_not_read() -> None:
    from resihp_core.runtime import session
    from resihp_core.runtime.store import LocalStore, _Table

    store = LocalStore(_Table())
    session.put_ready(store, 0, 1, {"rebuild_s": 0.01, "state_s": 0.02})
    store.set("ctl0/ready/2", b"\xff\xfe not json")
    store.set("ctl0/ready/3", b"[0.1, 0.2]")
    assert session.get_ready(store, 0, 1) == {"rebuild_s": 0.01, "state_s": 0.02}
    assert session.get_ready(store, 0, 2) is None and session.get_ready(store, 0, 3) is None
    assert session.get_ready(store, 0, 4) is None
