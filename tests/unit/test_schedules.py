"""Schedule emission: programs are deadlock-free and follow the real frameworks' order."""

from __future__ import annotations

import itertools

import pytest

from resihp_core.plan import Migration, ParallelPlan, ScheduleKind
from resihp_core.predictor.schedules import (
    B,
    F,
    W,
    compute_orders,
    emit_programs,
    orders_from_programs,
    stage_order,
)
from resihp_core.program import ProgramError, check_programs, format_grid

SHAPES = [(1, 1), (2, 1), (2, 4), (4, 2), (4, 4), (3, 7), (4, 9)]  # (stages, micro-batches)


def _fb(seq):
    return [("F" if k == F else "B", i) for k, i in seq if k in (F, B)]


@pytest.mark.parametrize("kind", list(ScheduleKind))
@pytest.mark.parametrize("pp,m", SHAPES)
def test_every_schedule_is_complete_and_deadlock_free(kind, pp, m):
    plan = ParallelPlan.uniform(tp=1, pp=pp, dp=2, num_layers=pp * 2, num_microbatches=m, schedule=kind)
    programs = emit_programs(plan)
    check_programs(programs)
    for (r, s), order in compute_orders(plan).items():
        kinds = {F: 0, B: 0, W: 0}
        for k, _, _ in order:
            kinds[k] += 1
        assert kinds[F] == kinds[B] == m
        assert kinds[W] == (m if kind is ScheduleKind.ZB_H1 else 0)
    assert orders_from_programs(programs) == compute_orders(plan)


def test_deepspeed_train_schedule_order():
    """Healthy 1F1B runs F/B on each stage in exactly DeepSpeed's TrainSchedule order."""
    from deepspeed.runtime.pipe import schedule as ds

    for pp, m in SHAPES + [(4, 1), (8, 3)]:
        for s in range(pp):
            sched = ds.TrainSchedule(micro_batches=m, stages=pp, stage_id=s)
            nbuf = sched.num_pipe_buffers()
            inflight: dict[int, list[int]] = {}
            fwd = 0
            theirs = []
            for cmds in sched.steps():
                for c in cmds:
                    if type(c) is ds.ForwardPass:
                        assert c.buffer_id == fwd % nbuf
                        inflight.setdefault(c.buffer_id, []).append(fwd)
                        theirs.append(("F", fwd))
                        fwd += 1
                    elif type(c) is ds.BackwardPass:
                        theirs.append(("B", inflight[c.buffer_id].pop(0)))
            ours = _fb(stage_order(ScheduleKind.ONE_F_ONE_B, m, s, pp))
            assert ours == theirs, (pp, m, s)


class _RecordingStage:
    """Stands in for a torch pipelining stage: records compute, does no communication."""

    has_backward = True

    def __init__(self, index: int, n: int) -> None:
        self.stage_index, self.num_stages = index, n
        self.group_size, self.group_rank = n, index
        self.log: list[tuple[str, int]] = []

    is_first = property(lambda self: self.stage_index == 0)
    is_last = property(lambda self: self.stage_index == self.num_stages - 1)

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(("F", mb))

    def backward_one_chunk(self, mb, *args, **kwargs):
        self.log.append(("B", mb))

    def __getattr__(self, name):  # p2p op lists etc.: nothing to do
        return lambda *args, **kwargs: []


def test_torch_pipelining_1f1b_order():
    """Same order as torch.distributed.pipelining's Schedule1F1B, by running its real step
    loop over a recording stage (torch refuses fewer micro-batches than stages; that case
    is covered by the DeepSpeed comparison)."""
    from torch.distributed.pipelining import schedules as ts

    for pp, m in SHAPES:
        if m < pp:
            continue
        for s in range(pp):
            stage = _RecordingStage(s, pp)
            sched = ts.Schedule1F1B(stage, m)
            sched._initialize_stage = lambda *a, **k: None
            sched._check_inputs = lambda a, k, t, l: ([None] * m, [{}] * m)
            sched._maybe_compute_loss = lambda *a, **k: None
            sched._maybe_get_loss = lambda *a, **k: None
            sched._step_microbatches()
            assert _fb(stage_order(ScheduleKind.ONE_F_ONE_B, m, s, pp)) == stage.log, (pp, m, s)


