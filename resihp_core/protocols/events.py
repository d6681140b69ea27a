"""The job's events, typed: what the controller learns and what the job decides.

Two unions, one stream:

- :data:`ControllerEvent`: what the controller publishes to its one sink (a callable):
  a failure report, each fail-slow detection, a worker process started or ended, a
  node's agent lost or back. The job (:class:`resihp_core.runtime.controller.resilient.ResilientJob`)
  routes them to the supervisor and the process host.
- :data:`JobEvent`: what the job did about it, as the supervisor and the control loop
  decide it (a plan posted, a failure acted on, a re-plan judged, a checkpoint chosen,
  the job's own error...), stamped by the job's session with the time, the iteration
  and the plan generation. ``events.json`` and the run log hold them as JSON objects
  whose ``kind`` names the type (:func:`encode_events`, :func:`decode_events`).

A run's observer (``RunHooks.observe``) gets both, and each committed iteration's
:class:`~resihp_core.protocols.metrics.IterationMetrics`, as one :data:`Event` stream.
Tests and benchmarks subscribe to the controller's part with an :class:`EventLog`.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, TypeVar, Union

import msgspec

from resihp_core.detector import Detection
from resihp_core.protocol import FailureReport, WorkerProcess
from resihp_core.protocols.metrics import IterationMetrics

__all__ = ["Attached", "CheckpointChosen", "CheckpointFailed", "ControllerEvent", "Event", "EventLog",
           "Failure", "Injected", "IterationMetrics", "JobEnded", "JobErrorEvent", "JobEvent", "Killed",
           "NodeBack", "NodeLost", "PlanPosted", "Recovered", "Relaunched", "Replanned", "Resumed", "SdcFound",
           "Sink", "StartUp", "decode_events", "encode_events", "event_dicts", "fan_out", "observer", "only"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class NodeLost:
    """A node's agent is gone (its connection closed, or it sent nothing for the agent
    timeout): every worker of the node counts as dead."""

    node: int


@dataclass(frozen=True)
class NodeBack:
    """The agent of a node cut off earlier is back, its stale workers fenced, and
    offers ``devices`` again."""

    node: int
    devices: tuple[int, ...]


ControllerEvent = Union[FailureReport, Detection, WorkerProcess, NodeLost, NodeBack]
Sink = Callable[[ControllerEvent], None]
E = TypeVar("E")


def only(kind: type[E], fn: Callable[[E], None]) -> Sink:
    """A sink that hands ``fn`` the events of type ``kind`` and ignores the rest."""

    def publish(event: ControllerEvent) -> None:
        if isinstance(event, kind):
            fn(event)

    return publish


def fan_out(*sinks: Sink) -> Sink:
    """One sink that hands each event to every one of ``sinks`` in order; a sink that
    raises is logged and does not keep the event from the others."""

    def publish(event: ControllerEvent) -> None:
        for s in sinks:
            try:
                s(event)
            except Exception:  # noqa: BLE001 - one observer's bug must not stop detection
                logger.exception("event sink %r failed on %s", s, type(event).__name__)

    return publish


class EventLog:
    """A sink that keeps every event, for whoever wants to look or wait (tests,
    benchmarks, the stand-alone controller). Thread-safe: the controller publishes on
    its loop, readers wait on their own threads."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._events: list[ControllerEvent] = []

    def __call__(self, event: ControllerEvent) -> None:
        with self._cond:
            self._events.append(event)
            self._cond.notify_all()

    def of(self, kind: type[E]) -> list[E]:
        """The events of one type so far, oldest first."""
        with self._cond:
            return [e for e in self._events if isinstance(e, kind)]

    @property
    def reports(self) -> list[FailureReport]:
        return self.of(FailureReport)

    @property
    def detections(self) -> list[Detection]:
        return self.of(Detection)

    def wait_for(self, kind: type[E], predicate: Callable[[E], bool] = lambda e: True,
                 timeout: float = 10.0, *, after: int = 0) -> E | None:
        """Block until an event of type ``kind`` matching ``predicate`` exists (among the
        events from index ``after`` on); None after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self._events[after:]:
                    if isinstance(e, kind) and predicate(e):
                        return e
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def wait_for_report(self, predicate: Callable[[FailureReport], bool] = lambda r: True,
                        timeout: float = 10.0) -> FailureReport | None:
        """Block until a failure report matching ``predicate`` exists."""
        return self.wait_for(FailureReport, predicate, timeout)

    def __len__(self) -> int:
        with self._cond:
            return len(self._events)


# ------------------------------------------------------------------ the job's events
class _JobEvent(msgspec.Struct, kw_only=True, frozen=True, tag_field="kind"):
    """What every job event carries: the seconds since the job started, the iteration
    the job was at, the plan generation, a sentence for people, the devices concerned."""

    text: str
    time: float = 0.0
    iteration: int = 0
    generation: int = 0
    devices: tuple[int, ...] = ()

    @property
    def kind(self) -> str:
        """The event's type, as ``events.json`` names it."""
        return str(self.__struct_config__.tag)


