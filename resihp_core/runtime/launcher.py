"""Launch and steer the worker processes of one job (our own launcher, not torchrun:
torchrun tears every worker down when one dies, we must shrink in place).

:class:`LocalJob` hosts the job's authenticated store (rendezvous with a fresh key prefix per
plan generation), starts one worker process per device through a process host (its
own children, or the node agents: :mod:`resihp_core.runtime.processes`), posts plan
generations, aborts a generation when a worker dies, and collects per-iteration
reports. Every process started is tracked by pid and reaped by :meth:`LocalJob.close`.
"""

from __future__ import annotations

import json
import os
import secrets as _secrets
import signal
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from resihp_core.plan import ParallelPlan
from resihp_core.protocol import IterationReport, PlanUpdate, WorkerLeft, node_credential
from resihp_core.runtime import jobstore
from resihp_core.runtime.processes import LocalProcesses, WorkerProcesses

__all__ = ["LocalJob", "JobError"]


class JobError(RuntimeError):
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
    """

    def __init__(self, job_json: str, devices: Iterable[int], *,
                 worker_module: str = "resihp_core.runtime.worker",
                 workdir: str | os.PathLike | None = None, host: str = "127.0.0.1",
                 env: dict[str, str] | None = None,
                 processes: Callable[[Path], WorkerProcesses] = LocalProcesses,
                 secret: str = "", store: tuple[Any, str] | None = None,
                 attach: PlanUpdate | None = None) -> None:
        self.devices = sorted(devices)
        self._tmp = tempfile.TemporaryDirectory(prefix="resihp-job-") if workdir is None else None
        self.workdir = Path(workdir or self._tmp.name)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.job_path = self.workdir / "job.json"
        self.job_path.write_text(job_json)
        self._secret = secret or _secrets.token_hex(16)
        self._hosted = store is None
        self.store, self.address = jobstore.host(host, secret=self._secret) if store is None else store
        self.worker_module = worker_module
        self.env = env or {}
        self.processes = processes(self.workdir)
        if isinstance(self.processes, LocalProcesses):
            # Our own children are "node 0"; agents give their workers their node's credential.
            self.env = {**self.env, "RESIHP_SECRET": node_credential(self._secret, 0), "RESIHP_NODE": "0"}
        self.generation = -1
        self.plan: ParallelPlan | None = None
        self.committed = 0  # iterations known committed
        self.committed_in: dict[int, int] = {}  # iteration -> generation that committed it
        self.message: PlanUpdate | None = None
        self.plans: dict[int, ParallelPlan] = {}
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
            self.store.set(jobstore.PRESENT_KEY, "1")

    def _adopt(self, msg: PlanUpdate) -> None:
        """Take over generation ``msg`` its workers are in (no launch, no post)."""
        plan = msg.parsed_plan()
        self.generation, self.plan, self.message = msg.generation, plan, msg
        self.plans[msg.generation] = plan
        self.committed = msg.resume
        self.committed_through()

    # ------------------------------------------------------------ processes
    def alive(self) -> list[int]:
        return self.processes.alive()

    def dead(self) -> list[int]:
        return self.processes.dead()

    def relaunch(self, devices: Iterable[int]) -> None:
        """Start the workers of ``devices`` again (repaired devices); they wait for a
        plan generation that uses them."""
        devices = sorted(devices)
        for d in devices:  # wait_started waits for the new worker's own pid key
            try:
                self.store.delete_key(f"worker/{d}/pid")
            except Exception:  # noqa: BLE001 - absent
                pass
        self.processes.launch(sorted(devices), module=self.worker_module, job_path=self.job_path,
                              job_json=self.job_path.read_text(), store=self.address, env=self.env)

    def wait_started(self, devices: Iterable[int], timeout: float = 60.0) -> bool:
        """Wait until the workers of ``devices`` are up (each posts ``worker/<d>/pid``
        once its adapter exists); False on time-out or if one died."""
        devices = sorted(devices)
        keys = [f"worker/{d}/pid" for d in devices]
        deadline = time.monotonic() + timeout
        while not self.store.check(keys):
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
             exclude: set[int] | frozenset[int] = frozenset()) -> int:
        """Post the next generation: ``plan`` on every live worker not in ``exclude``."""
        g = self.generation + 1
        plan = plan.with_(generation=g) if plan.generation != g else plan
        devices = tuple(d for d in self.alive() if d not in exclude)
        missing = [d for d in plan.devices() if d not in devices]
        if missing:
            raise JobError(f"plan generation {g} uses devices {missing} that have no live worker")
        msg = PlanUpdate.of(plan, devices=devices, resume=self.committed if resume is None else resume,
                            iterations=iterations, restore=restore, fresh=fresh)
        jobstore.post_plan(self.store, msg)
        self.generation, self.plan, self.message = g, plan, msg
        self.plans[g] = plan
        return g

    def abort(self) -> int:
        """Abort the current generation; returns the iteration to resume from."""
        first = self.committed
        self.committed = jobstore.abort_generation(self.store, self.generation, first)
        for i in range(first, self.committed):  # committed before the abort, not yet seen
            self.committed_in[i] = self.generation
        return self.committed

    def committed_through(self) -> int:
        """Advance :attr:`committed` over iterations whose verdict is ``commit``."""
        g = self.generation
        while self.store.check([f"ctl{g}/verdict{self.committed}"]):
            if self.store.get(f"ctl{g}/verdict{self.committed}") != b"commit":
                break
            self.committed_in[self.committed] = g
            self.committed += 1
        return self.committed

    def wait(self, iteration: int, *, timeout: float = 120.0, on_death: str = "raise") -> list[int]:
        """Wait until ``iteration`` iterations are committed. Returns the devices that
        died meanwhile (``on_death='return'``), or raises :class:`JobError`."""
        deadline = time.monotonic() + timeout
        while self.committed_through() < iteration:
            dead = [d for d in self.dead() if self.message and d in self.message.devices]
            if dead:
                if on_death == "return":
                    return dead
                raise JobError(f"worker(s) {dead} died during generation {self.generation}:\n"
                               + "\n".join(self.log(d)[-2000:] for d in dead))
            if time.monotonic() > deadline:
                raise JobError(f"iteration {self.committed} did not commit in {timeout:.0f}s "
                               f"(generation {self.generation}); logs in {self.workdir}")
            time.sleep(0.002)
        return []

    def ready_times(self, generation: int | None = None) -> dict[int, float]:
        g = self.generation if generation is None else generation
        out = {}
        for d in self.message.devices if self.message else []:
            key = f"ctl{g}/ready/{d}"
            if self.store.check([key]):
                out[d] = json.loads(self.store.get(key))["seconds"]
        return out

    def worker_failures(self, generation: int | None = None) -> dict[int, str]:
        """Devices whose iteration raised in ``generation`` (default: current), with why."""
        return {d: left.reason for d, left in self.workers_left(generation).items()}

    def workers_left(self, generation: int | None = None) -> dict[int, WorkerLeft]:
        """Devices that left ``generation`` (default: current), with their typed reports."""
        g = self.generation if generation is None else generation
        out = {}
        for d in self.message.devices if self.message else []:
            left = jobstore.get_left(self.store, g, d)
            if left is not None:
                out[d] = left
        return out

    def ready_info(self, generation: int | None = None) -> dict[int, dict[str, float]]:
        """Per-device reconfiguration breakdown of a generation (rebuild, state, bytes)."""
        g = self.generation if generation is None else generation
        out = {}
        for d in self.message.devices if self.message else []:
            key = f"ctl{g}/ready/{d}"
            if self.store.check([key]):
                out[d] = json.loads(self.store.get(key))
        return out

    def report(self, iteration: int, generation: int | None = None) -> dict[int, IterationReport]:
        """Per-device reports of ``iteration`` in ``generation`` (default: the one that
        committed it)."""
        g = self.committed_in.get(iteration, self.generation) if generation is None else generation
        out = {}
        plan = self.plans[g]
        for d in plan.devices():
            r = jobstore.get_report(self.store, g, iteration, d)
            if r is not None:
                out[d] = r
        return out

    def close(self, timeout: float = 10.0) -> None:
        """Tell workers to stop, then reap every process we started (by pid)."""
        try:
            g = self.generation + 1
            jobstore.post_plan(self.store, PlanUpdate(generation=g, stop=True))
            self.generation = g
        except Exception:  # noqa: BLE001 - the store may be gone; still reap
            pass
        self.processes.close(timeout)
        if self._hosted:
            self.store.server.close()
        else:  # the store host ends with the job
            try:
                self.store.set(jobstore.SHUTDOWN_KEY, "1")
            except Exception:  # noqa: BLE001 - already gone
                pass
            self.store.close()
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> LocalJob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
