"""The worker's side of the detector: heartbeats with progress, and profiles.

A :class:`WorkerClient` lives inside a worker process. It connects to its node agent
(TCP on loopback, or a Unix socket), authenticates with the job secret (HMAC
handshake, role ``"worker"``, identity ``worker:<device>:<rank>:<pid>``), then a
daemon thread sends a :class:`~resihp_core.protocol.Heartbeat` every ``interval``
seconds carrying the latest progress, and forwards queued
:class:`~resihp_core.protocol.IterationProfile` s with the next beat (within one
interval), one ``sendall`` per wake-up.

The training loop only calls :meth:`WorkerClient.beat` (an attribute store: no lock,
no syscall) and :meth:`WorkerClient.send_profile` (a deque append and an event set);
neither ever blocks on the network. If the agent goes away the thread keeps trying to
reconnect with back-off and training continues; profiles queued meanwhile are kept up
to ``max_queue`` (oldest dropped).

Because the beats come from a separate thread, a worker whose *main* thread is stuck
still beats — with progress that no longer advances, which is how the agent tells a
hang (stalled progress) from a dead or stopped process (no beats at all).

:meth:`WorkerClient.close` says goodbye (an ``Ack`` with ``what="bye"``), so a worker
that finishes normally is not reported as failed.

Environment (for :meth:`WorkerClient.from_env`): ``RESIHP_AGENT_ADDR`` (``host:port``
or ``unix:/path``), ``RESIHP_SECRET``, ``RESIHP_RANK``, ``RESIHP_DEVICE``, optional
``RESIHP_GENERATION`` and ``RESIHP_HEARTBEAT_INTERVAL``.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from resihp_core.protocol import (
    Ack,
    AuthError,
    Heartbeat,
    IterationProfile,
    Message,
    ProtocolError,
    client_handshake_sync,
    encode_frame,
)

__all__ = [
    "BYE",
    "COMMITS",
    "ENV_AGENT_ADDR",
    "ClientStats",
    "WorkerClient",
    "format_address",
    "parse_address",
    "parse_worker_identity",
    "worker_identity",
]

logger = logging.getLogger("resihp.worker")

ENV_AGENT_ADDR = "RESIHP_AGENT_ADDR"
#: ``Ack.what`` of the goodbye a worker sends before closing on purpose.
BYE = "bye"
ANNOUNCE = "controller:"  # a controller's first message to an agent: Ack(what=ANNOUNCE + its incarnation)


def parse_address(address: str | tuple[str, int]) -> tuple[str, int] | str:
    """``"host:port"`` / ``("host", port)`` -> ``(host, port)``; ``"unix:/path"`` -> path."""
    if isinstance(address, tuple):
        host, port = address
        return str(host), int(port)
    if address.startswith("unix:"):
        path = address[5:]
        if not path:
            raise ValueError("empty Unix socket path in address 'unix:'")
        return path
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port' or 'unix:/path', got {address!r}")
    return host.strip("[]"), int(port)


def format_address(address: tuple[str, int] | str) -> str:
    if isinstance(address, str):
        return f"unix:{address}"
    return f"{address[0]}:{address[1]}"


def worker_identity(device: int, rank: int, pid: int) -> str:
    return f"worker:{device}:{rank}:{pid}"


#: identity prefix of a worker's commit connection to its agent (``commit:<device>:<rank>:<pid>``)
COMMITS = "commit:"


def parse_worker_identity(identity: str) -> tuple[int, int, int | None]:
    """``worker:<device>:<rank>:<pid>`` -> (device, rank, pid); raises ValueError."""
    parts = identity.split(":")
    if len(parts) not in (3, 4) or parts[0] != "worker":
        raise ValueError(f"not a worker identity: {identity!r}")
    device, rank = int(parts[1]), int(parts[2])
    pid = int(parts[3]) if len(parts) == 4 and parts[3] else None
    if device < 0 or rank < 0:
        raise ValueError(f"negative device or rank in {identity!r}")
    return device, rank, pid


@dataclass
class ClientStats:
    beats_sent: int = 0
    profiles_sent: int = 0
    profiles_dropped: int = 0
    connects: int = 0
    send_errors: int = 0


class WorkerClient:
    """Heartbeats and profiles from a worker to its node agent (see the module docstring).

    :param address: the agent's worker endpoint (``host:port``, ``unix:/path``, tuple).
    :param secret: the job secret.
    :param rank, device: who this worker is (the device id is stable across plan
        generations, the rank is not).
    :param interval: heartbeat interval in seconds (``detector.heartbeat_interval_s``).
    :param on_agent_lost: called (from the beat thread) when the connection drops.
    """

    def __init__(
        self,
        address: str | tuple[str, int],
        secret: str | bytes,
        *,
        rank: int,
        device: int,
        generation: int = 0,
        interval: float = 0.1,
        connect_timeout: float = 5.0,
        send_timeout: float = 2.0,
        max_queue: int = 256,
        reconnect: bool = True,
        on_agent_lost: Callable[[BaseException | None], None] | None = None,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if rank < 0 or device < 0:
            raise ValueError("rank and device must be >= 0")
        self.address = parse_address(address)
        self._secret = secret
        self.rank, self.device, self.generation = rank, device, generation
        self.interval, self.connect_timeout, self.send_timeout = interval, connect_timeout, send_timeout
        self.reconnect, self.on_agent_lost = reconnect, on_agent_lost
        self.identity = worker_identity(device, rank, os.getpid())
        self.stats = ClientStats()
        self._progress: tuple[int, int] = (0, 0)
        self._sent_generation = generation
        self._profiles: deque[IterationProfile] = deque()
        self._max_queue = max_queue
        self._sock: socket.socket | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # guards the socket between the thread and close()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: object) -> WorkerClient:
        """Build from ``RESIHP_AGENT_ADDR``, ``RESIHP_SECRET``, ``RESIHP_RANK``,
        ``RESIHP_DEVICE`` (+ optional ``RESIHP_GENERATION``, ``RESIHP_HEARTBEAT_INTERVAL``)."""
        env = dict(os.environ if env is None else env)
        missing = [k for k in (ENV_AGENT_ADDR, "RESIHP_SECRET", "RESIHP_RANK", "RESIHP_DEVICE") if not env.get(k)]
        if missing:
            raise ValueError(f"WorkerClient.from_env: environment lacks {', '.join(missing)}")
        kw: dict[str, object] = dict(
            rank=int(env["RESIHP_RANK"]),
            device=int(env["RESIHP_DEVICE"]),
            generation=int(env.get("RESIHP_GENERATION", "0")),
            interval=float(env.get("RESIHP_HEARTBEAT_INTERVAL", "0.1")),
        )
        kw.update(overrides)
        return cls(env[ENV_AGENT_ADDR], env["RESIHP_SECRET"], **kw)  # type: ignore[arg-type]

    # ------------------------------------------------------------ the training side
    def beat(self, iteration: int, step: int = 0) -> None:
        """Record progress (cheap; never blocks). Call it at every step."""
        self._progress = (iteration, step)

    @property
    def progress(self) -> tuple[int, int]:
        return self._progress

    def set_generation(self, generation: int, rank: int | None = None) -> None:
        """A new plan generation (progress restarts; the agent resets its hang timer),
        with this worker's new rank if it changed (device ids never change)."""
        if rank is not None:
            if rank < 0:
                raise ValueError("rank must be >= 0")
            self.rank = rank
        self.generation = generation
        self._progress = (0, 0)
        self._wake.set()

    def send_profile(self, profile: IterationProfile) -> None:
        """Queue a profile for the agent (never blocks). It travels with the next
        heartbeat, i.e. within one interval: the fail-slow detector works per iteration
        and does not need it sooner, and batching saves the worker a wake-up."""
        if not isinstance(profile, IterationProfile):
            raise TypeError(f"expected IterationProfile, got {type(profile).__name__}")
        if len(self._profiles) >= self._max_queue:
            self._profiles.popleft()
            self.stats.profiles_dropped += 1
        self._profiles.append(profile)
        if len(self._profiles) >= 16:
            self._wake.set()

    def pause(self) -> None:
        """Stop sending (the connection stays open). For measuring the detector's
        overhead; a paused worker looks silent to its agent."""
        self._running.clear()

    def resume(self) -> None:
        self._running.set()
        self._wake.set()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    # ------------------------------------------------------------ lifecycle
    def start(self) -> WorkerClient:
        """Connect and authenticate (raises ``OSError``/``AuthError`` if that fails),
        then start the beat thread."""
        if self._thread is not None:
            raise RuntimeError("WorkerClient already started")
        self._connect()
        self._send(self._heartbeat())
        self._thread = threading.Thread(target=self._run, name=f"resihp-beat-{self.device}", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> WorkerClient:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.close(goodbye=exc[0] is None)

    def close(self, *, goodbye: bool = True, timeout: float = 2.0) -> None:
        """Stop the thread; with ``goodbye`` flush queued profiles and say goodbye first,
        so the agent does not report this worker as failed."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        self._running.set()
        if self._thread is not None:
            self._thread.join(timeout)
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            if goodbye:
                while self._profiles:
                    sock.sendall(encode_frame(self._profiles.popleft()))
                    self.stats.profiles_sent += 1
                sock.sendall(encode_frame(Ack(generation=self.generation, what=BYE)))
        except OSError:
            pass
        finally:
            sock.close()

    # ------------------------------------------------------------ the thread
    def _heartbeat(self) -> Heartbeat:
        it, step = self._progress
        return Heartbeat(self.rank, self.device, self.generation, it, step, time.time())

    def _connect(self) -> None:
        if isinstance(self.address, str):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.address)
            except OSError:
                sock.close()
                raise
        else:
            sock = socket.create_connection(self.address, timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            client_handshake_sync(sock, self._secret, self.identity, role="worker", timeout=self.connect_timeout)
        except AuthError:
            sock.close()
            raise
        sock.settimeout(self.send_timeout)
        with self._lock:
            self._sock = sock
        self.stats.connects += 1

    def _send(self, msg: Message) -> None:
        sock = self._sock
        if sock is None:
            raise ConnectionError("not connected")
        sock.sendall(encode_frame(msg))

    def _drop(self, exc: BaseException | None) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
            self.stats.send_errors += 1
            logger.warning("worker %d: lost the agent connection: %r", self.device, exc)
            if self.on_agent_lost is not None:
                try:
                    self.on_agent_lost(exc)
                except Exception:  # noqa: BLE001 - a callback must not kill the beat thread
                    logger.exception("on_agent_lost callback failed")

    def _run(self) -> None:
        next_beat = time.monotonic() + self.interval
        backoff = self.interval
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if not self._running.is_set():
                self._running.wait()
                next_beat = time.monotonic()
            if self._stop.is_set():
                break
            if self._sock is None:
                if not self.reconnect:
                    break
                try:
                    self._connect()
                    backoff = self.interval
                except (OSError, AuthError, ProtocolError) as e:
                    logger.debug("worker %d: reconnect failed: %r", self.device, e)
                    self._stop.wait(backoff)
                    backoff = min(5.0, backoff * 2)
                    continue
            try:
                now = time.monotonic()
                beat_now = now >= next_beat or self.generation != self._sent_generation
                if not beat_now and len(self._profiles) < 16:
                    continue
                n_prof = min(len(self._profiles), 64)
                batch = [self._profiles.popleft() for _ in range(n_prof)]
                frames = [encode_frame(p) for p in batch]
                if beat_now:
                    frames.append(encode_frame(self._heartbeat()))
                try:
                    sock = self._sock
                    if sock is None:
                        raise ConnectionError("not connected")
                    sock.sendall(b"".join(frames))
                except OSError:
                    for p in reversed(batch):  # retry them after reconnecting
                        self._profiles.appendleft(p)
                    raise
                self.stats.profiles_sent += n_prof
                if beat_now:
                    self.stats.beats_sent += 1
                    self._sent_generation = self.generation
                    next_beat = max(next_beat + self.interval, now + 0.5 * self.interval)
            except OSError as e:
                self._drop(e)
