"""The node agent's monitor: the node-local half of the fail-stop detector (docs/design.md §3.1).

:class:`WorkerMonitor` serves a node's workers (TCP on loopback by default, or a Unix
socket; each authenticates with the job secret and identifies as
``worker:<device>:<rank>:<pid>``) and runs a
:class:`~resihp_core.detector.failstop.FailStopMonitor` over them: missed beats,
connection loss, process exit (watched through a pidfd when the pid is known: the
worker's identity carries it, or the launcher calls :meth:`WorkerMonitor.watch_pid` /
:meth:`WorkerMonitor.worker_exited`), and hangs with a learned timeout. It is one half
of :class:`~resihp_core.runtime.agent.NodeAgent`; the other is the launcher
(:mod:`resihp_core.runtime.agent.node_launcher`). The agent supplies ``_to_controller``
(where profiles and worker reports go) and ``_poll_children`` (reap launched workers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket

from resihp_core.detector.failstop import ProcessState, WorkerFailure
from resihp_core.protocol import (
    Ack,
    AuthError,
    FailureReport,
    Heartbeat,
    IterationProfile,
    ProtocolError,
    read_msg,
    server_handshake,
)
from resihp_core.runtime.heartbeat import BYE, COMMITS, parse_worker_identity
from resihp_core.runtime.session import WATCH_IDENTITY

__all__ = ["WorkerMonitor", "process_state", "nodelay"]

logger = logging.getLogger("resihp.agent")


def nodelay(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def process_state(pid: int) -> ProcessState:
    """Look at ``pid`` from outside: alive, stopped (SIGSTOP), dead (or zombie), unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return "dead"
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return "dead"
        except OSError:
            return "unknown"
        return "alive"
    state = data[data.rfind(b")") + 2: data.rfind(b")") + 3]
    if state in (b"T", b"t"):
        return "stopped"
    if state in (b"Z", b"X", b"x"):
        return "dead"
    return "alive"


