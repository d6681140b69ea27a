"""The typed messages of the wire protocol and their msgpack codec.

Every message is a frozen msgspec Struct tagged by its ``kind`` field and belongs to
the one :data:`Message` union. Decoding validates types and ranges (device ids >= 0,
throughput in (0, 1], a parseable plan text, ...), so code behind the decoder never
sees a malformed message. Schema evolution rules are in :mod:`resihp_core.protocol`.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

import msgspec

from resihp_core.plan import ParallelPlan, PlanError, parse_plan
from resihp_core.program import Program
from resihp_core.protocol.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION", "Hello", "Challenge", "AuthResponse", "AuthResult", "Heartbeat",
    "MicroBatchProfile", "IterationProfile", "FailureReport", "PlanUpdate", "IterationReport", "WorkerSummary",
    "AgentState", "Ack", "Error", "LaunchWorkers", "SignalWorker", "WorkerProcess",
    "NodeRejoin", "LinkProbe", "WorkerLeft", "JobError", "ScriptEnded", "CommitRequest", "CommitVerdict",
    "ProfileBatch",
    "Message", "MESSAGE_TYPES", "encode", "decode", "FailureClass", "Cause",
]

# 2: agents launch workers; 3: mutual authentication (Hello.nonce, Challenge.proof);
# 4: LinkProbe (a tag older agents reject); 5: CommitRequest / CommitVerdict (node commits),
# ProfileBatch (a node's profiles of one iteration)
PROTOCOL_VERSION = 5

# ------------------------------------------------------------------- field types
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0)]
Throughput = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Nonce = Annotated[bytes, msgspec.Meta(min_length=16, max_length=64)]
Digest = Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
ShortText = Annotated[str, msgspec.Meta(max_length=256)]
FailureClass = Literal["fail-stop", "fail-slow"]
# "contention": other processes on the device's host took its CPU (docs/detector.md);
# "sdc": the device computed wrong numbers (silent data corruption, docs/sdc.md)
Cause = Literal["compute", "communication", "contention", "sdc", "unknown"]


class _Msg(msgspec.Struct, frozen=True, tag_field="kind"):
    pass


# ------------------------------------------------------------------- handshake
class Hello(_Msg, tag="hello"):
    """First message of every connection, from the connecting side."""

    version: NonNeg
    role: ShortText  # "agent", "worker", "cli", ... (free text so new roles stay decodable)
    identity: ShortText  # e.g. "agent:node3"; bound into the HMAC
    nonce: Annotated[bytes, msgspec.Meta(max_length=64)] = b""  # the client's challenge (v3)


class Challenge(_Msg, tag="challenge"):
    """The server's nonce, and its proof that it holds the client's key (v3)."""

    nonce: Nonce
    proof: Annotated[bytes, msgspec.Meta(max_length=32)] = b""


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
    # Seconds the rank's training thread was runnable but waiting for a CPU (Linux run
    # delay) in the whole iteration and in its compute chunks; 0 = not measured. Time
    # other processes took from it: the environment, not the device (detector/environment.py).
    cpu_wait_s: Seconds = 0.0
    compute_wait_s: Seconds = 0.0
    # The CPUs its training thread may run on (os.sched_getaffinity); () = not measured.
    # A worker that shares its CPUs with its peers has no cores of its own for another
    # process to contend (docs/detector.md "Pinned or unpinned").
    cpus: tuple[NonNeg, ...] = ()


class ProfileBatch(_Msg, tag="profiles"):
    """Agent -> controller: its workers' profiles of one iteration in one message (the
    controller's cost per iteration grows with nodes, not ranks)."""

    profiles: Annotated[tuple[IterationProfile, ...], msgspec.Meta(min_length=1, max_length=4096)]


