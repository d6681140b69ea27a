"""The connection handshake: mutual HMAC challenge-response on a shared key.

::

    client -> Hello(version, role, identity, client_nonce)
    server -> Challenge(server_nonce, proof)     # proof = HMAC(key, "server" + both nonces + identity)
    client -> AuthResponse(HMAC(key, server_nonce + identity))   # only if the proof is right
    server -> AuthResult(ok, reason)

Both sides prove knowledge of the key without sending it; a client never obeys a server
that cannot prove it (an agent does not launch anything a stranger tells it to). The
server may pick the key from the client's claimed identity (:data:`KeySource` as a
callable): the controller derives each node's key with :func:`node_credential`, so a
node's credential cannot authenticate as another node. Handshake frames are limited
to :data:`HANDSHAKE_MAX_FRAME_BYTES`.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from typing import TYPE_CHECKING, Callable, Union

from resihp_core.protocol.errors import AuthError, HandshakeBroken, ProtocolError
from resihp_core.protocol.framing import read_msg, recv_msg, send_msg, write_msg
from resihp_core.protocol.messages import (
    PROTOCOL_VERSION, AuthResponse, AuthResult, Challenge, Hello, Message,
)

if TYPE_CHECKING:
    import asyncio
    import socket

__all__ = ["NONCE_BYTES", "HANDSHAKE_TIMEOUT_S", "HANDSHAKE_MAX_FRAME_BYTES", "auth_digest", "server_handshake",
           "client_handshake", "server_handshake_sync", "client_handshake_sync",
           "node_credential", "server_proof", "KeySource"]

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


KeySource = Union[str, bytes, Callable[[Hello], Union[str, bytes]]]
"""A server's key: fixed, or chosen from the client's Hello (raise AuthError to refuse it)."""


def node_credential(secret: str | bytes, node: int) -> str:
    """Node ``node``'s own key, HMAC-SHA256(job secret, "resihp/node/<node>") in hex.

    Node ``node``'s agent and its workers authenticate with it; it proves nothing about
    any other node, and the job secret cannot be recovered from it.
    """
    if isinstance(node, bool) or not isinstance(node, int) or node < 0:
        raise ValueError(f"node must be an int >= 0, got {node!r}")
    return hmac.new(_key(secret), f"resihp/node/{node}".encode(), hashlib.sha256).hexdigest()


def auth_digest(secret: str | bytes, nonce: bytes, identity: str) -> bytes:
    """The client's proof: HMAC-SHA256 over the server's nonce and the claimed identity."""
    return hmac.new(_key(secret), nonce + identity.encode(), hashlib.sha256).digest()


def server_proof(secret: str | bytes, client_nonce: bytes, server_nonce: bytes, identity: str) -> bytes:
    """The server's proof: HMAC-SHA256 over a domain tag, both nonces and the identity
    (the tag keeps it from ever equalling a client digest)."""
    return hmac.new(_key(secret), b"resihp-server\0" + client_nonce + server_nonce + identity.encode(),
                    hashlib.sha256).digest()


def _handshake_failed(exc: BaseException) -> AuthError:
    return HandshakeBroken(f"handshake failed: {str(exc) or type(exc).__name__}")


def _expect(msg: Message | None, typ: type, step: str) -> None:
    if msg is None:
        raise HandshakeBroken(f"peer closed the connection while waiting for {step}")
    if not isinstance(msg, typ):
        raise AuthError(f"expected {step}, got {type(msg).__name__}")


class _Server:
    """The server's side of the handshake as a tiny state machine shared by sync/async."""

    def __init__(self, secret: KeySource) -> None:
        self.source = secret if callable(secret) else _key(secret)
        self.key = b""
        self.hello: Hello | None = None
        self.nonce = secrets.token_bytes(NONCE_BYTES)

    def on_hello(self, msg: Message | None) -> Message:
        _expect(msg, Hello, "Hello")
        assert isinstance(msg, Hello)
        self.hello = msg
        if msg.version != PROTOCOL_VERSION:
            return AuthResult(False, f"protocol version {msg.version} unsupported, need {PROTOCOL_VERSION}")
        if len(msg.nonce) < 16:
            return AuthResult(False, "no client nonce: mutual authentication is required")
        if callable(self.source):
            try:
                self.key = _key(self.source(msg))
            except AuthError as e:
                return AuthResult(False, str(e))
        else:
            self.key = self.source
        return Challenge(self.nonce, server_proof(self.key, msg.nonce, self.nonce, msg.identity))

    def on_response(self, msg: Message | None) -> AuthResult:
        _expect(msg, AuthResponse, "AuthResponse")
        assert isinstance(msg, AuthResponse) and self.hello is not None
        want = auth_digest(self.key, self.nonce, self.hello.identity)
        if hmac.compare_digest(msg.digest, want):
            return AuthResult(True)
        return AuthResult(False, "authentication failed")


class _Client:
    def __init__(self, secret: str | bytes, identity: str, role: str) -> None:
        self.key = _key(secret)
        self.identity = identity
        self.hello = Hello(PROTOCOL_VERSION, role, identity, secrets.token_bytes(NONCE_BYTES))

    def reply(self, msg: Message | None) -> AuthResponse:
        if isinstance(msg, AuthResult) and not msg.ok:
            raise AuthError(f"server refused: {msg.reason}")
        _expect(msg, Challenge, "Challenge")
        assert isinstance(msg, Challenge)
        want = server_proof(self.key, self.hello.nonce, msg.nonce, self.identity)
        if not hmac.compare_digest(msg.proof, want):
            raise AuthError("the server could not prove it knows the secret (mutual authentication failed)")
        return AuthResponse(auth_digest(self.key, msg.nonce, self.identity))


def _client_result(msg: Message | None) -> None:
    _expect(msg, AuthResult, "AuthResult")
    assert isinstance(msg, AuthResult)
    if not msg.ok:
        raise AuthError(f"server refused: {msg.reason}")


def server_handshake_sync(
    sock: socket.socket, secret: KeySource, *, timeout: float = HANDSHAKE_TIMEOUT_S
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
    """Prove knowledge of ``secret`` to the server on ``sock`` and check that the server
    knows it too. Raises :class:`AuthError`."""
    client = _Client(secret, identity, role)
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        send_msg(sock, client.hello)
        send_msg(sock, client.reply(recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES)))
        _client_result(recv_msg(sock, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
    except AuthError:
        raise
    except (ProtocolError, OSError) as exc:
        raise _handshake_failed(exc) from None


async def server_handshake(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: KeySource,
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
    client = _Client(secret, identity, role)
    deadline = time.monotonic() + timeout
    left = lambda: max(0.0, deadline - time.monotonic())  # noqa: E731
    try:
        await write_msg(writer, client.hello)
        await write_msg(writer, client.reply(await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES)))
        _client_result(await read_msg(reader, left(), max_frame_bytes=HANDSHAKE_MAX_FRAME_BYTES))
    except AuthError:
        raise
    except (ProtocolError, OSError, asyncio.TimeoutError) as exc:
        raise _handshake_failed(exc) from None
