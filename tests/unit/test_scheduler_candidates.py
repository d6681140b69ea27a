"""The planner weighs whole candidate plans (each peer system's move) and times large
plans by parts; the simulator and the scheduler benchmark know the 16,384- and
131,072-device jobs."""

from __future__ import annotations

import argparse

import pytest

from resihp_core.protocol import FailureReport
from resihp_core.scheduler import Planner, apply_report
from resihp_core.scheduler.candidates import drop_replicas, peer_candidates, shed_replicas
from resihp_core.scheduler.evaluate import Evaluator
from resihp_core.sim.cluster import STANDARD_JOBS, JobSpec


@pytest.fixture(scope="module")
def wide():
    """LLaMA-2 7B, TP4 PP4 DP16 (256 devices), 8 micro-batches: wide enough in DP that
    spreading one replica's work beats shrinking its hit group."""
    st = JobSpec("llama2-7b", 4, 4, 16, 8).state()
    return st, st.evaluator.time(st.plan)


def _stop(dev: int, gen: int = 0) -> FailureReport:
    return FailureReport(generation=gen, failure="fail-stop", devices=(dev,))


def test_spreading_the_hit_replica_beats_halving_its_tp_group(wide) -> None:
    st, healthy = wide
    dev = st.plan.group(3, 2)[2]
    stages = Planner(peer_moves=False).plan(st, _stop(dev))
    assert "replica 3 stage 2: TP 4 -> 2" in stages.notes[0]  # the old first step: halve TP
    best = Planner().plan(st, _stop(dev))
    assert best.predicted_time < stages.predicted_time * 0.97
    assert "peers: drop-replica" in best.notes[-1]
    plan = best.plan
    assert all(not g for g in plan.tp_groups[3])  # replica 3 left the plan...
    assert {m.replica for m in plan.migrations} == {3}  # ...its micro-batches run elsewhere
    assert len(plan.migrations) == plan.pp * plan.num_microbatches
    # ...whole: each micro-batch on one replica at every stage.
    assert len({(m.mb, m.to) for m in plan.migrations}) == plan.num_microbatches
    assert dev not in plan.devices()
    assert best.predicted_time > healthy  # a lost device still costs something


@pytest.mark.parametrize("report", [
    "stop",
    "slow",
    "comm",
])
def test_planner_is_never_slower_than_any_peer_move(wide, report: str) -> None:
    st, _ = wide
    dev = st.plan.group(5, 1)[0]
    rep = {"stop": _stop(dev),
           "slow": FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause="compute",
                                 throughput={dev: 0.4}),
           "comm": FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause="communication",
                                 throughput={dev: 0.2})}[report]
    d = Planner().plan(st, rep)
    before = apply_report(st, rep)
    from dataclasses import replace
    before = replace(before, previous=st.plan)
    stages = Planner(peer_moves=False).plan(st, rep)
    cands = peer_candidates(before, replace(before, plan=stages.plan))
    names = {n for n, _ in cands}
    assert {"drop-replica", "drop-group"} <= names
    if report != "stop":
        assert "keep" in names  # no failed device: running on unchanged is a candidate
    ev = before.evaluator
    for name, plan in cands:
        if before.memory_violations(plan):
            continue
        assert d.predicted_time <= ev.time(plan) * (1 + 1e-9), name
    assert d.predicted_time <= stages.predicted_time * (1 + 1e-9)


def test_shed_keeps_the_first_microbatches_and_runs_the_rest_whole_elsewhere(wide) -> None:
    st, _ = wide
    plan = shed_replicas(st.plan, [2, 9], keep=3)
    m, pp = plan.num_microbatches, plan.pp
    moved = {(mg.replica, mg.mb) for mg in plan.migrations}
    assert moved == {(r, j) for r in (2, 9) for j in range(3, m)}
    for r, j in moved:
        dest = {mg.to for mg in plan.migrations if (mg.replica, mg.mb) == (r, j)}
        assert len(dest) == 1 and not dest & {2, 9}  # one healthy replica, every stage
    assert len(plan.migrations) == 2 * (m - 3) * pp
    load = {}
    for mg in plan.migrations:
        if mg.stage == 0:
            load[mg.to] = load.get(mg.to, 0) + 1
    assert max(load.values()) - min(load.values()) <= 1  # spread evenly
    dropped = drop_replicas(st.plan, [4], frozenset())
    assert set(st.plan.tp_groups[4][0]) <= set(dropped.standbys)


def test_time_by_parts_equals_the_whole_simulation() -> None:
    st = JobSpec("llama2-7b", 4, 4, 8, 8).state()
    slow = st.plan.group(1, 2)[1]
    link = st.plan.group(6, 0)[0]
    rep_slow = FailureReport(generation=0, failure="fail-slow", devices=(slow,), cause="compute",
                             throughput={slow: 0.5})
    rep_link = FailureReport(generation=0, failure="fail-slow", devices=(link,), cause="communication",
                             throughput={link: 0.3})
    failed = apply_report(apply_report(st, rep_slow), rep_link)
    d = Planner().plan(failed, _stop(st.plan.group(3, 3)[0]))
    plans = [st.plan, d.plan, drop_replicas(st.plan, [2, 5], frozenset()),
             shed_replicas(st.plan, [1], keep=2)]
    ev = d.state.evaluator
    for plan in plans:
        whole = Evaluator(ev.predictor, ev.features, ev.speeds, ev.link_speeds).simulate(plan)
        by_parts = Evaluator(ev.predictor, ev.features, ev.speeds, ev.link_speeds).time_by_parts(plan)
        again = Evaluator(ev.predictor, ev.features, ev.speeds, ev.link_speeds).time_by_parts(plan)
        assert by_parts == pytest.approx(whole.iteration_time, rel=1e-12)
        assert again == by_parts  # from the per-replica store this time


def test_the_large_jobs_are_known_to_the_simulator_and_the_benchmark() -> None:
    from resihp_core.sim.cli import _job, configure

    for n, (tp, pp, dp) in {16384: (8, 16, 128), 131072: (8, 16, 1024)}.items():
        job = STANDARD_JOBS[n]
        assert (job.devices, job.tp, job.pp, job.dp) == (n, tp, pp, dp)
        p = argparse.ArgumentParser()
        configure(p)
        assert _job(p.parse_args(["stop-30m", "--devices", str(n)])).devices == n
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "scheduler.py"
    spec = importlib.util.spec_from_file_location("sched_bench", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]
    assert {16384, 131072} <= set(mod.LATENCY_JOBS) and {16384, 131072} <= set(mod.JOBS)
    assert mod.main(["--jobs", "16", "--latency-jobs", "1000", "--exact", "none"]) == 2
