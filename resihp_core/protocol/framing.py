"""Frames: a 4-byte big-endian payload length followed by one msgpack message.

Readers enforce a maximum frame size before buffering a body (an oversized header
is rejected as soon as its 4 bytes arrive). Helpers for blocking sockets, asyncio
streams and a sans-IO :class:`FrameReader`. Error rules are in :mod:`resihp_core.protocol`.
"""

from __future__ import annotations

import struct
import time
from typing import TYPE_CHECKING

from resihp_core.protocol.errors import ProtocolError
from resihp_core.protocol.messages import Message, decode, encode

if TYPE_CHECKING:  # asyncio is imported lazily: it costs ~45 ms at import time
    import asyncio
    import socket

__all__ = ["MAX_FRAME_BYTES", "HEADER_BYTES", "encode_frame", "decode_frame", "FrameReader",
           "send_msg", "recv_msg", "write_msg", "read_msg"]

MAX_FRAME_BYTES = 16 * 1024 * 1024
HEADER_BYTES = 4
_HEADER = struct.Struct(">I")


def encode_frame(msg: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Length prefix + payload. Refuses to build a frame the receiver would reject."""
    payload = encode(msg)
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            f"{type(msg).__name__} encodes to {len(payload)} bytes, above the "
            f"{max_frame_bytes}-byte frame limit"
        )
    return _HEADER.pack(len(payload)) + payload



def _frame_length(header: bytes | bytearray, max_frame_bytes: int) -> int:
    (n,) = _HEADER.unpack(bytes(header))
    if n > max_frame_bytes:
        raise ProtocolError(f"frame of {n} bytes exceeds the {max_frame_bytes}-byte limit")
    return n


def decode_frame(frame: bytes | bytearray | memoryview, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Decode exactly one complete frame (header + payload, nothing after it)."""
    frame = bytes(frame)
    if len(frame) < HEADER_BYTES:
        raise ProtocolError(f"truncated frame: {len(frame)} bytes, no complete header")
    n = _frame_length(frame[:HEADER_BYTES], max_frame_bytes)
    body = frame[HEADER_BYTES:]
    if len(body) != n:
        raise ProtocolError(f"frame header says {n} bytes, got {len(body)}")
    return decode(body)


class FrameReader:
    """Sans-IO incremental decoder: feed it bytes as they arrive, get whole messages back.

    An oversized length header is rejected as soon as its 4 bytes arrive, before any
    of the body is buffered. On any :class:`ProtocolError` the reader is poisoned:
    buffered bytes are dropped (together with messages decoded earlier in the same
    ``feed`` call) and every later ``feed`` raises until :meth:`reset`. The caller is
    expected to close the connection instead of resetting.
    """

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            raise ValueError(f"max_frame_bytes must be >= 1, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._buf = bytearray()
        self._need: int | None = None  # body length once the header is read
        self._error: ProtocolError | None = None

    @property
    def poisoned(self) -> bool:
        return self._error is not None

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet form a complete frame."""
        return len(self._buf) + (HEADER_BYTES if self._need is not None else 0)

    def reset(self) -> None:
        """Forget buffered bytes and any earlier error (e.g. to reuse for a new connection)."""
        self._buf.clear()
        self._need = None
        self._error = None

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Buffer ``data`` and return every message it completes, in order."""
        if self._error is not None:
            raise ProtocolError(f"reader is poisoned by an earlier error: {self._error}")
        self._buf += data
        out: list[Message] = []
        try:
            while True:
                if self._need is None:
                    if len(self._buf) < HEADER_BYTES:
                        break
                    self._need = _frame_length(self._buf[:HEADER_BYTES], self.max_frame_bytes)
                    del self._buf[:HEADER_BYTES]
                if len(self._buf) < self._need:
                    break
                body = bytes(self._buf[: self._need])
                del self._buf[: self._need]
                self._need = None
                out.append(decode(body))
        except ProtocolError as exc:
            self._buf.clear()
            self._need = None
            self._error = exc
            raise
        return out

    def close(self) -> None:
        """At end of stream: raise :class:`ProtocolError` if a frame was cut short."""
        if self._error is None and self.buffered:
            n = self.buffered
            self._buf.clear()
            self._need = None
            self._error = ProtocolError(f"stream ended inside a frame ({n} bytes left over)")
            raise self._error


# ------------------------------------------------------------------- blocking sockets
#: A frame's body may arrive this long after the message's deadline once its header has
#: come: the sender writes a frame in one piece, so the body is already on its way (or
#: buffered). Without it, a reader whose process was starved past the deadline read the
#: header and then failed on a body it had already received ("timed out inside a
#: frame"), and a loaded machine lost a healthy node that way.
BODY_GRACE_S = 1.0


def _body_deadline(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline, time.monotonic() + BODY_GRACE_S)


def send_msg(sock: socket.socket, msg: Message) -> None:
    sock.sendall(encode_frame(msg))


def _recv_exactly(
    sock: socket.socket, n: int, deadline: float | None, *, mid_frame: bool
) -> bytes | None:
    """``n`` bytes, or None on a clean EOF before the first byte of a frame."""
    buf = bytearray()
    while len(buf) < n:
        try:
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("timed out")
                sock.settimeout(remaining)
            chunk = sock.recv(min(n - len(buf), 1 << 20))
        except TimeoutError:
            if mid_frame or buf:
                raise ProtocolError(
                    f"timed out inside a frame ({len(buf)} of {n} bytes received)"
                ) from None
            raise
        if not chunk:
            if mid_frame or buf:
                raise ProtocolError(
                    f"connection closed inside a frame ({len(buf)} of {n} bytes received)"
                )
            return None
        buf += chunk
    return bytes(buf)


def recv_msg(
    sock: socket.socket, timeout: float | None = None, *, max_frame_bytes: int = MAX_FRAME_BYTES
) -> Message | None:
    """Read one message. Returns None if the peer closed cleanly between frames.

    ``timeout`` bounds the whole message (its body gets :data:`BODY_GRACE_S` more
    once the header is in). Expiring before any byte arrived raises ``TimeoutError``
    (the stream is intact, call again); expiring inside a frame raises
    :class:`ProtocolError` (the stream is broken, close it).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    old = sock.gettimeout()
    try:
        header = _recv_exactly(sock, HEADER_BYTES, deadline, mid_frame=False)
        if header is None:
            return None
        n = _frame_length(header, max_frame_bytes)
        body = _recv_exactly(sock, n, _body_deadline(deadline), mid_frame=True)
        assert body is not None
        return decode(body)
    finally:
        if deadline is not None:
            sock.settimeout(old)


# ------------------------------------------------------------------- asyncio streams
async def write_msg(writer: asyncio.StreamWriter, msg: Message) -> None:
    writer.write(encode_frame(msg))
    await writer.drain()


async def read_msg(
    reader: asyncio.StreamReader,
    timeout: float | None = None,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
) -> Message | None:
    """Asyncio twin of :func:`recv_msg`, with the same EOF and timeout rules."""
    import asyncio
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    try:
        # readexactly consumes nothing when cancelled while waiting, so a timeout here
        # leaves the stream at a frame boundary.
        header = await asyncio.wait_for(reader.readexactly(HEADER_BYTES), left())
    except asyncio.TimeoutError:  # distinct from TimeoutError before Python 3.11
        raise TimeoutError("timed out waiting for a frame") from None
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError(f"connection closed inside a frame header ({len(exc.partial)} bytes)") from None
    n = _frame_length(header, max_frame_bytes)
    body_deadline = _body_deadline(deadline)
    try:
        body = await asyncio.wait_for(
            reader.readexactly(n), None if body_deadline is None else body_deadline - time.monotonic())
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"connection closed inside a frame ({len(exc.partial)} of {n} bytes received)"
        ) from None
    except asyncio.TimeoutError:
        raise ProtocolError(f"timed out inside a frame of {n} bytes") from None
    return decode(body)
