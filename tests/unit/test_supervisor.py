"""The supervisor's state machine driven without processes: typed events in, actions
out, time from an injected clock (docs/design.md, "The supervisor's state machine").
The last tests run the control loop's deploy path on an in-memory job store."""

from __future__ import annotations

from types import SimpleNamespace

from resihp_core.protocols.events import Killed, PlanPosted
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.protocol import FailureReport, WorkerLeft
from resihp_core.runtime.session import StorageFault
from resihp_core.runtime.controller.supervisor import (
    Committed, Deploy, Deployed, DeployFailed, Emit, Fail, Kill, NotifyFailure, Phase, PlanFailure, Planned,
    PlanRejoin, Ready, Rejoin, Relaunch, RelaunchFailed, Retry, Supervisor, Tick, needs_restore,
)
from resihp_core.scheduler.planner import PlanDecision, Planner
from resihp_core.scheduler.state import PlannerState

PLAN = ParallelPlan.uniform(tp=1, pp=2, dp=2, num_layers=4, num_microbatches=2)
DEVICES = (0, 1, 2, 3)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def planner_state() -> PlannerState:
    topology = Topology.uniform(2, 2)
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8, ref_layers=2,
                                       ref_tp=1), 2)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=64, hidden=32, params_per_layer=10_000),
                              LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9))
    corpus = CorpusSpec(scale=12.0, shape=0.8, min_len=2, max_len=64, token_budget=64)
    feats = workload_features(iteration_workload(corpus, 0, 2, 2), 2, 2)
    return PlannerState.create(topology, PLAN, pred, feats)


STATE = planner_state()


def running(clock: Clock | None = None, **kw) -> Supervisor:
    """A supervisor whose generation 0 runs on every device and committed iteration 0."""
    sup = Supervisor(STATE, clock=clock or Clock(), **kw)
    sup.handle(Deployed(0, DEVICES, 0))
    sup.handle(Committed(0, 0))
    assert sup.phase is Phase.RUNNING
    return sup


def tick(alive=DEVICES, dead=()) -> Tick:
    return Tick(alive=frozenset(alive), dead=frozenset(dead))


def decision(plan: ParallelPlan = PLAN, kind: str = "continue") -> PlanDecision:
    return PlanDecision(plan=plan, kind=kind, reason="test", predicted_time=1.0, timings={}, state=STATE)


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


# ------------------------------------------------------------------ failures
def test_a_fail_stop_goes_running_planning_deploying_running_and_is_notified_once() -> None:
    sup = running()
    # The controller's report and the backstop (the process exited) are one failure.
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,), evidence="connection closed"))
    acts = sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    assert len(of(acts, NotifyFailure)) == 1 and of(acts, NotifyFailure)[0].report.devices == (1,)
    assert of(acts, PlanFailure) and not of(acts, Kill) and sup.phase is Phase.PLANNING
    acts = sup.handle(Planned(decision(), 0.01))
    assert of(acts, Deploy) and of(acts, Deploy)[0].from_checkpoint is False
    sup.handle(Deployed(1, (0, 2, 3), 1))
    assert sup.phase is Phase.DEPLOYING
    assert sup.handle(tick(alive=(0, 2, 3), dead=(1,))) == []  # handled: not reported again
    sup.handle(Committed(1, 1))
    assert sup.phase is Phase.RUNNING and sup.handled == {1}


def test_fail_stop_is_planned_before_fail_slow_which_waits_for_the_next_round() -> None:
    sup = running()
    sup.handle(FailureReport(generation=0, failure="fail-slow", devices=(2,), cause="compute", throughput=0.5))
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,)))
    acts = sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    assert [a.report.failure for a in of(acts, PlanFailure)] == ["fail-stop"]
    sup.handle(Planned(decision(), 0.0))
    sup.handle(Deployed(1, (0, 2, 3), 1))
    acts = sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    assert [a.report.failure for a in of(acts, PlanFailure)] == ["fail-slow"]


