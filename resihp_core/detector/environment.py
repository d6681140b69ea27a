"""Telling a device from its environment: the time a worker waits for a CPU.

A slowdown caused by other processes on the machine is not a device failure: no plan
runs faster around it. A compute chunk's wall time splits into three parts (Linux
accounts the first two per thread, ``/proc/thread-self/schedstat``)::

    wall = time on a CPU + time runnable but waiting for a CPU (run delay) + time off the CPU

A slow device lengthens the first (a slower processor) or the third (waiting for a slow
accelerator; the :class:`~resihp_core.runtime.worker.injector.FaultInjector` sleeps); other
processes competing for the cores lengthen only the second. :class:`CpuWaitMeter` sums
the training thread's run delay over each iteration and over its compute chunks; the
worker sends both in its :class:`~resihp_core.protocol.IterationProfile`
(``cpu_wait_s``, ``compute_wait_s``) and verification takes the rise of that wait
over its healthy level out of the measured compute before it blames a device
(docs/design.md, "Device or environment").

This replaced a node-wide estimate (:class:`EnvironmentProbe`, still reported by the
agents and quoted in the evidence, no longer a deciding input): the contention factor
other runnable tasks impose on an average worker. The scheduler is not fair per process
over short windows, so one executor could lose far more time than the node average
(1.69x slower against a 1.26x contention rise); the worker's own run delay measures
exactly the time it lost.
"""

from __future__ import annotations

import logging
import os
import statistics
import threading
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from resihp_core.protocol import IterationProfile

__all__ = [
    "CpuWaitMeter", "allowed_cpus", "EnvironmentProbe", "environment_change", "is_running", "run_delay_s", "runnable_tasks",
    "wait_shares",
]

logger = logging.getLogger("resihp.environment")


def runnable_tasks() -> int | None:
    """Tasks (threads) runnable on this machine right now (None: unknown). The first
    number of ``/proc/loadavg``'s fourth field: the kernel's ``nr_running()``, the same
    count as ``/proc/stat``'s ``procs_running``, from a file of a few bytes instead of
    one the kernel builds from every CPU's counters (the probe reads it 20 times a
    second on every node)."""
    try:
        with open("/proc/loadavg", "rb") as f:
            return int(f.read().split()[3].split(b"/")[0])
    except (OSError, ValueError, IndexError):
        return None


def is_running(pid: int) -> bool:
    """Whether process ``pid``'s main thread is runnable (state R)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return False
    end = text.rfind(b")")
    return text[end + 2:end + 3] == b"R"


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def allowed_cpus() -> tuple[int, ...]:
    """The CPUs the calling thread may run on (its affinity), sorted; () where the
    platform does not say. Sent in every profile (``IterationProfile.cpus``): whether a
    worker has cores of its own decides how its waiting for a CPU is read
    (docs/detector.md "Pinned or unpinned"). One system call, read every iteration since
    a worker may be pinned after it starts."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return ()


_SCHEDSTAT = "/proc/thread-self/schedstat"
_no_schedstat = False


def run_delay_s() -> float | None:
    """Seconds the calling thread has been runnable but waiting for a CPU since it
    started (the second field of ``/proc/thread-self/schedstat``); None where the kernel
    does not say (not Linux, or no scheduler statistics): nothing is corrected then."""
    global _no_schedstat
    if _no_schedstat:
        return None
    try:
        with open(_SCHEDSTAT, "rb") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        _no_schedstat = True
        return None


class CpuWaitMeter:
    """The training thread's waits for a CPU over one iteration and over its compute
    chunks (see the module docstring). The worker calls :meth:`start_iteration`; every
    primitive starts with :meth:`start_chunk` (``AdapterContext.step``) and every compute
    chunk ends with :meth:`end_chunk` (``FaultInjector.stretch``, before any injected
    sleep). Readings from any thread but the one that started the iteration are ignored."""

    def __init__(self, clock: Callable[[], float | None] | None = None) -> None:
        self.clock = clock  # None: this thread's schedstat, through a file kept open
        self.compute_s = 0.0  # waited during this iteration's compute chunks
        self._iteration0: float | None = None
        self._chunk0: float | None = None
        self._thread = threading.get_ident()  # readings of one thread only are comparable
        self._fd: int | None = None
        self._fd_thread: int | None = None

    def _read(self) -> float | None:
        if threading.get_ident() != self._thread:
            return None
        if self.clock is not None:
            return self.clock()
        if self._fd_thread != self._thread:
            # An open /proc/thread-self file stays the opening thread's: re-read with
            # pread (~3 us) instead of opening it at every primitive (~13 us).
            self._close()
            self._fd_thread = self._thread
            if not _no_schedstat:
                try:
                    self._fd = os.open(_SCHEDSTAT, os.O_RDONLY)
                except OSError:
                    self._fd = None
        if self._fd is None:
            return None
        try:
            return int(os.pread(self._fd, 128, 0).split()[1]) / 1e9
        except (OSError, IndexError, ValueError):
            return None

    def _close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def __del__(self) -> None:
        self._close()

    def start_iteration(self) -> None:
        self._thread = threading.get_ident()
        self._iteration0 = self._chunk0 = self._read()
        self.compute_s = 0.0

    def start_chunk(self) -> None:
        self._chunk0 = self._read()

    def end_chunk(self) -> None:
        now = self._read()
        if now is not None and self._chunk0 is not None:
            self.compute_s += max(0.0, now - self._chunk0)
        self._chunk0 = now  # a chunk that follows without its own start counts from here

    def iteration_s(self) -> float:
        """Waited since :meth:`start_iteration` (0.0 when not measurable)."""
        now = self._read()
        if now is None or self._iteration0 is None:
            return 0.0
        return max(0.0, now - self._iteration0)


class EnvironmentProbe:
    """Samples the CPU demand of processes outside the job, from a background thread
    (the node agent's; reported to the controller and quoted in verification evidence).

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


def wait_shares(iterations: Iterable[Mapping[int, IterationProfile]]) -> dict[int, tuple[float, float]]:
    """Per device: the share of its compute, and of its time outside compute, that it
    spent waiting for a CPU over ``iterations`` (per-rank profiles). Taken over healthy
    iterations it is the waiting a healthy prediction already contains. Devices that
    reported no waiting at all are left out (not measured, or nothing to take out)."""
    sums: dict[int, list[float]] = {}
    for profiles in iterations:
        for p in profiles.values():
            comp = sum(mb.forward_s + mb.backward_s for mb in p.microbatches)
            s = sums.setdefault(p.device, [0.0, 0.0, 0.0, 0.0])
            s[0] += p.compute_wait_s
            s[1] += comp
            s[2] += max(0.0, p.cpu_wait_s - p.compute_wait_s)
            s[3] += max(0.0, p.iteration_s - comp)
    return {d: (w / c if c > 0 else 0.0, wo / o if o > 0 else 0.0)
            for d, (w, c, wo, o) in sums.items() if w > 0 or wo > 0}
