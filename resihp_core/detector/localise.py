"""Localised or machine-wide: is one device slower than its peers? (docs/detector.md)

A slowdown that one device (its executor) shows more than the others is a fail-slow
whatever its cause — a slower device, other processes contending for its cores, a
throttled or duty-cycled process — because moving work away from it helps. One that
every device shows alike (the whole machine is loaded) or that the workload explains
(longer documents: the healthy model predicts them) is not: no plan runs faster around it.

The measure is per rank and per iteration: the log of its measured compute over its
healthy prediction for the same documents (:meth:`~.model.WorkloadModel.rank_compute`),
minus the median of the same quantity over the ranks of *other* executors (its peers).
The workload cancels in the ratio, a machine-wide slowdown cancels in the difference
(replicas of a DP-only job do the same kind of work and compare directly), and what is
left is how much slower this device is than its peers right now.

Thresholds are relative to the noise of each device's own healthy history of that
measure (:class:`PeerExcessWatch`): a device is flagged when its excess over its own
healthy level is above ``max(log(1 + floor), k x sigma)``, sigma the robust spread of
its healthy values, so the sensitivity depends on how steady the device's timing is,
not on how long an iteration takes.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import defaultdict, deque
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from resihp_core.detector import ProfileSet
    from resihp_core.protocol import IterationProfile

__all__ = ["PeerExcessWatch", "compute_of", "confined", "machine_noise", "median_without", "own_compute_of", "own_cores",
           "peer_excess", "peers_waiting", "robust_sigma", "unshared_waiting"]


def compute_of(p: IterationProfile) -> float:
    """Seconds of compute a rank measured in one iteration (Σ forward + backward)."""
    return sum(mb.forward_s + mb.backward_s for mb in p.microbatches)


def own_compute_of(p: IterationProfile) -> float:
    """Compute seconds without the time the rank was runnable but waited for a CPU other
    processes held (its run delay): the device's own work. A device slowed by itself (or
    an injected slowdown) lengthens it; a loaded host's scheduling noise mostly does
    not, so replicas that wait for each other's collectives still compare cleanly."""
    return max(0.0, compute_of(p) - p.compute_wait_s)


def peers_waiting(profiles: ProfileSet, device: int) -> float:
    """Median over the ranks of executors other than ``device``'s of the share of their
    measured compute they spent runnable but waiting for a CPU (0 when none measured).
    High on a loaded machine: there every rank's compute is mostly waiting, and which
    rank waits longest changes from one iteration to the next."""
    mine = [(p.replica, p.stage) for p in profiles.values() if p.device == device]
    shares = [min(1.0, p.compute_wait_s / c) for p in profiles.values()
              if (p.replica, p.stage) not in mine and (c := compute_of(p)) > 0]
    return statistics.median(shares) if shares else 0.0


def own_cores(iterations: Iterable[ProfileSet], devices: Iterable[int]) -> bool:
    """Whether ``devices`` ran on cores of their own over ``iterations``: each of their
    ranks reported its CPUs (``IterationProfile.cpus``, the affinity) and none of those
    CPUs may run a rank of another executor. Only then can other processes contend
    *its* cores and not its peers' (a pinned hog); a worker free to run where its peers
    run waits for a CPU by the scheduler's choice (docs/detector.md "Pinned or
    unpinned"). Unknown CPUs (a profile without them) count as shared."""
    want = set(devices)
    mine: set[int] = set()
    theirs: set[int] = set()
    executors: set[tuple[int, int]] = set()
    rows = [list(ps.values()) for ps in iterations]
    for row in rows:
        executors |= {(p.replica, p.stage) for p in row if p.device in want}
    seen = False
    for row in rows:
        for p in row:
            if p.device in want:
                if not p.cpus:
                    return False
                mine.update(p.cpus)
                seen = True
            elif (p.replica, p.stage) not in executors:
                if not p.cpus:
                    return False
                theirs.update(p.cpus)
    return seen and not (mine & theirs)