def test_a_hung_device_is_fenced_and_a_paused_one_only_planned_out() -> None:
    sup = running()
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,), evidence="hang"))
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(2,), evidence="stopped", paused=(2,)))
    acts = sup.handle(tick())
    assert of(acts, Kill) == [Kill(1)] and sup.paused == {2}
    assert acts.index(Kill(1)) < acts.index(of(acts, PlanFailure)[0])  # fenced before the next generation


def test_a_plan_naming_a_device_that_died_meanwhile_is_planned_again() -> None:
    sup = running()
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,)))
    (ask,) = of(sup.handle(tick(alive=(0, 2, 3), dead=(1,))), PlanFailure)
    answer = Planner().plan(ask.state, ask.report)
    assert 3 in answer.plan.devices() and 1 not in answer.plan.devices()
    acts = sup.handle(Planned(answer, 0.0, dead=frozenset({1, 3})))  # device 3 died while it planned
    assert of(acts, PlanFailure)[0].report.devices == (3,)
    assert 3 in sup.handled and sup.phase is Phase.PLANNING
    acts = sup.handle(Planned(decision(), 0.0))
    assert of(acts, Deploy)


def test_a_device_gone_before_the_post_is_planned_out() -> None:
    sup = running()
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,)))
    sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    sup.handle(Planned(decision(), 0.0))
    acts = sup.handle(DeployFailed((3,)))
    assert of(acts, PlanFailure)[0].report.devices == (3,) and 3 in sup.handled


def test_a_planner_that_keeps_placing_work_on_a_dead_device_ends_the_job_instead_of_looping() -> None:
    """Plan -> post fails (device 3 gone) -> plan again: with a planner that ignores the
    state's failed devices this never ends (the control loop recursed until Python's
    limit); past max_retries in a row the supervisor gives up with why."""
    sup = running(max_retries=2)
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(1,)))
    sup.handle(tick(alive=(0, 2, 3), dead=(1,)))
    sup.handle(Planned(decision(), 0.0))
    assert of(sup.handle(DeployFailed((3,))), PlanFailure)  # new: planned out
    for _ in range(2):  # the same dead device again: retried up to max_retries
        sup.handle(Planned(decision(), 0.0))
        assert of(sup.handle(DeployFailed((3,))), PlanFailure)
    sup.handle(Planned(decision(), 0.0))
    (fail,) = of(sup.handle(DeployFailed((3,))), Fail)
    assert "dead devices [3] 3 times in a row" in fail.message


def test_a_report_about_a_rejoined_devices_previous_life_is_ignored() -> None:
    sup = running()
    sup.rejoined[1] = 4
    sup.handle(Deployed(4, DEVICES, 1))
    sup.handle(FailureReport(generation=3, failure="fail-stop", devices=(1,)))
    assert sup.handle(tick()) == []


# ------------------------------------------------------------------ state lost, stalls
def test_state_lost_is_read_from_the_typed_flag_only() -> None:
    sup = running(can_restore=True)
    sup.handle(WorkerLeft(generation=0, device=0, reason="LookupError: no surviving complete copy of x"))
    assert sup.handle(tick()) == []  # error text that reads like it: not acted on
    sup.handle(WorkerLeft(generation=0, device=2, reason="StateLost: shard 1/2", error="StateLost", state_lost=True))
    acts = sup.handle(tick())
    assert of(acts, Emit)[0].event.failure == "state-lost"
    (dep,) = of(acts, Deploy)
    assert dep.from_checkpoint and dep.kind == "restore" and dep.decision.plan == PLAN


def test_a_worker_left_of_an_older_generation_is_ignored() -> None:
    sup = running(can_restore=True)
    sup.handle(Deployed(1, DEVICES, 1))
    sup.handle(WorkerLeft(generation=0, device=2, reason="StateLost", state_lost=True))
    assert sup.handle(tick()) == []


def test_a_stall_with_workers_gone_is_retried_then_given_up() -> None:
    clock = Clock()
    sup = running(clock, stall_s=15.0, max_retries=2)
    sup.handle(WorkerLeft(generation=0, device=2, reason="DistStoreError: timed out"))
    assert sup.handle(tick()) == []
    for attempt in (1, 2):
        clock.now += 16
        (retry,) = sup.handle(tick())
        assert isinstance(retry, Retry) and retry.attempt == attempt and 2 in retry.failures
        sup.handle(Deployed(attempt, DEVICES, 1))
        sup.handle(WorkerLeft(generation=attempt, device=2, reason="DistStoreError: timed out"))
    clock.now += 16
    (fail,) = sup.handle(tick())
    assert isinstance(fail, Fail) and "device 2" in fail.message


