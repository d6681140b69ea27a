"""The exact solver (HiGHS MILP) against hand-computed optima, brute force, the
simulator's closed form, and the heuristic."""

from __future__ import annotations

import itertools

import pytest

from resihp_core.plan import Migration, ranges_from_counts
from resihp_core.scheduler import DEFAULT_STAGES, Planner, apply_report
from resihp_core.scheduler.exact import model_time, solve_exact, spread

from resihp_core.protocol import FailureReport
from resihp_core.sim.jobs import TOY_FORWARD_S as F_MS
from resihp_core.sim.jobs import toy_state as tiny


def slow(dev: int, p: float) -> FailureReport:
    return FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause="compute",
                         throughput={dev: p})

ITEM_MS = 3 * F_MS  # F + B of one layer of one micro-batch at TP 1


def test_hand_computed_optimum_one_stage_two_replicas() -> None:
    # Replica 0 at half speed: 6 ms per micro-batch vs 3 ms. 8 micro-batches: keeping
    # k on replica 0 costs max(6k, 3(8-k)) -> k = 2 or 3 -> 18 ms (dropping it: 24 ms).
    st = tiny(dp=2, m=4, speeds={0: 0.5})
    ex = solve_exact(st)
    assert ex.optimal
    assert ex.model_time == pytest.approx(6 * ITEM_MS)
    assert ex.lower_bound == pytest.approx(ex.model_time, rel=1e-3)
    kept = 4 - sum(1 for m in ex.plan.migrations if m.replica == 0)
    assert kept in (2, 3) and ex.plan.group(0, 0) == (0,)


def test_model_is_the_simulators_closed_form_when_healthy() -> None:
    st = tiny(pp=2, layers=2, m=4)
    # 1F1B, homogeneous: (m + p - 1)(F + B) = 5 x 3 ms.
    assert model_time(st, st.plan) == pytest.approx(5 * ITEM_MS)
    assert st.evaluator.time(st.plan) == pytest.approx(5 * ITEM_MS)
    ex = solve_exact(st)
    assert ex.optimal and ex.model_time == pytest.approx(5 * ITEM_MS) and not ex.plan.migrations


def test_exact_matches_brute_force_over_partitions_and_assignments() -> None:
    st = apply_report(tiny(pp=2, dp=2, m=2, layers=3), slow(1, 0.5))
    best = float("inf")
    items = [(s, r, j) for s in range(2) for r in range(2) for j in range(2)]
    for c in [(1, 2), (2, 1)]:
        base = st.plan.with_(layer_ranges=ranges_from_counts(c))
        for where in itertools.product(range(2), repeat=len(items)):
            migs = tuple(Migration(s, r, j, e) for (s, r, j), e in zip(items, where) if e != r)
            best = min(best, model_time(st, base.with_(migrations=migs)))
    ex = solve_exact(st)
    assert ex.optimal
    assert ex.model_time == pytest.approx(best, rel=1e-6)


def test_exact_bounds_the_heuristic_under_the_model() -> None:
    st = tiny(tp=2, pp=2, dp=2, m=4, layers=4)
    dev = st.plan.group(0, 1)[1]
    failed = apply_report(st, slow(dev, 0.3))
    d = Planner(stages=DEFAULT_STAGES).plan(st, slow(dev, 0.3))
    ex = solve_exact(failed, time_limit=30)
    assert ex.optimal and ex.combinations >= 3  # TP 2, TP 1, dropped
    assert ex.lower_bound <= ex.model_time * (1 + 1e-9)
    assert ex.model_time <= model_time(d.state, d.plan) * (1 + 1e-9)
    ex.plan.validate(failed.topology)
    assert dev not in ex.plan.devices() or failed.throughput(dev) > 0


def test_spread_indices() -> None:
    assert spread(0, 8) == []
    assert spread(2, 8) == [3, 7]
    assert spread(8, 8) == list(range(8))
