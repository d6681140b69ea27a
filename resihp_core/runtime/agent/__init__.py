"""The node agent: one per node, the node-local half of the fail-stop detector (docs/design.md §3.1)
and the launcher of the node's workers.

A :class:`NodeAgent` is made of

* the **monitor** (:class:`~resihp_core.runtime.agent.node_monitor.WorkerMonitor`): serves
  the node's workers and watches them (missed beats, lost connections, process exits
  through pidfds, hangs with a learned timeout);
* the **launcher** (:class:`~resihp_core.runtime.agent.node_launcher.WorkerLauncher`):
  starts one worker per device on the controller's
  :class:`~resihp_core.protocol.LaunchWorkers`, with their collectives bound to the
  interface the agent reaches the controller on, signals and fences them;
* the node's **commits** (:mod:`~resihp_core.runtime.agent.node_commits`: one store
  request per node and iteration) and **generation watch**
  (:mod:`~resihp_core.runtime.agent.node_generations`: one store wait and one plan read
  per node and generation, relayed to the workers);
* **one** persistent, authenticated TCP connection to the controller (this module),
  over which it sends an :class:`~resihp_core.protocol.AgentState` (a summary of all
  its workers) every heartbeat interval and at once on any failure, and forwards its
  workers' :class:`~resihp_core.protocol.IterationProfile` s. The controller sees one
  connection and one small message per interval per node, whatever the number of
  devices.

Lifecycle. At a normal job end the controller says goodbye (``Ack(what="bye")``): the
agent reaps its workers and ends (status 0). When the connection to the controller is
lost otherwise (the controller declared the node lost: a partition, a crash), the agent
with ``rejoin_timeout > 0`` fences (kills by pid) its stale workers at once, keeps
dialling the controller for up to ``rejoin_timeout`` seconds and, once back, offers its
devices again (:class:`~resihp_core.protocol.NodeRejoin`); the Scheduler plans them back
in. With ``rejoin_timeout == 0`` (the library default) it calls ``on_controller_lost``
or stops. A half-open connection (a cut link) is noticed by ``TCP_USER_TIMEOUT``.
:meth:`NodeAgent.stop` says goodbye to the controller first, so a node leaving on
purpose is not reported.

Run it as a process (``resihp agent`` is the same)::

    RESIHP_SECRET=... python -m resihp_core.runtime.agent --node 0 \\
        --controller 127.0.0.1:29400 [--listen 127.0.0.1:0 | --unix PATH] [--address-file F] \\
        [--workdir DIR] [--interface IFACE|ADDRESS] [--rejoin-timeout S]

The worker endpoint (``host:port`` or ``unix:/path``) is printed on stdout (and written
to ``--address-file``); workers get it as ``RESIHP_AGENT_ADDR``. Exit status: 0 when the
job finished or after SIGTERM/SIGINT, 3 when the controller was lost (and not regained
within ``--rejoin-timeout``), 1 when the controller refused the agent, 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

from resihp_core.config import DetectorConfig
from resihp_core.detector.environment import EnvironmentProbe
from resihp_core.detector.failstop import FailStopMonitor, WorkerFailure
from resihp_core.protocol import (
    Ack,
    LinkProbe,
    AgentState,
    AuthError,
    Error,
    HandshakeBroken,
    LaunchWorkers,
    IterationProfile,
    Message,
    NodeRejoin,
    ProfileBatch,
    ProtocolError,
    SignalWorker,
    WorkerProcess,
    client_handshake,
    node_credential,
    read_msg,
    write_msg,
)
from resihp_core.runtime.gate import PreAuthGate
from resihp_core.runtime.heartbeat import ANNOUNCE, BYE, format_address, parse_address
from resihp_core.runtime.agent.node_commits import NodeCommits
from resihp_core.runtime.agent.node_generations import NodeGenerations
from resihp_core.runtime.agent.node_launcher import WorkerLauncher
from resihp_core.runtime.agent.node_monitor import WorkerMonitor, nodelay as _nodelay, process_state

__all__ = ["NodeAgent", "configure", "main", "process_state", "run"]

logger = logging.getLogger("resihp.agent")


class NodeAgent(WorkerMonitor, WorkerLauncher):
    """Watches one node's workers and reports to the controller (see the module docstring).

    :param node: this node's id.
    :param controller: the controller's address (``host:port`` or tuple); None runs the
        agent detached (failures go to ``on_failure`` only; for tests).
    :param secret: the job secret; the agent keeps only this node's credential derived
        from it (:func:`~resihp_core.protocol.node_credential`), which it authenticates
        to the controller with, requires from its workers and gives them.
    :param credential: this node's credential instead of the job secret.
    :param config: heartbeat interval, miss limit and hang timeout settings.
    :param host, port, unix_path: where workers connect.
    :param on_failure: called with each :class:`WorkerFailure` (on the loop).
    :param on_controller_lost: called when the controller connection drops (not at a
        normal job end); default: rejoin (``rejoin_timeout > 0``) or stop the agent.
    :param workdir: where launched workers' job description and logs go
        (``worker<device>.log``); default: a fresh temporary folder.
    :param interface: the interface name or local address workers bind their
        collectives to; default: the job's ``runtime.interface``, else
        ``GLOO_SOCKET_IFNAME``, else the interface this agent reaches the controller on.
    :param rejoin_timeout: after losing the controller, fence the workers and keep
        dialling it this many seconds to offer the node's devices again; 0: do not.
    :param controller_grace_s: after losing the controller, keep the workers (they hold
        their commits) and redial it this many seconds; a restarted controller
        re-attaches to them (docs/failover.md). None: the job's value, from its launch
        message (``RESIHP_CONTROLLER_GRACE``), else 0 (fence at once, as above).
    """

    def __init__(
        self,
        node: int,
        controller: str | tuple[str, int] | None,
        secret: str | bytes,
        config: DetectorConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        unix_path: str | None = None,
        on_failure: Callable[[WorkerFailure], None] | None = None,
        on_controller_lost: Callable[[BaseException | None], None] | None = None,
        connect_timeout: float = 10.0,
        handshake_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        workdir: str | os.PathLike | None = None,
        interface: str | None = None,
        rejoin_timeout: float = 0.0,
        credential: str | None = None,
        controller_grace_s: float | None = None,
    ) -> None:
        if node < 0:
            raise ValueError(f"node must be >= 0, got {node}")
        if not secret and not credential:
            raise ValueError("the job secret must not be empty")
        self.node = node
        self.controller = parse_address(controller) if controller is not None else None
        # The agent and its workers hold this node's credential only (docs/security.md).
        self._secret = credential or node_credential(secret, node)
        self.config = config or DetectorConfig()
        self.host, self.port, self.unix_path = host, port, unix_path
        self.on_failure, self.on_controller_lost = on_failure, on_controller_lost
        self.connect_timeout, self.handshake_timeout = connect_timeout, handshake_timeout
        self.clock = clock
        self.monitor = FailStopMonitor.from_config(self.config, process_state=process_state)
        self.failures: list[WorkerFailure] = []
        self.profiles_forwarded = 0
        self._profiles: dict[tuple[int, int], list[IterationProfile]] = {}  # (generation, iteration) -> held
        self.states_sent = 0
        self._server: asyncio.AbstractServer | None = None
        self._ctl_writer: asyncio.StreamWriter | None = None
        self._ctl_queue: asyncio.Queue[Message] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._pidfds: dict[int, int] = {}
        self._closed: asyncio.Event | None = None
        self._done: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.controller_lost: BaseException | None | bool = False
        self.worker_address: str | None = None
        self._workdir = Path(workdir) if workdir is not None else None
        self.children: dict[int, subprocess.Popen] = {}  # device -> worker this agent launched
        self._ended: set[int] = set()  # pids whose end the controller was told
        self.interface = interface
        self.local_address: str | None = None  # this end of the controller connection
        self.rejoin_timeout = rejoin_timeout
        self.job_finished = False  # the controller said goodbye: the job is over
        self.refused = ""  # why the controller refused this agent (then it never rejoins)
        self.rejoins = 0
        self._ctl_tasks: list[asyncio.Task[None]] = []
        self._gate = PreAuthGate(f"agent{node}")
        self.environment: EnvironmentProbe | None = None
        self.controller_grace_s = controller_grace_s
        self.incarnation = ""  # the connected controller's, from its announcement
        self.reattaches = 0
        self._launch_interface = ""
        cred = self._secret.decode() if isinstance(self._secret, bytes) else self._secret
        # The node's executors' commits (node_commits.py); one waiting for its verdict is not hung.
        self.commits = NodeCommits(node, cred,
                                   on_wait=lambda d, waiting: self.monitor.commit_wait(d, self.clock(), waiting))
        # The node's generation watch (node_generations.py): one store wait per node, not per worker.
        self.generations = NodeGenerations(node, cred)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> str:
        """Connect to the controller, start serving workers; returns the worker address."""
        self._loop = asyncio.get_running_loop()
        self._closed = asyncio.Event()
        self._done = asyncio.Event()
        self._changed = asyncio.Event()
        self._ctl_queue = asyncio.Queue()
        if self.controller is not None:
            await self._connect_controller()
            self._after_connect()
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
            self._server = await asyncio.start_unix_server(self._serve_worker, self.unix_path)
            self.worker_address = format_address(self.unix_path)
        else:
            self._server = await asyncio.start_server(self._serve_worker, self.host, self.port)
            sock = self._server.sockets[0].getsockname()
            self.worker_address = format_address((sock[0], sock[1]))
        self._tasks = [asyncio.create_task(self._check_loop(), name=f"agent{self.node}-check")]
        if self.controller is not None:
            # Tells the machine's slowdowns from a device's: CPU taken outside the job.
            self.environment = EnvironmentProbe(self._job_pids).start()
            self._start_controller_tasks()
        logger.info("event=agent_started node=%d workers_at=%s controller=%s", self.node,
                    self.worker_address, self.controller)
        return self.worker_address

    async def _connect_controller(self) -> None:
        assert self.controller is not None
        deadline = time.monotonic() + self.connect_timeout
        delay = 0.05
        while True:
            try:
                if isinstance(self.controller, str):
                    reader, writer = await asyncio.open_unix_connection(self.controller)
                else:
                    reader, writer = await asyncio.open_connection(*self.controller)
                break
            except OSError:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(1.0, delay * 2)
        try:
            await client_handshake(reader, writer, self._secret, f"agent:{self.node}", role="agent",
                                   timeout=self.handshake_timeout)
        except AuthError:
            writer.close()
            raise
        _nodelay(writer)
        self._ctl_reader, self._ctl_writer = reader, writer

    async def stop(self, *, goodbye: bool = True) -> None:
        """Stop serving; with ``goodbye`` tell the controller this node leaves on purpose."""
        if self._closed is None or self._closed.is_set():
            return
        self._closed.set()
        self._gate.close_all()
        if self.environment is not None:
            self.environment.stop()
        if self._server is not None:
            self._server.close()
        for fd in list(self._pidfds.values()):
            self._unwatch_fd(fd)
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        w = self._ctl_writer
        if w is not None and goodbye and self.controller_lost is False:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush_and_bye(), 2.0)
        if w is not None:
            w.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(w.wait_closed(), 1.0)
        for cw in list(self._conns.values()):
            cw.close()
        self.commits.close()
        self.generations.close()
        self._reap_children()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        if self.unix_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.unix_path)
        assert self._done is not None
        self._done.set()

    async def _flush_and_bye(self) -> None:
        assert self._ctl_queue is not None and self._ctl_writer is not None
        while not self._ctl_queue.empty():
            await write_msg(self._ctl_writer, self._ctl_queue.get_nowait())
        await write_msg(self._ctl_writer, Ack(what=BYE))

    async def wait_closed(self) -> None:
        """Return once :meth:`stop` has finished (also after a lost controller)."""
        assert self._done is not None
        await self._done.wait()

    # ------------------------------------------------------------ controller
    def _after_connect(self) -> None:
        """Note this end's address (workers bind their collectives there) and let the
        kernel break the connection when the controller stops acknowledging (a cut
        link), so a partitioned node fences its workers without waiting for the heal."""
        w = self._ctl_writer
        sock = w.get_extra_info("socket") if w is not None else None
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
            self.local_address = None
            return
        self.local_address = sock.getsockname()[0]
        if hasattr(socket, "TCP_USER_TIMEOUT"):
            ms = int(1000 * self.config.agent_silence())  # the controller's limit on this agent's silence
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)

    def _start_controller_tasks(self) -> None:
        self._ctl_tasks = [
            asyncio.create_task(self._state_loop(), name=f"agent{self.node}-state"),
            asyncio.create_task(self._writer_loop(), name=f"agent{self.node}-write"),
            asyncio.create_task(self._controller_reader(), name=f"agent{self.node}-read"),
        ]
        self._tasks += self._ctl_tasks

    def _hold_profile(self, p: IterationProfile) -> None:
        """Send a worker's profile with its node's others of the same iteration: at once
        when every connected worker's came, else one heartbeat interval after the first
        (standby workers send none)."""
        key = (p.generation, p.iteration)
        held = self._profiles.setdefault(key, [])
        held.append(p)
        if len(held) >= len(self._conns):
            self._send_profiles(key)
        elif len(held) == 1:
            asyncio.get_running_loop().call_later(self.config.heartbeat_interval_s, self._send_profiles, key)

    def _send_profiles(self, key: tuple[int, int]) -> None:
        held = self._profiles.pop(key, None)
        if held:
            self._to_controller(held[0] if len(held) == 1 else ProfileBatch(tuple(held)))

    def _to_controller(self, msg: Message) -> None:
        if self._ctl_queue is not None and self.controller is not None:
            if isinstance(msg, AgentState) and self.controller_lost is not False:
                return  # stale by the time it could be sent
            self._ctl_queue.put_nowait(msg)

    def _job_pids(self) -> list[int]:
        """This node's workers (launched here or connected with their pid)."""
        pids = [c.pid for c in list(self.children.values())]
        pids += [w.pid for w in list(self.monitor.workers.values()) if getattr(w, "pid", None)]
        return pids

    def state(self) -> AgentState:
        env = self.environment.level if self.environment is not None else 0.0
        return AgentState(node=self.node, time=max(0.0, time.time()), workers=self.monitor.summaries(self.clock()),
                          environment=env)

    async def _state_loop(self) -> None:
        assert self._changed is not None and self._closed is not None
        while not self._closed.is_set():
            self._to_controller(self.state())
            self.states_sent += 1
            self._changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._changed.wait(), self.monitor.interval)

    async def _writer_loop(self) -> None:
        assert self._ctl_queue is not None and self._ctl_writer is not None
        writer = self._ctl_writer
        try:
            while True:
                msg = await self._ctl_queue.get()
                await write_msg(writer, msg)
        except (ConnectionError, OSError) as e:
            self._lost_controller(e)

    async def _controller_reader(self) -> None:
        exc: BaseException | None = None
        try:
            while True:
                msg = await read_msg(self._ctl_reader)
                if msg is None:
                    break
                if isinstance(msg, LaunchWorkers):
                    self._adopt_job_failover(msg)
                    self.launch(msg)
                elif isinstance(msg, SignalWorker):
                    self.signal_worker(msg.device, signal.Signals[msg.signal])
                elif isinstance(msg, LinkProbe):  # the controller times this host's link
                    self._to_controller(LinkProbe(seq=msg.seq, node=self.node, payload=msg.payload))
                elif isinstance(msg, Ack) and msg.what == BYE:
                    self._job_finished()
                    return
                elif isinstance(msg, Ack) and msg.what.startswith(ANNOUNCE):
                    self.incarnation = msg.what[len(ANNOUNCE):]
                elif isinstance(msg, Error):
                    logger.warning("agent %d: controller says %s: %s", self.node, msg.code, msg.detail)
                    if msg.code in ("duplicate-node", "bad-identity"):
                        self.refused = f"{msg.code}: {msg.detail}"
        except (ProtocolError, ConnectionError, OSError) as e:
            exc = e
        self._lost_controller(exc)

    def _job_finished(self) -> None:
        """The controller ended the job: reap the workers, say goodbye, stop."""
        if self.job_finished or (self._closed is not None and self._closed.is_set()):
            return
        self.job_finished = True
        logger.info("event=job_finished node=%d", self.node)
        asyncio.get_running_loop().create_task(self.stop())

    def _lost_controller(self, exc: BaseException | None) -> None:
        if self.controller_lost is not False or self.job_finished or (self._closed is not None and self._closed.is_set()):
            return
        self.controller_lost = exc
        rejoin = self.rejoin_timeout > 0 and not self.refused and self.on_controller_lost is None
        hold = self._grace() > 0 and not self.refused and self.on_controller_lost is None
        action = (f" action=hold_and_redial within={self._grace():.0f}s" if hold else
                  f" action=fence_and_rejoin within={self.rejoin_timeout:.0f}s" if rejoin else "")
        logger.log(logging.WARNING if rejoin or hold else logging.ERROR, "event=controller_lost node=%d error=%r%s",
                   self.node, exc, action)
        if self.on_controller_lost is not None:
            try:
                self.on_controller_lost(exc)
            except Exception:  # noqa: BLE001
                logger.exception("on_controller_lost callback failed")
        elif self._grace() > 0 and not self.refused:
            self._tasks.append(asyncio.get_running_loop().create_task(self._hold_and_redial(),
                                                                      name=f"agent{self.node}-hold"))
        elif rejoin:
            self._tasks.append(asyncio.get_running_loop().create_task(self._rejoin(), name=f"agent{self.node}-rejoin"))
        else:
            asyncio.get_running_loop().create_task(self.stop(goodbye=False))

    async def _end_controller_tasks(self) -> None:
        """Cancel this connection's other tasks (reader, beats) and forget them; the
        caller, one of them, goes on."""
        me = asyncio.current_task()
        old = [t for t in self._ctl_tasks if t is not me]
        for t in old:
            t.cancel()
        await asyncio.gather(*old, return_exceptions=True)
        self._tasks = [t for t in self._tasks if t not in old]

    async def _rejoin(self) -> None:
        """Fence the stale workers, dial the controller until ``rejoin_timeout``, then
        offer this node's devices again (the controller has planned without them)."""
        await self._end_controller_tasks()
        devices = self.fence()
        if self._ctl_writer is not None:
            self._ctl_writer.close()
        assert self._closed is not None
        deadline = time.monotonic() + self.rejoin_timeout
        delay = 0.2
        while not self._closed.is_set():
            try:
                await asyncio.wait_for(self._connect_controller(), max(0.5, min(5.0, deadline - time.monotonic())))
                break
            except AuthError as e:
                self.refused = str(e)
            except (OSError, asyncio.TimeoutError):
                pass
            if self.refused or time.monotonic() >= deadline:
                logger.error("event=rejoin_failed node=%d reason=%r", self.node,
                             self.refused or f"controller unreachable for {self.rejoin_timeout:.0f} s")
                asyncio.get_running_loop().create_task(self.stop(goodbye=False))
                return
            await asyncio.sleep(delay)
            delay = min(2.0, delay * 2)
        if self._closed.is_set():
            return
        self._after_connect()
        assert self._ctl_queue is not None
        keep = self._drain_queue()
        for m in keep:
            self._ctl_queue.put_nowait(m)
        self.controller_lost = False
        self.rejoins += 1
        self._start_controller_tasks()
        self._to_controller(NodeRejoin(node=self.node, devices=tuple(devices)))
        logger.warning("event=rejoined node=%d devices=%s", self.node, devices)

    # ------------------------------------------------------------ controller failover
    def _grace(self) -> float:
        return self.controller_grace_s or 0.0

    def _adopt_job_failover(self, msg: LaunchWorkers) -> None:
        """Take the job's grace period from its launch message unless given one, and
        note the interface choice (a re-attach reports the workers' addresses again)."""
        from resihp_core.runtime.session import ENV_GRACE
        from resihp_core.runtime.netif import INTERFACE_ENV

        self._launch_interface = msg.env.get(INTERFACE_ENV, "")
        if self.controller_grace_s is None:
            try:
                self.controller_grace_s = max(0.0, float(msg.env.get(ENV_GRACE, "0") or 0))
            except ValueError:
                self.controller_grace_s = 0.0

    async def _hold_and_redial(self) -> None:
        """The controller is gone: keep the workers (they finish their iteration and
        hold its commit) and dial it for the grace period. A restarted controller (a
        new incarnation) gets them back; the same one (a healed partition: it planned
        without this node) gets the node offered again, the workers fenced first;
        none within the grace period: end the workers as without a grace period."""
        from resihp_core.runtime.failover import GraceTimer

        await self._end_controller_tasks()
        if self._ctl_writer is not None:
            self._ctl_writer.close()
        timer = GraceTimer(self._grace(), time.monotonic)
        timer.lost()
        assert self._closed is not None and self._loop is not None
        keeper = self._loop.create_task(self._hold_progress(2 * timer.grace_s), name=f"agent{self.node}-hold-progress")
        self._tasks.append(keeper)
        logger.warning("event=controller_lost_holding node=%d workers=%s grace_s=%.0f", self.node,
                       sorted(d for d, c in self.children.items() if c.poll() is None), timer.grace_s)
        announced: str | None = None
        delay = 0.2
        try:
            while not self._closed.is_set():
                try:
                    await asyncio.wait_for(self._connect_controller(), max(0.5, min(5.0, timer.left())))
                    announced = await self._read_announcement()
                    break
                except AuthError as e:
                    if not isinstance(e, HandshakeBroken):  # broken off (a controller dying or
                        self.refused = str(e)               # starting): dial again, as below
                    elif self._ctl_writer is not None:
                        self._ctl_writer.close()
                except (OSError, ProtocolError, asyncio.TimeoutError):
                    # Close a half-made connection: left open, the controller would
                    # refuse the next dial as a duplicate of this node.
                    if self._ctl_writer is not None:
                        self._ctl_writer.close()
                if self.refused or timer.expired():
                    keeper.cancel()
                    self._grace_expired(timer.grace_s)
                    return
                await asyncio.sleep(max(0.05, min(delay, timer.left())))
                delay = min(1.0, delay * 2)
        except BaseException:
            keeper.cancel()
            raise
        if self._closed.is_set():
            return
        if announced and announced != self.incarnation:
            self.incarnation = announced
            self._reattach()
        else:  # the same controller, or one that does not announce itself: as after a partition
            keeper.cancel()
            self._healed_same_controller()

    async def _read_announcement(self) -> str | None:
        """The first message of a fresh connection: a controller announces its
        incarnation (None: it did not, or it refused this agent)."""
        msg = await read_msg(self._ctl_reader, self.handshake_timeout)
        if isinstance(msg, Ack) and msg.what.startswith(ANNOUNCE):
            return msg.what[len(ANNOUNCE):]
        if isinstance(msg, Error):
            if msg.code != "duplicate-node":  # that one: our previous connection is not gone yet
                self.refused = f"{msg.code}: {msg.detail}"
            raise ProtocolError(f"{msg.code}: {msg.detail}")
        return None

    async def _hold_progress(self, limit_s: float) -> None:
        """While the controller is away the workers wait at their commit, and after a
        restarted one re-attached until it lets them commit: that is not a hang. Each
        worker's progress clock restarts once its progress moves (or after ``limit_s``)."""
        held = {d: (w.generation, w.iteration, w.step) for d, w in self.monitor.workers.items()}
        deadline = time.monotonic() + limit_s
        while held and time.monotonic() < deadline:
            now = self.clock()
            for d, mark in list(held.items()):
                w = self.monitor.workers.get(d)
                if w is None or (w.generation, w.iteration, w.step) != mark:
                    del held[d]
                elif w.last_progress is not None:
                    w.last_progress = now
            await asyncio.sleep(self.monitor.interval / 2)

    def _grace_expired(self, grace_s: float) -> None:
        logger.error("event=controller_grace_expired node=%d reason=%r", self.node,
                     self.refused or f"no controller within {grace_s:.0f} s")
        left = self.rejoin_timeout - grace_s
        if left > 0 and not self.refused:
            self.rejoin_timeout = left
            self._tasks.append(asyncio.get_running_loop().create_task(self._rejoin(), name=f"agent{self.node}-rejoin"))
        else:
            asyncio.get_running_loop().create_task(self.stop(goodbye=False))

    def _back_online(self) -> None:
        """The connection is up again: what waited for it goes first, then the loops."""
        self._after_connect()
        assert self._ctl_queue is not None
        for m in self._drain_queue():
            self._ctl_queue.put_nowait(m)
        self.controller_lost = False

    def _healed_same_controller(self) -> None:
        """The controller that lost this node (and planned without it) is back: fence
        the stale workers and offer the devices again, as after a partition."""
        devices = self.fence()
        self._back_online()
        self.rejoins += 1
        self._start_controller_tasks()
        self._to_controller(NodeRejoin(node=self.node, devices=tuple(devices)))
        logger.warning("event=rejoined node=%d devices=%s", self.node, devices)

    def _reattach(self) -> None:
        """A restarted controller: tell it which workers still run (same pids)."""
        self._back_online()
        self.reattaches += 1
        iface = None
        with contextlib.suppress(ValueError, OSError):
            iface = self.collective_interface(self._launch_interface)
        kept = []
        for d, child in sorted(self.children.items()):
            if child.poll() is None:
                kept.append(d)
                self._to_controller(WorkerProcess(node=self.node, device=d, pid=child.pid,
                                                  address=iface.address if iface else ""))
        self._start_controller_tasks()
        logger.warning("event=reattached node=%d workers=%s", self.node, kept)

    def _drain_queue(self) -> list[Message]:
        """Take what waited for the controller, less the stale node states."""
        assert self._ctl_queue is not None
        out: list[Message] = []
        while not self._ctl_queue.empty():
            m = self._ctl_queue.get_nowait()
            if not isinstance(m, AgentState):
                out.append(m)
        return out


