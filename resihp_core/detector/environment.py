"""Telling a device from its environment: a calibrated CPU probe outside the job.

A slowdown the whole machine feels (other processes' CPU load, a power cap) is not a
device failure: no plan runs faster around it. Each node agent runs
:class:`EnvironmentProbe` — a fixed amount of hashing, which releases the GIL, about
``target_s`` of CPU every ``interval_s`` — and reports the probe's **contention**: wall
time over CPU time of the same work, 1.0 when it never waited for a core. A probe that
runs outside the job slows when the machine is contended, not when a device of the job
is slow (an injected or real device slowdown does not take the agent's core).

The controller attaches each node's recent contention to every iteration it hands the
fail-slow detector; the verifier compares a suspect's compute slowdown with how much
its node's contention rose from before the change to the verification window
(:func:`environment_change`). See docs/security.md ("Fail-slow and the environment").
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import threading
import time
from typing import Callable, Mapping, Sequence

__all__ = ["EnvironmentProbe", "contention", "environment_change"]

logger = logging.getLogger("resihp.environment")


def contention(buf: bytes) -> tuple[float, float]:
    """Hash ``buf`` once; returns (wall seconds, contention = wall / CPU seconds >= 1)."""
    w0, c0 = time.perf_counter(), time.thread_time()
    hashlib.sha256(buf).digest()
    wall, cpu = time.perf_counter() - w0, time.thread_time() - c0
    return wall, max(1.0, wall / cpu) if cpu > 0 else 1.0


class EnvironmentProbe:
    """Samples the machine's CPU contention from a background thread of this process.

    :param interval_s: time between samples.
    :param target_s: CPU seconds one sample costs (long enough to outlast the scheduler's
        wake-up credit, so a contended machine shows; ~2 % of a core by default).
    :param window: samples in :attr:`level` (their median).
    """

    def __init__(self, interval_s: float = 0.25, target_s: float = 0.005, window: int = 3,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s <= 0 or target_s <= 0 or window < 1:
            raise ValueError("need interval_s > 0, target_s > 0 and window >= 1")
        self.interval_s, self.target_s, self.window = interval_s, target_s, window
        self.samples: list[float] = []
        self._buf = self._calibrate(target_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._clock = clock

    @staticmethod
    def _calibrate(target_s: float) -> bytes:
        size = 1 << 16
        while size < 1 << 30:
            c0 = time.thread_time()
            hashlib.sha256(b"\0" * size).digest()
            if time.thread_time() - c0 >= target_s / 4:
                break
            size *= 2
        c0 = time.thread_time()
        buf = b"\0" * size
        hashlib.sha256(buf).digest()
        cpu = max(1e-6, time.thread_time() - c0)
        return b"\0" * max(1 << 16, int(size * target_s / cpu))

    def sample(self) -> float:
        """Take one sample now (also what the thread does)."""
        _, c = contention(self._buf)
        self.samples.append(c)
        del self.samples[: -4 * self.window]
        return c

    @property
    def level(self) -> float:
        """The median of the last ``window`` samples; 0.0 before the first."""
        return statistics.median(self.samples[-self.window:]) if self.samples else 0.0

    def start(self) -> EnvironmentProbe:
        self._thread = threading.Thread(target=self._run, daemon=True, name="resihp-env-probe")
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sample()
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
