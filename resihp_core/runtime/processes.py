"""Where a job's worker processes run, and how they are started, signalled and reaped.

A :class:`~resihp_core.runtime.controller.launcher.LocalJob` steers its workers through one of two
*process hosts* with the same small interface (:class:`WorkerProcesses`):

* :class:`LocalProcesses` starts them as children of this process (tests, benchmarks
  of the backend alone);
* :class:`AgentProcesses` asks each node's agent, through the controller, to start
  them (``resihp run``: the agent is the launcher of its node, on this machine or
  another). It learns starts and exits from the agents' ``WorkerProcess`` messages, and
  treats every worker of a node whose agent is lost as dead: the agent started its
  workers with :func:`spawn_worker`, so they die with it.

:func:`spawn_worker` runs ``python -m resihp_core.runtime.processes MODULE``: a
trampoline that asks the kernel to SIGKILL the worker when its launcher dies
(``PR_SET_PDEATHSIG``, Linux) and then runs ``MODULE`` as ``__main__``. A worker is
thereby never orphaned into a job that has moved on without it, and no ``preexec_fn``
runs in a multi-threaded launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol

if TYPE_CHECKING:
    from resihp_core.protocol import WorkerProcess

__all__ = ["WorkerProcesses", "LocalProcesses", "AgentProcesses", "spawn_worker", "worker_env"]

PARENT_ENV = "RESIHP_PARENT_PID"


def worker_env(*, store: str, device: int, job_path: str | os.PathLike, extra: Mapping[str, str] = {}) -> dict[str, str]:
    """The environment of one worker: ours, ``extra``, and the job's coordinates."""
    env = dict(os.environ)
    env.update(extra)
    env.update(RESIHP_STORE=store, RESIHP_DEVICE=str(device), RESIHP_JOB=str(job_path),
               OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    return env


def spawn_worker(module: str, env: Mapping[str, str], log_path: str | os.PathLike,
                 args: Iterable[str] = ()) -> subprocess.Popen:
    """Start ``python -m module args...`` (through the die-with-parent trampoline),
    output appended to ``log_path``."""
    env = dict(env)
    env[PARENT_ENV] = str(os.getpid())
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, "-m", __name__, module, *args], env=env,
                                stdout=log, stderr=subprocess.STDOUT)


class WorkerProcesses(Protocol):
    """What a job needs from wherever its workers run."""

    def launch(self, devices: Iterable[int], *, module: str, job_path: Path, job_json: str,
               store: str, env: Mapping[str, str]) -> None: ...
    def alive(self) -> list[int]: ...
    def dead(self) -> list[int]: ...
    def signal(self, device: int, sig: int) -> None: ...
    def kill(self, device: int, *, wait: bool = True) -> None: ...
    def close(self, timeout: float) -> None: ...


