"""Wire protocol: round trips, hostile input, framing and the HMAC handshake on loopback."""

from __future__ import annotations

import asyncio
import socket
import struct
import threading
from typing import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resihp_core import protocol as P
from resihp_core.plan import ParallelPlan
from resihp_core.program import (
    Backward,
    BackwardWeight,
    Forward,
    LoadMicroBatch,
    OptimizerStep,
    Program,
    RecvActivation,
    RecvGrad,
    RecvLayerState,
    ReduceGrads,
    SendActivation,
    SendGrad,
    SendLayerState,
)

SECRET = "job-secret-123"

# ------------------------------------------------------------------ strategies
ids = st.integers(0, 2**31 - 1)
small = st.integers(0, 64)
secs = st.floats(0, 1e9, allow_nan=False, allow_infinity=False)
text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=40)
throughput = st.floats(0, 1, exclude_min=True, allow_nan=False)


def _op(cls: type, n: int) -> st.SearchStrategy:
    return st.builds(cls, *([small] * n))


primitives = st.one_of(
    _op(LoadMicroBatch, 2),
    _op(Forward, 3),
    st.builds(Backward, small, small, small, st.booleans()),
    _op(BackwardWeight, 3),
    _op(SendActivation, 4),
    _op(RecvActivation, 4),
    _op(SendGrad, 4),
    _op(RecvGrad, 4),
    _op(ReduceGrads, 1),
    _op(OptimizerStep, 1),
    _op(SendLayerState, 3),
    _op(RecvLayerState, 3),
)


@st.composite
def plan_updates(draw: st.DrawFn) -> P.PlanUpdate:
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.integers(1, 4))
    dp = draw(st.integers(1, 3))
    gen = draw(st.integers(0, 1000))
    plan = ParallelPlan.uniform(
        tp=tp,
        pp=pp,
        dp=dp,
        num_layers=pp * draw(st.integers(1, 3)),
        num_microbatches=draw(st.integers(1, 8)),
        schedule=draw(st.sampled_from(["gpipe", "1f1b", "zbh1"])),
    ).with_(generation=gen)
    programs = draw(
        st.lists(
            st.builds(Program, small, small, st.just(gen), st.lists(primitives, max_size=12).map(tuple)),
            max_size=4,
        )
    )
    return P.PlanUpdate.of(plan, programs)


mb_profiles = st.builds(
    P.MicroBatchProfile,
    small,
    small,
    secs,
    secs,
    st.lists(st.integers(1, 4096), max_size=8).map(tuple),
)
workers = st.builds(P.WorkerSummary, ids, ids, st.booleans(), ids, ids, secs, text)

messages = st.one_of(
    st.builds(P.Hello, small, text, text),
    st.builds(P.Challenge, st.binary(min_size=16, max_size=64)),
    st.builds(P.AuthResponse, st.binary(min_size=32, max_size=32)),
    st.builds(P.AuthResult, st.booleans(), text),
    st.builds(P.Heartbeat, ids, ids, ids, ids, ids, secs),
    st.builds(
        P.IterationProfile,
        ids, ids, ids, ids, small, small,
        st.lists(mb_profiles, max_size=6).map(tuple),
        secs, secs,
    ),
    st.builds(
        P.FailureReport,
        ids,
        st.sampled_from(["fail-stop", "fail-slow"]),
        st.lists(ids, max_size=8).map(tuple),
        st.sampled_from(["compute", "communication", "unknown"]),
        st.dictionaries(ids, throughput, max_size=8),
        text,
        secs,
    ),
    plan_updates(),
    st.builds(P.IterationReport, ids, ids, ids, ids, ids, st.floats(allow_nan=False, allow_infinity=False),
              st.lists(st.tuples(ids, ids, ids), max_size=6).map(tuple), secs, secs, secs, secs,
              st.lists(mb_profiles, max_size=4).map(tuple)),
    st.builds(P.AgentState, ids, secs, st.lists(workers, max_size=8).map(tuple)),
    st.builds(P.Ack, ids, text),
    st.builds(P.Error, text, text),
    st.builds(P.WorkerProcess, ids, ids, ids, st.none() | small, text, st.sampled_from(["", "10.0.0.2", "::1"])),
    st.builds(P.NodeRejoin, ids, st.lists(ids, max_size=8).map(tuple)),
    st.builds(P.LinkProbe, ids, ids, st.binary(max_size=64)),
    st.builds(P.WorkerLeft, ids, ids, text, text, st.booleans()),
    st.builds(P.JobError, ids, text, text, text, text, st.sampled_from(["setup", "training"]), ids, small),
    st.builds(P.ScriptEnded, ids, ids),
    st.builds(P.CommitRequest,
              st.builds(P.IterationReport, ids, ids, ids, ids, ids, st.floats(allow_nan=False, allow_infinity=False)),
              st.integers(1, 1 << 20), st.booleans(), st.floats(0, 86400), st.floats(0.001, 86400)),
    st.builds(P.CommitVerdict, ids, ids, st.sampled_from(["commit", "abort", "decide"])),
    st.builds(P.ProfileBatch, st.lists(st.builds(P.IterationProfile, ids, ids, ids, ids, small, small,
                                                 st.lists(mb_profiles, max_size=2).map(tuple), secs, secs),
                                       min_size=1, max_size=4).map(tuple)),
)