def test_a_commit_resets_the_retries() -> None:
    clock = Clock()
    sup = running(clock, max_retries=1)
    sup.handle(WorkerLeft(generation=0, device=2, reason="x"))
    clock.now += 16
    assert of(sup.handle(tick()), Retry)
    sup.handle(Deployed(1, DEVICES, 1))
    sup.handle(Committed(1, 1))
    assert sup.retries == 0


def test_storage_faults_are_reported_and_nothing_else() -> None:
    sup = running(checkpoint_every=4)
    (ev,) = sup.handle(StorageFault(device=1, iteration=3, error="PermissionError: read-only"))
    assert ev.kind == "storage" and "training goes on" in ev.text and "next checkpoint at iteration 7" in ev.text
    assert sup.phase is Phase.RUNNING


# ------------------------------------------------------------------ repairs
def failed_device(sup: Supervisor, d: int = 3) -> None:
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(d,)))
    alive = tuple(x for x in DEVICES if x != d)
    sup.handle(tick(alive=alive, dead=(d,)))
    sup.handle(Planned(decision(), 0.0))
    sup.handle(Deployed(1, alive, 1))


def test_a_repaired_device_waits_for_a_commit_then_joins_once_ready() -> None:
    sup = running()
    failed_device(sup)
    sup.handle(Rejoin((3,)))
    assert sup.handle(tick(alive=(0, 1, 2), dead=(3,))) == []  # generation 1 has not committed yet
    sup.handle(Committed(1, 1))
    acts = sup.handle(tick(alive=(0, 1, 2), dead=()))
    assert of(acts, Relaunch) == [Relaunch((3,))] and sup.phase is Phase.JOINING
    assert sup.handle(tick(alive=DEVICES)) == []  # not ready yet
    sup.handle(Ready((3,)))
    acts = sup.handle(tick(alive=DEVICES))
    assert of(acts, PlanRejoin) == [PlanRejoin((3,), sup.state)] and 3 not in sup.handled
    (dep,) = sup.handle(Planned(decision(), 0.0))
    assert dep.kind == "rejoin" and dep.from_checkpoint  # device 3 has work and no state
    sup.handle(Deployed(2, DEVICES, 2))
    assert sup.rejoined == {3: 2} and sup.phase is Phase.DEPLOYING


def test_a_repaired_device_whose_failure_is_not_handled_yet_stays_offered() -> None:
    sup = running()
    sup.handle(Rejoin((3,)))
    assert sup.handle(tick(alive=(0, 1, 2), dead=())) == []
    failed_device(sup)
    sup.handle(Committed(1, 1))
    assert of(sup.handle(tick(alive=(0, 1, 2), dead=())), Relaunch) == [Relaunch((3,))]


def test_scheduled_repairs_come_due_with_the_commits_and_live_devices_are_never_relaunched() -> None:
    sup = running(repairs={3: (3,), 9: (1,)})
    failed_device(sup)
    sup.handle(Rejoin((0,)))  # alive: nothing to repair
    sup.handle(Committed(1, 1))
    assert of(sup.handle(tick(alive=(0, 1, 2), dead=())), Relaunch) == []
    sup.handle(Committed(2, 1))
    assert of(sup.handle(tick(alive=(0, 1, 2), dead=())), Relaunch) == [Relaunch((3,))]
    assert sup.repairs == {9: (1,)}


def test_a_relaunch_that_fails_leaves_the_device_out() -> None:
    sup = running()
    failed_device(sup)
    sup.handle(Committed(1, 1))
    sup.handle(Rejoin((3,)))
    sup.handle(tick(alive=(0, 1, 2), dead=()))
    (ev,) = sup.handle(RelaunchFailed((3,), "RuntimeError: node 1 is not connected"))
    assert "could not be started again" in ev.text and not sup.joining and sup.phase is Phase.RUNNING


