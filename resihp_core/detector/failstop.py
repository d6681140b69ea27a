"""Fail-stop detection over one node's workers: the pure logic of the node agent.

A :class:`FailStopMonitor` is fed events with explicit timestamps (seconds on a
monotonic clock) and never reads a clock or a socket itself, so every rule is
unit-testable with a fake clock (docs/design.md §3.1):

* **missed beats** — no heartbeat for ``heartbeat_miss_limit`` intervals (plus a
  small grace): a silent death when the process is gone or cannot be looked at. If
  the process is alive and running, silence is a *hang* (every thread stuck) only
  once it outlasts ``hang_min_timeout_s`` too: a beat thread starved of CPU on a
  loaded host is late by a second or two, and was taken for a hang at 0.8 s;
* **a pause** — silent while its process is *stopped* (state ``T``: SIGSTOP, a debugger,
  a preempting host): declared ``paused``, which fences it (its work is planned
  elsewhere) without killing it. If it beats again and keeps beating for
  ``resume_check_s`` (the health check) it is healthy again (:meth:`FailStopMonitor.take_resumed`):
  it is offered back. Stopped longer than ``max_pause_s``, or running again but still
  silent, it is a hang (``after_pause``: the agent kills it, nobody else will);
* **connection loss** and **process exit** — at once;
* **hang with progress stalled** — heartbeats keep coming (the worker's beat thread is
  alive) but ``(iteration, step)`` has not advanced for longer than a timeout *learned
  from the observed step times*: ``max(hang_min_timeout_s, hang_timeout_factor x
  typical gap between progress advances, hang_max_gap_margin x the longest gap seen
  recently)``. The last term means a gap already seen in healthy operation (an
  optimizer step, a checkpoint) never triggers; the first one gives a short or empty
  history a safe floor. Hang detection starts with the first progress advance, and
  again with the first advance of each plan generation: start-up (loading, compiling)
  and reconfiguration (communicators, state moves, which take seconds on a loaded
  machine) are not steps; a peer stuck there fails its collectives' own timeouts.

A failure is reported once per worker; a worker that said goodbye (``finished``) is
never reported.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

if TYPE_CHECKING:
    from resihp_core.config import DetectorConfig
    from resihp_core.protocol import WorkerSummary

__all__ = [
    "FailStopMonitor",
    "FailureKind",
    "HangTimeout",
    "ProcessState",
    "WorkerFailure",
    "WorkerStatus",
]

#: What a pid looks like from outside: running/sleeping, stopped (SIGSTOP/ptrace),
#: gone (or a zombie), or unknown (no pid, no permission).
ProcessState = Literal["alive", "stopped", "dead", "unknown"]


class FailureKind(str, enum.Enum):
    EXIT = "exit"  # the process exited
    DISCONNECT = "disconnect"  # its connection to the agent closed
    MISSED_BEATS = "missed-beats"  # silent, process state unknown or gone
    HANG = "hang"  # process alive but silent, or beating without progress
    PAUSED = "paused"  # silent while its process is stopped: fenced, not killed


@dataclass(frozen=True)
class WorkerFailure:
    """A worker declared fail-stopped: when, why, and where its progress stood."""

    device: int
    rank: int
    kind: FailureKind
    reason: str
    time: float
    iteration: int = 0
    step: int = 0
    after_pause: bool = False  # a hang that followed a pause: its fence is already planned, kill it here


class HangTimeout:
    """Learns the hang timeout of one worker from the gaps between progress advances."""

    def __init__(self, factor: float, min_timeout: float, *, window: int = 64, max_gap_margin: float = 2.0) -> None:
        if factor <= 1 or min_timeout <= 0 or window < 1 or max_gap_margin < 1:
            raise ValueError("need factor > 1, min_timeout > 0, window >= 1, max_gap_margin >= 1")
        self.factor, self.min_timeout, self.max_gap_margin = factor, min_timeout, max_gap_margin
        self._gaps: deque[float] = deque(maxlen=window)
        self._timeout: float | None = None  # until the next gap: the agent asks many times per beat

    def observe(self, gap: float) -> None:
        if gap >= 0:
            self._gaps.append(gap)
            self._timeout = None

    @property
    def samples(self) -> int:
        return len(self._gaps)

    def typical(self) -> float:
        """Median gap between progress advances (0 before any)."""
        if not self._gaps:
            return 0.0
        g = sorted(self._gaps)
        return g[len(g) // 2]

    def timeout(self) -> float:
        if not self._gaps:
            return self.min_timeout
        if self._timeout is None:
            self._timeout = max(self.min_timeout, self.factor * self.typical(), self.max_gap_margin * max(self._gaps))
        return self._timeout


@dataclass
class WorkerStatus:
    """The monitor's view of one worker."""

    device: int
    rank: int
    pid: int | None
    registered: float
    last_beat: float
    iteration: int = 0
    step: int = 0
    generation: int = 0
    last_progress: float | None = None  # when (iteration, step) last advanced
    failure: WorkerFailure | None = None
    finished: bool = False
    connected: bool = True
    hang: HangTimeout | None = field(default=None, repr=False)
    resumed_at: float | None = None  # a paused worker's first beat since the pause
    running_since: float | None = None  # a paused worker's process first seen running again
    committing: bool = False  # waiting for its iteration's commit verdict (its agent says so)

    @property
    def paused(self) -> bool:
        return self.failure is not None and self.failure.kind is FailureKind.PAUSED

    @property
    def alive(self) -> bool:
        return self.failure is None and not self.finished


