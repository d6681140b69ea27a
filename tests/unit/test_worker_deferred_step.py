"""The step after the commit (docs/worker-protocol.md): a worker driving an adapter that
can stop before its optimizer step votes first and steps only a committed iteration,
takes no rollback snapshot, and after a refused commit rolls back without stepping. The
user's own loop (begin_iteration / end_iteration) keeps the snapshot."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from resihp_core.adapter import IterationResult  # noqa: E402
from resihp_core.job import JobSpec  # noqa: E402
from resihp_core.plan import ParallelPlan  # noqa: E402
from resihp_core.protocol import PlanUpdate  # noqa: E402
from resihp_core.runtime import session  # noqa: E402
from resihp_core.runtime.store import LocalStore, _Table  # noqa: E402
from resihp_core.runtime.worker import DeferredStep, Worker  # noqa: E402

from tests.unit.test_worker_check_move import Recording  # noqa: E402

ONE = ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=2, num_microbatches=1)


class Deferring(Recording):
    """Records the iteration's parts; steps after the commit when the worker wants it."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.defer = False

    def defer_steps(self, wanted: bool, *, fingerprints: bool) -> bool:
        self.calls.append(f"defer {wanted}")
        self.defer = wanted
        return wanted

    def apply_step(self) -> None:
        self.calls.append("apply")

    def run_iteration(self, program, iteration):
        self.calls.append(f"run {iteration}" + (" (no step)" if self.defer else " (stepped)"))
        return IterationResult(iteration)

    def snapshot(self):
        self.calls.append("snapshot")

    def rollback(self):
        self.calls.append("rollback")

    def start_fresh(self, plan):
        pass

    def release(self):
        self.calls.append("release")

    @property
    def where(self):
        return (0, 0, 0)


def _worker(iterations: int) -> tuple[Worker, LocalStore]:
    store = LocalStore(_Table(), timeout_s=5.0)
    w = Worker(0, store, JobSpec(adapter="deferring", timeout_s=1.0), factory=Deferring)
    assert isinstance(w.adapter, DeferredStep)
    session.post_plan(store, PlanUpdate(generation=0, plan=ONE.to_text(), devices=(0,), iterations=iterations))
    return w, store


def test_train_batch_votes_before_the_step_and_takes_no_snapshot():
    w, _ = _worker(3)
    for i in range(3):
        assert w.step().iteration == i
    assert w.deferred and w.iteration == 3
    assert w.adapter.calls == ["rebuild 0", "defer True", "run 0 (no step)", "apply", "run 1 (no step)", "apply",
                               "run 2 (no step)", "apply"]


def test_a_refused_commit_rolls_back_without_stepping():
    w, store = _worker(3)
    assert w.step().iteration == 0
    session.decide(store, 0, 1, check=lambda: False)  # the controller aborted iteration 1
    w.adapter.calls.clear()
    assert w.next_iteration() == 1
    assert w._deferred_iteration() is None
    assert w.adapter.calls == ["run 1 (no step)", "rollback", "release"]
    assert w.iteration == 1 and not w.active


def test_the_users_own_loop_keeps_the_snapshot():
    w, _ = _worker(2)
    assert w.next_iteration() == 0  # as trainer.iterations() drives it: no run() or step()
    assert not w.deferred
    w.begin_iteration()
    assert w.adapter.calls == ["rebuild 0", "defer False", "snapshot"]
