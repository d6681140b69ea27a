"""The job store: an authenticated key-value store for plans, commit verdicts, reports
and torch.distributed rendezvous (replaces an open ``TCPStore``; docs/security.md).

:class:`StoreServer` runs in the controller's process, bound to the address the user
chose. Every connection starts with the protocol's mutual handshake
(:mod:`resihp_core.protocol.auth`): a worker proves its node's credential
(identity ``worker:<node>:<device>``, key :func:`~resihp_core.protocol.node_credential`),
a tool holding the job secret may connect as ``controller``. Before the handshake the
listener holds at most 64 pending connections with 1 KiB frames; after it, requests are
length-prefixed msgpack frames of at most 16 MiB. Workers may not write the plan keys
(``plan/...``): only the controller posts plan generations, from its own process
(:meth:`StoreServer.local`) or as ``controller``. Refusals are logged
(``event=auth_refused listener=store``, ``event=store_write_refused``).

The server is one asyncio event loop on one thread, whatever the number of connections:
a job of N ranks holds about N open store connections (each worker's rendezvous store),
and a thread for each would cost the controller's process N stacks and a scheduler
that wakes them in turn. A request that waits for keys parks a future under those keys;
the write that creates them (from the network or from the controller's own process)
completes it.

:class:`StoreClient` and :class:`LocalStore` are ``torch.distributed.Store`` subclasses,
so they work as the store of ``init_process_group`` / ``PrefixStore`` with gloo. This
module imports torch: only workers and the controller load it.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import socket
import threading
import time
from typing import Any, Protocol

import torch.distributed as dist

from resihp_core.protocol import (
    MAX_FRAME_BYTES,
    AuthError,
    Hello,
    ProtocolError,
    node_credential,
    server_handshake,
)
from resihp_core.runtime.gate import PreAuthGate

__all__ = ["StoreServer", "StoreClient", "LocalStore", "StoreError", "worker_store_identity"]

logger = logging.getLogger("resihp.store")

MAX_KEY_CHARS = 1024
MAX_PENDING_HANDSHAKES = 64
# Keys only the controller writes (plans; presence and shutdown, docs/failover.md), and
# the presence key a store host drops with the controller's connection (presence=True):
# spelled once, in the job session.
from resihp_core.runtime.session import CONTROLLER_PREFIX, PLAN_PREFIX, PRESENT_KEY  # noqa: E402
from resihp_core.runtime.store_wire import (  # noqa: E402
    _DEC,
    _ENC,
    _HEADER,
    StoreOps,
    WireError,
    WireStore,
    _seconds,
)


class StoreError(dist.DistStoreError):
    """A store request failed (time-out, refused write, lost connection)."""


def worker_store_identity(node: int, device: int) -> str:
    return f"worker:{node}:{device}"


# ------------------------------------------------------------------ the table
class _Waiter(Protocol):
    def set(self) -> None: ...


class _Table:
    """The keys and values, with the operations both the server and LocalStore run.

    A request that waits for keys registers a waiter (a thread's event, or a future of
    the server's loop) under each missing key; a write wakes only the waiters of the
    key it wrote. (One condition for every key would wake every waiter on every write:
    at a thousand ranks, each blocked on its next plan key, each report or counter add
    would wake a thousand of them.)"""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self._waiters: dict[str, list[_Waiter]] = {}

    def _wrote(self, key: str) -> None:  # under the lock
        for ev in self._waiters.pop(key, ()):
            ev.set()

    def register(self, keys: list[str], waiter: _Waiter) -> None:  # under the lock
        for k in keys:
            self._waiters.setdefault(k, []).append(waiter)

    def unregister(self, keys: list[str], waiter: _Waiter) -> None:  # under the lock
        for k in keys:
            waiting = self._waiters.get(k)
            if waiting is not None and waiter in waiting:
                waiting.remove(waiter)
                if not waiting:
                    del self._waiters[k]

    def waiting(self) -> int:
        """How many waiters are registered (for tests and benchmarks)."""
        with self.lock:
            return sum(len(w) for w in self._waiters.values())

    def _sleep(self, keys: list[str], deadline: float) -> bool:
        """Under the lock: sleep until one of ``keys`` is written or ``deadline``;
        False once the deadline has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        ev = threading.Event()
        self.register(keys, ev)
        self.lock.release()
        try:
            ev.wait(left)
        finally:
            self.lock.acquire()
        if len(keys) > 1 or not ev.is_set():  # unregister where no write popped it
            self.unregister(keys, ev)
        return True

    def ready(self, op: str, args: list[Any]) -> tuple[bool, Any]:
        """Under the lock: a waiting operation's result if its keys are there,
        ``(False, missing keys)`` if not (the event loop's form of :meth:`_wait`)."""
        keys = [args[0]] if op == "get" else list(args[0])
        if op == "any":
            for n, k in enumerate(keys):
                if k in self.data:
                    return True, n
            return False, keys
        missing = [k for k in keys if k not in self.data]
        if missing:
            return False, missing
        if op == "get":
            return True, self.data[keys[0]]
        return True, ([self.data[k] for k in keys] if op == "mget" else None)

    def set(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = value
            self._wrote(key)

    def _wait(self, keys: list[str], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [k for k in keys if k not in self.data]
            if not missing:
                return
            if not self._sleep(missing, deadline):
                raise StoreError(f"timed out after {timeout_s:.1f} s waiting for keys {missing[:4]}")

    def get(self, key: str, timeout_s: float) -> bytes:
        with self.lock:
            self._wait([key], timeout_s)
            return self.data[key]

    def multi_get(self, keys: list[str], timeout_s: float) -> list[bytes]:
        with self.lock:
            self._wait(keys, timeout_s)
            return [self.data[k] for k in keys]

    def wait(self, keys: list[str], timeout_s: float) -> None:
        with self.lock:
            self._wait(keys, timeout_s)

    def wait_any(self, keys: list[str], timeout_s: float) -> int:
        """Block until one of ``keys`` exists; its index, -1 if none came in ``timeout_s``
        (no error: the caller waits again, as a poll would have looked again)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                for n, k in enumerate(keys):
                    if k in self.data:
                        return n
                if not self._sleep(keys, deadline):
                    return -1

    def add(self, key: str, amount: int) -> int:
        with self.lock:
            return self._add(key, amount)

    def _add(self, key: str, amount: int) -> int:  # under the lock
        try:
            value = int(self.data.get(key, b"0")) + amount
        except ValueError:
            raise StoreError(f"key {key!r} does not hold an integer") from None
        self.data[key] = str(value).encode()
        self._wrote(key)
        return value

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """torch's semantics: set if the value equals ``expected`` (absent counts as
        ``b""``) and return the new value, else return the current one."""
        with self.lock:
            cur = self.data.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self.data[key] = desired
                self._wrote(key)
                return desired
            return expected if cur is None else cur

    def add_commits(self, keys: list[str], values: list[bytes], counter: str, amount: int, target: int,
                    verdict: str, decide: bool) -> tuple[int, bytes | None]:
        """The write half of ``commit``: set ``keys`` (a node's reports), add ``amount``
        to ``counter``; if that completes the count to ``target`` and ``decide``, write
        ``commit`` to ``verdict`` unless a verdict is there (the first one stands).
        Returns the count and the verdict if there is one now."""
        with self.lock:
            for k, v in zip(keys, values):
                self.data[k] = v
                self._wrote(k)
            count = self._add(counter, amount)
            if count == target and decide and verdict not in self.data:
                self.data[verdict] = b"commit"
                self._wrote(verdict)
            return count, self.data.get(verdict)

    def append(self, key: str, value: bytes) -> None:
        with self.lock:
            self.data[key] = self.data.get(key, b"") + value
            self._wrote(key)

    def check(self, keys: list[str]) -> bool:
        with self.lock:
            return all(k in self.data for k in keys)

    def delete(self, key: str) -> bool:
        with self.lock:
            return self.data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self.lock:
            return len(self.data)


_WRITES = {"set", "add", "cas", "append", "del", "mset", "madd", "commit"}
_WAITS = {"get", "mget", "wait", "any"}  # operations that may wait for keys (their last argument: seconds)


def _run_op(table: _Table, op: str, args: list[Any]) -> Any:
    if op == "set":
        return table.set(args[0], args[1])
    if op == "get":
        return table.get(args[0], args[1])
    if op == "mget":
        return table.multi_get(args[0], args[1])
    if op == "mset":
        for k, v in zip(args[0], args[1]):
            table.set(k, v)
        return None
    if op == "madd":  # a node's reports and its executors' commit-counter add, one request
        for k, v in zip(args[0], args[1]):
            table.set(k, v)
        return table.add(args[2], args[3])
    if op == "commit":  # in-process: the write, then a blocking wait for the verdict
        count, verdict = table.add_commits(*args[:7])
        if verdict is None and count != args[4]:
            try:
                verdict = table.get(args[5], args[7])
            except StoreError:
                pass  # no verdict in time: the caller aborts (the first verdict stands)
        return [count, verdict]
    if op == "wait":
        return table.wait(args[0], args[1])
    if op == "any":
        return table.wait_any(args[0], args[1])
    if op == "add":
        return table.add(args[0], args[1])
    if op == "cas":
        return table.compare_set(args[0], args[1], args[2])
    if op == "append":
        return table.append(args[0], args[1])
    if op == "check":
        return table.check(args[0])
    if op == "del":
        return table.delete(args[0])
    if op == "num":
        return table.num_keys()
    raise StoreError(f"unknown store operation {op!r}")


def _keys_of(op: str, args: list[Any]) -> list[str]:
    if op in ("mget", "mset", "wait", "any", "check"):
        return list(args[0])
    if op == "madd":
        return [*args[0], args[2]]
    if op == "commit":
        return [*args[0], args[2], args[5]]
    return [args[0]] if op != "num" else []


def _check_request(req: Any) -> tuple[str, list[Any]]:
    if not isinstance(req, list) or not req or not isinstance(req[0], str):
        raise ProtocolError("a store request is a list [op, args...]")
    op, args = req[0], req[1:]
    try:
        keys = _keys_of(op, args) if args or op == "num" else None
    except (TypeError, IndexError):  # an argument of the wrong shape where keys belong
        keys = None
    if keys is None or not all(isinstance(k, str) and 0 < len(k) <= MAX_KEY_CHARS for k in keys):
        raise ProtocolError(f"store request {op!r}: bad keys")
    want = _ARG_TYPES.get(op)
    if want is None or len(args) != len(want) or not all(t(a) for t, a in zip(want, args)):
        raise ProtocolError(f"store request {op!r}: bad arguments")
    if op in ("mset", "madd", "commit") and len(args[0]) != len(args[1]):
        raise ProtocolError(f"store request {op!r}: {len(args[0])} keys but {len(args[1])} values")
    return op, args


def _is_key(a: Any) -> bool:
    return isinstance(a, str)


def _is_keys(a: Any) -> bool:
    return isinstance(a, list) and all(isinstance(k, str) for k in a)


def _is_bytes(a: Any) -> bool:
    return isinstance(a, bytes)


def _is_values(a: Any) -> bool:
    return isinstance(a, list) and all(isinstance(v, bytes) for v in a)


def _is_int(a: Any) -> bool:
    return isinstance(a, int) and not isinstance(a, bool)


def _is_flag(a: Any) -> bool:
    return isinstance(a, bool)


def _is_seconds(a: Any) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and 0 <= a <= 86400


_ARG_TYPES = {
    "set": (_is_key, _is_bytes), "get": (_is_key, _is_seconds), "mget": (_is_keys, _is_seconds),
    "mset": (_is_keys, _is_values),
    "madd": (_is_keys, _is_values, _is_key, _is_int),
    # a node's reports, its counter add, the target count, the verdict key, whether the
    # store may decide, seconds to wait for the verdict (docs/worker-protocol.md)
    "commit": (_is_keys, _is_values, _is_key, _is_int, _is_int, _is_key, _is_flag, _is_seconds),
    "wait": (_is_keys, _is_seconds), "any": (_is_keys, _is_seconds), "add": (_is_key, _is_int),
    "cas": (_is_key, _is_bytes, _is_bytes),
    "append": (_is_key, _is_bytes), "check": (_is_keys,), "del": (_is_key,), "num": (),
}


# ------------------------------------------------------------------ server
class _LoopWaiter:
    """A waiter of the server's loop: a write (from any thread) completes its future.

    A write made on the loop's own thread (a request's, such as the add that completes
    an iteration's count and wakes every parked commit) completes it at once: handing
    each wake through ``call_soon_threadsafe`` costs a write to the loop's wake-up pipe
    per waiter, thousands per iteration at thousands of nodes (benchmarks/store_fanout.py)."""

    __slots__ = ("loop", "fut", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: int) -> None:
        self.loop = loop
        self.thread = thread  # the loop's thread
        self.fut: asyncio.Future[None] = loop.create_future()

    def set(self) -> None:
        if threading.get_ident() == self.thread:
            self._wake()
            return
        try:
            self.loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the server closed: nobody waits any more, the write stands
            pass

    def _wake(self) -> None:
        if not self.fut.done():
            self.fut.set_result(None)


def _reply(writer: asyncio.StreamWriter, reply: list[Any]) -> None:
    """Write one reply frame (a reply over the frame limit is refused in its place)."""
    payload = _ENC.encode(reply)
    if len(payload) > MAX_FRAME_BYTES:
        payload = _ENC.encode([False, f"reply of {len(payload)} bytes exceeds the frame limit"])
    writer.write(_HEADER.pack(len(payload)) + payload)


async def _read_frame(reader: asyncio.StreamReader) -> Any:
    """One request frame; None at a clean end of the connection."""
    try:
        header = await reader.readexactly(_HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise ProtocolError(f"connection closed inside a frame header ({len(e.partial)} bytes)") from None
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"store frame of {n} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    try:
        body = await reader.readexactly(n)
    except asyncio.IncompleteReadError:
        raise ProtocolError("connection closed inside a frame") from None
    try:
        return _DEC.decode(body)
    except Exception as e:  # noqa: BLE001 - msgspec's decode errors: hostile bytes
        raise ProtocolError(f"bad store frame: {e}") from None


class StoreServer:
    """The authenticated job store, served by one event loop on a thread of the
    controller's process.

    :param host: the address to bind (the one the user chose; never widened).
    :param secret: the job secret (workers prove their node's credential derived from it).
    :param port: 0 = any free port.
    :param nodes: node ids allowed to connect (None: any).
    :param presence: drop ``controller/present`` (which the controller sets once it
        steers the job) when the last ``controller`` connection closes: a store hosted
        outside the controller's process, whose workers hold their commits while no
        controller steers them (docs/failover.md).
    """

    def __init__(self, host: str, secret: str, port: int = 0, *, nodes: set[int] | None = None,
                 handshake_timeout: float = 5.0, presence: bool = False) -> None:
        if not secret:
            raise ValueError("the job secret must not be empty")
        self._secret = secret
        self.nodes = None if nodes is None else set(nodes)
        self.handshake_timeout = handshake_timeout
        self.table = _Table()
        self.served = 0  # requests served over the network (a counter for benchmarks)
        self.connections = 0  # open authenticated connections
        self._refused = 0
        self._gate = PreAuthGate("store", MAX_PENDING_HANDSHAKES)
        self._sock = sock = socket.create_server((host, port), backlog=1024)
        self.host, self.port = sock.getsockname()[:2]
        self._closed = False
        self.presence = presence
        self.controllers = 0  # open connections of the controller identity
        self.controller_left = time.monotonic()  # when the last steering one closed
        self._loop = asyncio.new_event_loop()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.AbstractServer | None = None
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(sock, started), daemon=True, name="resihp-store")
        self._thread.start()
        started.wait()
        logger.info("event=store_started address=%s", self.address)

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def refused(self) -> int:
        """Connections and requests refused: failed handshakes, handshakes over the
        pending limit, writes to plan keys."""
        return self._refused + self._gate.refused

    def local(self, timeout_s: float = 300.0) -> LocalStore:
        """The store as seen from this process (the controller): no socket, every key writable."""
        return LocalStore(self.table, timeout_s)

    # ------------------------------------------------------------ the loop
    def _run(self, sock: socket.socket, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(asyncio.start_server(self._accept, sock=sock))
        finally:
            started.set()
        self._loop.run_forever()
        self._loop.close()

    def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = self._loop.create_task(self._serve(reader, writer))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _key_for(self, hello: Hello) -> str:
        role, _, rest = hello.identity.partition(":")
        if hello.identity == "controller":
            return self._secret
        if role == "agent" and rest.isdigit() and len(rest) <= 9:  # a node agent's commits
            rest += ":0"
            role = "worker"
        node_s, _, device_s = rest.partition(":")
        if role != "worker" or not node_s.isdigit() or not device_s.isdigit() or len(node_s) > 9:
            raise AuthError(f"bad store identity {hello.identity!r}: expected worker:<node>:<device> or agent:<node>")
        node = int(node_s)
        if self.nodes is not None and node not in self.nodes:
            raise AuthError(f"node {node} is not in the job")
        return node_credential(self._secret, node)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        identity = "?"
        if not self._gate.admit(writer):
            return
        try:
            try:
                hello = await server_handshake(reader, writer, self._key_for, timeout=self.handshake_timeout)
                identity = hello.identity
            except AuthError as e:
                self._refused += 1
                if not self._closed:
                    logger.warning("event=auth_refused listener=store peer=%s reason=%r", peer, str(e))
                return
            finally:
                self._gate.done(writer)
            sock = writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            may_plan = identity == "controller"
            self.connections += 1
            if may_plan:
                self._controller_joined()
            try:
                await self._requests(reader, writer, identity, may_plan)
            finally:
                self.connections -= 1
                if may_plan:
                    self._controller_gone()
        except (ProtocolError, OSError) as e:
            if not self._closed:
                logger.info("event=store_connection_closed identity=%s reason=%r", identity, str(e))
        finally:
            writer.close()

    def _controller_joined(self) -> None:
        self.controllers += 1

    def _controller_gone(self) -> None:
        steered = not self.presence or self.table.check([PRESENT_KEY])
        self.controllers -= 1
        none_left = self.controllers == 0
        if none_left and steered:  # a controller that only looked (never steered) starts no grace period
            self.controller_left = time.monotonic()
        if none_left and self.presence:
            self.table.delete(PRESENT_KEY)
            logger.warning("event=controller_absent listener=store")

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, identity: str,
                        may_plan: bool) -> None:
        """Serve one authenticated connection's requests until it closes."""
        while True:
            req = await _read_frame(reader)
            if req is None:
                return
            op, args = _check_request(req)
            self.served += 1
            if op in _WRITES and not may_plan and any(k.startswith((PLAN_PREFIX, CONTROLLER_PREFIX))
                                                      for k in _keys_of(op, args)):
                self._refused += 1
                logger.warning("event=store_write_refused identity=%s op=%s keys=%s reason=%r", identity, op,
                               _keys_of(op, args)[:4], "only the controller posts plans")
                reply: list[Any] = [False, f"{identity} may not write plan keys"]
            else:
                try:
                    value = (await self._waited(op, args) if op in _WAITS else
                             await self._commit(args) if op == "commit" else _run_op(self.table, op, args))
                    reply = [True, value]
                except (StoreError, IndexError, TypeError, ValueError) as e:
                    reply = [False, str(e)]
            _reply(writer, reply)
            await writer.drain()

    async def _commit(self, args: list[Any]) -> list[Any]:
        """``commit``: the write at once; then, unless it completed the count, the
        request parks until the verdict exists (the executors' verdict wait in the same
        round trip as their add). ``[count, verdict or None]``."""
        count, verdict = self.table.add_commits(*args[:7])
        if verdict is None and count != args[4]:
            try:
                verdict = await self._waited("get", [args[5], args[7]])
            except StoreError:
                pass  # no verdict in time: the caller aborts (the first verdict stands)
        return [count, verdict]

    async def _waited(self, op: str, args: list[Any]) -> Any:
        """A waiting operation without blocking the loop: park a future under the
        missing keys until a write completes it or the request's time runs out."""
        timeout_s = float(args[-1])
        deadline = time.monotonic() + timeout_s
        table = self.table
        while True:
            with table.lock:
                done, value = table.ready(op, args)
                if done:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    if op == "any":
                        return -1
                    raise StoreError(f"timed out after {timeout_s:.1f} s waiting for keys {value[:4]}")
                waiter = _LoopWaiter(self._loop, self._thread.ident)
                table.register(value, waiter)
            # One timer that ends the wait, not ``asyncio.wait_for`` (a second future and
            # its callbacks per parked request: the verdict wakes thousands at once).
            timer = self._loop.call_later(left, waiter._wake)
            try:
                await waiter.fut
            finally:
                timer.cancel()
                with table.lock:
                    table.unregister(value, waiter)

    def close(self) -> None:
        """Stop listening and drop every connection (quietly)."""
        if self._closed:
            return
        self._closed = True
        if self._loop.is_closed():
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=10)
        except Exception:  # noqa: BLE001 - the loop is already gone (interpreter exit)
            pass
        self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        self._gate.close_all()
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._loop.call_soon(self._loop.stop)


# ------------------------------------------------------------------ the two Store faces
class _StoreAPI(StoreOps, dist.Store):
    """torch.distributed.Store's methods on top of ``_call(op, *args)``."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__()
        self._timeout_s = timeout_s

    def _call(self, op: str, *args: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout_s = _seconds(timeout, self._timeout_s)

    @property
    def timeout(self) -> datetime.timedelta:  # type: ignore[override]
        return datetime.timedelta(seconds=self._timeout_s)


class LocalStore(_StoreAPI):
    """The server's table as a ``dist.Store`` in the server's own process."""

    def __init__(self, table: _Table, timeout_s: float = 300.0) -> None:
        super().__init__(timeout_s)
        self._table = table

    def _call(self, op: str, *args: Any) -> Any:
        return _run_op(self._table, op, list(args))


class StoreClient(_StoreAPI):
    """A connection to a :class:`StoreServer` as a ``torch.distributed.Store`` (one
    request at a time; thread-safe): :class:`~resihp_core.runtime.store_wire.WireStore`
    behind torch's face.

    :param key: the node credential (or the job secret for ``identity="controller"``).
    """

    def __init__(self, address: str, key: str, identity: str, *, timeout_s: float = 300.0,
                 connect_timeout_s: float | None = None) -> None:
        super().__init__(timeout_s)
        try:
            self._wire = WireStore(address, key, identity, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s)
        except WireError as e:
            raise StoreError(str(e)) from None
        self.address, self.identity = address, identity

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return self._wire.call(op, *args)
        except WireError as e:
            raise StoreError(str(e)) from None

    def close(self) -> None:
        self._wire.close()