class LocalProcesses:
    """Workers as children of this process."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: dict[int, subprocess.Popen] = {}

    def launch(self, devices: Iterable[int], *, module: str, job_path: Path, job_json: str,
               store: str, env: Mapping[str, str]) -> None:
        for d in devices:
            self.procs[d] = spawn_worker(module, worker_env(store=store, device=d, job_path=job_path,
                                                            extra={**env, "RESIHP_RANK": str(d)}),
                                         self.workdir / f"worker{d}.log")

    def alive(self) -> list[int]:
        return sorted(d for d, p in self.procs.items() if p.poll() is None)

    def dead(self) -> list[int]:
        return sorted(d for d, p in self.procs.items() if p.poll() is not None)

    def signal(self, device: int, sig: int) -> None:
        if self.procs[device].poll() is None:
            self.procs[device].send_signal(sig)

    def kill(self, device: int, *, wait: bool = True) -> None:
        p = self.procs[device]
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
        if wait:
            p.wait(10)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    p.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
                p.wait(5)


class AgentProcesses:
    """Workers started by the node agents, steered through the controller.

    :param controller: a started :class:`~resihp_core.runtime.controller.Controller`
        whose ``on_process`` and ``on_node_lost`` feed :meth:`process` and
        :meth:`node_lost`.
    :param call: runs a coroutine on the controller's loop and returns its result
        (:meth:`~resihp_core.runtime.loop.LoopThread.run`).
    :param node_of: device -> node.
    :param detector: the detector section sent to every agent.
    """

    def __init__(self, controller, call: Callable, node_of: Mapping[int, int],
                 detector: Mapping[str, object] = {}, launch_timeout: float = 60.0) -> None:
        self.controller, self.call = controller, call
        self.node_of = dict(node_of)
        self.detector = dict(detector)
        self.launch_timeout = launch_timeout
        self.pids: dict[int, int] = {}
        self.exits: dict[int, int | None] = {}  # device -> return code (None: its node was lost)
        self.errors: dict[int, str] = {}
        self.addresses: dict[int, str] = {}  # device -> address its collectives bind to
        self._cond = threading.Condition()

    # fed by the controller (on its loop)
    def process(self, msg: WorkerProcess) -> None:
        with self._cond:
            if msg.error:
                self.errors[msg.device] = msg.error
                self.exits[msg.device] = None
            elif msg.returncode is None:
                self.pids[msg.device] = msg.pid
                self.exits.pop(msg.device, None)
                self.addresses[msg.device] = msg.address
            else:
                self.exits[msg.device] = msg.returncode
            self._cond.notify_all()

    def node_lost(self, node: int) -> None:
        with self._cond:
            for d, n in self.node_of.items():
                if n == node and d in self.pids:
                    self.exits.setdefault(d, None)
            self._cond.notify_all()

    def launch(self, devices: Iterable[int], *, module: str, job_path: Path, job_json: str,
               store: str, env: Mapping[str, str]) -> None:
        from resihp_core.protocol import LaunchWorkers

        devices = sorted(devices)
        host, _, port = store.rpartition(":")
        by_node: dict[int, list[int]] = {}
        for d in devices:
            if d not in self.node_of:
                raise ValueError(f"device {d} is on no node of the topology")
            by_node.setdefault(self.node_of[d], []).append(d)
        with self._cond:
            for d in devices:
                self.pids.pop(d, None)
                self.exits.pop(d, None)
                self.errors.pop(d, None)
        for node, devs in sorted(by_node.items()):
            msg = LaunchWorkers(devices=tuple(devs), module=module, job=job_json, store_port=int(port),
                                store_host="" if host in ("127.0.0.1", "localhost", "0.0.0.0", "[::]", "::", "") else host,
                                env=dict(env), detector=self.detector)
            self.call(self.controller.send(node, msg))
        deadline = time.monotonic() + self.launch_timeout
        with self._cond:
            while not all(d in self.pids or d in self.errors for d in devices):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [d for d in devices if d not in self.pids]
                    raise TimeoutError(f"agents did not start devices {missing} within {self.launch_timeout:.0f} s")
                self._cond.wait(left)
            failed = {d: self.errors[d] for d in devices if d in self.errors}
            addresses = dict(self.addresses)
        if failed:
            raise RuntimeError("; ".join(f"device {d}: {e}" for d, e in sorted(failed.items())))
        from resihp_core.runtime.netif import check_collective_addresses

        try:
            check_collective_addresses(addresses, self.node_of)
        except ValueError as e:
            raise RuntimeError(str(e)) from None

    def alive(self) -> list[int]:
        with self._cond:
            return sorted(d for d in self.pids if d not in self.exits)

    def dead(self) -> list[int]:
        with self._cond:
            return sorted(self.exits)

    def signal(self, device: int, sig: int) -> None:
        from resihp_core.protocol import SignalWorker

        if device in self.alive():
            self.call(self.controller.send(self.node_of[device],
                                           SignalWorker(device=device, signal=signal.Signals(sig).name)))

    def kill(self, device: int, *, wait: bool = True) -> None:
        self.signal(device, signal.SIGKILL)
        if wait:
            deadline = time.monotonic() + 10
            with self._cond:
                while device not in self.exits and time.monotonic() < deadline:
                    self._cond.wait(0.1)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(d not in self.exits for d in self.pids) and time.monotonic() < deadline:
                self._cond.wait(0.1)
        for d in self.alive():
            try:
                self.kill(d, wait=False)
            except Exception:  # noqa: BLE001 - the agent may be gone; it reaps its own
                pass


def _die_with_parent() -> None:
    """SIGKILL this process when the launcher that started it dies (Linux)."""
    parent = int(os.environ.pop(PARENT_ENV, "0") or 0)
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent and os.getppid() != parent:  # it died before we could ask
        sys.exit(1)


if __name__ == "__main__":
    import runpy

    if len(sys.argv) < 2:
        print(f"usage: python -m {__spec__.name if __spec__ else 'processes'} MODULE [ARGS...]", file=sys.stderr)
        sys.exit(2)
    _die_with_parent()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
