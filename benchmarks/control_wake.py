"""The control loop's own reaction and idle cost, without agents or workers: a
FailureReport put in its inbox -> the next generation posted (planning included), and
the process's CPU over one idle second; the loop that sleeps on what wakes it (an
``Inbox``) next to the 5 ms poll it replaced (the same loop given a plain queue).
It drives the loop through tests/unit/test_control_wake.py's in-memory job on a real
job store (docs/benchmarks.md, "The controller's own CPU").

Usage: python benchmarks/control_wake.py [ROUNDS]
"""
import os
import queue
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "unit"))
import test_control_wake as T  # noqa: E402
from resihp_core.protocol import FailureReport  # noqa: E402
from resihp_core.runtime.controller.control import ControlLoop, Inbox  # noqa: E402
from resihp_core.runtime.store import StoreServer  # noqa: E402
from resihp_core.scheduler.planner import Planner  # noqa: E402


def trial(sleeping: bool) -> tuple[float, float]:
    """(seconds from the report to the next generation, process CPU seconds over 1 s idle)."""
    srv = StoreServer("127.0.0.1", T.SECRET)
    store = srv.local()
    job = T.FakeJob(store)
    ctl = ControlLoop(job, Planner(), T._state(), 3, reports=Inbox() if sleeping else queue.Queue())
    t, out = T._run(ctl)
    while job.session.generation != 0:
        time.sleep(0.001)
    T._commit(store, 0, range(1))
    while len(ctl.records) < 1:
        time.sleep(0.001)
    time.sleep(0.2)
    p0 = time.process_time()
    time.sleep(1.0)  # idle: what the loop costs with nothing happening
    idle_cpu = time.process_time() - p0
    job.gone.add(3)
    t0 = time.perf_counter()
    ctl.reports.put(FailureReport(generation=0, failure="fail-stop", devices=(3,), evidence="bench"))
    while job.session.generation != 1:
        pass
    dt = time.perf_counter() - t0
    T._commit(store, 1, range(1, 3))
    t.join(30)
    srv.close()
    return dt, idle_cpu


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    res: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    load0 = os.getloadavg()[0]
    for _ in range(rounds):
        for sleeping in (False, True):  # interleaved: both see the same load
            res[sleeping].append(trial(sleeping))
    for sleeping, rows in res.items():
        d = sorted(r[0] * 1e3 for r in rows)
        c = statistics.median(r[1] for r in rows) * 1e3
        print(f"{'sleeps on what wakes it' if sleeping else 'polls every 5 ms':24s}: report -> plan posted, ms: "
              f"median {statistics.median(d):.1f} (min {d[0]:.1f}, max {d[-1]:.1f}, n {len(d)}); "
              f"process CPU over 1 s idle: {c:.0f} ms")
    print(f"load (1 min) {load0:.1f} -> {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