class FailStopMonitor:
    """Tracks one node's workers and declares fail-stops (see the module docstring).

    :param interval: heartbeat interval the workers use (seconds).
    :param miss_limit: consecutive missed beats that make a worker silent.
    :param hang_factor, hang_min_timeout: the learned hang timeout (see :class:`HangTimeout`).
    :param grace: extra fraction of an interval allowed before a beat counts as missed
        (absorbs scheduling jitter).
    :param process_state: how to look at a pid (injected; the agent reads ``/proc``).
    """

    def __init__(
        self,
        interval: float = 0.1,
        miss_limit: int = 3,
        hang_factor: float = 10.0,
        hang_min_timeout: float = 5.0,
        *,
        grace: float = 0.5,
        process_state: Callable[[int], ProcessState] | None = None,
        max_pause_s: float = 300.0,
        resume_check_s: float | None = None,
    ) -> None:
        if interval <= 0 or miss_limit < 1 or grace < 0 or max_pause_s <= 0:
            raise ValueError("need interval > 0, miss_limit >= 1, grace >= 0, max_pause_s > 0")
        self.max_pause_s = max_pause_s
        # The health check of a resumed worker: it beats steadily this long.
        self.resume_check_s = resume_check_s if resume_check_s is not None else max(0.3, 3 * interval)
        self._resumed: list[int] = []
        self.interval, self.miss_limit, self.grace = interval, miss_limit, grace
        self.hang_factor, self.hang_min_timeout = hang_factor, hang_min_timeout
        self.process_state = process_state
        self.workers: dict[int, WorkerStatus] = {}

    @classmethod
    def from_config(cls, config: DetectorConfig, **kwargs: object) -> FailStopMonitor:
        return cls(
            config.heartbeat_interval_s,
            config.heartbeat_miss_limit,
            config.hang_timeout_factor,
            config.hang_min_timeout_s,
            max_pause_s=config.pause_max_s,
            **kwargs,  # type: ignore[arg-type]
        )

    @property
    def silence_limit(self) -> float:
        """Seconds without a heartbeat after which a worker is declared silent."""
        return (self.miss_limit + self.grace) * self.interval

    # ------------------------------------------------------------- events
    def add(self, device: int, rank: int, now: float, pid: int | None = None) -> WorkerStatus:
        """A worker connected (or reconnected: its state starts afresh)."""
        w = WorkerStatus(device, rank, pid, now, now, hang=HangTimeout(self.hang_factor, self.hang_min_timeout))
        self.workers[device] = w
        return w

    def commit_wait(self, device: int, now: float, waiting: bool) -> None:
        """The worker waits for its iteration's commit verdict through this node's agent:
        not a hang (the job decides the verdict, and the wait has a time-out of its own),
        so stalled progress is not held against it; its progress clock restarts when the
        verdict comes. Without this, every survivor of a silent peer looks hung while the
        controller waits out the silent node's agent."""
        w = self.workers.get(device)
        if w is None:
            return
        w.committing = waiting
        if not waiting and w.last_progress is not None:
            w.last_progress = now

    def set_pid(self, device: int, pid: int) -> None:
        self.workers[device].pid = pid

    def beat(self, device: int, now: float, iteration: int, step: int, generation: int = 0) -> None:
        w = self.workers.get(device)
        if w is not None and w.paused:
            self._paused_beat(w, now, iteration, step, generation)
            return
        if w is None or not w.alive:
            return
        w.last_beat = now
        if generation != w.generation:  # a new plan generation: disarmed until its first step
            w.generation, w.iteration, w.step, w.last_progress = generation, iteration, step, None
            return
        if (iteration, step) != (w.iteration, w.step):
            if w.last_progress is not None and w.hang is not None:
                w.hang.observe(now - w.last_progress)
            w.iteration, w.step, w.last_progress = iteration, step, now

    def finished(self, device: int) -> None:
        """The worker said goodbye: its exit or disconnect is not a failure."""
        w = self.workers.get(device)
        if w is not None:
            w.finished = True

    def connection_lost(self, device: int, now: float) -> WorkerFailure | None:
        w = self.workers.get(device)
        if w is None:
            return None
        w.connected = False
        return self._fail(w, now, FailureKind.DISCONNECT, "connection to the agent closed")

    def process_exited(self, device: int, now: float, returncode: int | None = None) -> WorkerFailure | None:
        w = self.workers.get(device)
        if w is None:
            return None
        how = "exited" if returncode is None else (
            f"killed by signal {-returncode}" if returncode < 0 else f"exited with code {returncode}"
        )
        return self._fail(w, now, FailureKind.EXIT, f"process {how}")

    def _fail(self, w: WorkerStatus, now: float, kind: FailureKind, reason: str,
              after_pause: bool = False) -> WorkerFailure | None:
        if not w.alive and not (w.paused and kind is not FailureKind.PAUSED):
            return None  # a paused worker may still fail for good (exit, hang)
        w.resumed_at = w.running_since = None
        w.failure = WorkerFailure(w.device, w.rank, kind, reason, now, w.iteration, w.step, after_pause)
        return w.failure

    # ------------------------------------------------------------- pauses
    def _paused_beat(self, w: WorkerStatus, now: float, iteration: int, step: int, generation: int) -> None:
        """A paused worker beats again: its health check starts (or goes on)."""
        if now - w.last_beat > self.silence_limit:
            w.resumed_at = None  # silent again in between: the check starts over
        w.last_beat = now
        if w.resumed_at is None:
            w.resumed_at = now
        w.iteration, w.step, w.generation = iteration, step, generation

    def _check_paused(self, w: WorkerStatus, now: float, state: ProcessState) -> WorkerFailure | None:
        """The rules for a paused worker: a hang after too long a pause or silent while
        running, healthy again after a steady ``resume_check_s`` of beats."""
        assert w.failure is not None
        silent = now - w.last_beat
        if state == "dead":
            return self._fail(w, now, FailureKind.EXIT, f"process {w.pid} is gone (paused since {w.failure.time:.2f})")
        if silent <= self.silence_limit and w.resumed_at is not None:
            if now - w.resumed_at >= self.resume_check_s and state != "stopped":
                w.failure, w.resumed_at, w.running_since = None, None, None
                w.last_progress = None  # disarmed until it makes progress again
                self._resumed.append(w.device)
            return None
        if state == "stopped":
            w.running_since = None
            paused = now - w.failure.time
            if paused > self.max_pause_s:
                return self._fail(w, now, FailureKind.HANG, f"process {w.pid} stopped for {paused:.1f} s "
                                  f"(more than the {self.max_pause_s:.0f} s a pause may last)", after_pause=True)
            return None
        # Running (or unknown) and silent beyond the limit *since it runs again*: a hang,
        # not a pause. Counted from when it was first seen running: just after SIGCONT
        # its beat thread has not been scheduled yet, and its last beat is the pause's age.
        if w.running_since is None:
            w.running_since = now
        running_silent = now - max(w.last_beat, w.running_since)
        if running_silent > self.silence_limit and now - w.failure.time > self.silence_limit:
            return self._fail(w, now, FailureKind.HANG, f"process {w.pid} runs again but has not beaten "
                              f"for {running_silent:.2f} s since (silent {silent:.2f} s in all)", after_pause=True)
        return None

    def take_resumed(self) -> list[int]:
        """Devices whose paused worker passed its health check since the last call."""
        out, self._resumed = self._resumed, []
        return out

    # ------------------------------------------------------------- the clock
    def check(self, now: float) -> list[WorkerFailure]:
        """Apply the time-based rules at ``now``; returns the newly failed workers."""
        out: list[WorkerFailure] = []
        for w in self.workers.values():
            if w.paused:
                state: ProcessState = "unknown"
                if w.pid is not None and self.process_state is not None:
                    state = self.process_state(w.pid)
                f = self._check_paused(w, now, state)
                if f:
                    out.append(f)
                continue
            if not w.alive:
                continue
            silent = now - w.last_beat
            if silent > self.silence_limit:
                state = "unknown"
                if w.pid is not None and self.process_state is not None:
                    state = self.process_state(w.pid)
                if state == "alive" and silent <= self.hang_min_timeout:
                    # Running but silent: a beat thread starved of CPU (or of the GIL) on a
                    # loaded host looks like this for a second or two; a process whose every
                    # thread is stuck stays silent past the hang timeout's floor.
                    continue
                if state == "dead":
                    f = self._fail(w, now, FailureKind.EXIT, f"process {w.pid} is gone (no heartbeat for {silent:.2f} s)")
                elif state == "stopped":
                    f = self._fail(w, now, FailureKind.PAUSED, f"no heartbeat for {silent:.2f} s while process "
                                   f"{w.pid} is stopped: fenced, kept up to {self.max_pause_s:.0f} s")
                elif state == "alive":
                    what = "alive"
                    f = self._fail(
                        w, now, FailureKind.HANG,
                        f"no heartbeat for {silent:.2f} s ({self.miss_limit} missed) while "
                        f"process {w.pid} is {what}",
                    )
                else:
                    f = self._fail(
                        w, now, FailureKind.MISSED_BEATS,
                        f"missed {self.miss_limit} heartbeats (none for {silent:.2f} s)",
                    )
                if f:
                    out.append(f)
                continue
            if w.last_progress is not None and w.hang is not None and w.hang.samples and not w.committing:
                stalled = now - w.last_progress
                limit = w.hang.timeout()
                if stalled > limit:
                    f = self._fail(
                        w, now, FailureKind.HANG,
                        f"progress stuck at iteration {w.iteration} step {w.step} for "
                        f"{stalled:.2f} s (timeout {limit:.2f} s learned from "
                        f"{w.hang.samples} step gaps, typical {w.hang.typical():.3f} s)",
                    )
                    if f:
                        out.append(f)
        return out

    def next_deadline(self, now: float) -> float:
        """The earliest time a rule could fire (the agent sleeps until then, capped)."""
        t = now + self.interval
        for w in self.workers.values():
            if not w.alive:
                continue
            t = min(t, w.last_beat + self.silence_limit)
            if w.last_progress is not None and w.hang is not None and w.hang.samples and not w.committing:
                t = min(t, w.last_progress + w.hang.timeout())
        return max(t, now)

    # ------------------------------------------------------------- reporting
    def summaries(self, now: float) -> tuple[WorkerSummary, ...]:
        """One :class:`~resihp_core.protocol.WorkerSummary` per worker, for ``AgentState``."""
        from resihp_core.protocol import WorkerSummary

        out = []
        for w in sorted(self.workers.values(), key=lambda w: w.device):
            reason = ""
            if w.failure is not None:
                reason = f"{w.failure.kind.value}: {w.failure.reason}"
            elif w.finished:
                reason = "finished"
            out.append(
                WorkerSummary(
                    device=w.device,
                    rank=w.rank,
                    alive=w.alive or (w.finished and w.failure is None),
                    iteration=w.iteration,
                    step=w.step,
                    last_beat_age_s=max(0.0, now - w.last_beat),
                    reason=reason[:256],
                )
            )
        return tuple(out)
