"""A stand-in worker for the detector's tests, demos and benchmarks (not a trainer).

Each iteration it "runs" its replica's packed micro-batches of a synthetic
variable-length corpus (:mod:`resihp_core.predictor.corpus`): for each micro-batch it
sleeps the forward time ``α·N + β·Σ l²`` and twice that for the backward, then a fixed
"communication" time, calling :meth:`~.heartbeat.WorkerClient.beat` at every step and
sending an :class:`~resihp_core.protocol.IterationProfile` with what it measured.
Faults are injected on the command line:

* ``--slow-compute F --slow-from I``: compute F times slower from iteration I;
* ``--slow-comm F --slow-from I``: communication F times slower;
* ``--stall-at I``: stop making progress at iteration I (the beat thread goes on: a hang);
* ``--exit-at I``: exit at iteration I with status 1, without goodbye.

With ``--busy`` the compute is a fixed amount of CPU work (calibrated at start to the
times above, in the thread's CPU time) instead of a sleep, so other processes on its core, a SIGSTOP or a
throttle lengthen it as they would a real trainer's (the detector benchmark's
externally made slowdowns).

It connects with :meth:`WorkerClient.from_env` (``RESIHP_AGENT_ADDR``, ``RESIHP_SECRET``,
``RESIHP_RANK``, ``RESIHP_DEVICE``). Prints ``ready`` once connected (and with
``--wait-stdin`` waits for a line on stdin, so several workers start together). Sleeping (not
spinning) keeps many of them cheap on a small CI machine.

    python -m resihp_core.testing.synthetic --iterations 40 --microbatches 4
"""

from __future__ import annotations

import argparse
import sys
import time

from resihp_core.detector.environment import CpuWaitMeter, allowed_cpus
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.protocol import IterationProfile, MicroBatchProfile
from resihp_core.runtime.heartbeat import WorkerClient