def test_zero_bubble_keeps_1f1b_memory():
    """ZB-H1 never holds more micro-batches' activations than 1F1B (<= pp in flight)."""
    for pp, m in SHAPES:
        for s in range(pp):
            live = peak = 0
            for k, _ in stage_order(ScheduleKind.ZB_H1, m, s, pp):
                live += 1 if k == F else -1 if k == W else 0
                peak = max(peak, live)
            assert peak <= min(pp, m)


def test_migrated_work_gets_matching_sends_and_receives():
    plan = ParallelPlan.uniform(tp=2, pp=3, dp=2, num_layers=6, num_microbatches=4)
    # Replica 1 loses stage 1: all four of its micro-batches run there on replica 0.
    groups = (plan.tp_groups[0], (plan.tp_groups[1][0], (), plan.tp_groups[1][2]))
    moved = plan.with_(tp_groups=groups, migrations=tuple(Migration(1, 1, j, 0) for j in range(4)))
    programs = emit_programs(moved)
    check_programs(programs)
    grid = format_grid(programs)
    assert "1F0@r1" in grid and "1B3@r1" in grid


def test_checker_finds_missing_receive_and_deadlock():
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2)
    progs = emit_programs(plan)
    p0, p1 = sorted(progs, key=lambda p: p.stage)
    broken = p1.__class__(p1.replica, p1.stage, p1.generation, tuple(o for o in p1.ops if type(o).__name__ != "RecvActivation"))
    with pytest.raises(ProgramError, match="no matching receive"):
        check_programs([p0, broken])
    # Stage 0 waiting for a gradient before sending the activation it depends on.
    rev = p0.__class__(p0.replica, p0.stage, p0.generation, tuple(reversed(p0.ops)))
    with pytest.raises(ProgramError, match="deadlock"):
        check_programs([rev, p1])


def test_grid_is_step_by_executor():
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=2)
    lines = format_grid(emit_programs(plan)).splitlines()
    assert lines[0].split() == ["step", "r0s0", "r0s1"]
    assert lines[1].split() == ["0", "0F0", "1F0"]
    assert lines[2].split() == ["1", "0F1", "1B0"]


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_dynamic_policy_reproduces_templates_without_migrations(kind):
    """The deadlock-free policy used for migrated work is the same schedule when nothing
    is migrated (ZB-H1 may run W passes earlier when there are fewer micro-batches than
    stages, where the template would leave the stage idle)."""
    from resihp_core.predictor.schedules import dynamic_orders

    for pp, m in itertools.product(range(1, 7), range(1, 12)):
        if kind is ScheduleKind.ZB_H1 and m < pp:
            continue
        plan = ParallelPlan.uniform(tp=1, pp=pp, dp=2, num_layers=pp, num_microbatches=m, schedule=kind)
        assert dynamic_orders(plan) == compute_orders(plan), (pp, m)


@pytest.mark.parametrize("kind", list(ScheduleKind))
def test_random_two_way_migrations_never_deadlock(kind):
    """Replicas exchanging work in both directions: a fixed local-first order deadlocks
    on such plans; the emitted programs must pass the dry-run checker every time."""
    import numpy as np

    for seed in range(150):
        rng = np.random.default_rng(seed)
        pp, dp, m = int(rng.integers(2, 5)), int(rng.integers(2, 4)), int(rng.integers(1, 7))
        plan = ParallelPlan.uniform(tp=1, pp=pp, dp=dp, num_layers=pp, num_microbatches=m, schedule=kind)
        moves = {}
        for s in range(pp):
            for j in range(m):
                if rng.random() < 0.5:
                    src = int(rng.integers(dp))
                    moves[(s, src, j)] = Migration(s, src, j, (src + 1 + int(rng.integers(dp - 1))) % dp)
        check_programs(emit_programs(plan.with_(migrations=tuple(moves.values()))))
