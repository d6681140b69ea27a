"""A worker stopped part of the time, as a throttled or preempted process is: SIGSTOP
and SIGCONT by its pid (tests and benchmarks of the Detector, docs/detector.md)."""

from __future__ import annotations

import os
import signal
import threading
import time

__all__ = ["duty_cycle", "duty_period"]


def duty_period(iteration_s: float) -> float:
    """A stop cycle several times shorter than the job's healthy iteration, so that every
    iteration is stopped about half of its time (a 0.2 s cycle against ~0.07 s
    iterations stopped some iterations whole and left others alone). At least 20 ms
    (signals and a thread's sleep are not much finer), at most 0.2 s."""
    return min(0.2, max(0.02, iteration_s / 4))


def duty_cycle(pid: int, stop: threading.Event, period: float) -> tuple[float, float]:
    """Stop ``pid`` for half of every ``period`` until ``stop`` is set (or the process is
    gone), then let it run; returns (seconds it was stopped, seconds the cycling took)."""
    t0, held = time.monotonic(), 0.0
    try:
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            s0 = time.monotonic()
            time.sleep(period / 2)
            os.kill(pid, signal.SIGCONT)
            held += time.monotonic() - s0
            time.sleep(period / 2)
    except ProcessLookupError:
        pass
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    return held, time.monotonic() - t0