__all__ = ["SyntheticCluster", "main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m resihp_core.testing.synthetic", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=40, help="0 = run until killed")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=1024, help="token budget N per micro-batch")
    ap.add_argument("--alpha", type=float, default=5e-6, help="forward seconds per token")
    ap.add_argument("--beta", type=float, default=2e-9, help="forward seconds per squared document length")
    ap.add_argument("--comm", type=float, default=0.002, help="communication seconds per iteration")
    ap.add_argument("--replica", type=int, help="DP replica (default: the rank)")
    ap.add_argument("--replicas", type=int, default=64, help="replicas in the corpus split")
    ap.add_argument("--stage", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slow-compute", type=float, default=1.0)
    ap.add_argument("--slow-comm", type=float, default=1.0)
    ap.add_argument("--slow-from", type=int, default=0)
    ap.add_argument("--stall-at", type=int, default=-1)
    ap.add_argument("--exit-at", type=int, default=-1)
    ap.add_argument("--interval", type=float, help="heartbeat interval (default: environment or 0.1)")
    ap.add_argument("--busy", action="store_true",
                    help="compute is CPU work (calibrated to the times above), not a sleep")
    ap.add_argument("--wait-stdin", action="store_true",
                    help="after 'ready', wait for a line on stdin before the first iteration")
    return ap.parse_args(argv)


def _sleep(seconds: float) -> float:
    t0 = time.perf_counter()
    if seconds > 0:
        time.sleep(seconds)
    return time.perf_counter() - t0


def _spin_rate(seconds: float = 0.05) -> float:
    """Loop turns per second of this thread's CPU time (the best of a few short tries).
    CPU time, not wall time: calibrated by the wall clock on a loaded machine (where the
    thread runs a fifteenth of the time) the "fixed amount of CPU work" came out a
    fifteenth of the times asked for, so small that the few milliseconds by which the
    run-delay reading and the chunk's timing disagree were most of a worker's own compute
    (docs/detector.md "Measured")."""
    best = 0.0
    for _ in range(3):
        n, t0 = 0, time.thread_time()
        while time.thread_time() - t0 < seconds:
            for _ in range(1000):
                pass
            n += 1000
        best = max(best, n / max(time.thread_time() - t0, 1e-9))
    return best


def _spin(seconds: float, rate: float) -> float:
    """Do ``seconds`` worth of CPU work (at ``rate`` turns per second); returns the wall time."""
    t0 = time.perf_counter()
    for _ in range(int(seconds * rate)):
        pass
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    a = _parse(argv)
    kw = {} if a.interval is None else {"interval": a.interval}
    client = WorkerClient.from_env(**kw).start()
    replica = client.rank if a.replica is None else a.replica
    spec = CorpusSpec(distribution="lognormal", scale=a.tokens / 6, shape=1.0, min_len=16,
                      max_len=2 * a.tokens, token_budget=a.tokens, seed=a.seed)
    print("ready", flush=True)
    if a.wait_stdin:
        sys.stdin.readline()
    it = 0
    waits = CpuWaitMeter()  # what it waited for a CPU, as a real worker reports it
    rate = _spin_rate() if a.busy else 0.0
    compute = (lambda s: _spin(s, rate)) if a.busy else _sleep
    try:
        while a.iterations <= 0 or it < a.iterations:
            if it == a.exit_at:
                sys.stdout.flush()
                import os

                os._exit(1)
            if it == a.stall_at:
                while True:  # stuck: progress stops, the beat thread goes on
                    time.sleep(3600)
            slow = it >= a.slow_from
            fc = a.slow_compute if slow else 1.0
            cc = a.slow_comm if slow else 1.0
            work = iteration_workload(spec, it, a.replicas, a.microbatches)
            t_iter = time.perf_counter()
            waits.start_iteration()
            mbs = []
            for j in range(a.microbatches):
                lengths = work[(replica % a.replicas, j)]
                fwd = (a.alpha * sum(lengths) + a.beta * sum(l * l for l in lengths)) * fc
                client.beat(it, 2 * j)
                waits.start_chunk()
                f = compute(fwd)
                waits.end_chunk()
                client.beat(it, 2 * j + 1)
                waits.start_chunk()
                b = compute(2 * fwd)
                waits.end_chunk()
                mbs.append(MicroBatchProfile(owner=replica, mb=j, forward_s=f, backward_s=b, doc_lengths=lengths))
            client.beat(it, 2 * a.microbatches)
            comm = _sleep(a.comm * cc)
            total = time.perf_counter() - t_iter
            client.send_profile(IterationProfile(
                rank=client.rank, device=client.device, generation=client.generation, iteration=it,
                stage=a.stage, replica=replica, microbatches=tuple(mbs), comm_s=comm, iteration_s=total,
                cpu_wait_s=waits.iteration_s(), compute_wait_s=waits.compute_s, cpus=allowed_cpus(),
            ))
            it += 1
    except KeyboardInterrupt:
        pass
    client.close(goodbye=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ------------------------------------------------------------------ a small cluster for tests
class SyntheticCluster:
    """A controller in this process, one node agent process and synthetic worker
    processes: the detector end to end on one machine (tests, demos, benchmarks).

    ``workers`` maps device id -> extra command-line arguments of that worker (see
    :func:`main`); ranks equal device ids. Every process is started with ``subprocess``,
    tracked by pid and killed by pid in :meth:`close` (after a ``SIGCONT``, in case a
    test stopped it). Use as a context manager::

        with SyntheticCluster(config, {0: [], 1: ["--slow-compute", "2"]}) as c:
            c.go()
            report = c.events.wait_for_report(lambda r: r.failure == "fail-slow", 10)
    """

    def __init__(self, config: object, workers: dict[int, list[str]], *, node: int = 0,
                 secret: str | None = None, failslow: object = None, plugins: object = None,
                 iterations: int = 0, wait_stdin: bool = True) -> None:
        import os

        self.config = config
        self.node = node
        self.secret = secret or f"synthetic-{os.getpid()}-{id(self):x}"
        self.worker_args = workers
        self.iterations = iterations
        self.wait_stdin = wait_stdin
        self._failslow = failslow
        self._plugins = plugins
        self.agent: object = None
        self.workers: dict[int, object] = {}
        self.controller: object = None
        self._loop: object = None
        self._procs: list[object] = []
        self._tmp: object = None

    def _env(self) -> dict[str, str]:
        import os

        return dict(os.environ, RESIHP_SECRET=self.secret, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")

    def __enter__(self) -> SyntheticCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        import subprocess
        import tempfile

        from resihp_core.config import Config
        from resihp_core.plugins import Plugins
        from resihp_core.runtime.controller import Controller
        from resihp_core.protocols.events import EventLog
        from resihp_core.runtime.loop import LoopThread

        self._tmp = tempfile.TemporaryDirectory(prefix="resihp-synthetic-")
        cfg_path = f"{self._tmp.name}/config.toml"  # type: ignore[attr-defined]
        with open(cfg_path, "w") as f:
            f.write(Config(detector=self.config).to_toml())  # type: ignore[arg-type]
        self._loop = LoopThread("synthetic-controller").start()
        self.events = EventLog()  # what the controller publishes
        self.controller = Controller(
            self.config, self.secret, sink=self.events,  # type: ignore[arg-type]
            plugins=self._plugins if self._plugins is not None else Plugins(autoload=False),
            failslow=self._failslow,  # type: ignore[arg-type]
        )
        self._loop.run(self.controller.start())  # type: ignore[attr-defined]
        self.agent = subprocess.Popen(
            [sys.executable, "-m", "resihp_core.runtime.agent", "--node", str(self.node),
             "--controller", self.controller.address_text, "--config", cfg_path],  # type: ignore[attr-defined]
            env=self._env(), stdout=subprocess.PIPE, text=True,
        )
        self._procs.append(self.agent)
        address = self.agent.stdout.readline().strip()  # type: ignore[attr-defined]
        if not address:
            raise RuntimeError("the agent did not start")
        for device, extra in self.worker_args.items():
            from resihp_core.protocol import node_credential

            env = dict(self._env(), RESIHP_SECRET=node_credential(self.secret, self.node), RESIHP_AGENT_ADDR=address,
                       RESIHP_RANK=str(device), RESIHP_DEVICE=str(device))
            args = [sys.executable, "-m", "resihp_core.testing.synthetic", "--iterations", str(self.iterations)]
            if self.wait_stdin:
                args.append("--wait-stdin")
            p = subprocess.Popen(args + list(extra), env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self._procs.append(p)
            self.workers[device] = p
        for device, p in self.workers.items():
            if p.stdout.readline().strip() != "ready":  # type: ignore[attr-defined]
                raise RuntimeError(f"worker {device} did not start")

    def go(self) -> None:
        """Let every worker start iterating (with ``wait_stdin``)."""
        for p in self.workers.values():
            p.stdin.write("go\n")  # type: ignore[attr-defined]
            p.stdin.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        import contextlib
        import signal

        for p in reversed(self._procs):
            with contextlib.suppress(ProcessLookupError, OSError):
                p.send_signal(signal.SIGCONT)  # type: ignore[attr-defined]
                p.kill()  # type: ignore[attr-defined]
        for p in self._procs:
            with contextlib.suppress(Exception):
                p.wait(5)  # type: ignore[attr-defined]
            for stream in ("stdin", "stdout"):
                with contextlib.suppress(Exception):
                    getattr(p, stream).close()
        self._procs.clear()
        if self._loop is not None:
            if self.controller is not None:
                with contextlib.suppress(Exception):
                    self._loop.run(self.controller.stop())  # type: ignore[attr-defined]
            self._loop.stop()  # type: ignore[attr-defined]
            self._loop = None
        if self._tmp is not None:
            self._tmp.cleanup()  # type: ignore[attr-defined]
            self._tmp = None