class FailureReport(_Msg, tag="failure"):
    """A confirmed failure. ``cause`` says compute, communication or contention of the
    device's host (``kind`` is the tag); the Scheduler plans around all of them alike.

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
    # Fail-stopped devices (of ``devices``) whose processes are alive and stopped: fenced
    # (work planned elsewhere) but not killed; offered back when they resume (docs/detector.md).
    paused: tuple[NonNeg, ...] = ()


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
    stop: bool = False
    fresh: bool = False  # start again from the seed's initial state (a restore with no checkpoint yet)
    # A restore from peers' memory copies, not a checkpoint file: for each component of
    # the model, the device holding each of its parts (resihp_core.runtime.peercopy).
    memory_holders: dict[str, list[NonNeg]] | None = None

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


class CommitRequest(_Msg, tag="commit"):
    """Worker -> its node agent: commit ``report``'s iteration. The agent posts the
    reports of the node's executors that asked together and adds them to the
    iteration's commit counter in one store round trip, then answers each with a
    :class:`CommitVerdict` (docs/worker-protocol.md). ``check``: this executor must run
    its cross-replica check before a commit is decided (docs/sdc.md); ``hold_s``: hold
    the iteration up to that long while no controller steers the job; ``wait_s``: how
    long to wait for the verdict before aborting the iteration; ``fingerprint``: this
    executor's SDC fingerprint of the iteration, posted in the same store request as
    the report, before the add (docs/sdc.md)."""

    report: IterationReport
    executors: Annotated[int, msgspec.Meta(ge=1)]
    check: bool = False
    hold_s: Annotated[float, msgspec.Meta(ge=0.0, le=86400.0)] = 0.0
    wait_s: Annotated[float, msgspec.Meta(gt=0.0, le=86400.0)] = 600.0  # then the iteration is aborted
    fingerprint: Annotated[str, msgspec.Meta(max_length=1 << 16)] | None = None


class CommitVerdict(_Msg, tag="verdict"):
    """Agent -> worker: the verdict of ``iteration`` in ``generation``; ``decide``: this
    executor's counter add completed the count, so it runs its check and decides."""

    generation: NonNeg
    iteration: NonNeg
    verdict: Literal["commit", "abort", "decide"]


class WorkerLeft(_Msg, tag="worker_left"):
    """Why a worker left a generation (a peer died, a state move failed), as the
    supervisor reads it from the job store. ``state_lost`` is the typed signal that the
    adapter raised :class:`~resihp_core.adapter.StateLost` (some state has no surviving
    holder: restore from a checkpoint); the core never reads ``reason``'s text for it."""

    generation: NonNeg
    device: NonNeg
    reason: str
    error: str = ""  # the exception's class name
    state_lost: bool = False


class JobError(_Msg, tag="job_error"):
    """Worker -> controller (through the job store): the job's own code raised on this
    device (the user's script, or an adapter refusing it): the job ends, nothing is
    planned (docs/errors.md). ``where`` is the user's ``file:line``; ``phase`` says
    whether training had started (``setup`` before the first iteration ran)."""

    device: NonNeg
    exc_type: ShortText
    message: str
    where: str = ""
    traceback: str = ""
    phase: Literal["setup", "training"] = "training"
    iteration: NonNeg = 0
    generation: int = -1

    def line(self) -> str:
        """One line for the console: the exception, the user's file:line and the rank."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        return f"{self.exc_type}: {first} (at {self.where or '?'}, device {self.device})"


class ScriptEnded(_Msg, tag="script_ended"):
    """Worker -> controller (through the job store): the user's training script returned
    on this device after ``iteration`` committed iterations, before the job's configured
    end (its own loop ended early). The job ends normally (docs/errors.md)."""

    device: NonNeg
    iteration: NonNeg


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
    # CPU contention of a probe the agent runs outside the job (wall / CPU time, >= 1;
    # 0 = not measured): how much the machine itself is slowed (detector/environment.py).
    environment: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 0.0


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


class LinkProbe(_Msg, tag="link_probe"):
    """Controller -> agent: echo ``payload`` back (agent -> controller, ``node`` its
    own): the round trip times the link of that node's host (runtime/controller/linkprobe.py)."""

    seq: NonNeg
    node: NonNeg = 0
    payload: Annotated[bytes, msgspec.Meta(max_length=8 * 1024 * 1024)] = b""


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
    LinkProbe,
    WorkerLeft,
    JobError,
    ScriptEnded,
    CommitRequest,
    CommitVerdict,
    ProfileBatch,
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


def decode(payload: bytes | bytearray | memoryview) -> Message:
    """Decode and validate one payload; every failure is a :class:`ProtocolError`."""
    try:
        return _DECODER.decode(payload)
    except msgspec.MsgspecError as exc:
        raise ProtocolError(f"bad message: {exc}") from None
    except (ValueError, TypeError, OverflowError, RecursionError) as exc:  # belt and braces
        raise ProtocolError(f"bad message: {exc}") from None