def confined(iterations: Iterable[ProfileSet], devices: Iterable[int]) -> bool:
    """Whether ``devices`` were held to CPUs their peers are not held to: cores of their
    own (:func:`own_cores`), or a subset of cores while the ranks of the other executors
    may also run elsewhere (a worker pinned to a core it shares with a noisy neighbour,
    its peers unpinned). Either way a load on its cores stays on it while the scheduler
    moves its peers away from it: its waiting is its host's, not the scheduler's luck
    (docs/detector.md "Pinned or unpinned"). Unknown CPUs count as shared."""
    rows = [list(ps.values()) for ps in iterations]
    want = set(devices)
    executors = {(p.replica, p.stage) for row in rows for p in row if p.device in want}
    mine: set[int] = set()
    theirs: set[int] = set()
    for row in rows:
        for p in row:
            if p.device not in want and (p.replica, p.stage) in executors:
                continue
            if not p.cpus:
                return False
            (mine if p.device in want else theirs).update(p.cpus)
    return bool(mine) and bool(theirs) and (not (mine & theirs) or bool(theirs - mine))


def unshared_waiting(rows: Sequence[ProfileSet], device: int, healthy: Callable[[IterationProfile], float],
                     bar: float, *, share: float = 0.5, spread: float = 2.0) -> list[tuple[float, float]] | None:
    """Evidence that ``device`` waits for a CPU its peers do not wait for (a noisy
    neighbour on its own cores), in *every* one of ``rows``, that a loaded machine's
    chance does not give: per iteration, with ``c`` a rank's measured compute over its
    healthy compute and ``w`` its waiting for a CPU in compute over the same,

    * its paired ratio ``c / median of the other executors' c`` is at least ``bar``;
    * it is the slowest: ``c`` above every other executor's (the same device each time);
    * at least ``share`` of its measured compute was that waiting (a neighbour holds the
      core it is held to; a rank waiting on a slower member inside a collective, or
      stopped, is off the CPU and shows none);
    * its waiting beyond the most any other executor waited (``w`` minus their largest)
      is at least half of its excess over them (``c`` minus their median): the excess
      is waiting its peers, under the same load, did not do;

    and over the iterations the paired ratio is consistent in size (largest over
    smallest at most ``spread``): a neighbour keeps taking about the same share of its
    core, while the scheduler's luck on a loaded machine swings 2-3x between iterations.
    Returns per iteration (its paired ratio, the share of its compute it waited) when
    all hold, else None (docs/detector.md "Contention its peers do not share")."""
    seen: list[tuple[float, float]] = []
    for ps in rows:
        mine = [p for p in ps.values() if p.device == device]
        if len(mine) != 1:
            return None
        me = mine[0]
        peers: dict[tuple[int, int], list[IterationProfile]] = defaultdict(list)
        for p in ps.values():
            if (p.replica, p.stage) != (me.replica, me.stage):
                peers[(p.replica, p.stage)].append(p)
        comp, h = compute_of(me), healthy(me)
        if not peers or comp <= 0 or not h > 0:
            return None
        c, w = comp / h, me.compute_wait_s / h
        pc: list[float] = []
        pw: list[float] = []
        for ranks in peers.values():
            hs = [(p, healthy(p)) for p in ranks]
            if not all(x > 0 for _, x in hs):
                return None
            pc.append(max(compute_of(p) / x for p, x in hs))
            pw.append(max(p.compute_wait_s / x for p, x in hs))
        med = statistics.median(pc)
        if not med > 0:
            return None
        ratio = c / med
        if (ratio < bar or c <= max(pc) or me.compute_wait_s < share * comp
                or w - max(pw) < 0.5 * (c - med)):
            return None
        seen.append((ratio, me.compute_wait_s / comp))
    if not seen or max(r for r, _ in seen) > spread * min(r for r, _ in seen):
        return None
    return seen


def machine_noise(noise: Mapping[int, float], devices: Iterable[int]) -> float:
    """The healthy paired noise to hold ``devices`` to: the largest of their own and the
    median over the other devices measured. The paired ratio's swings on a loaded host
    come mostly from the host's load, which every device's history samples; one device's
    estimate from a few of its own iterations can come out far below it by chance (0.25
    next to 0.7-0.8 for its peers on the same host), and a bar on it alone would take
    three unlucky iterations for a slowdown its peers do not share."""
    mine = set(devices)
    own = max((noise.get(d, 0.0) for d in mine), default=0.0)
    others = [x for d, x in noise.items() if d not in mine]
    return max(own, statistics.median(others)) if others else own


def robust_sigma(xs: list[float]) -> float:
    """Robust standard deviation (1.4826 x median absolute deviation); 0 for < 2 values."""
    if len(xs) < 2:
        return 0.0
    med = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - med) for x in xs)


