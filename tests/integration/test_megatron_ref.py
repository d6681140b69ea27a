"""Real multi-process training on the reference backend (gloo on CPU): fault-free
equivalence with a single process, and live reconfiguration that changes nothing about
training semantics."""

from __future__ import annotations

import signal
import time

import pytest

from resihp_core import checkpoints
from resihp_core.plan import Migration, ranges_from_counts
from resihp_core.runtime.controller.launcher import LocalJob

from .backend_harness import check_against_reference, finish, job_spec, tmpdir, uniform

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]
# Waits for a commit: the first includes the workers' start (seconds of torch imports
# each, minutes on a loaded 2-core machine); a deadline, not a speed bound.
COMMIT_S = 300.0


def _run_steps(plan0, steps, *, every=2, m=3, restore=False, spec_kw=None, tol=1e-9):
    """Train ``every`` iterations on ``plan0``; then, per step ``(change, kill)``:
    optionally SIGKILL the devices ``kill`` mid-iteration, switch to ``change(plan)``
    and train ``every`` more. Finish and compare against the reference (every
    iteration's loss and accounting, every survivor's parameters and AdamW state).
    Each step starts from where the previous one left the job, so one set of worker
    processes carries several reconfigurations. Returns the plans by generation."""
    iterations = every * (len(steps) + 1)
    spec = job_spec(dp=plan0.dp, m=m, dump_dir=tmpdir(), **(spec_kw or {}))
    plan = plan0
    with LocalJob(spec.to_json(), plan0.devices()) as job:
        job.post(plan0, iterations=iterations)
        for k, (change, kill) in enumerate(steps):
            job.wait(every * (k + 1), timeout=COMMIT_S)
            if kill:
                time.sleep(0.05)  # inside the next iteration
                for d in kill:
                    job.kill(d, signal.SIGKILL)
                assert job.wait(iterations, timeout=COMMIT_S, on_death="return"), "kill went unnoticed"
            resume = job.abort()
            plan = change(plan)
            point = None
            if restore and k == len(steps) - 1:  # as the supervisor does: the newest complete
                # checkpoint (writes are asynchronous: a killed writer may not have finished;
                # none: from the seed)
                point = checkpoints.newest_complete(spec.checkpoint_dir, at_most=resume - 1)[0]
                resume = job.committed = 0 if point is None else point + 1
            job.post(plan, iterations=iterations, resume=resume, restore=point,
                     fresh=restore and k == len(steps) - 1 and point is None)
        job.wait(iterations, timeout=COMMIT_S)
        # every step's plan trained: its generation committed iterations of the result
        ran = {job.committed_in[i] for i in range(iterations)}
        assert ran >= set(range(job.generation - len(steps) + 1, job.generation + 1)), job.committed_in
        plans = dict(job.plans)
        done = finish(job, spec, iterations)
    check_against_reference(done, iterations, tol=tol)
    return plans


def _tp_shrink_planned(p):
    """Replica 1's stage-0 TP group loses its second member, which becomes a standby."""
    groups = [list(rep) for rep in p.tp_groups]
    groups[1][0] = groups[1][0][:1]
    return p.with_(tp_groups=tuple(tuple(r) for r in groups), standbys=(p.tp_groups[1][0][1],))


def test_every_schedule_then_a_planned_tp_shrink_then_a_killed_tp_member_equal_single_process():
    """TP2 x PP2 x DP2, one job of 8 workers: fault-free under GPipe, then 1F1B, then
    ZB-H1 (a generation each, same layout); then a planned TP shrink (2 -> 1 in one
    replica, the member kept as a standby); then a SIGKILLed TP member of the other
    replica: its group shrinks. Every iteration's loss and micro-batch accounting, and
    the final parameters and AdamW state, equal the single-process run (float64,
    1e-10): a schedule that computed anything differently would differ from its first
    iteration on."""
    plan = uniform(2, 2, 2, 3, "gpipe")
    victim = plan.group(0, 1)[1]

    def shrink_killed(p):
        groups = [list(rep) for rep in p.tp_groups]
        groups[0][1] = groups[0][1][:1]
        return p.with_(tp_groups=tuple(tuple(r) for r in groups), excluded=frozenset([victim]))

    plans = _run_steps(plan, [(lambda p: p.with_(schedule="1f1b"), ()), (lambda p: p.with_(schedule="zbh1"), ()),
                             (_tp_shrink_planned, ()), (shrink_killed, [victim])], tol=1e-10)
    # the schedules ran in that order, each in its own generation (all of which trained)
    assert [plans[g].schedule.value for g in sorted(plans)][:3] == ["gpipe", "1f1b", "zbh1"]


def test_layer_repartition_then_dp_migration_then_a_whole_replica_killed_mid_iteration():
    """PP2 x DP2: layers repartitioned (3 + 1, parameters and optimizer state move),
    then stage micro-batches migrated between replicas, then both devices of replica 1
    SIGKILLed mid-iteration: replica 0 takes all of its micro-batches."""
    plan = uniform(1, 2, 2, 3)
    dead = [plan.group(1, 0)[0], plan.group(1, 1)[0]]

    def migrate(p):
        return p.with_(migrations=(Migration(1, 1, 0, 0), Migration(0, 0, 2, 1), Migration(1, 1, 2, 0)))

    def drop_replica(p):
        groups = (p.tp_groups[0], ((), ()))
        moves = tuple(Migration(s, 1, j, 0) for s in range(2) for j in range(3))
        return p.with_(tp_groups=groups, migrations=moves, excluded=frozenset(dead))

    _run_steps(plan, [(lambda p: p.with_(layer_ranges=ranges_from_counts([3, 1])), ()),
                      (migrate, ()), (drop_replica, dead)])


def test_every_replica_of_a_stage_lost_restores_from_checkpoint():
    plan = uniform(1, 2, 2, 3)
    dead = [plan.group(0, 1)[0], plan.group(1, 1)[0]]
    live = [plan.group(0, 0)[0], plan.group(1, 0)[0]]

    def rebuild(p):
        return p.with_(tp_groups=(((live[0],),), ((live[1],),)), layer_ranges=((0, 4),),
                       excluded=frozenset(dead))

    _run_steps(plan, [(rebuild, dead)], restore=True, spec_kw=dict(checkpoint_dir=tmpdir(), checkpoint_every=1))