class WorkerMonitor:
    """Serving and watching the workers of one node (a mixin of ``NodeAgent``; the
    attributes it uses are set up by the agent's constructor and ``start``)."""

    # ------------------------------------------------------------ launcher hooks
    def watch_pid(self, device: int, pid: int) -> None:
        """Watch ``pid`` as ``device``'s process (call on the agent's loop)."""
        if device in self.monitor.workers:
            self.monitor.set_pid(device, pid)
        self._watch(device, pid)

    def worker_exited(self, device: int, returncode: int | None) -> None:
        """The launcher saw ``device``'s process exit (call on the agent's loop)."""
        f = self.monitor.process_exited(device, self.clock(), returncode)
        if f is not None:
            self._failed(f)

    def _watch(self, device: int, pid: int) -> None:
        if device in self._pidfds or self._loop is None:
            return
        try:
            fd = os.pidfd_open(pid)  # type: ignore[attr-defined]
        except (AttributeError, OSError) as e:  # no pidfd: the missed-beat rule still applies
            logger.debug("agent %d: cannot watch pid %d: %r", self.node, pid, e)
            return
        self._pidfds[device] = fd
        self._loop.add_reader(fd, self._pid_exited, device, fd)

    def _unwatch_fd(self, fd: int) -> None:
        if self._loop is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(fd)
        with contextlib.suppress(OSError):
            os.close(fd)
        for d, f in list(self._pidfds.items()):
            if f == fd:
                del self._pidfds[d]

    def _pid_exited(self, device: int, fd: int) -> None:
        self._unwatch_fd(fd)
        self._poll_children()
        w = self.monitor.workers.get(device)
        if w is not None and w.finished:
            return
        f = self.monitor.process_exited(device, self.clock())
        if f is not None:
            self._failed(f)

    # ------------------------------------------------------------ pauses
    def _after_pauses(self) -> None:
        """Workers back from a pause and healthy: tell the controller now (it offers
        them back). docs/detector.md "Paused workers"."""
        back = self.monitor.take_resumed()
        for d in back:
            logger.warning("event=worker_resumed node=%d device=%d", self.node, d)
        if back and self._changed is not None:
            self._changed.set()

    def _kill_after_pause(self, f: WorkerFailure) -> None:
        """A pause that became a hang: its work is planned elsewhere already and nobody
        else will end it, so the agent does (by pid)."""
        w = self.monitor.workers.get(f.device)
        if w is None or w.pid is None:
            return
        logger.warning("event=worker_killed node=%d device=%d pid=%d reason=%r", self.node, f.device, w.pid, f.reason)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(w.pid, signal.SIGKILL)
            os.kill(w.pid, signal.SIGCONT)

    # ------------------------------------------------------------ failures
    def _failed(self, f: WorkerFailure) -> None:
        if f.after_pause:
            self._kill_after_pause(f)
        self.failures.append(f)
        logger.warning("event=worker_failed node=%d device=%d rank=%d kind=%s reason=%r",
                       self.node, f.device, f.rank, f.kind.value, f.reason)
        if self.on_failure is not None:
            try:
                self.on_failure(f)
            except Exception:  # noqa: BLE001
                logger.exception("on_failure callback failed")
        if self._changed is not None:
            self._changed.set()  # push an AgentState now

    async def _check_loop(self) -> None:
        """Apply the monitor's rules a few times per heartbeat interval.

        Heartbeats that arrived while this agent was not scheduled (a loaded machine)
        sit unread in socket buffers; the readers get to run first, and a round that
        woke up more than an interval late gives no missed-beat verdict at all, so a
        starved *agent* never declares its workers silent. A round on time yields to
        the readers once (a beat read in the same wake-up as this round's timer is
        handled then); a late one three times, for the backlog. The rounds run a few
        times per heartbeat interval all job long: each yield is a turn of the loop."""
        assert self._closed is not None
        wake = self.clock()
        while not self._closed.is_set():
            for _ in range(3 if self.clock() - wake > self.monitor.interval / 4 else 1):
                await asyncio.sleep(0)  # let queued worker messages in
            now = self.clock()
            self._poll_children()
            if now - wake <= self.monitor.interval:
                for f in self.monitor.check(now):
                    self._failed(f)
                self._after_pauses()
            cap = self.monitor.interval / 4
            wait = min(cap, max(0.005, self.monitor.next_deadline(now) - now + 0.001))
            wake = now + wait
            await asyncio.sleep(wait)

    # ------------------------------------------------------------ workers
    async def _serve_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        device: int | None = None
        try:
            if not self._gate.admit(writer):
                return
            try:
                try:
                    hello = await server_handshake(reader, writer, self._secret, timeout=self.handshake_timeout)
                finally:
                    self._gate.done(writer)
                if hello.identity.startswith(COMMITS):  # the worker's commit connection
                    device = parse_worker_identity("worker:" + hello.identity[len(COMMITS):])[0]
                    nodelay(writer)
                    await self.commits.serve(device, reader, writer)
                    return
                if hello.identity.startswith(WATCH_IDENTITY):  # the worker's generation watch
                    device = parse_worker_identity("worker:" + hello.identity[len(WATCH_IDENTITY):])[0]
                    await self.generations.serve(device, reader, writer)
                    return
                device, rank, pid = parse_worker_identity(hello.identity)
            except (AuthError, ValueError) as e:
                if not self._gate.closing:
                    logger.warning("event=auth_refused listener=agent%d reason=%r", self.node, str(e))
                return
            old = self._conns.pop(device, None)
            if old is not None:
                old.close()
            self._conns[device] = writer
            self.monitor.add(device, rank, self.clock(), pid)
            if pid is not None:
                self._watch(device, pid)
            nodelay(writer)
            logger.info("event=worker_connected node=%d device=%d rank=%d pid=%s", self.node, device, rank, pid)
            if self._changed is not None:
                self._changed.set()
            await self._worker_messages(device, reader)
        except (ProtocolError, ConnectionError, OSError) as e:
            logger.info("agent %d: worker %s connection error: %r", self.node, device, e)
        finally:
            if device is not None and self._conns.get(device) is writer:
                del self._conns[device]
                if not (self._closed and self._closed.is_set()):
                    f = self.monitor.connection_lost(device, self.clock())
                    if f is not None:
                        self._failed(f)
            writer.close()

    async def _worker_messages(self, device: int, reader: asyncio.StreamReader) -> None:
        while True:
            msg = await read_msg(reader)
            if msg is None:
                return
            if isinstance(msg, Heartbeat):
                w = self.monitor.workers.get(device)
                if w is not None and msg.rank != w.rank:
                    w.rank = msg.rank  # ranks are renumbered at each plan generation
                self.monitor.beat(device, self.clock(), msg.iteration, msg.step, msg.generation)
            elif isinstance(msg, IterationProfile):
                if device in self.monitor.workers:
                    w = self.monitor.workers[device]
                    self.monitor.beat(device, self.clock(), w.iteration, w.step, w.generation)
                self._hold_profile(msg)
                self.profiles_forwarded += 1
            elif isinstance(msg, Ack) and msg.what == BYE:
                self.monitor.finished(device)
                if device in self._pidfds:
                    self._unwatch_fd(self._pidfds[device])
                if self._changed is not None:
                    self._changed.set()
            elif isinstance(msg, FailureReport):
                self._to_controller(msg)  # a worker may report what it saw itself
            else:
                logger.debug("agent %d: ignoring %s from device %d", self.node, type(msg).__name__, device)
