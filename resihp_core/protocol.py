"""The wire protocol between workers, node agents and the controller.

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

Connections start with an HMAC challenge-response on a shared job secret::

    client -> Hello(version, role, identity)
    server -> Challenge(nonce)                       # 32 fresh random bytes
    client -> AuthResponse(HMAC-SHA256(secret, nonce + identity))
    server -> AuthResult(ok, reason)                 # then closes if not ok

Any failure of the handshake (wrong or missing secret, wrong version, a silent or
misbehaving peer, a timeout) raises :class:`AuthError` on the side that sees it. The
secret never crosses the wire. Authentication is one-way: the server learns that the
client knows the secret; the client trusts the address it dialled (the controller
binds to loopback unless told otherwise).

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

import hashlib
import hmac
import secrets
import struct
import time
from typing import TYPE_CHECKING, Annotated, Literal, Union

import msgspec

from resihp_core.plan import ParallelPlan, PlanError, parse_plan
from resihp_core.program import Program

if TYPE_CHECKING:  # asyncio is imported lazily: it costs ~45 ms at import time
    import asyncio
    import socket

__all__ = [
    "PROTOCOL_VERSION",
    "MAX_FRAME_BYTES",
    "HEADER_BYTES",
    "ProtocolError",
    "AuthError",
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
]

PROTOCOL_VERSION = 2  # 2: agents launch workers (launch / signal / process)
MAX_FRAME_BYTES = 16 * 1024 * 1024
HEADER_BYTES = 4
_HEADER = struct.Struct(">I")
NONCE_BYTES = 32
HANDSHAKE_TIMEOUT_S = 5.0


class ProtocolError(ValueError):
    """A frame is malformed, truncated, oversized or of an unknown kind; close the stream."""


class AuthError(ProtocolError):
    """The handshake failed: wrong or missing secret, wrong version, silent peer."""


# ------------------------------------------------------------------- field types
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
Throughput = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
FailureClass = Literal["fail-stop", "fail-slow"]
Cause = Literal["compute", "communication", "unknown"]


class _Msg(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


# ------------------------------------------------------------------- handshake
class Hello(_Msg, tag="hello"):
    """First message of every connection, from the connecting side."""

    version: NonNeg
    role: ShortText  # "agent", "worker", "cli", ... (free text so new roles stay decodable)
    identity: ShortText  # e.g. "agent:node3"; bound into the HMAC


class Challenge(_Msg, tag="challenge"):
    nonce: Nonce


class AuthResponse(_Msg, tag="auth"):
    digest: Digest


class AuthResult(_Msg, tag="auth_result"):
    ok: bool
    reason: str = ""


# ------------------------------------------------------------------- detector traffic
class Heartbeat(_Msg, tag="heartbeat"):
    """Liveness plus progress: ``step`` is the primitive index within ``iteration``."""

    rank: NonNeg
    device: NonNeg
    generation: NonNeg
    iteration: NonNeg
    step: NonNeg
    time: Seconds


class MicroBatchProfile(msgspec.Struct, frozen=True):
    """Measured compute of one (owner, mb) on one stage, with its document lengths."""

    owner: NonNeg
    mb: NonNeg
    forward_s: Seconds
    backward_s: Seconds
    doc_lengths: tuple[Annotated[int, msgspec.Meta(gt=0)], ...] = ()


class IterationProfile(_Msg, tag="profile"):
    """What one rank measured in one iteration; feeds the predictor and the filter."""

    rank: NonNeg
    device: NonNeg
    generation: NonNeg
    iteration: NonNeg
    stage: NonNeg
    replica: NonNeg
    microbatches: tuple[MicroBatchProfile, ...]
    comm_s: Seconds
    iteration_s: Seconds


class FailureReport(_Msg, tag="failure"):
    """A confirmed failure. ``cause`` says compute or communication (``kind`` is the tag).

    ``throughput`` maps device id to its normalised throughput p_i in (0, 1]; devices
    absent from it are at full speed, fail-stopped devices are in ``devices`` only.
    """

    generation: NonNeg
    failure: FailureClass
    devices: tuple[NonNeg, ...]
    cause: Cause = "unknown"
    throughput: dict[NonNeg, Throughput] = {}
    evidence: str = ""
    time: Seconds = 0.0


# ------------------------------------------------------------------- scheduler traffic
class PlanUpdate(_Msg, tag="plan"):
    """A new plan generation, as every worker reads it from the job store.

    ``plan`` is the plan text (see ``ParallelPlan.to_text``), ``devices`` every live
    worker of this generation's world (executors and standbys), ``resume`` the first
    iteration to run, ``iterations`` the count to run up to, ``restore`` the completed
    iteration whose checkpoint to load first (None: keep or move the live state),
    ``fresh`` start again from the seed's initial state (a restore with no complete
    checkpoint yet), and ``stop`` the end of the job (then ``plan`` is empty). Decoding checks that the text
    parses, that its generation matches, and that every program belongs to it.
    """

    generation: NonNeg
    plan: str = ""
    programs: tuple[Program, ...] = ()
    devices: tuple[NonNeg, ...] = ()
    resume: NonNeg = 0
    iterations: NonNeg = 0
    restore: NonNeg | None = None
    fresh: bool = False
    stop: bool = False

    def __post_init__(self) -> None:
        if self.stop:
            return
        parsed = parse_plan(self.plan)  # PlanError is a ValueError: becomes a decode error
        if parsed.generation != self.generation:
            raise PlanError(
                f"plan text is generation {parsed.generation}, message says {self.generation}"
            )
        for p in self.programs:
            if p.generation != self.generation:
                raise PlanError(
                    f"program of replica {p.replica} stage {p.stage} is generation "
                    f"{p.generation}, message says {self.generation}"
                )
        missing = sorted(set(parsed.devices()) - set(self.devices)) if self.devices else []
        if missing:
            raise PlanError(f"plan generation {self.generation} uses devices {missing} "
                            "that are not in its devices list")

    @classmethod
    def of(cls, plan: ParallelPlan, programs: tuple[Program, ...] | list[Program] = (),
           **fields: object) -> PlanUpdate:
        return cls(generation=plan.generation, plan=plan.to_text(), programs=tuple(programs),
                   **fields)  # type: ignore[arg-type]

    def parsed_plan(self) -> ParallelPlan:
        return parse_plan(self.plan)


class IterationReport(_Msg, tag="iteration_report"):
    """What one executor did in one committed-or-not iteration: its share of the loss
    (the last stage's TP rank 0 reports it, others 0), the (stage, owner, mb) work it
    computed (for exact accounting), and its timings. One per executor and iteration."""

    generation: NonNeg
    iteration: NonNeg
    device: NonNeg
    replica: NonNeg
    stage: NonNeg
    loss: float = 0.0
    computed: tuple[tuple[NonNeg, NonNeg, NonNeg], ...] = ()
    iteration_s: Seconds = 0.0
    comm_s: Seconds = 0.0
    forward_s: Seconds = 0.0
    backward_s: Seconds = 0.0
    microbatches: tuple[MicroBatchProfile, ...] = ()


# ------------------------------------------------------------------- agent traffic
class WorkerSummary(msgspec.Struct, frozen=True):
    """An agent's view of one local worker: its last heartbeat and whether it is alive."""

    device: NonNeg
    rank: NonNeg
    alive: bool
    iteration: NonNeg = 0
    step: NonNeg = 0
    last_beat_age_s: Seconds = 0.0  # seconds since its last heartbeat, at ``AgentState.time``
    reason: str = ""  # why it is not alive: "exit code -9", "missed 3 heartbeats", "hang"


class AgentState(_Msg, tag="agent_state"):
    """The node-level summary an agent sends the controller (one per node, not per device)."""

    node: NonNeg
    time: Seconds
    workers: tuple[WorkerSummary, ...] = ()


# ------------------------------------------------------------------- launcher traffic
ModuleName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$",
                                         max_length=200)]
