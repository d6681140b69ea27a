"""Supervisor decisions that need no processes: the one queue of repaired devices, and
whether a generation superseded while it moved state forces a restore
(docs/worker-protocol.md, "A generation superseded while it moved state")."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace

from resihp_core.runtime.supervisor import Supervisor


class Store:
    def __init__(self, keys: set[str] = frozenset()) -> None:
        self.keys = set(keys)

    def check(self, keys: list[str]) -> bool:
        return all(k in self.keys for k in keys)

    def get(self, key: str) -> bytes:
        raise KeyError(key)


class Job:
    """What the supervisor reads of a LocalJob, in memory."""

    def __init__(self, alive: list[int], generation: int = 2, committed: int = 0,
                 committed_in: dict[int, int] | None = None, store: Store | None = None) -> None:
        self._alive = list(alive)
        self.generation, self.committed = generation, committed
        self.committed_in = dict(committed_in or {})
        self.store = store or Store()
        from resihp_core.runtime.session import JobSession

        self.session = JobSession(self.store)
        self.relaunched: list[list[int]] = []

    def alive(self) -> list[int]:
        return self._alive

    def dead(self) -> list[int]:
        return [d for d in range(4) if d not in self._alive]

    def relaunch(self, devices: list[int]) -> None:
        self.relaunched.append(list(devices))


def supervisor(job: Job, **kw) -> Supervisor:
    sup = Supervisor(job, planner=None, state=None, iterations=100, **kw)
    sup._t0 = time.monotonic()
    return sup


def drained(q: queue.Queue) -> set[int]:
    out: set[int] = set()
    while not q.empty():
        out.update(q.get_nowait())
    return out


def test_a_repaired_device_waits_for_a_commit_of_the_current_generation() -> None:
    job = Job(alive=[0, 1, 2], generation=2, committed_in={0: 0, 1: 1})
    sup = supervisor(job, handled_devices={3})
    sup.repaired.put([3])
    assert not sup._offered() and job.relaunched == []  # generation 2 has not committed yet
    job.committed_in[2] = 2
    assert sup._offered() and job.relaunched == [[3]] and 3 in sup._joining


def test_a_repaired_device_whose_failure_is_not_handled_yet_stays_queued() -> None:
    job = Job(alive=[0, 1, 2], generation=2, committed_in={0: 2})
    sup = supervisor(job)
    sup.repaired.put((3,))
    assert not sup._offered() and job.relaunched == []
    assert drained(sup.repaired) == {3}  # still offered, for when its loss is planned
    sup.repaired.put((3,))
    sup.handled_devices.add(3)
    assert sup._offered() and job.relaunched == [[3]]


def test_scheduled_repairs_and_run_time_offers_share_one_queue() -> None:
    """A repair due at an iteration goes through the same queue and rules as a device
    offered by a healed node or another thread; a live device is never relaunched."""
    job = Job(alive=[0, 2], generation=4, committed=6, committed_in={5: 4})
    sup = supervisor(job, handled_devices={1, 3}, repairs={6: (1,), 9: (3,)})
    sup.repaired.put((0,))  # alive: nothing to repair
    assert sup._offered() and job.relaunched == [[1]]
    assert sup.repairs == {9: (3,)} and sup.repaired.empty()
    assert not hasattr(sup, "repair_requests")


def test_a_relaunch_that_fails_leaves_the_device_out() -> None:
    class NoAgent(Job):
        def relaunch(self, devices: list[int]) -> None:
            raise RuntimeError("node 1 is not connected")

    job = NoAgent(alive=[0, 1], generation=1, committed_in={0: 1})
    sup = supervisor(job, handled_devices={2})
    sup.repaired.put([2])
    assert not sup._joining and sup._offered() is True
    assert not sup._joining and "could not be started again" in sup.events[-1]["text"]


# ------------------------------------------------------------------ layouts
def prev(generation: int = 7, resume: int = 40, devices=(0, 1, 2, 3), restore=None, fresh=False):
    return SimpleNamespace(generation=generation, resume=resume, devices=tuple(devices), restore=restore,
                           fresh=fresh, stop=False)


def layout_case(ready: set[int], failed: set[int], alive=(0, 1, 2, 3), resume: int = 40,
                checkpoint_dir: str | None = "/ckpt", **kw) -> bool:
    keys = {f"ctl7/ready/{d}" for d in ready} | {f"ctl7/failed/{d}" for d in failed}
    sup = supervisor(Job(alive=list(alive), generation=7, store=Store(keys)), checkpoint_dir=checkpoint_dir)
    return sup._needs_restore(prev(**kw), resume)


def test_a_move_every_live_worker_finished_is_trusted() -> None:
    assert not layout_case(ready={0, 1, 2, 3}, failed=set())
    assert not layout_case(ready={0, 1, 2, 3}, failed={1})  # left later, in training: new layout


def test_a_move_every_live_worker_gave_up_keeps_the_old_layout() -> None:
    assert not layout_case(ready=set(), failed={0, 1, 2, 3})


def test_a_mixed_or_unfinished_move_restores() -> None:
    assert layout_case(ready={0, 1}, failed={2, 3})  # some moved, some did not
    assert layout_case(ready={0, 1, 2}, failed=set())  # device 3 still moving (or stuck)


def test_dead_workers_do_not_count() -> None:
    assert not layout_case(ready={0, 1, 2}, failed=set(), alive=(0, 1, 2))


def test_a_generation_that_committed_or_restores_is_decided_by_that() -> None:
    assert not layout_case(ready={0}, failed={1}, resume=41)  # it committed: every executor was ready
    assert layout_case(ready={0, 1, 2, 3}, failed=set(), restore=39)  # a restore that never committed
    assert not layout_case(ready={0}, failed={1}, checkpoint_dir=None)  # nothing to restore from


# ------------------------------------------------------------------ state lost
class LostJob(Job):
    """A job whose workers left generation 3 with typed reports; records what is posted."""

    def __init__(self, left: dict, committed: int = 10) -> None:
        super().__init__(alive=[0, 2, 3], generation=3, committed=committed)
        self.left, self.posted = left, []
        self.message = SimpleNamespace(generation=3, resume=8, devices=(0, 2, 3), restore=None, fresh=False,
                                       stop=False)

    def workers_left(self) -> dict:
        return self.left

    def abort(self) -> int:
        return self.committed

    def post(self, plan, **kw) -> int:
        self.posted.append(kw)
        self.generation += 1
        return self.generation


def _sealed(root, *iterations: int) -> None:
    from resihp_core import checkpoints

    for it in iterations:
        d = checkpoints.iteration_dir(root, it)
        d.mkdir(parents=True)
        (d / "layer_0000-tp0.pt").write_bytes(b"state %d" % it)
        checkpoints.seal(root, it)


def test_state_lost_is_read_from_the_typed_flag_and_restores_the_newest_complete_checkpoint(tmp_path) -> None:
    from resihp_core.plan import ParallelPlan
    from resihp_core.protocol import WorkerLeft

    _sealed(tmp_path, 3, 7)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
    state = SimpleNamespace(plan=plan, speeds={})
    # Error text that reads like a lost state, without the typed flag: not acted on.
    text_only = {0: WorkerLeft(generation=3, device=0, reason="LookupError: no surviving complete copy of x")}
    job = LostJob(text_only)
    sup = supervisor(job, checkpoint_dir=str(tmp_path), checkpoint_every=4, checkpoint_grace_s=0.0)
    sup.state = state
    assert not sup._unsourceable() and job.posted == []
    typed = {d: WorkerLeft(generation=3, device=d, reason="StateLost: shard 1/2 of stage 0", error="StateLost",
                           state_lost=True) for d in (0, 2, 3)}
    job = LostJob(typed)
    sup = supervisor(job, checkpoint_dir=str(tmp_path), checkpoint_every=4, checkpoint_grace_s=0.0)
    sup.state = state
    assert sup._unsourceable()
    assert job.posted[-1]["restore"] == 7 and job.posted[-1]["resume"] == 8 and not job.posted[-1]["fresh"]
    plan_ev = [e for e in sup.events if e["kind"] == "plan"][-1]
    assert "resumed from the checkpoint of iteration 7" in plan_ev["text"]
    assert plan_ev["iteration"] == 10 and plan_ev["restore"] == 7  # labelled where the job was