def test_a_relaunched_device_that_never_gets_ready_is_dropped_after_the_join_timeout() -> None:
    clock = Clock()
    sup = running(clock, join_timeout_s=120.0)
    failed_device(sup)
    sup.handle(Committed(1, 1))
    sup.handle(Rejoin((3,)))
    sup.handle(tick(alive=(0, 1, 2), dead=()))
    clock.now += 121
    acts = sup.handle(tick(alive=DEVICES))
    assert Kill(3) in acts and "did not get ready" in of(acts, Emit)[0].text and sup.phase is Phase.RUNNING


def test_paused_workers_back_join_without_a_relaunch_and_leftovers_are_killed_at_the_end() -> None:
    sup = running()
    sup.handle(FailureReport(generation=0, failure="fail-stop", devices=(2, 3), paused=(2, 3)))
    sup.handle(tick())
    sup.handle(Planned(decision(), 0.0))
    sup.handle(Deployed(1, DEVICES, 1))
    sup.handle(Committed(1, 1))
    sup.handle(Rejoin((2,)))
    acts = sup.handle(tick())
    assert not of(acts, Relaunch) and of(acts, Emit)[0].kind == "resumed" and 2 in sup.joining
    assert sup.finish(alive=DEVICES) == [Emit(Killed(text="device 3 was still paused at the job's end: killed",
                                                     devices=(3,))), Kill(3)]


# ------------------------------------------------------------------ layouts
def prev(resume: int = 40, restore=None, fresh=False):
    return SimpleNamespace(generation=7, resume=resume, devices=DEVICES, restore=restore, fresh=fresh, stop=False)


def layout_case(layouts, resume: int = 40, can_restore: bool = True, **kw) -> bool:
    return needs_restore(prev(**kw), resume, can_restore=can_restore, layouts=lambda: layouts)


def test_a_move_every_live_worker_finished_or_gave_up_is_trusted() -> None:
    assert not layout_case(["moved"] * 4)
    assert not layout_case(["kept"] * 4)


def test_a_mixed_or_unfinished_move_restores() -> None:
    assert layout_case(["moved", "moved", "kept", "kept"])
    assert layout_case(["moved", "moved", "moved", "unknown"])


def test_a_generation_that_committed_or_restores_is_decided_by_that() -> None:
    assert not layout_case(["moved", "kept"], resume=41)  # it committed: every executor was ready
    assert layout_case(["moved"] * 4, restore=39)  # a restore that never committed
    assert not layout_case(["moved", "kept"], can_restore=False)  # nothing to restore from


# ------------------------------------------------------------------ the control loop's deploy path
class MemStore:
    """The job store in memory (what JobSession needs of it)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}

    def set(self, key, value) -> None:
        self.kv[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key) -> bytes:
        return self.kv[key]

    def add(self, key, value) -> int:
        n = int(self.kv.get(key, b"0")) + value
        self.kv[key] = str(n).encode()
        return n

    def check(self, keys) -> bool:
        return all(k in self.kv for k in keys)

    def compare_set(self, key, expected, desired) -> bytes:
        if key not in self.kv and expected == "":
            self.set(key, desired)
        return self.kv.get(key, b"")

    def delete_key(self, key) -> bool:
        return self.kv.pop(key, None) is not None


class FakeJob:
    """A LocalJob's processes in memory; its session is the real one."""

    def __init__(self) -> None:
        from resihp_core.runtime.session import JobSession

        self.session = JobSession(MemStore())
        self.killed: list[int] = []

    def __getattr__(self, name):
        return getattr(self.session, name)

    def alive(self) -> list[int]:
        return list(DEVICES)

    def dead(self) -> list[int]:
        return []

    def post(self, plan, *, iterations, resume=None, restore=None, fresh=False, exclude=frozenset()) -> int:
        return self.session.post(plan, devices=DEVICES, iterations=iterations, resume=resume, restore=restore,
                                 fresh=fresh)

    def workers_left(self):
        return self.session.workers_left()

    def kill(self, device, sig=None) -> None:
        self.killed.append(device)