EnvName = Annotated[str, msgspec.Meta(pattern=r"^[A-Z_][A-Z0-9_]*$", max_length=100)]
SignalName = Literal["SIGKILL", "SIGSTOP", "SIGCONT", "SIGTERM"]


class LaunchWorkers(_Msg, tag="launch"):
    """Controller -> agent: start one worker process per device of ``devices`` on this node.

    Workers run ``python -m module`` with the job description ``job`` (JSON text, saved
    by the agent and named by ``RESIHP_JOB``), the job store at ``store_host:store_port``
    (``store_host`` empty: the host the agent dialled the controller at) and ``env``.
    ``detector`` (the detector configuration section) replaces the agent's own, so
    one configuration, the controller's, governs every node.
    """

    devices: tuple[NonNeg, ...]
    module: ModuleName
    job: str
    store_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    store_host: ShortText = ""
    env: dict[EnvName, Annotated[str, msgspec.Meta(max_length=4096)]] = {}
    detector: dict[ShortText, Union[int, float, str, bool]] = {}


class SignalWorker(_Msg, tag="signal"):
    """Controller -> agent: send ``signal`` to ``device``'s worker process (fencing)."""

    device: NonNeg
    signal: SignalName


class WorkerProcess(_Msg, tag="process"):
    """Agent -> controller: a worker process it launched has started (``returncode``
    None) or ended; ``error`` says why a launch failed."""

    node: NonNeg
    device: NonNeg
    pid: NonNeg = 0
    returncode: int | None = None
    error: str = ""
    address: ShortText = ""  # the local address its collectives bind to ("" = the library's default)


