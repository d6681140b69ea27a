"""Real multi-process training on the reference backend (gloo on CPU): fault-free
equivalence with a single process, and live reconfiguration that changes nothing about
training semantics."""

from __future__ import annotations

import signal
import time

import pytest

from resihp_core import checkpoints
from resihp_core.plan import Migration, ranges_from_counts
from resihp_core.runtime.launcher import LocalJob

from .backend_harness import check_against_reference, finish, job_spec, tmpdir, uniform

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbh1"])
def test_fault_free_tp2_pp2_dp2_equals_single_process(schedule):
    spec = job_spec(dp=2, m=3, dump_dir=tmpdir())
    plan = uniform(2, 2, 2, 3, schedule)
    with LocalJob(spec.to_json(), plan.devices()) as job:
        job.post(plan, iterations=2)
        job.wait(2)
        done = finish(job, spec, 2)
    assert check_against_reference(done, 2, tol=1e-10) <= 1e-10


def _run_then(plan0, change, *, iterations=4, switch_at=2, m=3, kill=(), restore=False,
              spec_kw=None):
    """Train ``switch_at`` iterations on ``plan0``, optionally SIGKILL devices mid-run,
    switch to ``change(plan0)``, finish, and compare against the reference."""
    spec = job_spec(dp=plan0.dp, m=m, dump_dir=tmpdir(), **(spec_kw or {}))
    with LocalJob(spec.to_json(), plan0.devices()) as job:
        job.post(plan0, iterations=iterations)
        job.wait(switch_at)
        if kill:
            time.sleep(0.05)  # inside the next iteration
            for d in kill:
                job.kill(d, signal.SIGKILL)
            assert job.wait(iterations, timeout=60, on_death="return"), "kill went unnoticed"
            resume = job.abort()
        else:
            resume = job.abort()
        new = change(plan0)
        point = None
        if restore:  # as the supervisor does: the newest complete checkpoint (writes are
            # asynchronous: a killed writer may not have finished; none: from the seed)
            point = checkpoints.newest_complete(spec.checkpoint_dir, at_most=resume - 1)[0]
            resume = job.committed = 0 if point is None else point + 1
        job.post(new, iterations=iterations, resume=resume, restore=point, fresh=restore and point is None)
        job.wait(iterations)
        done = finish(job, spec, iterations)
    check_against_reference(done, iterations)
    return done


def test_tp_shrink_two_to_one_in_one_replica():
    def shrink(p):
        groups = [list(rep) for rep in p.tp_groups]
        groups[1][0] = groups[1][0][:1]
        return p.with_(tp_groups=tuple(tuple(r) for r in groups), standbys=(p.tp_groups[1][0][1],))

    _run_then(uniform(2, 2, 2, 3), shrink)


def test_layer_repartition_moves_parameters_and_optimizer_state():
    _run_then(uniform(1, 2, 2, 3), lambda p: p.with_(layer_ranges=ranges_from_counts([3, 1])))


def test_dp_migration_of_stage_micro_batches():
    def migrate(p):
        return p.with_(migrations=(Migration(1, 1, 0, 0), Migration(0, 0, 2, 1), Migration(1, 1, 2, 0)))

    _run_then(uniform(1, 2, 2, 3), migrate)


def test_whole_replica_killed_mid_iteration():
    plan = uniform(1, 2, 2, 3)
    dead = [plan.group(1, 0)[0], plan.group(1, 1)[0]]

    def drop_replica(p):
        groups = (p.tp_groups[0], ((), ()))
        moves = tuple(Migration(s, 1, j, 0) for s in range(2) for j in range(3))
        return p.with_(tp_groups=groups, migrations=moves, excluded=frozenset(dead))

    _run_then(plan, drop_replica, kill=dead)


def test_one_tp_member_killed_its_group_shrinks():
    plan = uniform(2, 2, 2, 3)
    victim = plan.group(0, 1)[1]

    def shrink(p):
        groups = [list(rep) for rep in p.tp_groups]
        groups[0][1] = groups[0][1][:1]
        return p.with_(tp_groups=tuple(tuple(r) for r in groups), excluded=frozenset([victim]))

    _run_then(plan, shrink, kill=[victim])


def test_every_replica_of_a_stage_lost_restores_from_checkpoint():
    plan = uniform(1, 2, 2, 3)
    dead = [plan.group(0, 1)[0], plan.group(1, 1)[0]]
    live = [plan.group(0, 0)[0], plan.group(1, 0)[0]]

    def rebuild(p):
        return p.with_(tp_groups=(((live[0],),), ((live[1],),)), layer_ranges=((0, 4),),
                       excluded=frozenset(dead))

    _run_then(plan, rebuild, kill=dead, restore=True,
              spec_kw=dict(checkpoint_dir=tmpdir(), checkpoint_every=1))