# ------------------------------------------------------------------ process entry point
def configure(ap: argparse.ArgumentParser) -> None:
    """The agent's command-line arguments (also ``resihp agent``)."""
    ap.add_argument("--node", type=int, required=True, help="this node's id")
    ap.add_argument("--controller", required=True, help="controller address host:port")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--listen", default="127.0.0.1:0", help="worker endpoint host:port (default 127.0.0.1:0)")
    where.add_argument("--unix", help="serve workers on this Unix socket path instead")
    ap.add_argument("--address-file", help="write the worker endpoint here once serving")
    ap.add_argument("--workdir", help="folder for launched workers' job file and logs (default: a temporary one)")
    ap.add_argument("--config", help="TOML/YAML configuration file (detector section, runtime.interface)")
    ap.add_argument("--secret-env", default="RESIHP_SECRET", help="environment variable holding the job secret")
    ap.add_argument("--credential-env", default="RESIHP_NODE_KEY",
                    help="environment variable holding this node's credential (used instead of the job secret)")
    ap.add_argument("--connect-timeout", type=float, default=60.0,
                    help="keep trying to reach the controller this many seconds (default 60)")
    ap.add_argument("--interface", help="interface name or local address this node's workers bind their "
                                        "collectives to (default: runtime.interface, else GLOO_SOCKET_IFNAME, "
                                        "else the interface that reaches the controller)")
    ap.add_argument("--rejoin-timeout", type=float, default=300.0,
                    help="after losing the controller (a partition), fence the workers and keep dialling it "
                         "this many seconds to offer the node's devices again; 0: exit at once (default 300)")
    ap.add_argument("--controller-grace", type=float, default=None,
                    help="after losing the controller, keep the workers and redial it this many seconds, for a "
                         "restarted controller to re-attach to them (default: the job's "
                         "runtime.controller_grace_s; docs/failover.md)")
    ap.add_argument("--log-level", default="WARNING")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m resihp_core.runtime.agent", description="ResiHP node agent")
    configure(ap)
    return ap.parse_args(argv)


