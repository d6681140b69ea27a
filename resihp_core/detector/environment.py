"""Telling a device from its environment: CPU demand from processes outside the job.

A slowdown the whole machine feels (other processes' CPU load, a power cap) is not a
device failure: no plan runs faster around it. Each node agent runs
:class:`EnvironmentProbe`: a few times per interval it reads how many tasks are
runnable on the machine (``procs_running`` in ``/proc/stat``) and how many of them are
the job's workers (state ``R`` in ``/proc/<pid>/stat``), and reports the **contention**
factor the other tasks impose on a CPU-bound worker::

    max(1, (job + outside) / cores) / max(1, job / cores)      # >= 1; 1.0 = nothing else runs

A device's own slowdown (a slow accelerator, or an injected one) does not raise it; a
burst of other work on the machine does. Two simpler probes were tried first and
dropped: a short hashing probe (woken from sleep, the scheduler favours it, so it
under-reads what CPU-bound workers feel) and the CPU time taken outside the job
(it saturates at the core count on a busy machine, where demand does not).

The controller attaches each node's recent contention to every iteration it hands the
fail-slow detector; the verifier compares a suspect's compute slowdown with how much
its node's contention rose from before the change to the verification window
(:func:`environment_change`). See docs/security.md ("Fail-slow and the environment").
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
from typing import Callable, Iterable, Mapping, Sequence

__all__ = ["EnvironmentProbe", "environment_change", "runnable_tasks", "is_running"]

logger = logging.getLogger("resihp.environment")


def runnable_tasks() -> int | None:
    """Tasks (threads) runnable on this machine right now (None: unknown)."""
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith("procs_running "):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def is_running(pid: int) -> bool:
    """Whether process ``pid``'s main thread is runnable (state R)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rfind(")") + 2:text.rfind(")") + 3] == "R"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


class EnvironmentProbe:
    """Samples the CPU demand of processes outside the job, from a background thread.

    :param job_pids: the job's processes on this node (the agent's workers).
    :param interval_s: time between samples; each averages ``reads`` reads spread over it.
    :param window: samples in :attr:`level` (their median).
    """

    def __init__(self, job_pids: Callable[[], Iterable[int]] = tuple, interval_s: float = 0.25,
                 window: int = 3, reads: int = 5) -> None:
        if interval_s <= 0 or window < 1 or reads < 1:
            raise ValueError("need interval_s > 0, window >= 1 and reads >= 1")
        self.job_pids, self.interval_s, self.window, self.reads = job_pids, interval_s, window, reads
        self.cores = _cores()
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def read(self) -> tuple[float, float] | None:
        """One reading: (runnable tasks of the job, runnable tasks outside it)."""
        total = runnable_tasks()
        if total is None:
            return None
        job = sum(1 for pid in set(self.job_pids()) if is_running(pid))
        return float(job), float(max(0, total - job - 1))  # - 1: this thread, reading

    def sample(self, pause: Callable[[float], object] | None = None) -> float:
        """Average ``reads`` readings (``pause`` between them; default none) into one
        contention value; 0.0 = not measurable here."""
        got = []
        for i in range(self.reads):
            if i and pause is not None:
                pause(self.interval_s / self.reads)
            r = self.read()
            if r is not None:
                got.append(r)
        if not got:
            return 0.0
        job = statistics.fmean(j for j, _ in got)
        outside = statistics.fmean(o for _, o in got)
        value = max(1.0, (job + outside) / self.cores) / max(1.0, job / self.cores)
        self.samples.append(value)
        del self.samples[: -4 * self.window]
        return value

    @property
    def level(self) -> float:
        """The median of the last ``window`` samples; 0.0 before the first."""
        return statistics.median(self.samples[-self.window:]) if self.samples else 0.0

    def start(self) -> EnvironmentProbe:
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-env-probe")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample(self._stop.wait)
            except Exception:  # noqa: BLE001 - a probe failure must never touch detection
                logger.exception("environment probe failed")
                return

    def stop(self) -> None:
        self._stop.set()


def environment_change(before: Sequence[Mapping[int, float]], after: Sequence[Mapping[int, float]]
                       ) -> dict[int, float]:
    """Per device: median contention in ``after`` over median contention in ``before``
    (each a sequence of per-iteration ``{device: contention}``; 0 = not measured).
    Devices without measurements on both sides are left out."""
    def medians(rows: Sequence[Mapping[int, float]]) -> dict[int, float]:
        vals: dict[int, list[float]] = {}
        for row in rows:
            for d, v in row.items():
                if v > 0:
                    vals.setdefault(d, []).append(v)
        return {d: statistics.median(v) for d, v in vals.items()}

    b, a = medians(before), medians(after)
    return {d: a[d] / b[d] for d in a.keys() & b.keys() if b[d] > 0}
