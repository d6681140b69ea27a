"""Busy processes that load chosen cores *from the same moment* (tests and benchmarks of
the Detector, docs/detector.md "Measured").

A busy process started with ``subprocess.Popen`` begins to load its core only once its
interpreter is up, which on a loaded 2-core machine takes seconds: hogs meant for every
core then load the first core alone for several iterations (a localised slowdown, which
the detector rightly reports), and a hog meant to start at an iteration starts several
later (the measured latency grows by the start-up). :class:`CpuHogs` starts every process,
pins it, waits until each one says it is ready, and only then lets them all spin at once
(:meth:`release`); the caller takes the onset after the release.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from typing import Iterable

__all__ = ["CpuHogs"]

# Waits for one line on stdin (the release), then spins until ``seconds`` pass or its
# parent is gone (so a killed test leaves nothing behind).
_SCRIPT = ("import os, sys, time\nsys.stdout.write('ready\\n'); sys.stdout.flush()\nsys.stdin.readline()\n"
           "end = time.time() + {seconds}\nwhile time.time() < end and os.getppid() != 1: pass\n")


class CpuHogs:
    """Busy processes, ``per_core`` pinned to each of ``cores`` (``None``: not pinned,
    ``per_core`` of them in all), held until :meth:`release`. Use as a context manager
    or call :meth:`kill`; every process is ended by its pid.

    :param ready_timeout_s: how long to wait for every process to be up before
        releasing the ones that are (a :class:`TimeoutError` names how many were not).
    """

    def __init__(self, cores: Iterable[int] | None, per_core: int = 3, seconds: float = 300.0,
                 ready_timeout_s: float = 60.0) -> None:
        if per_core < 1:
            raise ValueError(f"per_core must be >= 1, got {per_core}")
        self.cores = None if cores is None else list(cores)
        self.per_core, self.seconds, self.ready_timeout_s = per_core, seconds, ready_timeout_s
        self.procs: list[subprocess.Popen] = []
        self._core: dict[int, int | None] = {}  # pid -> the core it is pinned to
        self.released_at: float | None = None

    def start(self) -> CpuHogs:
        """Start and pin every process; returns when all are ready (held, not spinning)."""
        script = _SCRIPT.format(seconds=float(self.seconds))
        # Interleaved over the cores: no core's hogs are all started before another's.
        targets: list[int | None] = ([None] * self.per_core if self.cores is None
                                     else [c for _ in range(self.per_core) for c in self.cores])
        for core in targets:
            p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.procs.append(p)
            self._core[p.pid] = core
            if core is not None:
                os.sched_setaffinity(p.pid, {core})
        deadline = time.monotonic() + self.ready_timeout_s
        waiting = {p.stdout.fileno(): p for p in self.procs if p.stdout is not None}
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(waiting)} of {len(self.procs)} busy processes not up after "
                                   f"{self.ready_timeout_s:.0f} s")
            ready, _, _ = select.select(list(waiting), [], [], left)
            for fd in ready:
                p = waiting.pop(fd)
                if not os.read(fd, 64):
                    raise RuntimeError(f"busy process {p.pid} exited before it was ready (rc {p.poll()})")
        return self

    def release(self) -> float:
        """Let every process spin now; returns the time (``time.monotonic``) of the release."""
        for p in self.procs:
            if p.stdin is not None:
                try:
                    p.stdin.write(b"go\n")
                    p.stdin.flush()
                except (BrokenPipeError, OSError):
                    pass
        self.released_at = time.monotonic()
        return self.released_at

    def kill(self, cores: Iterable[int] | None = None) -> None:
        """End the processes pinned to ``cores`` (``None``: every one), by pid."""
        want = None if cores is None else set(cores)
        keep = []
        for p in self.procs:
            if want is not None and self._core.get(p.pid) not in want:
                keep.append(p)
                continue
            p.kill()
            p.wait(10)
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        self.procs = keep

    def __enter__(self) -> CpuHogs:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.kill()
