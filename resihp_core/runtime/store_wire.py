"""The job store's wire: framing, its operations, and a client that needs no torch.

The store server and torch's ``Store`` faces (:mod:`resihp_core.runtime.store`) build
on it; the node agent, which never loads torch, commits its workers' iterations through
:class:`WireStore` (docs/worker-protocol.md). Frames are a 4-byte big-endian length and
a msgpack body of at most :data:`~resihp_core.protocol.MAX_FRAME_BYTES`; a request is
``[op, args...]``, a reply ``[ok, value]``.
"""

from __future__ import annotations

import datetime
import random
import socket
import struct
import threading
import time
from typing import Any

import msgspec

from resihp_core.protocol import MAX_FRAME_BYTES, AuthError, HandshakeBroken, ProtocolError, client_handshake_sync

__all__ = ["StoreOps", "WireError", "WireStore"]

_HEADER = struct.Struct(">I")
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder()


class WireError(RuntimeError):
    """A store request failed (refused, timed out, connection lost)."""


def _b(v: str | bytes | bytearray) -> bytes:
    return v.encode() if isinstance(v, str) else bytes(v)


def _seconds(timeout: datetime.timedelta | float | None, default: float) -> float:
    if timeout is None:
        return default
    s = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return default if s <= 0 else s


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if buf:
                raise ProtocolError(f"connection closed inside a frame ({len(buf)} of {n} bytes)")
            return None
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> Any:
    header = _recv_exactly(sock, _HEADER.size)
    if header is None:
        return None
    (n,) = _HEADER.unpack(header)
    if n > MAX_FRAME_BYTES:
        raise ProtocolError(f"store frame of {n} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    body = _recv_exactly(sock, n)
    if body is None:
        raise ProtocolError("connection closed inside a frame")
    try:
        return _DEC.decode(body)
    except msgspec.MsgspecError as e:
        raise ProtocolError(f"bad store frame: {e}") from None


def _send(sock: socket.socket, obj: Any) -> None:
    payload = _ENC.encode(obj)
    if len(payload) > MAX_FRAME_BYTES:
        raise WireError(f"store frame of {len(payload)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit")
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class StoreOps:
    """The store's operations on top of ``_call(op, *args)`` (torch's ``Store`` method
    names, and ResiHP's own: ``get_within``, ``set_and_add``, ``add_and_await``, ``wait_any``)."""

    _timeout_s: float

    def _call(self, op: str, *args: Any) -> Any:  # pragma: no cover - overridden
        raise NotImplementedError

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", key, _b(value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, self._timeout_s)

    def get_within(self, key: str, timeout_s: float) -> bytes:
        """``get`` waiting up to ``timeout_s`` for the key (not the store's timeout): a
        wait and a read in one round trip (the worker's commit verdict)."""
        return self._call("get", key, float(timeout_s))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._call("mget", list(keys), self._timeout_s)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call("mset", list(keys), [_b(v) for v in values])

    def add(self, key: str, value: int) -> int:
        return int(self._call("add", key, int(value)))

    def set_and_add(self, keys: list[str], values: list[bytes], counter: str, amount: int) -> int:
        """Set ``keys`` to ``values`` and add ``amount`` to ``counter`` in one round trip;
        the counter's new value (a node's reports and its commit, docs/worker-protocol.md)."""
        if len(keys) != len(values):
            raise ValueError(f"set_and_add: {len(keys)} keys but {len(values)} values")
        return int(self._call("madd", list(keys), [_b(v) for v in values], counter, int(amount)))

    def add_and_await(self, keys: list[str], values: list[bytes], counter: str, amount: int, target: int,
                      verdict: str, decide: bool, timeout_s: float) -> tuple[int, bytes | None]:
        """Set ``keys``, add ``amount`` to ``counter`` and, unless that completes the
        count to ``target``, wait up to ``timeout_s`` for ``verdict``, in one round trip;
        with ``decide`` the add that completes the count writes ``commit`` (unless a
        verdict stands). The count and the verdict, None if none came (docs/worker-protocol.md)."""
        if len(keys) != len(values):
            raise ValueError(f"add_and_await: {len(keys)} keys but {len(values)} values")
        count, got = self._call("commit", list(keys), [_b(v) for v in values], counter, int(amount), int(target),
                                verdict, bool(decide), float(timeout_s))
        return int(count), got

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        return self._call("cas", key, _b(expected_value), _b(desired_value))

    def append(self, key: str, value: str | bytes) -> None:
        self._call("append", key, _b(value))

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call("wait", list(keys), _seconds(timeout, self._timeout_s))

    def wait_any(self, keys: list[str], timeout_s: float) -> int:
        """Block up to ``timeout_s`` until one of ``keys`` exists; its index, -1 if none
        came (ResiHP's own operation: the controller sleeps on what wakes it)."""
        return int(self._call("any", list(keys), float(timeout_s)))

    def check(self, keys: list[str]) -> bool:
        return bool(self._call("check", list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._call("del", key))

    def num_keys(self) -> int:
        return int(self._call("num"))


class WireStore(StoreOps):
    """A connection to the job store (one request at a time; thread-safe).

    :param key: the node credential (or the job secret for ``identity="controller"``).
    :param timeout_s: the default wait of blocking requests.
    """

    def __init__(self, address: str, key: str, identity: str, *, timeout_s: float = 300.0,
                 connect_timeout_s: float | None = None) -> None:
        self._timeout_s = timeout_s
        host, _, port = address.rpartition(":")
        host = host.strip("[]")
        deadline = time.monotonic() + (connect_timeout_s if connect_timeout_s is not None else timeout_s)
        delay = 0.05
        while True:
            try:
                self._sock = socket.create_connection((host, int(port)), timeout=10)
                client_handshake_sync(self._sock, key, identity, role="worker", timeout=min(30.0, timeout_s))
                break
            except (OSError, HandshakeBroken) as e:
                # Unreachable, or the handshake broken off: a store past its limit of
                # pending handshakes resets the rest when thousands of ranks dial at once.
                self._close_quietly()
                if time.monotonic() + delay > deadline:
                    raise WireError(f"cannot reach the job store at {address}: {e}") from None
                time.sleep(delay * random.uniform(0.5, 1.5))
                delay = min(1.0, delay * 2)
            except AuthError as e:
                self._sock.close()
                raise WireError(f"job store at {address} refused {identity}: {e}") from None
        self._sock.settimeout(None)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._lock = threading.Lock()
        self.address, self.identity = address, identity

    def call(self, op: str, *args: Any) -> Any:
        """One request and its reply; :class:`WireError` if refused or lost."""
        with self._lock:
            try:
                _send(self._sock, [op, *args])
                reply = _recv(self._sock)
            except (OSError, ProtocolError) as e:
                raise WireError(f"job store connection lost: {e}") from None
        if reply is None:
            raise WireError("the job store closed the connection")
        ok, value = reply
        if not ok:
            raise WireError(str(value))
        return value

    _call = call

    def close(self) -> None:
        self._close_quietly()

    def _close_quietly(self) -> None:
        sock = getattr(self, "_sock", None)
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