def frame_of(obj: object) -> bytes:
    """A frame around an arbitrary msgpack-encoded object (to forge bad messages)."""
    payload = msgspec.msgpack.encode(obj)
    return struct.pack(">I", len(payload)) + payload


# ------------------------------------------------------------------ round trips
def test_every_message_type_is_covered_by_the_strategy() -> None:
    assert len(P.MESSAGE_TYPES) == 23


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(messages)
def test_round_trip(msg: P.Message) -> None:
    assert P.decode(P.encode(msg)) == msg
    assert P.decode_frame(P.encode_frame(msg)) == msg


def test_plan_update_carries_a_usable_plan() -> None:
    plan = ParallelPlan.uniform(tp=2, pp=2, dp=2, num_layers=4, num_microbatches=4).with_(generation=7)
    prog = Program(0, 0, 7, (Forward(0, 0, 0), Backward(0, 0, 0, split=True), BackwardWeight(0, 0, 0)))
    got = P.decode_frame(P.encode_frame(P.PlanUpdate.of(plan, [prog])))
    assert isinstance(got, P.PlanUpdate)
    assert got.parsed_plan() == plan
    assert got.programs == (prog,)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError):
        P.encode(Forward(0, 0, 0))  # a primitive is not a top-level message


# ------------------------------------------------------------------ validation at decode
@pytest.mark.parametrize(
    "obj",
    [
        {"kind": "nope"},
        {"no_kind": 1},
        [1, 2, 3],
        {"kind": "heartbeat", "rank": -1, "device": 0, "generation": 0, "iteration": 0, "step": 0, "time": 0.0},
        {"kind": "heartbeat", "rank": 0, "device": 0, "generation": 0, "iteration": 0, "step": 0},
        {"kind": "heartbeat", "rank": "0", "device": 0, "generation": 0, "iteration": 0, "step": 0, "time": 0.0},
        {"kind": "failure", "generation": 0, "failure": "fail-slow", "devices": [1], "throughput": {1: 0.0}},
        {"kind": "failure", "generation": 0, "failure": "fail-slow", "devices": [1], "throughput": {1: 1.5}},
        {"kind": "failure", "generation": 0, "failure": "fail-slow", "devices": [1], "throughput": {1: float("nan")}},
        {"kind": "failure", "generation": 0, "failure": "fail-maybe", "devices": [1]},
        {"kind": "failure", "generation": 0, "failure": "fail-stop", "devices": [1], "cause": "cosmic"},
        {"kind": "challenge", "nonce": b"short"},
        {"kind": "auth", "digest": b"x" * 31},
        {"kind": "plan", "generation": 0, "plan": "not a plan"},
        {"kind": "plan", "generation": 1, "plan": ParallelPlan.uniform(tp=1, pp=1, dp=1, num_layers=1, num_microbatches=1).to_text()},
    ],
)
def test_invalid_messages_are_protocol_errors(obj: object) -> None:
    with pytest.raises(P.ProtocolError):
        P.decode_frame(frame_of(obj))


def test_schema_evolution_unknown_fields_ignored_and_defaults_filled() -> None:
    newer = P.decode_frame(frame_of({"kind": "ack", "generation": 3, "what": "plan", "added_later": [1]}))
    assert newer == P.Ack(3, "plan")
    older = P.decode_frame(frame_of({"kind": "failure", "generation": 2, "failure": "fail-stop", "devices": [5]}))
    assert older == P.FailureReport(2, "fail-stop", (5,))