def _sealed(root, *iterations: int) -> None:
    from resihp_core import checkpoints

    for it in iterations:
        d = checkpoints.iteration_dir(root, it)
        d.mkdir(parents=True)
        (d / "layer_0000-tp0.pt").write_bytes(b"state %d" % it)
        checkpoints.seal(root, it)


def test_state_lost_restores_the_newest_complete_checkpoint_through_the_control_loop(tmp_path) -> None:
    from resihp_core.runtime import session
    from resihp_core.runtime.controller.control import CheckpointPolicy, ControlLoop

    _sealed(tmp_path, 3, 7)
    job = FakeJob()
    job.session.post(PLAN, devices=DEVICES, iterations=20, resume=0)
    for i in range(10):  # iterations 0-9 committed in generation 0 (the last executor's add decides)
        assert session.commit(job.session.store, 0, i, 1) == "commit"
    ctl = ControlLoop(job, Planner(), STATE, 20, checkpoints=CheckpointPolicy(str(tmp_path), 4, grace_s=0.0))
    ctl._feed(Deployed(0, DEVICES, 0))
    assert job.session.committed_through() == 10
    ctl._feed(Committed(9, 0))
    session.put_left(job.session.store, WorkerLeft(generation=0, device=2, reason="StateLost: shard 1/2",
                                                   error="StateLost", state_lost=True))
    ctl._poll()
    ctl._feed(Tick(alive=frozenset(DEVICES), dead=frozenset()))
    msg = job.session.message
    assert job.session.generation == 1 and msg.restore == 7 and msg.resume == 8 and not msg.fresh
    plan_ev = [e for e in ctl.events if isinstance(e, PlanPosted)][-1]
    assert "resumed from the checkpoint of iteration 7" in plan_ev.text
    assert plan_ev.iteration == 10 and plan_ev.restore == 7  # labelled where the job was
    assert ctl.core.phase is Phase.DEPLOYING and ctl.core.committed == 8


class MemoryJob(FakeJob):
    """A job whose posts may name memory holders (a restore from peers' memory)."""

    def post(self, plan, *, iterations, resume=None, restore=None, fresh=False, exclude=frozenset(),
             memory_holders=None) -> int:
        return self.session.post(plan, devices=DEVICES, iterations=iterations, resume=resume, restore=restore,
                                 fresh=fresh, memory_holders=memory_holders)

    def workers_left(self, generation=None):
        return self.session.workers_left(generation)


def test_a_memory_copy_of_the_last_commit_beats_disk_and_a_failed_read_falls_back_to_disk(tmp_path) -> None:
    import json

    from resihp_core.runtime import peercopy, session
    from resihp_core.runtime.controller.control import CheckpointPolicy, ControlLoop

    _sealed(tmp_path, 3, 7)
    job = MemoryJob()
    store = job.session.store
    job.session.post(PLAN, devices=DEVICES, iterations=20, resume=0)
    for i in range(10):
        assert session.commit(store, 0, i, 1) == "commit"
    store.set(peercopy.MODEL_KEY, json.dumps(["stage0", "stage1"]))
    store.set(peercopy.HELD_KEY.format(0), json.dumps([[0, 8, 0, "stage0", 0, 1], [0, 9, 0, "stage0", 0, 1]]))
    store.set(peercopy.HELD_KEY.format(2), json.dumps([[1, 8, 0, "stage1", 0, 1], [1, 9, 0, "stage1", 0, 1]]))
    ctl = ControlLoop(job, Planner(), STATE, 20,
                      checkpoints=CheckpointPolicy(str(tmp_path), 4, grace_s=0.0, memory_every=1))
    ctl._feed(Deployed(0, DEVICES, 0))
    assert job.session.committed_through() == 10
    ctl._feed(Committed(9, 0))

    def state_lost(generation: int, why: str) -> None:
        session.put_left(store, WorkerLeft(generation=generation, device=2, reason=why, error=why.split(":")[0],
                                           state_lost=True))
        ctl._left_news = True  # as the store watcher says when a worker leaves
        ctl._poll()
        ctl._feed(Tick(alive=frozenset(DEVICES), dead=frozenset()))

    state_lost(0, "StateLost: shard 1/2")
    msg = job.session.message
    assert (msg.generation, msg.restore, msg.resume) == (1, 9, 10)  # not the checkpoint of 7: nothing re-trained
    assert msg.memory_holders == {"stage0": [0], "stage1": [2]}
    plan_ev = [e for e in ctl.events if isinstance(e, PlanPosted)][-1]
    assert "resumed from the memory copies of iteration 9 at iteration 10" in plan_ev.text
    # Device 2 cannot read its part (say, the holder's listener is unreachable): the
    # next restore reads the disk, and says why.
    state_lost(1, "PeerCopyError: cannot read the memory copy held by device 0")
    msg = job.session.message
    assert (msg.generation, msg.restore, msg.resume, msg.memory_holders) == (2, 7, 8, None)
    assert any("could not read the memory copies of iteration 9" in e.text for e in ctl.events)


