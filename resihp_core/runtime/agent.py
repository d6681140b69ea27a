"""The node agent: the node-local half of the fail-stop detector (docs/design.md §3.1).

One :class:`NodeAgent` per node. It

* serves its workers (TCP on loopback by default, or a Unix socket), authenticating
  each with the job secret; a worker identifies as ``worker:<device>:<rank>:<pid>``;
* runs a :class:`~resihp_core.detector.failstop.FailStopMonitor` over them: missed
  beats, connection loss, process exit (watched through a pidfd when the pid is known:
  the worker's identity carries it, or the launcher calls :meth:`NodeAgent.watch_pid`
  / :meth:`NodeAgent.worker_exited`), and hangs with a learned timeout;
* keeps **one** persistent, authenticated TCP connection to the controller, over which
  it sends an :class:`~resihp_core.protocol.AgentState` (a summary of all its workers)
  every heartbeat interval and at once on any failure, and forwards its workers'
  :class:`~resihp_core.protocol.IterationProfile` s. The controller therefore sees one
  connection and one small message per interval per node, whatever the number of
  devices.

* is the **launcher** of its node's workers: on the controller's
  :class:`~resihp_core.protocol.LaunchWorkers` it starts one worker process per device
  (:func:`~resihp_core.runtime.processes.spawn_worker`: they die with the agent),
  watches them, sends a :class:`~resihp_core.protocol.WorkerProcess` when each starts
  and ends, and signals them on :class:`~resihp_core.protocol.SignalWorker` (fencing).

When the controller connection drops the agent cannot do anything useful (the
controller has declared the node lost): it calls ``on_controller_lost`` and, by
default, stops, taking its workers with it. :meth:`NodeAgent.stop` says goodbye to
the controller first, so a node leaving on purpose is not reported.

Run it as a process (``resihp agent`` is the same)::

    RESIHP_SECRET=... python -m resihp_core.runtime.agent --node 0 \\
        --controller 127.0.0.1:29400 [--listen 127.0.0.1:0 | --unix PATH] [--address-file F] \\
        [--workdir DIR]

The worker endpoint (``host:port`` or ``unix:/path``) is printed on stdout (and written
to ``--address-file``); workers get it as ``RESIHP_AGENT_ADDR``. Exit status: 0 after
SIGTERM/SIGINT, 3 when the controller connection was lost, 2 on bad arguments.
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
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from resihp_core.config import DetectorConfig
from resihp_core.detector.failstop import FailStopMonitor, ProcessState, WorkerFailure
from resihp_core.protocol import (
    Ack,
    AgentState,
    AuthError,
    Error,
    FailureReport,
    Heartbeat,
    IterationProfile,
    LaunchWorkers,
    Message,
    ProtocolError,
    SignalWorker,
    WorkerProcess,
    client_handshake,
    read_msg,
    server_handshake,
    write_msg,
)
from resihp_core.runtime.heartbeat import BYE, format_address, parse_address, parse_worker_identity

__all__ = ["NodeAgent", "configure", "main", "process_state", "run"]

logger = logging.getLogger("resihp.agent")


def _nodelay(writer: asyncio.StreamWriter) -> None:
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


class NodeAgent:
    """Watches one node's workers and reports to the controller (see the module docstring).

    :param node: this node's id.
    :param controller: the controller's address (``host:port`` or tuple); None runs the
        agent detached (failures go to ``on_failure`` only; for tests).
    :param secret: the job secret (workers and controller use the same).
    :param config: heartbeat interval, miss limit and hang timeout settings.
    :param host, port, unix_path: where workers connect.
    :param on_failure: called with each :class:`WorkerFailure` (on the loop).
    :param on_controller_lost: called when the controller connection drops; default:
        stop the agent.
    :param workdir: where launched workers' job description and logs go
        (``worker<device>.log``); default: a fresh temporary folder.
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
    ) -> None:
        if node < 0:
            raise ValueError(f"node must be >= 0, got {node}")
        if not secret:
            raise ValueError("the job secret must not be empty")
        self.node = node
        self.controller = parse_address(controller) if controller is not None else None
        self._secret = secret
        self.config = config or DetectorConfig()
        self.host, self.port, self.unix_path = host, port, unix_path
        self.on_failure, self.on_controller_lost = on_failure, on_controller_lost
        self.connect_timeout, self.handshake_timeout = connect_timeout, handshake_timeout
        self.clock = clock
        self.monitor = FailStopMonitor.from_config(self.config, process_state=process_state)
        self.failures: list[WorkerFailure] = []
        self.profiles_forwarded = 0
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
            self._tasks += [
                asyncio.create_task(self._state_loop(), name=f"agent{self.node}-state"),
                asyncio.create_task(self._writer_loop(), name=f"agent{self.node}-write"),
                asyncio.create_task(self._controller_reader(), name=f"agent{self.node}-read"),
            ]
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

    # ------------------------------------------------------------ failures
    def _failed(self, f: WorkerFailure) -> None:
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
        starved *agent* never declares its workers silent."""
        assert self._closed is not None
        wake = self.clock()
        while not self._closed.is_set():
            for _ in range(3):
                await asyncio.sleep(0)  # let queued worker messages in
            now = self.clock()
            self._poll_children()
            if now - wake <= self.monitor.interval:
                for f in self.monitor.check(now):
                    self._failed(f)
            cap = self.monitor.interval / 4
            wait = min(cap, max(0.005, self.monitor.next_deadline(now) - now + 0.001))
            wake = now + wait
            await asyncio.sleep(wait)

    # ------------------------------------------------------------ workers
    async def _serve_worker(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        device: int | None = None
        try:
            try:
                hello = await server_handshake(reader, writer, self._secret, timeout=self.handshake_timeout)
                device, rank, pid = parse_worker_identity(hello.identity)
            except (AuthError, ValueError) as e:
                logger.warning("agent %d: refused a worker connection: %s", self.node, e)
                return
            old = self._conns.pop(device, None)
            if old is not None:
                old.close()
            self._conns[device] = writer
            self.monitor.add(device, rank, self.clock(), pid)
            if pid is not None:
                self._watch(device, pid)
            _nodelay(writer)
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
                self.monitor.beat(device, self.clock(), *self._progress(device), self._generation(device))
                self._to_controller(msg)
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

    def _progress(self, device: int) -> tuple[int, int]:
        w = self.monitor.workers[device]
        return w.iteration, w.step

    def _generation(self, device: int) -> int:
        return self.monitor.workers[device].generation

    # ------------------------------------------------------------ launcher
    @property
    def workdir(self) -> Path:
        if self._workdir is None:
            import tempfile

            self._workdir = Path(tempfile.mkdtemp(prefix=f"resihp-agent{self.node}-"))
        return self._workdir

    def launch(self, msg: LaunchWorkers) -> None:
        """Start one worker per device of ``msg`` (call on the agent's loop)."""
        from resihp_core.runtime.processes import spawn_worker, worker_env

        try:
            if msg.detector:
                self._reconfigure(msg.detector)
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
        for d in msg.devices:
            old = self.children.get(d)
            if old is not None and old.poll() is None:
                self._to_controller(WorkerProcess(node=self.node, device=d, pid=old.pid,
                                                  error=f"device {d} already runs (pid {old.pid})"))
                continue
            env = worker_env(store=f"{host}:{msg.store_port}", device=d, job_path=job_path, extra={
                **msg.env, "RESIHP_AGENT_ADDR": self.worker_address or "", "RESIHP_SECRET": secret,
                "RESIHP_RANK": str(d), "RESIHP_HEARTBEAT_INTERVAL": str(self.config.heartbeat_interval_s)})
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
            logger.info("event=worker_launched node=%d device=%d pid=%d", self.node, d, child.pid)
            self._to_controller(WorkerProcess(node=self.node, device=d, pid=child.pid))

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

    def _reap_children(self) -> None:
        """Kill and reap every worker still running (by pid) when the agent stops."""
        for child in self.children.values():
            if child.poll() is None:
                child.send_signal(signal.SIGCONT)
                child.kill()
        for child in self.children.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.wait(5)

    # ------------------------------------------------------------ controller
    def _to_controller(self, msg: Message) -> None:
        if self._ctl_queue is not None and self.controller is not None:
            self._ctl_queue.put_nowait(msg)

    def state(self) -> AgentState:
        return AgentState(node=self.node, time=max(0.0, time.time()), workers=self.monitor.summaries(self.clock()))

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
        try:
            while True:
                msg = await self._ctl_queue.get()
                await write_msg(self._ctl_writer, msg)
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
                    self.launch(msg)
                elif isinstance(msg, SignalWorker):
                    self.signal_worker(msg.device, signal.Signals[msg.signal])
                elif isinstance(msg, Error):
                    logger.warning("agent %d: controller says %s: %s", self.node, msg.code, msg.detail)
        except (ProtocolError, ConnectionError, OSError) as e:
            exc = e
        self._lost_controller(exc)

    def _lost_controller(self, exc: BaseException | None) -> None:
        if self.controller_lost is not False or (self._closed is not None and self._closed.is_set()):
            return
        self.controller_lost = exc
        logger.error("event=controller_lost node=%d error=%r", self.node, exc)
        if self.on_controller_lost is not None:
            try:
                self.on_controller_lost(exc)
            except Exception:  # noqa: BLE001
                logger.exception("on_controller_lost callback failed")
        else:
            asyncio.get_running_loop().create_task(self.stop(goodbye=False))


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
    ap.add_argument("--config", help="TOML/YAML configuration file (detector section)")
    ap.add_argument("--secret-env", default="RESIHP_SECRET", help="environment variable holding the job secret")
    ap.add_argument("--connect-timeout", type=float, default=60.0,
                    help="keep trying to reach the controller this many seconds (default 60)")
    ap.add_argument("--log-level", default="WARNING")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m resihp_core.runtime.agent", description="ResiHP node agent")
    configure(ap)
    return ap.parse_args(argv)


async def _amain(args: argparse.Namespace) -> int:
    from resihp_core.config import load_config

    config = load_config(args.config).detector
    secret = os.environ.get(args.secret_env, "")
    if not secret:
        print(f"agent: the job secret is missing (set {args.secret_env})", file=sys.stderr)
        return 2
    host, port = ("127.0.0.1", 0) if args.unix else parse_address(args.listen)  # type: ignore[misc]
    agent = NodeAgent(args.node, args.controller, secret, config, host=host, port=port, unix_path=args.unix,
                      workdir=args.workdir, connect_timeout=args.connect_timeout)
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
    return 3 if agent.controller_lost is not False else 0


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


if __name__ == "__main__":
    sys.exit(main())