def test_failure_report_keeps_throughput_per_device() -> None:
    rep = P.FailureReport(4, "fail-slow", (3,), "communication", {3: 0.45}, "p2p 2.2x slower", 12.5)
    got = P.decode_frame(P.encode_frame(rep))
    assert isinstance(got, P.FailureReport) and got.throughput == {3: 0.45} and got.cause == "communication"


# ------------------------------------------------------------------ hostile bytes
@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_garbage_payload_never_raises_anything_but_protocol_error(data: bytes) -> None:
    try:
        msg = P.decode(data)
    except P.ProtocolError:
        return
    assert isinstance(msg, P.MESSAGE_TYPES)  # astronomically unlikely, but then it is valid


@settings(max_examples=300)
@given(st.binary(max_size=300), st.integers(1, 64))
def test_garbage_stream_never_raises_anything_but_protocol_error(data: bytes, max_frame: int) -> None:
    reader = P.FrameReader(max_frame_bytes=max_frame)
    try:
        for msg in reader.feed(data):
            assert isinstance(msg, P.MESSAGE_TYPES)
        reader.close()
    except P.ProtocolError:
        assert reader.poisoned
        with pytest.raises(P.ProtocolError):
            reader.feed(P.encode_frame(P.Ack()))


@settings(max_examples=200)
@given(messages, st.data())
def test_truncated_frames_are_rejected(msg: P.Message, data: st.DataObject) -> None:
    frame = P.encode_frame(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(P.ProtocolError):
        P.decode_frame(frame[:cut])
    with pytest.raises(P.ProtocolError):
        P.decode(frame[P.HEADER_BYTES : max(P.HEADER_BYTES, cut)])
    reader = P.FrameReader()
    assert reader.feed(frame[:cut]) == []
    if cut:
        with pytest.raises(P.ProtocolError, match="inside a frame"):
            reader.close()
    else:
        reader.close()  # nothing was received: a clean end of stream


@settings(max_examples=100)
@given(messages, st.data())
def test_corrupted_frames_are_valid_or_protocol_errors(msg: P.Message, data: st.DataObject) -> None:
    frame = bytearray(P.encode_frame(msg))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(P.HEADER_BYTES, len(frame) - 1))
        frame[i] = data.draw(st.integers(0, 255))
    try:
        got = P.decode_frame(frame)
    except P.ProtocolError:
        return
    assert isinstance(got, P.MESSAGE_TYPES)


def test_oversized_header_rejected_before_the_body_arrives() -> None:
    reader = P.FrameReader(max_frame_bytes=100)
    with pytest.raises(P.ProtocolError, match="exceeds"):
        reader.feed(struct.pack(">I", 101))  # only the 4 header bytes
    assert reader.poisoned and reader.buffered == 0
    with pytest.raises(P.ProtocolError, match="poisoned"):
        reader.feed(P.encode_frame(P.Ack()))
    reader.reset()
    assert reader.feed(P.encode_frame(P.Ack(1))) == [P.Ack(1)]


def test_oversized_frames_rejected_everywhere() -> None:
    big = P.Error("x", "y" * 1000)
    with pytest.raises(P.ProtocolError):
        P.encode_frame(big, max_frame_bytes=100)
    with pytest.raises(P.ProtocolError):
        P.decode_frame(P.encode_frame(big), max_frame_bytes=100)
    with pytest.raises(P.ProtocolError):
        P.FrameReader().feed(b"\xff\xff\xff\xff")  # 4 GiB claimed, default 16 MiB limit


def test_error_after_good_frames_poisons_the_reader() -> None:
    reader = P.FrameReader()
    assert reader.feed(P.encode_frame(P.Ack(1))) == [P.Ack(1)]
    with pytest.raises(P.ProtocolError):
        reader.feed(frame_of({"kind": "nope"}) + P.encode_frame(P.Ack(2)))
    with pytest.raises(P.ProtocolError):
        reader.feed(P.encode_frame(P.Ack(3)))


@settings(max_examples=60, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(messages, min_size=1, max_size=6), st.data())
def test_frame_reader_any_chunking_yields_the_same_messages(
    msgs: list[P.Message], data: st.DataObject
) -> None:
    stream = b"".join(P.encode_frame(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=20)))
    reader = P.FrameReader()
    got: list[P.Message] = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)]):
        got += reader.feed(stream[a:b])
    reader.close()
    assert got == msgs
    assert reader.buffered == 0