def test_memory_copies_on_an_adapter_without_them_are_announced_and_serve_no_restore() -> None:
    from dataclasses import replace

    from resihp_core.adapter import Capabilities
    from resihp_core.runtime.controller.control import CheckpointPolicy, ControlLoop

    job = MemoryJob()
    state = replace(STATE, capabilities=replace(Capabilities.all(), memory_copy=False))
    ctl = ControlLoop(job, Planner(), state, 20, checkpoints=CheckpointPolicy(None, 0, memory_every=1))
    ctl._announce_memory()
    (ev,) = ctl.events
    assert "does not declare the memory_copy capability" in ev.text and "from the initial state" in ev.text
    assert not ctl.core.can_restore  # no checkpoints and no memory copies: nothing to restore from
    capable = ControlLoop(MemoryJob(), Planner(), STATE, 20, checkpoints=CheckpointPolicy(None, 0, memory_every=1))
    capable._announce_memory()
    assert capable.core.can_restore and not capable.events


def test_the_session_notifies_observers_once_per_failure() -> None:
    from resihp_core.runtime.controller.control import ControlLoop

    seen: list = []
    job = FakeJob()
    job.session.observers = SimpleNamespace(notify_failure=seen.append, notify_plan_changed=lambda *a: None,
                                            notify_iteration=lambda m: None)
    job.session.post(PLAN, devices=DEVICES, iterations=20, resume=0)
    ctl = ControlLoop(job, Planner(), STATE, 20)
    ctl._feed(Deployed(0, DEVICES, 0))
    for evidence in ("connection closed", "worker process exited", "heartbeat lost"):
        ctl.reports.put(FailureReport(generation=0, failure="fail-stop", devices=(3,), evidence=evidence))
    ctl._poll()
    ctl._feed(Tick(alive=frozenset({0, 1, 2}), dead=frozenset({3})))
    assert [r.devices for r in seen] == [(3,)] and job.session.generation == 1
    assert 3 not in job.session.plan.devices()


def test_the_control_loop_gives_the_payback_rule_the_workers_reconfiguration_timing_at_the_first_commit() -> None:
    from resihp_core.runtime import session
    from resihp_core.runtime.controller.control import ControlLoop

    job = FakeJob()
    store = job.session.store
    job.session.post(PLAN, devices=DEVICES, iterations=20, resume=0)
    for d in DEVICES:  # the first to arrive waited longest in the rebuild
        session.put_ready(store, 0, d, {"seconds": 0.5, "rebuild_s": 0.4 - 0.1 * d, "state_s": 0.01 * (d + 1),
                                        "bytes_received": 0})
    ctl = ControlLoop(job, Planner(), STATE, 20)
    ctl._feed(Deployed(0, DEVICES, 0))
    assert ctl.core.meter.timed_s is None
    assert session.commit(store, 0, 0, 1) == "commit"
    ctl._commits(0.0)
    fastest, slowest = min(0.4 - 0.1 * d for d in DEVICES), 0.01 * (max(DEVICES) + 1)
    assert ctl.core.meter.timed_s is not None and abs(ctl.core.meter.timed_s - (fastest + slowest)) < 1e-9
