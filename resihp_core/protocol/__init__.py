"""The wire protocol between workers, node agents and the controller (public face).

Three modules: :mod:`~resihp_core.protocol.messages` (typed messages and codec),
:mod:`~resihp_core.protocol.framing` (length-prefixed frames over sockets and streams),
:mod:`~resihp_core.protocol.auth` (the handshake). This package re-exports their names.


Every message is a frozen msgspec Struct tagged by its ``kind`` field and belongs to
the one :data:`Message` union. A message travels as one *frame*: a 4-byte big-endian
payload length followed by the msgpack payload. One module-level encoder and decoder
are built at import time and shared. Decoding validates types and ranges (device ids
>= 0, throughput in (0, 1], a parseable plan text, ...), so code behind the decoder
never sees a malformed message.

Anything wrong with a frame — garbage, a truncated body, a length above the reader's
limit, an unknown ``kind``, a field of the wrong type or out of range — raises
:class:`ProtocolError`, the only error this module raises for bad input. After a
``ProtocolError`` the byte stream can no longer be trusted to be at a frame boundary:
the caller closes the connection. :class:`FrameReader` enforces this by refusing
further input (it is *poisoned*) until :meth:`FrameReader.reset`. Socket errors
(``OSError``) are not protocol errors and propagate unchanged.

Connections start with a mutual HMAC challenge-response on a shared key (the job
secret, or a node's credential derived from it; see :mod:`resihp_core.protocol.auth`)::

    client -> Hello(version, role, identity, client_nonce)
    server -> Challenge(server_nonce, proof)          # proof: HMAC(key, tag + nonces + identity)
    client -> AuthResponse(HMAC-SHA256(key, server_nonce + identity))
    server -> AuthResult(ok, reason)                 # then closes if not ok

Any failure of the handshake (wrong or missing secret, wrong version, a silent or
misbehaving peer, a timeout) raises :class:`AuthError` on the side that sees it. The
secret never crosses the wire. Authentication is mutual: the client checks the
server's proof before it sends its own digest or obeys anything.

Schema evolution rules:

* Add a field only at the end of a Struct and only with a default, so older senders
  stay decodable. Receivers ignore fields they do not know, so newer senders stay
  decodable by older receivers.
* Never rename or reuse a ``kind`` tag or a field name; retire it instead.
* Unknown tags are rejected (``ProtocolError``): a peer must not silently drop a message
  it does not understand.
* :data:`PROTOCOL_VERSION` is sent in ``Hello`` and must match exactly; bump it only for
  a change that breaks the rules above.
"""

from __future__ import annotations

from resihp_core.protocol.auth import *  # noqa: F401,F403
from resihp_core.protocol.auth import HANDSHAKE_TIMEOUT_S, NONCE_BYTES  # noqa: F401
from resihp_core.protocol.errors import AuthError, HandshakeBroken, ProtocolError  # noqa: F401
from resihp_core.protocol.framing import *  # noqa: F401,F403
from resihp_core.protocol.messages import *  # noqa: F401,F403
from resihp_core.protocol.messages import Cause, FailureClass  # noqa: F401

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "ProtocolError",
    "AuthError",
    "HandshakeBroken",
    "Hello",
    "Challenge",
    "AuthResponse",
    "AuthResult",
    "Heartbeat",
    "MicroBatchProfile",
    "IterationProfile",
    "FailureReport",
    "PlanUpdate",
    "IterationReport",
    "WorkerSummary",
    "AgentState",
    "Ack",
    "Error",
    "LaunchWorkers",
    "SignalWorker",
    "WorkerProcess",
    "NodeRejoin",
    "LinkProbe",
    "WorkerLeft",
    "JobError",
    "ScriptEnded",
    "CommitRequest",
    "CommitVerdict",
    "ProfileBatch",
    "Message",
    "MESSAGE_TYPES",
    "encode",
    "encode_frame",
    "decode",
    "decode_frame",
    "FrameReader",
    "send_msg",
    "recv_msg",
    "write_msg",
    "read_msg",
    "auth_digest",
    "server_handshake",
    "client_handshake",
    "server_handshake_sync",
    "client_handshake_sync",
    "node_credential",
    "server_proof",
    "KeySource",
    "HANDSHAKE_MAX_FRAME_BYTES",
]