# ------------------------------------------------------------------ blocking socket helpers
def test_recv_msg_eof_timeout_and_truncation() -> None:
    a, b = socket.socketpair()
    with a, b:
        with pytest.raises(TimeoutError):
            P.recv_msg(a, timeout=0.05)  # nothing sent: stream still usable
        P.send_msg(b, P.Ack(5))
        assert P.recv_msg(a, timeout=1) == P.Ack(5)
        b.sendall(P.encode_frame(P.Ack(6))[:5])
        with pytest.raises(P.ProtocolError, match="timed out inside a frame"):
            P.recv_msg(a, timeout=0.05)
    a, b = socket.socketpair()
    with a:
        b.sendall(P.encode_frame(P.Ack(7)) + P.encode_frame(P.Ack(8))[:3])
        b.close()
        assert P.recv_msg(a, timeout=1) == P.Ack(7)
        with pytest.raises(P.ProtocolError, match="closed inside a frame"):
            P.recv_msg(a, timeout=1)
    a, b = socket.socketpair()
    with a:
        b.close()
        assert P.recv_msg(a, timeout=1) is None  # clean EOF between frames


def test_recv_msg_rejects_oversized_header() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.sendall(struct.pack(">I", 10_000))
        with pytest.raises(P.ProtocolError, match="exceeds"):
            P.recv_msg(a, timeout=1, max_frame_bytes=1000)


# ------------------------------------------------------------------ handshake over TCP (blocking)
class _Server:
    """A one-connection loopback server running ``handler(conn)`` in a thread."""

    def __init__(self, handler: Callable[[socket.socket], object]) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(5)
        self.port = self.sock.getsockname()[1]
        self.result: object = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(handler,), daemon=True)
        self.thread.start()

    def _run(self, handler: Callable[[socket.socket], object]) -> None:
        try:
            conn, _ = self.sock.accept()
            with conn:
                self.result = handler(conn)
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            self.error = exc

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def join(self) -> None:
        self.thread.join(timeout=5)
        assert not self.thread.is_alive(), "server thread wedged"
        self.sock.close()


def _serve_one(conn: socket.socket) -> P.Hello:
    hello = P.server_handshake_sync(conn, SECRET, timeout=2)
    msg = P.recv_msg(conn, timeout=2)
    assert isinstance(msg, P.Heartbeat)
    P.send_msg(conn, P.Ack(msg.generation, "heartbeat"))
    return hello


def test_tcp_right_secret_is_accepted() -> None:
    srv = _Server(_serve_one)
    with srv.connect() as c:
        P.client_handshake_sync(c, SECRET, "agent:node0", timeout=2)
        P.send_msg(c, P.Heartbeat(0, 0, 3, 10, 2, 1.0))
        assert P.recv_msg(c, timeout=2) == P.Ack(3, "heartbeat")
    srv.join()
    assert srv.error is None
    assert (srv.result.version, srv.result.role, srv.result.identity) == (P.PROTOCOL_VERSION, "agent", "agent:node0")
    assert len(srv.result.nonce) == 32  # the client's challenge to the server


def test_tcp_wrong_secret_is_refused_on_both_sides() -> None:
    srv = _Server(_serve_one)
    with srv.connect() as c:
        with pytest.raises(P.AuthError, match="mutual authentication failed"):
            P.client_handshake_sync(c, "not-the-secret", "agent:node0", timeout=2)
    srv.join()
    assert isinstance(srv.error, P.AuthError)


def test_a_handshake_broken_off_is_not_a_refusal() -> None:
    """A server that hangs up mid-handshake (a controller dying or starting) breaks the
    handshake off (retry); one that says no refuses it. Agents redialing a restarted
    controller tell the two apart: only a refusal ends their grace period."""
    srv = _Server(lambda conn: conn.close())
    with srv.connect() as c:
        with pytest.raises(P.HandshakeBroken):
            P.client_handshake_sync(c, SECRET, "agent:node0", timeout=2)
    srv.join()

    srv = _Server(_serve_one)
    with srv.connect() as c:
        with pytest.raises(P.AuthError) as refused:
            P.client_handshake_sync(c, "not-the-secret", "agent:node0", timeout=2)
    srv.join()
    assert not isinstance(refused.value, P.HandshakeBroken)