class PlanPosted(_JobEvent, tag="plan"):
    """A plan generation posted: ``kind_of_plan`` is the planner's (initial, tp, pp,
    dp, restore, rejoin, retry...); ``resume`` the first iteration it trains,
    ``restore`` the checkpoint it loads (None: state moved or kept)."""

    plan: str
    kind_of_plan: str = "initial"
    planning_s: float = 0.0
    resume: int | None = None
    restore: int | None = None


class Attached(_JobEvent, tag="attach"):
    """A restarted controller re-attached to the live job (docs/failover.md)."""

    plan: str
    resume: int


class CheckpointChosen(_JobEvent, tag="checkpoint"):
    """The checkpoint a restore loads (None: the initial state), the newer ones skipped
    because they are not complete, or the layouts of a generation superseded mid-move."""

    restore: int | None = None
    skipped: tuple[int, ...] = ()
    layout: tuple[str, ...] = ()


class Failure(_JobEvent, tag="failure"):
    """A failure the job acts on (``failure``: fail-stop, fail-slow, state-lost)."""

    failure: str
    cause: str = "unknown"


class Replanned(_JobEvent, tag="replan"):
    """A fail-slow re-plan judged by the payback rule (docs/detector.md)."""

    pays: bool
    gain_s: float
    cost_s: float
    horizon: int


class Recovered(_JobEvent, tag="recovered"):
    """Devices reported slow are healthy again."""


class Resumed(_JobEvent, tag="resumed"):
    """Paused workers are back and healthy; planned in once ready."""


class Relaunched(_JobEvent, tag="relaunch"):
    """Workers of devices started again; planned in once ready."""


class Killed(_JobEvent, tag="kill"):
    """A worker the job killed (still paused at the job's end)."""


class SdcFound(_JobEvent, tag="sdc"):
    """Silent data corruption found, re-executed or confirmed transient (docs/sdc.md)."""

    suspects: tuple[int, ...] = ()
    candidates: tuple[int, ...] = ()
    source: str = ""


class CheckpointFailed(_JobEvent, tag="storage"):
    """A checkpoint not written; training goes on."""

    checkpoint: int


class JobErrorEvent(_JobEvent, tag="job_error"):
    """The job's own error ends it (docs/errors.md)."""

    where: str
    exception: str
    phase: str


class JobEnded(_JobEvent, tag="ended"):
    """The training script returned before the configured iterations."""


class Injected(_JobEvent, tag="injection"):
    """A fault injected by the run's scenario (reports mark it)."""


class StartUp(_JobEvent, tag="start-up"):
    """Process start-up and the first iteration (reports mark it)."""


JobEvent = Union[PlanPosted, Attached, CheckpointChosen, Failure, Replanned, Recovered, Resumed, Relaunched, Killed,
                 SdcFound, CheckpointFailed, JobErrorEvent, JobEnded, Injected, StartUp]
#: everything a run's observer hears, in the order it happens
Event = Union[ControllerEvent, JobEvent, IterationMetrics]

def observer(*, job: Callable[[JobEvent], None] | None = None,
             iteration: Callable[[IterationMetrics], None] | None = None,
             report: Callable[[FailureReport], None] | None = None,
             detection: Callable[[Detection], None] | None = None) -> Callable[[Event], None]:
    """A run's observer made of one function per kind of event it cares about (the
    others are ignored): job events, committed iterations, failure reports, fail-slow
    detections."""
    routes: list[tuple[type | object, Callable]] = [
        (k, f) for k, f in ((JobEvent, job), (IterationMetrics, iteration), (FailureReport, report),
                            (Detection, detection)) if f is not None]

    def observe(event: Event) -> None:
        for kind, f in routes:
            if isinstance(event, kind):  # type: ignore[arg-type]
                f(event)

    return observe


_DECODER = msgspec.json.Decoder(list[JobEvent])


def event_dicts(events: list[JobEvent]) -> list[dict[str, object]]:
    """The events as JSON objects (``kind`` first), as ``events.json`` holds them."""
    return msgspec.json.decode(msgspec.json.encode(events))


def encode_events(events: list[JobEvent]) -> bytes:
    return msgspec.json.format(msgspec.json.encode(events), indent=1)


def decode_events(data: bytes | str) -> list[JobEvent]:
    """``events.json`` read back; a field of the wrong type or an unknown ``kind`` is
    refused naming where (:class:`msgspec.ValidationError`)."""
    return _DECODER.decode(data)
