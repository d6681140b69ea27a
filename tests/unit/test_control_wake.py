"""The control loop sleeps on what wakes it (docs/design.md, "The control loop"): a
commit verdict written to the job store, a worker leaving its generation, a failure
report put in its inbox. With ``idle_s`` set far beyond the test's timeout, a loop
that only moved when it polled would never finish: these tests show each wake-up
path on a real store, and that an idle loop goes round a handful of times, not every
few milliseconds."""

from __future__ import annotations

import threading

import pytest

from resihp_core.protocol import FailureReport, WorkerLeft
from resihp_core.runtime import session as s
from resihp_core.runtime.controller.control import ControlLoop, Inbox
from resihp_core.runtime.store import StoreClient, StoreServer
from resihp_core.scheduler.planner import Planner
from test_supervisor import planner_state  # the same planner state over the same plan

pytestmark = pytest.mark.timeout(120)

DEVICES = (0, 1, 2, 3)
SECRET = "s" * 32
NEVER = 3600.0  # the loop's idle wake-up: beyond the test's timeout


class FakeJob:
    """A LocalJob whose worker processes are in memory; its session and store are real."""

    def __init__(self, store) -> None:
        self.session = s.JobSession(store)
        self.gone: set[int] = set()

    def __getattr__(self, name):
        return getattr(self.session, name)

    @property
    def committed(self) -> int:
        return self.session.committed

    @committed.setter
    def committed(self, value: int) -> None:
        self.session.committed = value

    def alive(self) -> list[int]:
        return [d for d in DEVICES if d not in self.gone]

    def dead(self) -> list[int]:
        return sorted(self.gone)

    def post(self, plan, *, iterations, resume=None, restore=None, fresh=False, exclude=frozenset()) -> int:
        return self.session.post(plan, devices=tuple(plan.devices()), iterations=iterations, resume=resume,
                                 restore=restore, fresh=fresh)

    def kill(self, device, sig=None) -> None:
        self.gone.add(device)


@pytest.fixture
def server():
    srv = StoreServer("127.0.0.1", SECRET)
    yield srv
    srv.close()


def _run(ctl: ControlLoop) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["records"] = ctl.run(timeout=100)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _until(pred, t: threading.Thread) -> None:
    """Wait (no time limit but the test's) for ``pred``; the loop must still run."""
    done = threading.Event()
    while not pred():
        assert t.is_alive(), "the control loop ended early"
        done.wait(0.01)


def _commit(store, generation: int, iterations: range) -> None:
    for i in iterations:  # one executor: its add decides the verdict
        assert s.commit(store, generation, i, 1) == "commit"


def test_wait_any_returns_the_first_key_written_locally_and_over_a_connection(server) -> None:
    local = server.local()
    client = StoreClient(server.address, SECRET, "controller", timeout_s=30)
    try:
        for store, keys in ((local, ["a", "b"]), (client, ["c", "d"])):
            assert store.wait_any(keys, 0.05) == -1  # nothing came: no error
            threading.Timer(0.05, lambda k=keys[1]: local.set(k, b"1")).start()
            assert store.wait_any(keys, 60) == 1
            assert store.wait_any(keys, 60) == 1  # there already: at once
    finally:
        client.close()


def test_commits_wake_the_loop_it_does_not_poll(server) -> None:
    store = server.local()
    job = FakeJob(store)
    ctl = ControlLoop(job, Planner(), planner_state(), 5, reports=Inbox(), idle_s=NEVER)
    t, out = _run(ctl)
    _until(lambda: job.session.generation == 0, t)
    _commit(store, 0, range(5))
    t.join(60)
    assert not t.is_alive() and "error" not in out, out
    assert [r.iteration for r in out["records"]] == list(range(5))
    assert ctl._round <= 12, f"{ctl._round} rounds for 5 commits: the loop polled"


def test_a_failure_report_and_a_worker_leaving_wake_the_loop(server) -> None:
    store = server.local()
    job = FakeJob(store)
    ctl = ControlLoop(job, Planner(), planner_state(), 4, reports=Inbox(), idle_s=NEVER)
    t, out = _run(ctl)
    _until(lambda: job.session.generation == 0, t)
    _commit(store, 0, range(1))
    _until(lambda: len(ctl.records) == 1, t)
    job.gone.add(3)
    ctl.reports.put(FailureReport(generation=0, failure="fail-stop", devices=(3,), evidence="test"))
    _until(lambda: job.session.generation == 1, t)  # planned without device 3 and posted
    assert 3 not in job.session.plan.devices()
    # A worker of generation 1 leaves it (no device failed): the loop reads why at once.
    s.put_left(store, WorkerLeft(generation=1, device=0, reason="rendezvous gave up"))
    _until(lambda: 0 in ctl.core._left, t)
    _commit(store, 1, range(1, 4))
    t.join(60)
    assert not t.is_alive() and "error" not in out, out
    assert [r.iteration for r in out["records"]] == [0, 1, 2, 3]
