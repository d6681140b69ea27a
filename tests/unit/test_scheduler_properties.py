"""Properties of every planner output, over random small jobs and failure sequences:
it validates, runs each (stage, micro-batch) exactly once, stays within memory, never
uses a failed device, needs nothing the adapter lacks, and its programs dry-run."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from resihp_core.adapter import Capabilities
from resihp_core.plan import ScheduleKind
from resihp_core.program import Forward, check_programs
from resihp_core.protocol import FailureReport
from resihp_core.scheduler import DEFAULT_STAGES, MemoryModel, Planner, PlannerError

from resihp_core.sim.jobs import toy_state as tiny

CAPS = [
    Capabilities.all(),
    Capabilities(tp_resize=False, heterogeneous_tp=False, layer_repartition=True,
                 cross_replica_migration=True, checkpoint=True),
    Capabilities(tp_resize=True, heterogeneous_tp=True, layer_repartition=True,
                 cross_replica_migration=False, schedules=frozenset(ScheduleKind), checkpoint=True),
]


@st.composite
def jobs(draw):
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 3))
    dp = draw(st.integers(1, 3))
    m = draw(st.integers(1, 5))
    layers = pp + draw(st.integers(0, 4))
    schedule = draw(st.sampled_from(list(ScheduleKind)))
    caps = draw(st.sampled_from(CAPS))
    # Memory: the healthy plan fits with 1x to 3x headroom (so memory sometimes binds).
    per_layer, act = 1.0, draw(st.sampled_from([0.0, 0.25]))
    need = -(-layers // pp) * (per_layer + m * act) / tp
    mem_gib = need * draw(st.floats(1.0, 3.0))
    state = tiny(tp=tp, pp=pp, dp=dp, m=m, layers=layers, schedule=schedule, capabilities=caps,
                 memory=MemoryModel(layer_state_gib=per_layer, layer_activation_gib=act),
                 memory_gib=mem_gib, devices_per_node=draw(st.sampled_from([4, 8])),
                 effort=draw(st.sampled_from(["thorough", "lean"])))
    n = tp * pp * dp
    reports = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["stop", "compute", "communication"]))
        devs = tuple(sorted(set(draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2)))))
        if kind == "stop":
            reports.append(FailureReport(generation=0, failure="fail-stop", devices=devs))
        else:
            ps = {d: draw(st.floats(0.05, 1.0)) for d in devs}
            reports.append(FailureReport(generation=0, failure="fail-slow", devices=devs,
                                         cause=kind, throughput=ps))
    return state, reports


def check(decision, caps) -> None:
    state, plan = decision.state, decision.plan
    plan.validate(state.topology)
    assert not set(plan.devices()) & state.failed
    assert not state.memory_violations(plan)
    previous = None if decision.kind == "restore" else state.previous
    assert caps.violations(plan, previous) == []
    programs = decision.programs()
    check_programs(programs)
    ran = Counter((op.stage, op.owner, op.mb) for p in programs for op in p.ops if isinstance(op, Forward))
    want = {(s, r, j) for s in range(plan.pp) for r in range(plan.dp) for j in range(plan.num_microbatches)}
    assert set(ran) == want and set(ran.values()) == {1}


@settings(max_examples=int(__import__("os").environ.get("SCHED_EXAMPLES", 40)), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs())
def test_every_planner_output_is_valid(job) -> None:
    state, reports = job
    caps = state.capabilities
    planner = Planner(stages=DEFAULT_STAGES)
    gen = state.plan.generation
    for rep in reports:
        try:
            decision = planner.plan(state, rep)
        except PlannerError as e:
            event("planner error")
            # Only legitimate when the survivors cannot run the model at all.
            assert "cannot restore" in str(e) or "no replica has memory" in str(e) or \
                "cannot migrate" in str(e), e
            return
        event(f"{decision.kind}, {len(decision.plan.migrations) > 0 and 'migrated' or 'no migration'}")
        assert decision.plan.generation == gen + 1
        gen += 1
        check(decision, caps)
        state = decision.state
