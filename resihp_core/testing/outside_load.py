"""How much CPU processes *outside* a test used on the test's cores (tests of the
Detector, docs/detector.md "Tests").

The detector's timing targets (a report within 3 iterations) are asserted only on a
machine that the test does not share with much else. The load average cannot tell:
it counts the test's own workers, hogs, agents and controller as well, which on 2
cores already put it above the cores, so a test gated on it never asserted its
targets anywhere, CI included. :class:`OutsideLoad` measures the other processes
instead: the busy time of the test's cores (``/proc/stat``, per CPU) minus the CPU
time of the test's own process tree (this process and every descendant, the ones
that ended included: their time is in their parents' ``cutime``/``cstime`` once
reaped). What is left is CPU that other jobs took on those cores while the test ran,
in cores (CPU seconds per second).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Iterable

__all__ = ["OutsideLoad", "own_cpu_seconds"]

_TICK = float(os.sysconf("SC_CLK_TCK"))


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command (field 3, state, is index 0)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def own_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds used so far by ``root`` (default: this process) and all its
    descendants, live or ended and reaped within the tree."""
    root = os.getpid() if root is None else root
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        f = _stat_fields(int(name))
        if f is None or len(f) < 15:
            continue
        pid = int(name)
        parent[pid] = int(f[1])
        # utime, stime, cutime, cstime (fields 14-17)
        cpu[pid] = sum(int(x) for x in f[11:15]) / _TICK
    children: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        children.setdefault(pp, []).append(pid)
    total, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        total += cpu.get(pid, 0.0)
        todo.extend(children.get(pid, ()))
    return total


def busy_cpu_seconds(cores: Iterable[int]) -> float:
    """Busy seconds (everything but idle and iowait) of ``cores`` since boot."""
    want = {f"cpu{c}" for c in cores}
    total, found, every = 0, False, 0
    with open("/proc/stat") as f:
        for line in f:
            parts = line.split()
            if not parts or not parts[0].startswith("cpu"):
                continue
            # user nice system idle iowait irq softirq steal (guest is inside user)
            v = [int(x) for x in parts[1:9]]
            busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]
            if parts[0] == "cpu":
                every = busy
            elif parts[0] in want:
                total, found = total + busy, True
    # A /proc/stat whose CPUs are numbered otherwise (some containers): the whole machine.
    return (total if found else every) / _TICK


@dataclass(frozen=True)
class _Sample:
    time: float
    busy: float
    own: float


class OutsideLoad:
    """CPU that processes outside this test's tree used on its cores, sampled with
    :meth:`sample` (each sample walks /proc: a few milliseconds).

    :param cores: the cores watched (default: this process's affinity, which its
        children inherit: the test's own work runs there).
    :param root: the root of the test's own process tree (default: this process).
    """

    def __init__(self, cores: Iterable[int] | None = None, root: int | None = None) -> None:
        self.cores = sorted(os.sched_getaffinity(0) if cores is None else cores)
        self.root = os.getpid() if root is None else root
        self.samples: list[_Sample] = []

    def sample(self) -> None:
        self.samples.append(_Sample(time.monotonic(), busy_cpu_seconds(self.cores), own_cpu_seconds(self.root)))

    def cpu_seconds(self) -> float:
        """Outside CPU seconds between the first and the last sample (>= 0)."""
        if len(self.samples) < 2:
            return 0.0
        a, b = self.samples[0], self.samples[-1]
        return max(0.0, (b.busy - a.busy) - (b.own - a.own))

    def cores_used(self) -> float:
        """Outside CPU seconds per second between the first and the last sample."""
        if len(self.samples) < 2:
            return 0.0
        wall = self.samples[-1].time - self.samples[0].time
        return self.cpu_seconds() / wall if wall > 0 else 0.0

    def peak(self, seconds: float = 2.0) -> float:
        """The largest :meth:`cores_used` over spans of consecutive samples at least
        ``seconds`` long (a burst of other work during a few iterations)."""
        best, j = 0.0, 0
        for i in range(len(self.samples)):
            while j < i and self.samples[i].time - self.samples[j + 1].time >= seconds:
                j += 1
            a, b = self.samples[j], self.samples[i]
            if b.time - a.time >= seconds:
                best = max(best, max(0.0, (b.busy - a.busy) - (b.own - a.own)) / (b.time - a.time))
        return best

    def quiet(self, share: float = 0.25) -> bool:
        """Whether other processes used at most ``share`` of the watched cores' capacity
        over the samples (a fresh CI machine running only this suite: about 0)."""
        return len(self.samples) >= 2 and self.cores_used() <= share * len(self.cores)

    def describe(self) -> str:
        return (f"outside CPU {self.cores_used():.2f} cores (peak {self.peak():.2f} over 2 s) "
                f"on cores {self.cores}")