def peer_excess(profiles: ProfileSet, healthy: Callable[[IterationProfile], float],
                measure: Callable[[IterationProfile], float] = compute_of,
                unreliable: Iterable[int] = ()) -> dict[int, float]:
    """Per device: log(measured / healthy compute) minus the median of that over the ranks
    of the other executors. Empty when fewer than two executors computed anything.
    ``measure``: the compute taken (:func:`compute_of`, or :func:`own_compute_of`).
    ``unreliable``: devices that are no reference for the others (known slow: their
    healthy compute has an estimated speed put in, and one a little off, or a device
    back at full speed, makes every peer look slow); their own excess is still given,
    and a device with no other peer gets none."""
    skip = set(unreliable)
    logs: dict[int, float] = {}
    ex: dict[int, tuple[int, int]] = {}
    for p in profiles.values():
        comp = measure(p)
        if comp <= 0:
            continue
        h = healthy(p)
        if not h > 0:
            continue
        logs[p.device] = math.log(comp / h)
        ex[p.device] = (p.replica, p.stage)
    if len(set(ex.values())) < 2:
        return {}
    # Every device of an executor has the same peers: one median per executor, taken
    # from the sorted values of the whole job less the executor's own (a few), so the
    # cost grows as N log N with the job, not N^2 (docs/detector.md, "At scale").
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for d in logs:
        groups[ex[d]].append(d)
    every = sorted(logs.values())
    trusted = sorted(x for d, x in logs.items() if d not in skip)
    out = {}
    for members in groups.values():
        own_trusted = [logs[d] for d in members if d not in skip]
        med = median_without(trusted, own_trusted)
        fallback = None
        for d in members:
            if med is not None:
                out[d] = logs[d] - med
            elif d in skip:  # no trusted peer: a known-slow device is held to all the others
                if fallback is None:
                    fallback = median_without(every, [logs[e] for e in members])
                if fallback is not None:
                    out[d] = logs[d] - fallback
    return out


