"""The node agent's launcher: starts, signals, fences and reaps its node's workers.

:class:`WorkerLauncher` is the other half of
:class:`~resihp_core.runtime.agent.NodeAgent` (the first is the monitor,
:mod:`resihp_core.runtime.agent.node_monitor`). On the controller's
:class:`~resihp_core.protocol.LaunchWorkers` it starts one worker process per device
(:func:`~resihp_core.runtime.processes.spawn_worker`: they die with the agent),
watches them, sends a :class:`~resihp_core.protocol.WorkerProcess` when each starts
(with the address its collectives bind to) and ends, and signals them on
:class:`~resihp_core.protocol.SignalWorker`. :meth:`WorkerLauncher.fence` kills every
worker it started, by pid, when the node was cut off from the job.

Workers bind their collectives to the interface :func:`~resihp_core.runtime.netif.select_interface`
picks: the agent's ``interface`` (``--interface``), the job's ``runtime.interface``
(``RESIHP_INTERFACE`` in the launch message), ``GLOO_SOCKET_IFNAME`` set by the user,
or the interface of the agent's own connection to the controller.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from dataclasses import asdict
from pathlib import Path

from resihp_core.detector.failstop import FailStopMonitor
from resihp_core.protocol import LaunchWorkers, WorkerProcess
from resihp_core.runtime.netif import INTERFACE_ENV, Interface, collective_env, select_interface
from resihp_core.runtime.agent.node_monitor import process_state

__all__ = ["WorkerLauncher"]

logger = logging.getLogger("resihp.agent")


class WorkerLauncher:
    """Launching one node's workers (a mixin of ``NodeAgent``)."""

    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            import tempfile

            self._workdir = Path(tempfile.mkdtemp(prefix=f"resihp-agent{self.node}-"))
        return self._workdir

    def collective_interface(self, job_choice: str = "") -> Interface | None:
        """Where this node's workers bind their collectives (see the module docstring)."""
        return select_interface(self.interface or job_choice or None, local_address=self.local_address)

    def launch(self, msg: LaunchWorkers) -> None:
        """Start one worker per device of ``msg`` (call on the agent's loop)."""
        from resihp_core.runtime.processes import spawn_worker, worker_env

        try:
            if msg.detector:
                self._reconfigure(msg.detector)
            iface = self.collective_interface(msg.env.get(INTERFACE_ENV, ""))
            self.workdir.mkdir(parents=True, exist_ok=True)
            job_path = self.workdir / "job.json"
            tmp = job_path.with_name(f"job.json.tmp{os.getpid()}")
            tmp.write_text(msg.job)
            os.replace(tmp, job_path)
        except (OSError, ValueError) as e:
            for d in msg.devices:
                self._to_controller(WorkerProcess(node=self.node, device=d, error=f"node {self.node}: {e}"))
            return
        host = msg.store_host or (self.controller[0] if isinstance(self.controller, tuple) else "127.0.0.1")
        secret = self._secret.decode() if isinstance(self._secret, bytes) else self._secret
        self.commits.use_store(f"{host}:{msg.store_port}")
        self.generations.use_store(f"{host}:{msg.store_port}")
        net = collective_env(iface) if iface is not None else {}
        for d in msg.devices:
            old = self.children.get(d)
            if old is not None and old.poll() is None:
                self._to_controller(WorkerProcess(node=self.node, device=d, pid=old.pid,
                                                  error=f"device {d} already runs (pid {old.pid})"))
                continue
            env = worker_env(store=f"{host}:{msg.store_port}", device=d, job_path=job_path, extra={
                **msg.env, **net, "RESIHP_AGENT_ADDR": self.worker_address or "", "RESIHP_SECRET": secret,
                "RESIHP_NODE": str(self.node), "RESIHP_RANK": str(d), "RESIHP_HEARTBEAT_INTERVAL": str(self.config.heartbeat_interval_s)})
            try:
                child = spawn_worker(msg.module, env, self.workdir / f"worker{d}.log")
            except OSError as e:
                self._to_controller(WorkerProcess(node=self.node, device=d, error=f"node {self.node}: {e}"))
                continue
            self.children[d] = child
            self.monitor.workers.pop(d, None)  # a relaunched device starts with a clean record
            if d in self._pidfds:
                self._unwatch_fd(self._pidfds[d])
            self.watch_pid(d, child.pid)
            logger.info("event=worker_launched node=%d device=%d pid=%d interface=%s", self.node, d, child.pid,
                        f"{iface.name}/{iface.address}" if iface else "default")
            self._to_controller(WorkerProcess(node=self.node, device=d, pid=child.pid,
                                              address=iface.address if iface else ""))

    def _poll_children(self) -> None:
        """Reap launched workers that ended and tell the controller, once each."""
        for d, child in self.children.items():
            if child.pid not in self._ended and child.poll() is not None:
                self._ended.add(child.pid)
                self._to_controller(WorkerProcess(node=self.node, device=d, pid=child.pid,
                                                  returncode=child.returncode))

    def _reconfigure(self, detector: dict) -> None:
        """Adopt the controller's detector section (before any worker is watched)."""
        from resihp_core.config import Config

        cfg = Config.from_dict({"detector": {**asdict(self.config), **detector}}, source="the controller").detector
        if cfg != self.config and not self.monitor.workers:
            self.config = cfg
            self.monitor = FailStopMonitor.from_config(cfg, process_state=process_state)

    def signal_worker(self, device: int, sig: int) -> None:
        """Send ``sig`` to a worker this agent launched (SIGKILL also resumes a stopped one)."""
        child = self.children.get(device)
        if child is None or child.poll() is not None:
            return
        if sig == signal.SIGKILL:
            child.send_signal(signal.SIGCONT)
        child.send_signal(sig)
        logger.info("event=worker_signalled node=%d device=%d signal=%s", self.node, device,
                    signal.Signals(sig).name)

    def fence(self) -> list[int]:
        """Kill (by pid) and reap every worker this agent started that still runs, and
        forget their records: the job has moved on without them. Returns every device
        this agent has launched a worker for."""
        for d, child in self.children.items():
            if child.poll() is None:
                logger.warning("event=worker_fenced node=%d device=%d pid=%d", self.node, d, child.pid)
        self._reap_children()
        for d in list(self.children):
            self.monitor.workers.pop(d, None)
            if d in self._pidfds:
                self._unwatch_fd(self._pidfds[d])
        self._poll_children()
        return sorted(self.children)

    def _reap_children(self) -> None:
        """Kill and reap every worker still running (by pid)."""
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)
