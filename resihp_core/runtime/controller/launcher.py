"""Launch and steer the worker processes of one job (our own launcher, not torchrun:
torchrun tears every worker down when one dies, we must shrink in place).

:class:`LocalJob` hosts the job's authenticated store (rendezvous with a fresh key prefix per
plan generation), starts one worker process per device through a process host (its
own children, or the node agents: :mod:`resihp_core.runtime.processes`), posts plan
generations, aborts a generation when a worker dies, and collects per-iteration
reports. Every process started is tracked by pid and reaped by :meth:`LocalJob.close`.
"""

from __future__ import annotations

import os
import secrets as _secrets
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from resihp_core.plan import ParallelPlan
from resihp_core.protocol import IterationReport, PlanUpdate, WorkerLeft, node_credential
from resihp_core.runtime import session as _session
from resihp_core.runtime.session import JobSession, Observers
from resihp_core.runtime.processes import LocalProcesses, WorkerProcesses

if TYPE_CHECKING:
    from resihp_core.protocols.events import JobEvent
    from resihp_core.runtime.store import LocalStore, StoreClient

__all__ = ["LocalJob", "NoProgress"]


class NoProgress(RuntimeError):
    """The job could not make progress; the message says which device or iteration."""


class LocalJob:
    """One training job's workers, steered through the job store it hosts.

    :param host: the address the job store binds (and only that one).
    :param secret: the job secret (default: a fresh one); workers get their node's
        credential, never the secret itself.
    :param processes: builds the process host from the job's folder:
        :class:`~resihp_core.runtime.processes.LocalProcesses` (children of this
        process, the default) or the node agents' (``run_resilient``).
    :param store: the job store hosted elsewhere (a store host process, connected as
        ``controller``) and its address, instead of one hosted here
        (docs/failover.md); :meth:`close` then ends that process.
    :param attach: re-attach to a running job instead of launching workers: the
        generation its workers are in (a restarted controller; docs/failover.md).
    :param observers, on_event: who the job's :class:`~resihp_core.runtime.session.JobSession`
        (:attr:`session`: its shared state) notifies.
    """

    def __init__(self, job_json: str, devices: Iterable[int], *,
                 worker_module: str = "resihp_core.runtime.worker",
                 workdir: str | os.PathLike | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None,
                 processes: Callable[[Path], WorkerProcesses] = LocalProcesses,
                 secret: str = "", store: tuple[StoreClient, str] | None = None,
                 attach: PlanUpdate | None = None, observers: Observers | None = None,
                 on_event: Callable[[JobEvent], None] = lambda ev: None) -> None:
        self.devices = sorted(devices)
        self._tmp = tempfile.TemporaryDirectory(prefix="resihp-job-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job_path = self.workdir / "job.json"
        self.job_path.write_text(job_json)
        self._secret = secret or _secrets.token_hex(16)
        self._hosted = store is None
        self.store: LocalStore | StoreClient
        self.store, self.address = _session.host(host, secret=self._secret) if store is None else store
        self.worker_module = worker_module
        self.env = env or {}
        self.processes = processes(self.workdir)
        if isinstance(self.processes, LocalProcesses):
            # Our own children are "node 0"; agents give their workers their node's credential.
            self.env = {**self.env, "RESIHP_SECRET": node_credential(self._secret, 0), "RESIHP_NODE": "0"}
        # The job's shared state (generation counter, verdicts, observers): its session.
        self.session = JobSession(self.store, observers=observers, on_event=on_event)
        if attach is not None:
            self._adopt(attach)
            return
        self.steer()
        try:
            self.processes.launch(self.devices, module=worker_module, job_path=self.job_path,
                                  job_json=job_json, store=self.address, env=self.env)
        except BaseException:
            self.close(timeout=2.0)
            raise

    def steer(self) -> None:
        """Let the workers commit: a controller steers the job (a store hosted in its
        own process holds commits until then; docs/failover.md)."""
        if not self._hosted:
            self.session.steer()

    def _adopt(self, msg: PlanUpdate) -> None:
        """Take over generation ``msg`` its workers are in (no launch, no post)."""
        self.session.adopt(msg)

    # ------------------------------------------------------------ the session's state
    @property
    def generation(self) -> int:
        return self.session.generation

    @property
    def plan(self) -> ParallelPlan | None:
        return self.session.plan

    @property
    def message(self) -> PlanUpdate | None:
        return self.session.message

    @property
    def committed(self) -> int:
        return self.session.committed

    @committed.setter
    def committed(self, value: int) -> None:
        self.session.committed = value

    @property
    def committed_in(self) -> dict[int, int]:
        return self.session.committed_in

    @property
    def plans(self) -> dict[int, ParallelPlan]:
        return self.session.plans

    # ------------------------------------------------------------ processes
    def alive(self) -> list[int]:
        return self.processes.alive()

    def dead(self) -> list[int]:
        return self.processes.dead()

    def relaunch(self, devices: Iterable[int]) -> None:
        """Start the workers of ``devices`` again (repaired devices); they wait for a
        plan generation that uses them."""
        devices = sorted(devices)
        for d in devices:  # wait_started waits for the new worker's own pid
            self.session.forget_worker(d)
        self.processes.launch(sorted(devices), module=self.worker_module, job_path=self.job_path,
                              job_json=self.job_path.read_text(), store=self.address, env=self.env)

    def wait_started(self, devices: Iterable[int], timeout: float = 60.0) -> bool:
        """Wait until the workers of ``devices`` are up (each posts its pid once its
        adapter exists); False on time-out or if one died."""
        devices = sorted(devices)
        deadline = time.monotonic() + timeout
        while not self.session.workers_up(devices):
            if time.monotonic() > deadline or set(devices) & set(self.dead()):
                return False
            time.sleep(0.02)
        return True

    def kill(self, device: int, sig: int = signal.SIGKILL, *, reap: bool = True) -> None:
        """Send ``sig`` to the device's worker; for SIGKILL, wait until it is gone so
        the next generation does not count it alive."""
        if sig == signal.SIGKILL:
            self.processes.kill(device, wait=reap)
        else:
            self.processes.signal(device, sig)

    def log(self, device: int) -> str:
        path = self.workdir / f"worker{device}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    # ------------------------------------------------------------ generations
    def post(self, plan: ParallelPlan, *, iterations: int, resume: int | None = None,
             restore: int | None = None, fresh: bool = False,
             exclude: set[int] | frozenset[int] = frozenset(),
             memory_holders: dict[str, list[int]] | None = None) -> int:
        """Post the next generation: ``plan`` on every live worker not in ``exclude``."""
        devices = tuple(d for d in self.alive() if d not in exclude)
        missing = [d for d in plan.devices() if d not in devices]
        if missing:
            raise NoProgress(f"plan generation {self.generation + 1} uses devices {missing} that have no live worker")
        return self.session.post(plan, devices=devices, iterations=iterations, resume=resume, restore=restore,
                                 fresh=fresh, memory_holders=memory_holders)

    def abort(self) -> int:
        """Abort the current generation; returns the iteration to resume from."""
        return self.session.abort()

    def committed_through(self) -> int:
        """Advance :attr:`committed` over iterations whose verdict is ``commit``."""
        return self.session.committed_through()

    def wait(self, iteration: int, *, timeout: float = 120.0, on_death: str = "raise") -> list[int]:
        """Wait until ``iteration`` iterations are committed. Returns the devices that
        died meanwhile (``on_death='return'``), or raises :class:`NoProgress`: at
        ``timeout``, or as soon as every device of the generation has left it (with
        their reasons)."""
        deadline = time.monotonic() + timeout
        next_left = time.monotonic()
        while self.committed_through() < iteration:
            dead = [d for d in self.dead() if self.message and d in self.message.devices]
            if dead:
                if on_death == "return":
                    return dead
                raise NoProgress(f"worker(s) {dead} died during generation {self.generation}:\n"
                               + "\n".join(self.log(d)[-2000:] for d in dead))
            if time.monotonic() >= next_left:  # a few store reads: four times a second
                next_left = time.monotonic() + 0.25
                left = self.session.workers_left()
                if self.message and left and set(self.message.devices) <= set(left):
                    # every device gave the generation up (a state move they all refused):
                    # nothing will commit, and no supervisor here posts another one
                    raise NoProgress(f"every device left generation {self.generation}: " + "; ".join(
                        f"device {d}: {w.reason[:300]}" for d, w in sorted(left.items())))
            if time.monotonic() > deadline:
                raise NoProgress(f"iteration {self.committed} did not commit in {timeout:.0f}s "
                               f"(generation {self.generation}); logs in {self.workdir}")
            time.sleep(0.002)
        return []

    def ready_times(self, generation: int | None = None) -> dict[int, float]:
        return {d: info["seconds"] for d, info in self.session.ready_info(generation).items()}

    def worker_failures(self, generation: int | None = None) -> dict[int, str]:
        """Devices whose iteration raised in ``generation`` (default: current), with why."""
        return {d: left.reason for d, left in self.session.workers_left(generation).items()}

    def workers_left(self, generation: int | None = None) -> dict[int, WorkerLeft]:
        """Devices that left ``generation`` (default: current), with their typed reports."""
        return self.session.workers_left(generation)

    def ready_info(self, generation: int | None = None) -> dict[int, dict[str, float]]:
        """Per-device reconfiguration breakdown of a generation (rebuild, state, bytes)."""
        return self.session.ready_info(generation)

    def report(self, iteration: int, generation: int | None = None) -> dict[int, IterationReport]:
        """Per-device reports of ``iteration`` in ``generation`` (default: the one that
        committed it)."""
        return self.session.report(iteration, generation)

    def close(self, timeout: float = 10.0) -> None:
        """Tell workers to stop, then reap every process we started (by pid)."""
        try:
            self.session.stop()
        except Exception:  # noqa: BLE001 - the store may be gone; still reap
            pass
        self.processes.close(timeout)
        if self._hosted:
            self.store.server.close()
        else:  # the store host ends with the job
            try:
                self.session.end_store_host()
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