def median_without(pool: Sequence[float], drop: Sequence[float]) -> float | None:
    """``statistics.median`` of the sorted values ``pool`` less the values ``drop`` (a
    sub-multiset of ``pool``), the same float; None when nothing is left. It costs a
    few steps per dropped value instead of a copy of ``pool``."""
    n = len(pool) - len(drop)
    if n <= 0:
        return None
    counts: dict[float, int] = {}
    for v in drop:
        counts[v] = counts.get(v, 0) + 1
    # a dropped value takes the first places its value has in pool
    spans = [(bisect.bisect_left(pool, v), c) for v, c in counts.items()]

    def kth(k: int) -> float:  # the k-th smallest value left (0-based)
        i = k
        while True:  # k + the places dropped up to i: rises to the first fixed point, a kept place
            j = k + sum(min(c, max(0, i + 1 - lo)) for lo, c in spans)
            if j == i:
                return pool[i]
            i = j

    if n % 2:
        return kth(n // 2)
    return (kth(n // 2 - 1) + kth(n // 2)) / 2


class PeerExcessWatch:
    """Flags a device whose peer excess stays above its own healthy noise.

    :param k: noise scales (robust sigma of the device's healthy peer excess) a value
        must exceed its healthy level by to count.
    :param floor: ... and at least ``log(1 + floor)``: slowdowns below ``1 + floor``
        are not worth a new plan.
    :param window: consecutive flagged iterations that make a localised slowdown (its
        onset is the first of them; 3 keeps the latency <= 3 iterations).
    :param min_history: healthy values a device needs before it can be flagged (the
        detector gives it the warm-up's at once, so a slowdown right after the warm-up
        is judged against them instead of becoming part of the "healthy" history).
    :param history: healthy values kept per device.
    :param cap: see :meth:`threshold` (verification caps its margin the same way).
    """

    def __init__(self, *, k: float = 4.0, floor: float = 0.25, window: int = 3, min_history: int = 3,
                 history: int = 32, cap: float = 1.0) -> None:
        if k <= 0 or floor <= 0 or window < 1 or min_history < 2 or history < min_history:
            raise ValueError("need k > 0, floor > 0, window >= 1, 2 <= min_history <= history")
        self.k, self.floor, self.window, self.min_history, self.cap = k, floor, window, min_history, cap
        self._history_len = history
        self.reset()

    def reset(self) -> None:
        self._healthy: dict[int, deque[float]] = defaultdict(lambda: deque(maxlen=self._history_len))
        self._run: dict[int, list[tuple[int, float]]] = {}  # device -> flagged (iteration, excess) in a row
        self._need: dict[int, int] = {}  # device -> iterations its current run must reach, if not ``window``

    def level(self, device: int) -> float:
        h = self._healthy.get(device)
        return statistics.median(h) if h else 0.0

    def sigma(self, device: int) -> float:
        """The device's healthy noise (robust sigma of its peer excess)."""
        h = self._healthy.get(device)
        return robust_sigma(list(h)) if h else 0.0

    def threshold(self, device: int) -> float:
        """Log excess over the healthy level that flags ``device`` (never more than
        ``log(1 + cap)``: a device ``1 + cap`` times slower than its peers is flagged
        however noisy its few healthy values looked)."""
        return max(math.log1p(self.floor), min(math.log1p(self.cap), self.k * self.sigma(device)))

    def extend(self, device: int, iterations: int) -> None:
        """``device``'s current run must reach ``iterations`` before it is found (again)."""
        if device in self._run:
            self._need[device] = max(iterations, len(self._run[device]) + 1, self._need.get(device, self.window))

    def flagged(self, device: int) -> int:
        """Iterations in a row ``device`` has been flagged (its current run)."""
        return len(self._run.get(device, ()))

    def healthy_count(self, device: int) -> int:
        """Healthy values ``device``'s noise is measured on."""
        return len(self._healthy.get(device, ()))

    def may_find(self) -> bool:
        """Whether the next :meth:`update` can return a device: a run is found when it
        reaches ``window`` iterations or more, so only a run already ``window - 1`` long
        can. Lets a caller skip work for what a find needs (:meth:`noise` of every device
        before the update) on the iterations that cannot find anything."""
        return self.window <= 1 or any(len(r) >= self.window - 1 for r in self._run.values())

    def noise(self) -> dict[int, float]:
        """Device -> healthy noise, for devices with enough history."""
        return {d: self.sigma(d) for d, h in self._healthy.items() if len(h) >= self.min_history}

    def update(self, iteration: int, excess: Mapping[int, float],
               longer: Callable[[int, list[int]], int] | None = None) -> dict[int, int]:
        """Add one iteration's peer excess; returns device -> onset iteration for every
        device flagged in each of the last ``window`` iterations (reported once per run).
        A run of flagged values that ends sooner was noise: its values join the healthy
        history (leaving them out would understate the noise).

        ``longer(device, iterations of its run)``, asked when a run reaches ``window``:
        the iterations the run must reach instead (more evidence where the evidence is
        weaker: docs/detector.md "False reports on a loaded machine"); its answer holds
        for the rest of the run."""
        found: dict[int, int] = {}
        least = math.log1p(self.floor)  # every threshold's floor: below it no noise scale is needed
        for d, x in excess.items():
            h = self._healthy[d]
            if len(h) >= self.min_history and (gap := x - self.level(d)) > least and gap > self.threshold(d):
                run = self._run.setdefault(d, [])
                run.append((iteration, x))
                if len(run) == self.window and longer is not None:
                    self._need[d] = max(self.window, longer(d, [i for i, _ in run]))
                if len(run) == self._need.get(d, self.window):
                    found[d] = run[0][0]
            else:
                if len(self._run.get(d, ())) < self._need.get(d, self.window):
                    h.extend(v for _, v in self._run.get(d, ()))
                self._run.pop(d, None)
                self._need.pop(d, None)
                h.append(x)
        for d in [d for d in self._run if d not in excess]:
            del self._run[d]
            self._need.pop(d, None)
        return found

    def rate_above(self, excess: float) -> float:
        """The share of every device's healthy values (those with ``min_history``)
        that were ``excess`` or more above their device's healthy level: how often the
        host's healthy noise alone gives a peer excess that large (0 when none kept)."""
        n = above = 0
        for h in self._healthy.values():
            if len(h) < self.min_history:
                continue
            level = statistics.median(h)
            n += len(h)
            above += sum(1 for x in h if x - level >= excess)
        return above / n if n else 0.0

    def forget(self, devices: Iterable[int]) -> None:
        """The slowdown of ``devices`` was judged: they start a new healthy history at
        their new level (a reported device stays slow until the next plan)."""
        for d in devices:
            self._healthy.pop(d, None)
            self._run.pop(d, None)
            self._need.pop(d, None)
