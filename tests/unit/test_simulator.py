"""The DAG simulator against closed forms and an independent event-driven simulation."""

from __future__ import annotations

import heapq

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resihp_core.plan import Migration, ParallelPlan, ScheduleKind
from resihp_core.predictor.schedules import emit_programs, orders_from_programs
from resihp_core.predictor.simulator import SimulationError, order_matrix, simulate
from resihp_core.program import (
    Backward,
    BackwardWeight,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)


def _uniform(kind, pp, m, dp=1):
    return ParallelPlan.uniform(tp=1, pp=pp, dp=dp, num_layers=pp, num_microbatches=m, schedule=kind)


@pytest.mark.parametrize("kind", [ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])
@pytest.mark.parametrize("pp,m", [(1, 1), (2, 3), (4, 4), (4, 9), (8, 3), (5, 16)])
def test_homogeneous_closed_form(kind, pp, m):
    f, b = 0.7, 1.3
    d = np.zeros((3, pp, 1, m))
    d[0], d[1] = f, b
    r = simulate(_uniform(kind, pp, m), d, reduce_time=0.25, optimizer_time=0.125)
    assert r.pipeline_time == pytest.approx((m + pp - 1) * (f + b), abs=1e-9)
    assert r.iteration_time == pytest.approx((m + pp - 1) * (f + b) + 0.375, abs=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 3), (4, 4), (4, 9)])
def test_gpipe_closed_form_with_communication(pp, m):
    f, b, c = 1.0, 2.0, 0.3
    d = np.zeros((3, pp, 1, m))
    d[0], d[1] = f, b
    r = simulate(_uniform(ScheduleKind.GPIPE, pp, m), d, comm_forward=c, comm_backward=c)
    assert r.pipeline_time == pytest.approx((m + pp - 1) * (f + b) + 2 * (pp - 1) * c, abs=1e-9)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (8, 16)])
def test_zero_bubble_beats_1f1b(pp, m):
    f, bi, w = 1.0, 1.0, 1.0
    d = np.zeros((3, pp, 1, m))
    d[0], d[1], d[2] = f, bi, w
    zb = simulate(_uniform(ScheduleKind.ZB_H1, pp, m), d).pipeline_time
    d1 = d.copy()
    d1[1], d1[2] = bi + w, 0
    one = simulate(_uniform(ScheduleKind.ONE_F_ONE_B, pp, m), d1).pipeline_time
    work = m * (f + bi + w)
    assert one - work == pytest.approx((pp - 1) * (f + bi + w))
    assert zb - work == pytest.approx((pp - 1) * (f + bi - w))  # docs/design.md §3.4
    assert zb < one


def event_simulation(plan, d, cf, cb):
    """Independent reference: execute the emitted programs op by op with a global event
    queue (buffered sends, blocking receives) and return the last compute finish."""
    progs = {(p.replica, p.stage): p for p in emit_programs(plan)}
    pc = {k: 0 for k in progs}
    clock = {k: 0.0 for k in progs}
    arrived: dict[tuple, float] = {}
    last = 0.0
    queue = [(0.0, k) for k in progs]
    heapq.heapify(queue)
    kind = {Forward: 0, Backward: 1, BackwardWeight: 2}
    while queue:
        _, k = heapq.heappop(queue)
        p = progs[k]
        while pc[k] < len(p.ops):
            op = p.ops[pc[k]]
            if isinstance(op, (RecvActivation, RecvGrad)):
                src_stage = op.stage - 1 if isinstance(op, RecvActivation) else op.stage + 1
                key = (type(op).__name__[4:], src_stage, op.owner, op.mb)
                if key not in arrived:
                    break
                clock[k] = max(clock[k], arrived[key])
            elif isinstance(op, (SendActivation, SendGrad)):
                c = (cf if isinstance(op, SendActivation) else cb)[
                    op.stage + (1 if isinstance(op, SendActivation) else -1), op.owner, op.mb
                ]
                name = "Activation" if isinstance(op, SendActivation) else "Grad"
                arrived[(name, op.stage, op.owner, op.mb)] = clock[k] + c
                for other in progs:
                    heapq.heappush(queue, (clock[k], other))
            elif type(op) in kind:
                clock[k] += d[kind[type(op)], op.stage, op.owner, op.mb]
                last = max(last, clock[k])
            pc[k] += 1
    assert all(pc[k] == len(progs[k].ops) for k in progs), "reference simulation stalled"
    return last


@settings(max_examples=40, deadline=None)
@given(
    kind=st.sampled_from(list(ScheduleKind)),
    pp=st.integers(1, 4),
    dp=st.integers(1, 3),
    m=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    migrate=st.booleans(),
)
def test_heterogeneous_matches_event_simulation(kind, pp, dp, m, seed, migrate):
    rng = np.random.default_rng(seed)
    plan = _uniform(kind, pp, m, dp)
    if migrate and dp > 1:
        moves = {}
        for s in range(pp):
            for j in range(m):
                if rng.random() < 0.3:
                    src = int(rng.integers(dp))
                    dst = (src + 1 + int(rng.integers(dp - 1))) % dp
                    moves[(s, src, j)] = Migration(s, src, j, dst)
        plan = plan.with_(migrations=tuple(moves.values()))
    d = rng.uniform(0.1, 2.0, (3, pp, dp, m))
    if kind is not ScheduleKind.ZB_H1:
        d[2] = 0.0
    cf = rng.uniform(0, 0.5, (pp, dp, m))
    cb = rng.uniform(0, 0.5, (pp, dp, m))
    r = simulate(plan, d, comm_forward=cf, comm_backward=cb)
    assert r.pipeline_time == pytest.approx(event_simulation(plan, d, cf, cb), abs=1e-9)
    # The critical path runs from a vertex starting at 0 to the one finishing last.
    names = "FBW"
    k0, s0, r0, j0 = r.critical_path[0]
    k1, s1, r1, j1 = r.critical_path[-1]
    assert r.start[names.index(k0), s0, r0, j0] == pytest.approx(0.0, abs=1e-12)
    assert r.finish[names.index(k1), s1, r1, j1] == pytest.approx(r.pipeline_time)
    assert np.nanmax(r.finish) == pytest.approx(r.pipeline_time)
    # Programs read back give the same vertex order as the fast template path.
    programs_orders = orders_from_programs(emit_programs(plan))
    _, fast, _ = order_matrix(plan)
    _, slow, _ = order_matrix(plan, programs_orders)
    assert (fast == slow).all()


def test_progress_counts_migrated_forwards_on_the_executor():
    plan = _uniform(ScheduleKind.ONE_F_ONE_B, 2, 4, dp=2).with_(
        migrations=(Migration(1, 1, 0, 0), Migration(1, 1, 1, 0))
    )
    d = np.ones((3, 2, 2, 4))
    d[2] = 0
    r = simulate(plan, d)
    done = r.progress(float("inf"))
    assert done.tolist() == [[4, 4], [6, 2]]


def test_bad_durations_are_rejected():
    plan = _uniform(ScheduleKind.GPIPE, 2, 2)
    with pytest.raises(SimulationError, match="shape"):
        simulate(plan, np.zeros((3, 2, 1, 3)))
    with pytest.raises(SimulationError, match="finite"):
        simulate(plan, np.full((3, 2, 1, 2), np.nan))