class NodeRejoin(_Msg, tag="rejoin"):
    """Agent -> controller: this node is back after it lost the controller (a partition
    healed); it fenced its stale workers, so ``devices`` are free to be planned in again."""

    node: NonNeg
    devices: tuple[NonNeg, ...] = ()


class Ack(_Msg, tag="ack"):
    """Acknowledges ``what`` (e.g. "plan") of ``generation``."""

    generation: NonNeg = 0
    what: str = ""


class Error(_Msg, tag="error"):
    """A peer refuses a request; ``code`` is machine-readable, ``detail`` for people."""

    code: str
    detail: str = ""


Message = Union[
    Hello,
    Challenge,
    AuthResponse,
    AuthResult,
    Heartbeat,
    IterationProfile,
    FailureReport,
    PlanUpdate,
    IterationReport,
    AgentState,
    Ack,
    Error,
    LaunchWorkers,
    SignalWorker,
    WorkerProcess,
    NodeRejoin,
]
MESSAGE_TYPES: tuple[type, ...] = Message.__args__  # type: ignore[attr-defined]

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Message)


# ------------------------------------------------------------------- codec
def encode(msg: Message) -> bytes:
    """The msgpack payload of ``msg`` (no length prefix)."""
    if not isinstance(msg, MESSAGE_TYPES):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


def encode_frame(msg: Message, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> bytes:
    """Length prefix + payload. Refuses to build a frame the receiver would reject."""
    payload = encode(msg)
    if len(payload) > max_frame_bytes:
        raise ProtocolError(
            f"{type(msg).__name__} encodes to {len(payload)} bytes, above the "
            f"{max_frame_bytes}-byte frame limit"
        )
    return _HEADER.pack(len(payload)) + payload


def decode(payload: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one payload; every failure is a :class:`ProtocolError`."""
    try:
        return _DECODER.decode(payload)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"bad message: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # belt and braces
        raise ProtocolError(f"bad message: {exc}") from None


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

    ``timeout`` bounds the whole message. Expiring before any byte arrived raises
    ``TimeoutError`` (the stream is intact, call again); expiring inside a frame raises
    :class:`ProtocolError` (the stream is broken, close it).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    old = sock.gettimeout()
    try:
        header = _recv_exactly(sock, HEADER_BYTES, deadline, mid_frame=False)
        if header is None:
            return None
        n = _frame_length(header, max_frame_bytes)
        body = _recv_exactly(sock, n, deadline, mid_frame=True)
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
    try:
        body = await asyncio.wait_for(reader.readexactly(n), left())
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError(
            f"connection closed inside a frame ({len(exc.partial)} of {n} bytes received)"
        ) from None
    except asyncio.TimeoutError:
        raise ProtocolError(f"timed out inside a frame of {n} bytes") from None
    return decode(body)


# ------------------------------------------------------------------- handshake
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
        reply = state.on_hello(recv_msg(sock, left()))
        send_msg(sock, reply)
        if isinstance(reply, AuthResult):
            raise AuthError(reply.reason)
        result = state.on_response(recv_msg(sock, left()))
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
        send_msg(sock, _client_reply(secret, identity, recv_msg(sock, left())))
        _client_result(recv_msg(sock, left()))
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
        reply = state.on_hello(await read_msg(reader, left()))
        await write_msg(writer, reply)
        if isinstance(reply, AuthResult):
            raise AuthError(reply.reason)
        result = state.on_response(await read_msg(reader, left()))
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
        await write_msg(writer, _client_reply(secret, identity, await read_msg(reader, left())))
        _client_result(await read_msg(reader, left()))
    except AuthError:
        raise
    except (ProtocolError, OSError, asyncio.TimeoutError) as exc:
        raise _handshake_failed(exc) from None