def test_tcp_client_without_secret_is_refused() -> None:
    srv = _Server(_serve_one)
    with srv.connect() as c:
        P.send_msg(c, P.Heartbeat(0, 0, 0, 0, 0, 0.0))  # skips the handshake entirely
        assert P.recv_msg(c, timeout=2) is None  # the server hangs up
    srv.join()
    assert isinstance(srv.error, P.AuthError)

    srv = _Server(_serve_one)
    with srv.connect() as c:
        with pytest.raises(P.AuthError, match="secret"):
            P.client_handshake_sync(c, "", "agent:node0", timeout=2)  # no secret configured
    srv.join()
    assert isinstance(srv.error, P.AuthError)


def test_tcp_replayed_digest_for_another_identity_is_refused() -> None:
    srv = _Server(_serve_one)
    with srv.connect() as c:
        P.send_msg(c, P.Hello(P.PROTOCOL_VERSION, "agent", "agent:node1", b"n" * 32))
        ch = P.recv_msg(c, timeout=2)
        assert isinstance(ch, P.Challenge)
        P.send_msg(c, P.AuthResponse(P.auth_digest(SECRET, ch.nonce, "agent:node0")))
        res = P.recv_msg(c, timeout=2)
        assert isinstance(res, P.AuthResult) and not res.ok
    srv.join()
    assert isinstance(srv.error, P.AuthError)


def test_tcp_silent_client_times_out_and_bad_version_is_refused() -> None:
    srv = _Server(lambda conn: P.server_handshake_sync(conn, SECRET, timeout=0.2))
    with srv.connect():
        srv.join()
    assert isinstance(srv.error, P.AuthError)

    srv = _Server(lambda conn: P.server_handshake_sync(conn, SECRET, timeout=2))
    with srv.connect() as c:
        P.send_msg(c, P.Hello(P.PROTOCOL_VERSION + 1, "agent", "x"))
        res = P.recv_msg(c, timeout=2)
        assert isinstance(res, P.AuthResult) and not res.ok and "version" in res.reason
    srv.join()
    assert isinstance(srv.error, P.AuthError)


def test_tcp_garbage_during_handshake_is_an_auth_error() -> None:
    srv = _Server(lambda conn: P.server_handshake_sync(conn, SECRET, timeout=2))
    with srv.connect() as c:
        c.sendall(b"GET / HTTP/1.1\r\n\r\n")
        srv.join()
    assert isinstance(srv.error, P.AuthError)


# ------------------------------------------------------------------ handshake over asyncio
async def _async_session(client_secret: str) -> tuple[object, object]:
    outcome: dict[str, object] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            outcome["hello"] = await P.server_handshake(reader, writer, SECRET, timeout=2)
            msg = await P.read_msg(reader, timeout=2)
            await P.write_msg(writer, P.Ack(0, type(msg).__name__))
        except P.ProtocolError as exc:
            outcome["server"] = exc
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await P.client_handshake(reader, writer, client_secret, "worker:3", role="worker", timeout=2)
        await P.write_msg(writer, P.AgentState(0, 1.0))
        outcome["client"] = await P.read_msg(reader, timeout=2)
    except P.ProtocolError as exc:
        outcome["client"] = exc
    finally:
        writer.close()
        for _ in range(200):  # let the handler see the closed stream
            if "server" in outcome or "hello" in outcome:
                break
            await asyncio.sleep(0.01)
        server.close()
        await server.wait_closed()
    return outcome.get("client"), outcome.get("server", outcome.get("hello"))


def test_asyncio_right_secret_is_accepted() -> None:
    client, server = asyncio.run(asyncio.wait_for(_async_session(SECRET), 5))
    assert client == P.Ack(0, "AgentState")
    assert (server.version, server.role, server.identity) == (P.PROTOCOL_VERSION, "worker", "worker:3")


def test_asyncio_wrong_secret_is_refused() -> None:
    client, server = asyncio.run(asyncio.wait_for(_async_session("wrong"), 5))
    assert isinstance(client, P.AuthError)
    assert isinstance(server, P.AuthError)


def test_a_whole_frame_read_after_a_stalled_loop_is_not_a_broken_stream() -> None:
    """The event loop is starved past the read's deadline (a loaded machine) while a
    whole frame arrives: the header is read, and so must be the buffered body (it was
    'timed out inside a frame of 68 bytes', and the controller lost a healthy node)."""
    import time

    async def go() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        task = asyncio.ensure_future(P.read_msg(reader, timeout=0.2))
        await asyncio.sleep(0)  # waiting for the header
        b.sendall(P.encode_frame(P.Ack(9)))
        time.sleep(0.4)  # the loop does not run until after the deadline
        assert await task == P.Ack(9)
        b.close()
        writer.close()

    asyncio.run(go())


