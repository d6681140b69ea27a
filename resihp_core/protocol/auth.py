"""The connection handshake: HMAC challenge-response on the job secret."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import TYPE_CHECKING

from resihp_core.protocol.errors import AuthError, ProtocolError
from resihp_core.protocol.framing import read_msg, recv_msg, send_msg, write_msg
from resihp_core.protocol.messages import (
    PROTOCOL_VERSION, AuthResponse, AuthResult, Challenge, Hello, Message,
)

if TYPE_CHECKING:
    import asyncio
    import socket

__all__ = ["NONCE_BYTES", "HANDSHAKE_TIMEOUT_S", "HANDSHAKE_MAX_FRAME_BYTES", "auth_digest", "server_handshake",
           "client_handshake", "server_handshake_sync", "client_handshake_sync"]

NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0
# Every handshake message is a few hundred bytes (identity <= 256 characters, nonce <= 64
# bytes): a peer that has not authenticated yet cannot make either side buffer more.
HANDSHAKE_MAX_FRAME_BYTES = 1024


def _key(secret: str | bytes) -> bytes:
    key = secret.encode() if isinstance(secret, str) else bytes(secret)
    if not key:
        raise AuthError("no job secret configured (it must not be empty)")
    return key


def auth_digest(secret: str | bytes, nonce: bytes, identity: str) -> bytes:
    """HMAC-SHA256 over the server's nonce and the client's claimed identity."""
    return hmac.new(_key(secret), nonce + identity.encode(), hashlib.sha256).digest()


def _handshake_failed(exc: BaseException) -> AuthError:
    return AuthError(f"handshake failed: {str(exc) or type(exc).__name__}")


def _expect(msg: Message | None, typ: type, step: str) -> None:
    if msg is None:
        raise AuthError(f"peer closed the connection while waiting for {step}")
    if not isinstance(msg, typ):
        raise AuthError(f"expected {step}, got {type(msg).__name__}")


class _Server:
    """The server's side of the handshake as a tiny state machine shared by sync/async."""

    def __init__(self, secret: str | bytes) -> None:
        self.key = _key(secret)
        self.hello: Hello | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    def on_hello(self, msg: Message | None) -> Message:
        _expect(msg, Hello, "Hello")
        assert isinstance(msg, Hello)
        self.hello = msg
        if msg.version != PROTOCOL_VERSION:
            return AuthResult(False, f"protocol version {msg.version} unsupported, need {PROTOCOL_VERSION}")
        return Challenge(self.nonce)

    def on_response(self, msg: Message | None) -> AuthResult:
        _expect(msg, AuthResponse, "AuthResponse")
        assert isinstance(msg, AuthResponse) and self.hello is not None
        want = auth_digest(self.key, self.nonce, self.hello.identity)
        if hmac.compare_digest(msg.digest, want):
            return AuthResult(True)
        return AuthResult(False, "authentication failed")


def _client_reply(secret: str | bytes, identity: str, msg: Message | None) -> AuthResponse:
    if isinstance(msg, AuthResult) and not msg.ok:
        raise AuthError(f"server refused: {msg.reason}")
    _expect(msg, Challenge, "Challenge")
    assert isinstance(msg, Challenge)
    return AuthResponse(auth_digest(secret, msg.nonce, identity))


def _client_result(msg: Message | None) -> None:
    _expect(msg, AuthResult, "AuthResult")
    assert isinstance(msg, AuthResult)
    if not msg.ok:
        raise AuthError(f"server refused: {msg.reason}")


def server_handshake_sync(
    sock: socket.socket, secret: str | bytes, *, timeout: float = HANDSHAKE_TIMEOUT_S
) -> Hello:
    """Authenticate the client on ``sock``; returns its Hello. Raises :class:`AuthError`."""
    state = _Server(secret)
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        reply = state.on_hello(recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
        send_msg(sock, reply)
        if isinstance(reply, AuthResult):
            raise AuthError(reply.reason)
        result = state.on_response(recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
        send_msg(sock, result)
    except AuthError:
        raise
    except (ProtocolError, OSError) as exc:
        raise _handshake_failed(exc) from None
    if not result.ok:
        raise AuthError(f"client {state.hello.identity!r}: {result.reason}")  # type: ignore[union-attr]
    return state.hello  # type: ignore[return-value]


def client_handshake_sync(
    sock: socket.socket,
    secret: str | bytes,
    identity: str,
    *,
    role: str = "agent",
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> None:
    """Prove knowledge of ``secret`` to the server on ``sock``. Raises :class:`AuthError`."""
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        send_msg(sock, Hello(PROTOCOL_VERSION, role, identity))
        send_msg(sock, _client_reply(secret, identity, recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES)))
        _client_result(recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
    except AuthError:
        raise
    except (ProtocolError, OSError) as exc:
        raise _handshake_failed(exc) from None


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: str | bytes,
    *,
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> Hello:
    """Asyncio twin of :func:`server_handshake_sync`."""
    import asyncio
    state = _Server(secret)
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        reply = state.on_hello(await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
        await write_msg(writer, reply)
        if isinstance(reply, AuthResult):
            raise AuthError(reply.reason)
        result = state.on_response(await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
        await write_msg(writer, result)
    except AuthError:
        raise
    except (ProtocolError, OSError, asyncio.TimeoutError) as exc:
        raise _handshake_failed(exc) from None
    if not result.ok:
        raise AuthError(f"client {state.hello.identity!r}: {result.reason}")  # type: ignore[union-attr]
    return state.hello  # type: ignore[return-value]


async def client_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: str | bytes,
    identity: str,
    *,
    role: str = "agent",
    timeout: float = HANDSHAKE_TIMEOUT_S,
) -> None:
    """Asyncio twin of :func:`client_handshake_sync`."""
    import asyncio
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        await write_msg(writer, Hello(PROTOCOL_VERSION, role, identity))
        await write_msg(writer, _client_reply(secret, identity, await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES)))
        _client_result(await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
    except AuthError:
        raise
    except (ProtocolError, OSError, asyncio.TimeoutError) as exc:
        raise _handshake_failed(exc) from None