async def _amain(args: argparse.Namespace) -> int:
    from resihp_core.config import load_config

    from resihp_core.config import ConfigError

    try:
        full = load_config(args.config)
    except ConfigError as e:
        print(f"agent: {e}", file=sys.stderr)
        return 2
    config = full.detector
    args.interface = args.interface or full.runtime.interface or None
    secret = os.environ.get(args.secret_env, "")
    credential = os.environ.get(args.credential_env, "") or None
    if not secret and not credential:
        print(f"agent: the job secret is missing (set {args.secret_env} or {args.credential_env})", file=sys.stderr)
        return 2
    host, port = ("127.0.0.1", 0) if args.unix else parse_address(args.listen)  # type: ignore[misc]
    if args.interface:
        from resihp_core.runtime.netif import select_interface

        try:
            select_interface(args.interface)
        except ValueError as e:
            print(f"agent: --interface: {e}".replace("--interface: interface: ", "--interface: "), file=sys.stderr)
            return 2
    agent = NodeAgent(args.node, args.controller, secret, config, host=host, port=port, unix_path=args.unix,
                      workdir=args.workdir, connect_timeout=args.connect_timeout, interface=args.interface,
                      rejoin_timeout=args.rejoin_timeout, credential=credential,
                      controller_grace_s=getattr(args, "controller_grace", None))
    address = await agent.start()
    if args.address_file:
        tmp = f"{args.address_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(address + "\n")
        os.replace(tmp, args.address_file)
    print(address, flush=True)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: loop.create_task(agent.stop()))
    await agent.wait_closed()
    if agent.job_finished:
        print(f"agent: node {args.node}: the job finished; exiting", flush=True)
        return 0
    if agent.refused:
        print(f"agent: node {args.node}: the controller refused this agent ({agent.refused})", file=sys.stderr)
        return 1
    if agent.controller_lost is not False:
        print(f"agent: node {args.node}: lost the controller ({agent.controller_lost!r})", file=sys.stderr)
        return 3
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_parse(argv))


def run(args: argparse.Namespace) -> int:
    """Serve as a node agent until told to stop or the controller is lost."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(_amain(args))
    except (OSError, AuthError) as e:
        print(f"agent: {e}", file=sys.stderr)
        return 1