def test_asyncio_read_msg_timeout_eof_and_truncation() -> None:
    async def go() -> None:
        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        with pytest.raises(TimeoutError):
            await P.read_msg(reader, timeout=0.05)
        b.sendall(P.encode_frame(P.Ack(1)) + P.encode_frame(P.Ack(2))[:6])
        assert await P.read_msg(reader, timeout=1) == P.Ack(1)
        with pytest.raises(P.ProtocolError, match="timed out inside a frame"):
            await P.read_msg(reader, timeout=0.05)
        b.close()
        writer.close()

        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        b.sendall(P.encode_frame(P.Ack(3))[:2])
        b.close()
        with pytest.raises(P.ProtocolError, match="closed inside a frame"):
            await P.read_msg(reader, timeout=1)
        writer.close()

        a, b = socket.socketpair()
        reader, writer = await asyncio.open_connection(sock=a)
        b.close()
        assert await P.read_msg(reader, timeout=1) is None
        writer.close()

    asyncio.run(asyncio.wait_for(go(), 5))


# ------------------------------------------------------------------ mutual authentication, node keys
def test_client_refuses_a_server_without_the_secret_before_proving_anything() -> None:
    """A server that does not know the key cannot forge the proof; the client stops and
    never sends its digest (which an impostor could otherwise relay)."""
    sent: list[object] = []

    def impostor(conn: socket.socket) -> None:
        hello = P.recv_msg(conn, timeout=2)
        assert isinstance(hello, P.Hello)
        P.send_msg(conn, P.Challenge(b"x" * 32, P.server_proof("guessed", hello.nonce, b"x" * 32, hello.identity)))
        sent.append(P.recv_msg(conn, timeout=2))  # None: the client hung up

    srv = _Server(impostor)
    with srv.connect() as c:
        with pytest.raises(P.AuthError, match="mutual authentication failed"):
            P.client_handshake_sync(c, SECRET, "agent:0", timeout=2)
    srv.join()
    assert sent == [None]


def test_server_refuses_a_hello_without_client_nonce() -> None:
    srv = _Server(lambda conn: P.server_handshake_sync(conn, SECRET, timeout=2))
    with srv.connect() as c:
        P.send_msg(c, P.Hello(P.PROTOCOL_VERSION, "agent", "agent:0"))
        res = P.recv_msg(c, timeout=2)
        assert isinstance(res, P.AuthResult) and not res.ok and "mutual" in res.reason
    srv.join()
    assert isinstance(srv.error, P.AuthError)


def test_node_credentials_are_per_node_and_a_key_source_picks_them() -> None:
    k0, k1 = P.node_credential(SECRET, 0), P.node_credential(SECRET, 1)
    assert k0 != k1 and len(k0) == 64 and SECRET not in k0
    assert P.node_credential(SECRET, 0) == k0  # deterministic
    for bad in (-1, 1.5, "0", True):
        with pytest.raises(ValueError):
            P.node_credential(SECRET, bad)  # type: ignore[arg-type]

    def key_for(hello: P.Hello) -> str:
        node = int(hello.identity.split(":")[1])
        if node > 1:
            raise P.AuthError(f"unknown node {node}")
        return P.node_credential(SECRET, node)

    srv = _Server(lambda conn: P.server_handshake_sync(conn, key_for, timeout=2))
    with srv.connect() as c:
        P.client_handshake_sync(c, k1, "agent:1", timeout=2)
    srv.join()
    assert srv.error is None and srv.result.identity == "agent:1"

    srv = _Server(lambda conn: P.server_handshake_sync(conn, key_for, timeout=2))
    with srv.connect() as c:  # node 1's credential claiming node 0
        with pytest.raises(P.AuthError):
            P.client_handshake_sync(c, k1, "agent:0", timeout=2)
    srv.join()
    assert isinstance(srv.error, P.AuthError)

    srv = _Server(lambda conn: P.server_handshake_sync(conn, key_for, timeout=2))
    with srv.connect() as c:
        with pytest.raises(P.AuthError, match="unknown node 9"):
            P.client_handshake_sync(c, P.node_credential(SECRET, 9), "agent:9", timeout=2)
    srv.join()
    assert isinstance(srv.error, P.AuthError)
