"""What a person sees of a job: one console line per event, and the full text kept.

The console gets one line per event, cut to :data:`WIDTH` characters with a pointer to
the run log when cut. The run log (``run.log`` in the job's folder: one JSON object per
line, every event in full, a job error with its traceback) and ``events.json`` (the
events of the run, written at its end) keep what the console shortens; the console
names the run log at the start and at the end. How a run ends is said once by
:func:`finish` (docs/errors.md).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TextIO

from resihp_core.detector import Detection
from resihp_core.protocols.events import Event, JobEvent, PlanPosted, event_dicts
from resihp_core.protocols.metrics import IterationMetrics

if TYPE_CHECKING:
    from resihp_core.runtime.controller.resilient import ResilientRun

__all__ = ["RunLog", "WIDTH", "console_observer", "finish", "one_line"]

#: The longest console line an event gets.
WIDTH = 200


def one_line(text: str, width: int = WIDTH, where: str = "run.log") -> str:
    """``text`` on one line, cut to ``width`` with a pointer to ``where`` when cut."""
    indent = text[:len(text) - len(text.lstrip(" "))]
    flat = indent + " ".join(text.split())
    if len(flat) <= width:
        return flat
    tail = f" ... (full text in {where})"
    return flat[:max(20, width - len(tail))] + tail


class RunLog:
    """The run log and ``events.json`` of one job, in ``folder``."""

    def __init__(self, folder: Path, out: TextIO | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / "run.log"
        self.events_path = folder / "events.json"
        self.out = out
        self._f = open(self.path, "a", encoding="utf-8")

    @property
    def _stream(self) -> TextIO:
        return self.out if self.out is not None else sys.stdout

    def write(self, record: dict) -> None:
        if self._f.closed:
            return
        self._f.write(json.dumps({"time": round(time.time(), 3), **record}, default=str) + "\n")
        self._f.flush()

    def say(self, text: str) -> None:
        """A console line, also kept in the run log."""
        print(text, file=self._stream, flush=True)
        self.write({"kind": "console", "text": text})

    def event(self, ev: JobEvent) -> None:
        """One job event: in full in the run log, one line on the console (a plan's
        layout on a second line, as the stages and TP groups the plan text lists)."""
        self.write(event_dicts([ev])[0])
        print(one_line(f"[iteration {ev.iteration}] {ev.kind}: {ev.text}", where=str(self.path)),
              file=self._stream, flush=True)
        if isinstance(ev, PlanPosted):
            layout = [ln for ln in ev.plan.splitlines() if ln.startswith(("stages ", "replica "))]
            print(one_line(f"[iteration {ev.iteration}] layout: {'; '.join(layout)}", where=str(self.path)),
                  file=self._stream, flush=True)

    def close(self, events: list[dict]) -> None:
        self.events_path.write_text(json.dumps(events, indent=1, default=str))
        self._f.close()


def console_observer(log: RunLog, *also: Callable[[JobEvent], None]) -> Callable[[Event], None]:
    """A run's observer for the console: one line per committed iteration, each job
    event to ``log`` (after ``also``, e.g. the report's phases)."""

    def observe(ev: Event) -> None:
        if isinstance(ev, Detection) and ev.notice:  # the fail-slow detector's line for the user, said once
            log.say(ev.notice)
        elif isinstance(ev, IterationMetrics):
            print(f"iteration {ev.iteration:>3}  loss {ev.loss:.10f}  {ev.seconds:.2f}s  generation {ev.generation}",
                  file=log._stream, flush=True)
        elif isinstance(ev, JobEvent):
            for f in also:
                f(ev)
            log.event(ev)

    return observe


def finish(run: ResilientRun, log: RunLog, *, what: str, iterations: int, start: int = 0) -> int:
    """Say how ``run`` ended (the last console lines) and return the exit code
    (:mod:`resihp_core.errors`): the job's own error with the user's ``file:line``, the
    script's early end, a failure the job could not survive, or every iteration done."""
    err = sys.stderr if log.out is None else log.out
    done = start + len(run.records)
    if run.job_error is not None:
        e = run.job_error
        log.write({"kind": "job_error", "device": e.device, "exception": e.exc_type, "message": e.message,
                   "where": e.where, "phase": e.phase, "iteration": e.iteration, "traceback": e.traceback})
        log.close(run.events)
        when = "before training started" if e.phase == "setup" else f"at iteration {e.iteration}"
        print(f"{what}: the job's own code raised on device {e.device} {when} (not a device failure; "
              "nothing was re-planned)", file=err)
        print(one_line(f"  {e.exc_type}: {e.message}", where=str(log.path)), file=err)
        print(f"  at {e.where}", file=err)
        print(f"  full traceback: {log.path} (and the worker's log in {run.logs})", file=err, flush=True)
        return run.exit_code
    if not run.ok:
        print(one_line(f"{what} failed: {run.error}", where=str(log.path)), file=err)
        print(f"run log: {log.path}; worker logs: {run.logs}", file=err, flush=True)
        log.close(run.events)
        return run.exit_code
    if run.ended is not None and done < iterations:
        log.say(f"{what}: the training script's loop ended after {done} of {iterations} configured iterations "
                f"(device {run.ended.device}); run log: {log.path}")
        log.close(run.events)
        return 0
    log.say(f"{what}: {len(run.records)} iterations committed" + (f" from iteration {start}" if start else "")
            + f" ({done} of {iterations}); last plan generation {run.generation}; run log: {log.path}")
    log.close(run.events)
    return 0 if done >= iterations else 1
