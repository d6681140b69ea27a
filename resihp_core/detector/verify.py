"""Verification: localise a suspected fail-slow to device(s) and a cause (docs/design.md §3.2).

Two strategies behind :class:`~resihp_core.detector.VerificationStrategy`:

:class:`ProfileVerifier` (``"resihp"``) works from the per-rank profiles of the
iterations since the change point and the healthy model, and probes only where the
profiles cannot decide. It applies :attr:`ProfileVerifier.RULES` in order, each a
method whose docstring says what evidence it reads; the verdict names the rule that
decided (``Verdict.rule``; docs/detector.md "Verification rules"). In outline:

0. **localised or machine-wide** (docs/detector.md) — a suspect must be slower than the
   median of the other executors by its margin (``compute_margin``, or more where its
   device's healthy timing is noisier: ``VerificationContext.noise``), over the
   iterations verified and in most of them: every executor slowed alike is the
   machine, not a device. A localised suspect whose lost time is mostly time its
   training thread waited for a CPU other processes held (its run delay beyond the
   share the healthy prediction contains; :mod:`~resihp_core.detector.environment`)
   is reported with cause ``"contention"`` — unless its peers waited much as well
   (the whole machine is contended, unevenly), or it may run on its peers' CPUs (not
   pinned: the scheduler's choice) and its waiting is not persistent and large
   (docs/detector.md "Pinned or unpinned"). With a single executor (no peers) such
   waiting is the environment's. A device's own slowdown is measured with the waiting
   taken out.

1. **compute** — each rank's measured compute (Σ forward + backward of its
   micro-batches) over its healthy prediction for the same documents gives a slowdown
   ``q``. Executors (replica, stage) with ``q`` above their margin and at least half
   the worst executor's excess are suspects.

   * TP degree 1: the device is found, ``p = 1 / q``.
   * TP > 1 and the ranks of the group differ (the adapter timed pure compute): the
     ranks well above the group's fastest are the slow ones.
   * TP > 1 and the whole group is uniformly slow — what a TP group looks like when one
     member drags the per-layer collectives — the profiles cannot decide: a compute
     probe on the group's devices names the slow one(s); if every device computes at
     full speed the group's intra-node link is probed instead (a TP-communication
     slowdown looks like compute in per-chunk timings).

2. **communication** — no executor is slow in compute, yet the iteration is: each
   rank's time outside compute is compared with what the healthy model expects. If the
   excess sits on a few ranks (loosely coupled work), those are the devices; if it is
   spread over the job (pipelines and the DP sync make everyone wait for one slow
   link), a link probe over all devices finds the slow link(s).

Normalised throughput: compute ``p = healthy / measured`` compute time; communication
``p`` is the device's link throughput relative to healthy (from the probe), or, when
the profiles localise it, expected / measured time outside compute.

:class:`GreyhoundVerifier` (``"greyhound"``) is the baseline's (docs/design.md §7): it profiles
every device — a compute probe on all of them and a link probe per kind of
communication group — and calls a device a compute straggler above 2x the median
probe time and a communication straggler above 1.1x. Without a prober it applies the
same ratios to the per-rank profile totals.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from resihp_core.detector import VerificationContext, Verdict, _clip_p
from resihp_core.detector.environment import wait_shares
from resihp_core.detector.localise import compute_of, confined, machine_noise, own_compute_of

if TYPE_CHECKING:
    from resihp_core.protocol import IterationProfile

__all__ = ["GreyhoundVerifier", "ProfileVerifier", "make_greyhound_verifier", "make_profile_verifier"]


def _references(groups: Mapping[tuple[int, int], list[int]], ex: tuple[int, int], t: _Totals,
                known_slow: frozenset[int], fast: float) -> list[tuple[int, int]]:
    """The other executors whose compute over healthy ``ex``'s is compared with. Not an
    executor with a known-slow device (``VerificationContext.known_slow``) that computed
    faster than its prediction, which has the estimated speed in it, by more than the
    margin (under ``fast`` over the iterations verified): back at full speed, or slowed
    less than estimated, against it every peer looks slow by that factor (CI reported a
    healthy device at 1.5x against a peer just back at full speed). Running as slow as
    known it is a reference like any other. Where ``ex`` has a known-slow device too and
    no other is left, all of them are (as :func:`~.localise.peer_excess`). Empty:
    nothing to compare ``ex`` with, so it is not above its peers."""
    others = [e for e in groups if e != ex]
    if not known_slow:
        return others
    unreliable = {e for e in others if any(t.device[r] in known_slow for r in groups[e])
                  and max(t.q(r) for r in groups[e]) < fast}
    reliable = [e for e in others if e not in unreliable]
    mine = any(t.device[r] in known_slow for r in groups[ex])
    return reliable if reliable or not mine else others


def _fmt(ps: dict[int, float]) -> str:
    return ", ".join(f"device {d}: p={p:.2f}" for d, p in sorted(ps.items()))


class _Totals:
    """Per-rank sums over the iterations being verified."""

    def __init__(self, ctx: VerificationContext) -> None:
        self.measured: dict[int, float] = defaultdict(float)  # compute seconds
        self.predicted: dict[int, float] = defaultdict(float)
        self.outside: dict[int, float] = defaultdict(float)  # iteration - compute
        self.compute_wait: dict[int, float] = defaultdict(float)  # runnable, waiting for a CPU
        self.outside_wait: dict[int, float] = defaultdict(float)
        self.expected_outside: dict[int, float] = defaultdict(float)
        self.iteration_measured = 0.0
        self.iteration_predicted = 0.0
        # Per iteration verified, per rank: (outside, its waiting there, expected outside).
        self.outside_each: list[dict[int, tuple[float, float, float]]] = []
        self.device: dict[int, int] = {}
        self.executor: dict[int, tuple[int, int]] = {}
        self.have_model = True
        model: Any = ctx.model
        ready = model is not None and getattr(model, "ready", False)
        self._model = model if ready else None
        for profiles in ctx.iterations:
            it_meas = max(p.iteration_s for p in profiles.values())
            it_pred = None
            if ready:
                try:
                    it_pred = model.predict_healthy(next(iter(profiles.values())).iteration, profiles)
                except Exception:  # noqa: BLE001 - a model that cannot predict: fall back to peers
                    it_pred = None
            self.iteration_measured += it_meas
            self.iteration_predicted += it_pred or 0.0
            each: dict[int, tuple[float, float, float]] = {}
            self.outside_each.append(each)
            for rank, p in profiles.items():
                comp = sum(mb.forward_s + mb.backward_s for mb in p.microbatches)
                self.measured[rank] += comp
                self.outside[rank] += max(0.0, p.iteration_s - comp)
                self.compute_wait[rank] += p.compute_wait_s
                self.outside_wait[rank] += max(0.0, p.cpu_wait_s - p.compute_wait_s)
                self.device[rank] = p.device
                self.executor[rank] = (p.replica, p.stage)
                pred = None
                if ready:
                    try:
                        pred = model.rank_compute(p)
                    except Exception:  # noqa: BLE001
                        pred = None
                if pred is None:
                    self.have_model = False
                else:
                    self.predicted[rank] += pred
                    if it_pred is not None:
                        self.expected_outside[rank] += max(0.0, it_pred - pred)
                each[rank] = (max(0.0, p.iteration_s - comp), max(0.0, p.cpu_wait_s - p.compute_wait_s),
                              max(0.0, it_pred - pred) if it_pred is not None and pred is not None else 0.0)
        if not self.have_model:
            self._peer_predictions(ctx)
        # The waiting for a CPU the predictions already contain: the model's warm-up
        # (healthy by assumption, the level its predictions come from), else the
        # iterations just before the change.
        shares = getattr(model, "wait_share", None) if ready else None
        self.wait_share: dict[int, tuple[float, float]] = shares if shares is not None else wait_shares(ctx.before)

    def _peer_predictions(self, ctx: VerificationContext) -> None:
        """No model: a rank's "healthy" compute is the median of its stage's ranks."""
        by_stage: dict[int, list[float]] = defaultdict(list)
        for r, m in self.measured.items():
            by_stage[self.executor[r][1]].append(m)
        self.predicted = defaultdict(float, {
            r: statistics.median(by_stage[self.executor[r][1]]) for r in self.measured
        })
        med_out = statistics.median(self.outside.values()) if self.outside else 0.0
        self.expected_outside = defaultdict(float, {r: med_out for r in self.outside})

    def rank_prediction(self, p: IterationProfile, profiles: Mapping[int, IterationProfile]) -> float | None:
        """Healthy compute of one rank in one iteration: the model's, else the median of
        its stage's ranks in that iteration."""
        if self._model is not None and self.have_model:
            try:
                return float(self._model.rank_compute(p))
            except Exception:  # noqa: BLE001 - a model that cannot predict: fall back to peers
                pass
        same = [compute_of(o) for o in profiles.values() if o.stage == p.stage]
        return statistics.median(same) if same else None

    def q(self, rank: int) -> float:
        """Measured over healthy compute."""
        pred = self.predicted.get(rank, 0.0)
        return self.measured[rank] / pred if pred > 0 else 1.0

    def waited(self, rank: int) -> float:
        """Compute seconds ``rank`` lost waiting for a CPU, beyond its healthy share."""
        share = self.wait_share.get(self.device[rank], (0.0, 0.0))[0]
        return max(0.0, self.compute_wait[rank] - share * self.predicted.get(rank, 0.0))

    def device_measured(self, rank: int) -> float:
        """Measured compute without the time other processes held the CPU: the device's own."""
        return self.measured[rank] - self.waited(rank)

    def qd(self, rank: int) -> float:
        """The device's own compute slowdown (:meth:`q` without the waiting for a CPU)."""
        pred = self.predicted.get(rank, 0.0)
        return self.device_measured(rank) / pred if pred > 0 else 1.0

    def qo(self, rank: int) -> float:
        """The device's own compute slowdown as the per-device watch reads it: measured
        compute with *all* its waiting for a CPU taken out, over the healthy compute
        with its healthy waiting taken out. :meth:`qd` keeps the healthy waiting in both,
        which on a loaded host (waiting 80 % of the compute in the warm-up) dilutes a
        device 6x slower in its own compute to under 2x: verification then found "no
        compute suspect" where the own-compute watch had flagged it (docs/detector.md
        "Measured")."""
        pred = self.predicted.get(rank, 0.0)
        share = self.wait_share.get(self.device[rank], (0.0, 0.0))[0]
        base = pred * (1.0 - share)
        if not base > 0:
            return self.qd(rank)
        return max(0.0, self.measured[rank] - self.compute_wait[rank]) / base

    def outside_waited(self, rank: int) -> float:
        """Seconds outside compute ``rank`` lost waiting for a CPU, beyond its healthy share."""
        share = self.wait_share.get(self.device[rank], (0.0, 0.0))[1]
        return max(0.0, self.outside_wait[rank] - share * self.expected_outside.get(rank, 0.0))

    def device_outside(self, rank: int) -> float:
        """Time outside compute without its waiting for a CPU beyond the healthy share."""
        return max(0.0, self.outside[rank] - self.outside_waited(rank))

    def outside_excess_each(self) -> list[dict[int, float]]:
        """Per iteration verified: each rank's time outside compute (its waiting for a CPU
        beyond the healthy share taken out) minus what the healthy model expects."""
        out = []
        for each in self.outside_each:
            row = {}
            for r, (outside, waited, expected) in each.items():
                share = self.wait_share.get(self.device[r], (0.0, 0.0))[1]
                if not self.have_model:
                    expected = self.expected_outside[r] / max(1, len(self.outside_each))
                row[r] = max(0.0, outside - max(0.0, waited - share * expected)) - expected
            out.append(row)
        return out


@dataclass
class _Case:
    """One verification's evidence, as :attr:`ProfileVerifier.RULES` read and narrow it.

    Per executor (replica, stage): ``raw`` its worst rank's measured compute over
    healthy, ``worst`` the same without the waiting for a CPU, ``margin`` /
    ``own_margin`` the relative excess that makes it a suspect. ``local``: the suspects
    slower than their peers; ``dismissed``: localised suspects a rule put down to the
    environment, with that rule's name."""

    ctx: VerificationContext
    t: _Totals
    groups: dict[tuple[int, int], list[int]]
    raw: dict[tuple[int, int], float]
    worst: dict[tuple[int, int], float]
    margin: dict[tuple[int, int], float]
    own_margin: dict[tuple[int, int], float]
    suspects: dict[tuple[int, int], list[int]]
    local: set[tuple[int, int]] = field(default_factory=set)
    dismissed: dict[tuple[int, int], str] = field(default_factory=dict)
    memo: dict[tuple[str, tuple[int, int]], tuple[int, int]] = field(default_factory=dict)
    probe_only: bool = False  # machine-wide compute set aside: only a link probe may name a link


class ProfileVerifier:
    """ResiHP's verification: profiles first, targeted probes only when they cannot decide.

    :param compute_margin: an executor is a compute suspect when its compute is this
        much (relative) above healthy, or ``noise_k`` noise scales of its devices'
        healthy timing where that is more (``VerificationContext.noise``).
    :param spread: ranks of one TP group are told apart when their slowdowns differ by
        more than this (relative).
    :param probe_margin: a probed device is slow when its throughput is below 1 - this.
    :param concentrated: communication excess is "localised by profiles" when the ranks
        holding at least half of the largest excess are at most this fraction of all.
    :param share: an executor is a compute suspect only if its excess slowdown is at
        least this fraction of the worst executor's.
    :param waiting: a compute suspect whose waiting for a CPU (beyond its healthy share)
        is at least this fraction of its lost compute time was slowed by contention of
        its host: reported with cause ``"contention"`` when it is slower than its peers,
        the environment's (not reported) in a job of one executor.
    :param noise_k: see ``compute_margin``.
    :param max_margin: the noise-relative margin is at most this: a noise estimate from a
        few wild iterations (a warm-up on a loaded machine) must not hide a device
        computing twice as slowly as its peers.
    :param shared_wait: a suspect slowed by contention is the machine's when its peers
        lost at least this share of their compute waiting for a CPU too.
    :param loaded_share: the machine is loaded where a suspect's peers spent at least
        this share of their measured compute (absolute, not beyond healthy) waiting for a
        CPU; there a suspect slowed only by waiting must be above its peers in at least
        ``loaded_iterations`` iterations verified, all of them but one (docs/detector.md
        "False reports on a loaded machine").
    :param loaded_iterations: see ``loaded_share``.
    :param unpinned_iterations: a suspect slowed only by waiting for a CPU on CPUs its
        peers may use too (not pinned to cores of its own, or its CPUs unknown) must be
        above its peers in this many iterations verified, all but one, and
    :param unpinned_ratio: at least this much slower than its peers over them; else it
        is the scheduler's unevenness (docs/detector.md "Pinned or unpinned").
    :param unshared_ratio: a suspect held to CPUs of its own (``confined``) that computed
        at least this much slower than the median of its peers *in the same iteration*,
        in every iteration verified (all but one from 4 on), and over them together, is
        slowed by contention its peers do not share: localised and not the machine's,
        however much its peers waited too (docs/detector.md "Contention its peers do not
        share"). The same load on every rank cancels in that paired ratio; uneven load
        that moves between ranks does not hold it in every iteration.
    :param unshared_k: ... and at least ``exp(unshared_k * sigma)`` in each of those
        iterations, sigma its healthy per-iteration noise relative to its peers
        (``VerificationContext.noise``): a device whose paired ratio swings widely when
        healthy needs a larger one. Verification runs when the per-device watch has
        already seen 3 high values, so the bar must stand on its own: healthy noise puts
        3 iterations in a row above 2 sigma about once in 80 000 (one-sided 2.3 % each),
        as rare as 6 in a row above the watch's 2x cap at the noise of a loaded host.
    :param unshared_spread: ... and the paired ratios above that bar within this factor
        of each other: a neighbour takes about the same share of its core in every
        iteration, while a loaded host's stalls swing it 3-4x (7.5x, 6.3x, then 1.9x its
        peer in a no-fault run at load 18-28 on 2 cores).
    :param loaded_own_ratio: an executor sharing its CPUs with its peers (not
        ``confined``) on a loaded machine (peers waiting ``loaded_share`` of their compute
        or more) is above its peers in its own compute (waiting for a CPU taken out) only
        when it is this much above them in every iteration verified: a rank the scheduler
        preempts more often also computes slower between preemptions (its caches
        refilled), so a burst of load lifts the own compute of the ranks it hits most by
        1.2-2x for an iteration or two, above the margin the calm history's noise gives
        (docs/detector.md "False reports on a loaded machine").
    :param environment_rise: two or more executors slowed at once, every one on a node
        whose CPU contention (probed outside the job, ``VerificationContext.environment``)
        rose by at least this factor across the change: the environment, not reported.
    :param explain: compute suspects must account for at least this fraction of the
        iteration's excess over its prediction (in seconds); otherwise the slowdown is
        elsewhere (communication) and a little compute noise on some rank must not be
        blamed for it.
    """

    name = "resihp"

    def __init__(
        self,
        *,
        compute_margin: float = 0.15,
        spread: float = 0.15,
        probe_margin: float = 0.15,
        concentrated: float = 0.25,
        share: float = 0.5,
        explain: float = 0.3,
        waiting: float = 0.5,
        noise_k: float = 4.0,
        max_margin: float = 1.0,
        shared_wait: float = 0.25,
        loaded_share: float = 0.25,
        loaded_iterations: int = 6,
        unpinned_iterations: int = 12,
        unpinned_ratio: float = 1.5,
        unshared_ratio: float = 1.3,
        unshared_k: float = 2.0,
        unshared_spread: float = 2.0,
        environment_rise: float = 1.25,
        loaded_own_ratio: float = 1.5,
    ) -> None:
        for n, v in (("compute_margin", compute_margin), ("spread", spread), ("probe_margin", probe_margin),
                     ("waiting", waiting)):
            if not 0 < v < 1:
                raise ValueError(f"{n} must be in (0, 1), got {v!r}")
        self.compute_margin, self.spread, self.probe_margin = compute_margin, spread, probe_margin
        self.concentrated, self.share, self.explain = concentrated, share, explain
        self.waiting, self.noise_k = waiting, noise_k
        self.shared_wait, self.max_margin = shared_wait, max_margin
        self.loaded_share, self.loaded_iterations = loaded_share, loaded_iterations
        self.environment_rise, self.unpinned_ratio = environment_rise, unpinned_ratio
        self.unpinned_iterations = unpinned_iterations
        if not unshared_ratio > 1 or unshared_k < 0:
            raise ValueError(f"unshared_ratio must be > 1 and unshared_k >= 0, got {unshared_ratio!r}, {unshared_k!r}")
        self.unshared_ratio, self.unshared_k = unshared_ratio, unshared_k
        if not unshared_spread > 1:
            raise ValueError(f"unshared_spread must be > 1, got {unshared_spread!r}")
        self.unshared_spread = unshared_spread
        if not loaded_own_ratio > 1:
            raise ValueError(f"loaded_own_ratio must be > 1, got {loaded_own_ratio!r}")
        self.loaded_own_ratio = loaded_own_ratio

    def verify(self, ctx: VerificationContext) -> Verdict:
        """Apply :attr:`RULES` in order; the first that decides gives the verdict, named
        in ``Verdict.rule``. A rule that does not decide may narrow the suspects."""
        if not ctx.iterations:
            return Verdict({}, "unknown", "no profiles to verify", rule="no-profiles")
        c = self._case(ctx)
        for name, rule in self.RULES:
            v = rule(self, c)
            if v is not None:
                return v if v.rule else replace(v, rule=name)
        raise AssertionError("the last rule always decides")  # pragma: no cover

    def _case(self, ctx: VerificationContext) -> _Case:
        """The evidence every rule reads: per executor its worst rank's compute over
        healthy (measured, and its own without the waiting for a CPU), its margins, and
        the suspects (above healthy by their margin, a fair share of the worst excess)."""
        t = _Totals(ctx)
        groups: dict[tuple[int, int], list[int]] = defaultdict(list)
        for rank, ex in t.executor.items():
            groups[ex].append(rank)
        raw = {ex: max(t.q(r) for r in ranks) for ex, ranks in groups.items()}
        margin = {ex: self._margin(ctx, t, ranks) for ex, ranks in groups.items()}
        suspects = self._suspects(groups, raw, margin)
        worst = {ex: max(t.qd(r) for r in ranks) for ex, ranks in groups.items()}
        c = _Case(ctx, t, dict(groups), raw, worst, margin, {}, suspects)
        if ctx.own_noise and len(groups) >= 2:
            # A device slow by itself, measured without its waiting for a CPU (steady on
            # a loaded host, where the waiting swamps the measured compute): a suspect
            # too, judged against its own-compute noise (docs/detector.md "DP-only jobs"),
            # and on a loaded machine sharing its CPUs, only by ``loaded_own_ratio``.
            c.own_margin = {ex: self._margin(ctx, t, ranks, ctx.own_noise) for ex, ranks in groups.items()}
            own = {ex: max(t.qo(r) for r in ranks) for ex, ranks in groups.items()}
            for ex, ranks in self._suspects(groups, own, c.own_margin).items():
                if ex in suspects or not self._loaded_unpinned(c, ex) or self._own_above_peers(c, ex):
                    suspects.setdefault(ex, ranks)
        return c

    # ------------------------------------------------------------ rules
    def _rule_machine_wide(self, c: _Case) -> Verdict | None:
        """Localised or machine-wide (detector/localise.py). Reads each suspect's compute
        against the median of the other executors, over the iterations verified and in
        most of them one by one (measured compute, or its own where the own-compute
        watch applies). Only an executor slower than its peers is a fail-slow, whatever
        slowed it; suspects none of which is, or every executor slowed alike, are the
        machine: nothing to plan around. Needs two executors (else it does not apply)."""
        if len(c.groups) < 2:
            return None
        c.local = {ex for ex in c.suspects if self._above_peers(c.ctx, c.t, c.groups, ex, c.margin[ex])
                   or self._own_above_peers(c, ex) or self._unshared(c, ex)}
        everyone = all(c.raw[ex] > 1 + self.compute_margin for ex in c.groups)
        if (c.suspects or everyone) and self._elsewhere(c):
            # The compute lost (alike on a loaded machine, or a rank's waiting for a CPU)
            # explains little of what the iteration lost: the time went outside compute,
            # and a link probe decides now rather than the compute rules deferring it.
            c.suspects, c.local, c.probe_only = {}, set(), True
            return None
        if (c.suspects or everyone) and not c.local:
            n = len(c.ctx.iterations)
            ahead = {ex: self._over_peers(c, ex) for ex in c.suspects}
            thin = {ex: x for ex, x in ahead.items() if x > 1 + self.compute_margin}
            desc = ", ".join(f"replica {r} stage {s}: {c.raw[(r, s)]:.2f}x" for r, s in sorted(c.groups))
            if thin and n < self.loaded_iterations:
                # Above its peers by the base margin, yet not by its noise margin (wide
                # over few iterations) or not in most of them: too little evidence to
                # call either way. Verify again with one more iteration, up to
                # ``loaded_iterations``, rather than declare the machine.
                return Verdict({}, "unknown", "compute above the other executors' (" + ", ".join(
                    f"replica {r} stage {s}: {x:.2f}x its peers, margin {c.margin[(r, s)]:.2f}"
                    for (r, s), x in sorted(thin.items())) + f"; {desc}), but {n} iteration(s) are too few "
                    "to tell it from its noise: verified again with one more", more=n + 1,
                    rule="machine-wide-too-few")
            if everyone and not thin:
                return Verdict({}, "unknown", f"every executor slowed alike in compute ({desc}): a machine-wide "
                               "slowdown, no device to plan around")
            return Verdict({}, "unknown", f"no executor is slower in compute than the others by its margin over "
                           f"the {n} iteration(s) verified, together and in most of them ({desc}; margins "
                           + ", ".join(f"replica {r} stage {s}: {c.margin[(r, s)]:.2f}" for r, s in sorted(c.suspects))
                           + "".join(f"; replica {r} stage {s} has no peer to compare with but known-slow ones "
                                     "running faster than known" for r, s in sorted(c.suspects)
                                     if not self._refs(c, (r, s)))
                           + "): not localised to a device, nothing to plan around")
        return None

    def _elsewhere(self, c: _Case) -> bool:
        """With a link prober: whether the compute lost on any rank is under ``explain``
        of the iteration's excess over its prediction (the rest is outside compute)."""
        t = c.t
        if c.ctx.prober is None or not t.iteration_predicted > 0:
            return False
        excess = t.iteration_measured - t.iteration_predicted
        lost = max((t.measured[r] - t.predicted[r] for r in t.measured), default=0.0)
        return excess > 0 and lost < self.explain * excess

    def _rule_contention_shared_by_peers(self, c: _Case) -> Verdict | None:
        """Marks (never decides alone) the localised suspects slowed by waiting for a CPU
        whose peers lost ``shared_wait`` of their compute waiting as well: the machine
        is contended and how much each worker loses is the scheduler's unevenness, not
        its device — unless the suspect, held to CPUs of its own, lost ``unshared_ratio``
        more than its peers in each iteration (:meth:`_unshared`): that excess its peers
        did not share. Reads every rank's run delay in compute beyond its healthy share,
        the affinity and the per-iteration compute of the suspect against its peers."""
        for ex in c.local:
            if self._shared_contention(c, ex) and not self._unshared(c, ex) and not self._unshared_soon(c, ex):
                c.dismissed.setdefault(ex, "contention-shared-by-peers")
        return None

    def _rule_waiting_not_persistent(self, c: _Case) -> Verdict | None:
        """A localised suspect slowed only by waiting for a CPU (its own compute is not
        above its peers) on a loaded machine (its peers waited ``loaded_share`` of their
        compute or more) or that shares its CPUs with its peers (not ``confined``: an
        unpinned worker, or CPUs unknown) is the scheduler's luck unless it stays above
        its peers in ``loaded_iterations`` iterations, all but one — and, sharing its
        CPUs, by ``unpinned_ratio`` or more over them (docs/detector.md "Pinned or
        unpinned"). Reads each rank's run delay, its affinity and the per-iteration
        compute. Fewer iterations than that: ``Verdict.more``, verified again later."""
        if len(c.groups) < 2:
            return None
        n = len(c.ctx.iterations)
        loaded: dict[tuple[int, int], str] = {}
        window = 0
        for ex in c.local - set(c.dismissed):
            if not self._by_waiting_only(c, ex):
                continue
            pinned = confined(c.ctx.iterations, (c.t.device[r] for r in c.groups[ex]))
            busy = self._peers_waiting(c, ex) >= self.loaded_share
            if pinned and (not busy or self._unshared(c, ex)):
                # Its host's: a quiet machine, or contention its peers, under the same
                # load, do not share in any iteration verified.
                continue
            w = self.loaded_iterations if pinned else self.unpinned_iterations
            persistent = self._above_peers(c.ctx, c.t, c.groups, ex, c.margin[ex], need=max(w, n) - 1)
            if persistent and (pinned or self._over_peers(c, ex) >= self.unpinned_ratio):
                continue
            loaded[ex] = "loaded machine" if pinned else "unpinned" if not busy else "loaded machine, unpinned"
            if pinned and self._unshared_soon(c, ex):
                w = n + 1
            window = max(window, w)
        if loaded and set(loaded) | set(c.dismissed) >= c.local and n < window:
            return Verdict({}, "unknown", "slower than their peers only by waiting for a CPU, on a loaded "
                           "machine or on CPUs their peers may use (" + ", ".join(
                               f"replica {r} stage {s}: compute {c.raw[(r, s)]:.2f}x, peers waited "
                               f"{100 * self._peers_waiting(c, (r, s)):.0f} % of theirs, "
                               f"{loaded[(r, s)]}"
                               for r, s in sorted(loaded))
                           + f"): {n} iterations are too few to tell its host from "
                           "the scheduler's luck", more=window)
        for ex in loaded:
            c.dismissed.setdefault(ex, "waiting-not-persistent")
        return None

    def _rule_waiting_not_a_device(self, c: _Case) -> Verdict | None:
        """Decides when every localised suspect was dismissed by the two rules above
        (which ``Verdict.rule`` then names): the whole machine is contended, unevenly.
        Otherwise the dismissed and non-localised suspects are dropped. Reads only what
        those rules marked."""
        if len(c.groups) < 2:
            return None
        if c.local and set(c.dismissed) >= c.local:
            rules = sorted(set(c.dismissed[ex] for ex in c.local))
            return Verdict({}, "unknown", "the slowdown is waiting for a CPU that its peers share ("
                           + ", ".join(f"replica {r} stage {s}: compute {c.raw[(r, s)]:.2f}x, peers waited "
                                       f"{100 * self._peer_wait(c, (r, s)):.0f} % of their compute "
                                       f"beyond healthy, {100 * self._peers_waiting(c, (r, s)):.0f} % "
                                       f"in all, over {len(c.ctx.iterations)} iterations"
                                       for r, s in sorted(c.dismissed) if (r, s) in c.local)
                           + "): the whole machine is contended, unevenly; not a device", rule="+".join(rules))
        c.suspects = {ex: ranks for ex, ranks in c.suspects.items() if ex in c.local and ex not in c.dismissed}
        return None

    def _rule_environment_changed(self, c: _Case) -> Verdict | None:
        """Several executors slowed at the same onset while the CPU contention of their
        node(s), probed outside the job (``VerificationContext.environment``), rose by
        ``environment_rise`` or more: the environment changed (a burst of other
        processes), not several devices at once. One such executor is still reported (a
        hog on its own core raises its node's contention too). Reads the node probe's
        rise per device, nothing of the profiles but which executors are suspects."""
        if len(c.groups) < 2:
            return None
        t, env = c.t, c.ctx.environment
        rose = {ex for ex, ranks in c.suspects.items()
                if all(env.get(t.device[r], 0.0) >= self.environment_rise for r in ranks)}
        if len(c.suspects) >= 2 and rose == set(c.suspects):
            return Verdict({}, "unknown", f"{len(c.suspects)} executors slowed at once ("
                           + ", ".join(f"replica {r} stage {s}: compute {c.raw[(r, s)]:.2f}x" for r, s in sorted(rose))
                           + ") while the CPU contention of their node rose ("
                           + ", ".join(f"device {t.device[r]}: {env[t.device[r]]:.2f}x"
                                       for ex in sorted(rose) for r in c.suspects[ex])
                           + "): the environment changed, not several devices")
        return None

    def _rule_single_executor_waiting(self, c: _Case) -> Verdict | None:
        """One executor has no peers to compare with: a slowdown that is time its ranks
        waited for a CPU other processes held (its own compute within its margin, or
        most of the loss waiting) cannot be told from the machine's, and no plan of one
        executor runs around it. Reads its compute with and without its run delay."""
        if len(c.groups) >= 2:
            return None
        t = c.t
        waited = {ex for ex, ranks in c.suspects.items()
                  if c.worst[ex] <= 1 + c.margin[ex] or all(self._contended(t, r) for r in ranks)}
        if waited and len(waited) == len(c.suspects):
            return Verdict({}, "unknown", "the compute slowdown is time spent waiting for a CPU other "
                           "processes held, on the job's only executor (" + ", ".join(
                               f"replica {ex[0]} stage {ex[1]}: compute {c.raw[ex]:.2f}x, {c.worst[ex]:.2f}x "
                               f"without the {max(t.waited(r) for r in c.groups[ex]):.3f} s it waited"
                               for ex in sorted(waited)) + "): the environment, not a device")
        return None

    def _rule_compute(self, c: _Case) -> Verdict | None:
        """The suspects left account for at least ``explain`` of the iteration's excess
        over its prediction (without what other processes took: the most any rank
        waited for a CPU beyond its share): a compute (or, mostly waiting, contention)
        fail-slow of their devices (:meth:`_compute`). Otherwise the slowdown is
        elsewhere and a little compute noise must not be blamed for it. Reads the
        iteration time against its prediction and the suspects' lost compute; TP groups
        uniformly slow are split by a compute probe where there is a prober."""
        t = c.t
        if not c.suspects:
            return None
        excess = t.iteration_measured - t.iteration_predicted if t.iteration_predicted > 0 else 0.0
        excess -= max((t.waited(r) + t.outside_waited(r) for r in t.measured), default=0.0)
        explained = max(((t.measured[r] if self._contended(t, r) else t.device_measured(r)) - t.predicted[r]
                         for ranks in c.suspects.values() for r in ranks), default=0.0)
        if excess <= 0 or explained >= self.explain * excess:
            return self._compute(c.ctx, t, c.suspects)
        return None

    def _rule_communication(self, c: _Case) -> Verdict:
        """No compute suspect: reads each rank's time outside compute (its waiting for a
        CPU there taken out) against the healthy expectation, over the iterations and
        one by one, and probes links where the profiles cannot localise
        (:meth:`_communication`; ``Verdict.rule`` names which of its cases decided)."""
        return self._communication(c.ctx, c.t, c.probe_only, set(c.dismissed))

    RULES: tuple[tuple[str, Callable[[ProfileVerifier, _Case], Verdict | None]], ...] = (
        ("machine-wide", _rule_machine_wide),
        ("contention-shared-by-peers", _rule_contention_shared_by_peers),
        ("waiting-not-persistent", _rule_waiting_not_persistent),
        ("waiting-not-a-device", _rule_waiting_not_a_device),
        ("environment-changed", _rule_environment_changed),
        ("single-executor-waiting", _rule_single_executor_waiting),
        ("compute", _rule_compute),
        ("communication", _rule_communication),
    )

    def _own_above_peers(self, c: _Case, ex: tuple[int, int]) -> bool:
        """Whether ``ex``'s own compute (waiting for a CPU taken out) is above its peers'
        by its own-compute margin (only where own-compute noise is measured); on a loaded
        machine by ``loaded_own_ratio`` too, in every iteration verified."""
        if ex not in c.own_margin:
            return False
        margin, need = c.own_margin[ex], 0
        if self._loaded_unpinned(c, ex):
            margin, need = max(margin, self.loaded_own_ratio - 1.0), len(c.ctx.iterations)
        return self._above_peers(c.ctx, c.t, c.groups, ex, margin, own_compute_of, need=need)

    def _loaded_unpinned(self, c: _Case, ex: tuple[int, int]) -> bool:
        """``ex`` shares its CPUs with its peers (not ``confined``) on a loaded machine
        (its peers waited ``loaded_share`` of their compute or more)."""
        return (not confined(c.ctx.iterations, (c.t.device[r] for r in c.groups[ex]))
                and self._peers_waiting(c, ex) >= self.loaded_share)

    def _by_waiting_only(self, c: _Case, ex: tuple[int, int]) -> bool:
        """Every rank of ``ex`` lost its compute mostly waiting for a CPU and its own
        compute is not above its peers: other processes, not the device, slowed it."""
        return all(self._contended(c.t, r) for r in c.groups[ex]) and not self._own_above_peers(c, ex)

    def _paired(self, c: _Case, ex: tuple[int, int]) -> list[float]:
        """Per iteration verified: ``ex``'s measured compute over healthy (its worst
        rank's) divided by the median of the other executors' in *that* iteration. Load
        that every rank bears alike in an iteration cancels in it, however large; what
        is left is how much more this executor lost than its peers under the same load
        (the paired comparison; the workload cancels in each rank's ratio to healthy)."""
        t = c.t

        def worst(profiles: Mapping[int, IterationProfile], ranks: list[int]) -> float | None:
            vals = []
            for r in ranks:
                p = profiles.get(r)
                pred = t.rank_prediction(p, profiles) if p is not None else None
                if p is not None and pred:
                    vals.append(compute_of(p) / pred)
            return max(vals) if vals else None

        out = []
        for profiles in c.ctx.iterations:
            mine = worst(profiles, c.groups[ex])
            peers = [x for e in self._refs(c, ex) if (x := worst(profiles, c.groups[e])) is not None]
            if mine is not None and peers and statistics.median(peers) > 0:
                out.append(mine / statistics.median(peers))
        return out

    #: Iterations verified that the paired comparison of :meth:`_unshared` needs at least
    #: (the per-device watch's window): two are too few to call "every iteration".
    UNSHARED_MIN = 3

    def _unshared(self, c: _Case, ex: tuple[int, int]) -> bool:
        """Whether ``ex`` is slowed by contention its peers do not share: mostly waiting
        for a CPU (:meth:`_contended`; a device slow by itself keeps the noise margins),
        held to CPUs its
        peers are not held to (:func:`~.localise.confined`: a load on its cores stays on
        it while the scheduler can move its peers away), and computing ``unshared_ratio``
        (or ``exp(unshared_k * sigma)``, sigma its healthy paired noise) slower than its peers
        in the same iteration, in every iteration verified (all but one from 4 on) and
        over them together. Judged on the paired ratio (:meth:`_paired`), not on how
        much each side waited: at one or two busy processes per core its unpinned peer
        waits 30 % beyond healthy too, and a neighbour on its core still costs it 1.5-2x
        more in every iteration. Cached per case."""
        above, n = self._unshared_count(c, ex)
        return n >= self.UNSHARED_MIN and above >= (n if n < 4 else n - 1)

    def _unshared_soon(self, c: _Case, ex: tuple[int, int]) -> bool:
        """Whether one more iteration may make ``ex`` :meth:`_unshared`: above the bar in
        all but one of 3 iterations (the first may be only partly slowed: the onset
        fell inside it) and over them together. ``waiting-not-persistent`` then asks
        for that one more (``Verdict.more``) rather than the loaded machine's 6."""
        above, n = self._unshared_count(c, ex)
        return n == len(c.ctx.iterations) and self.UNSHARED_MIN <= n < 4 and above == n - 1

    def _unshared_count(self, c: _Case, ex: tuple[int, int]) -> tuple[int, int]:
        """(iterations in which ``ex`` was above its peers by the bar of :meth:`_unshared`,
        iterations verified); (0, 0) where it is not confined or below the bar over the
        iterations together. Cached per case."""
        key = ("unshared", ex)
        if key in c.memo:
            return c.memo[key]
        c.memo[key] = (0, 0)
        if (len(c.groups) < 2 or not all(self._contended(c.t, r) for r in c.groups[ex])
                or not confined(c.ctx.iterations, (c.t.device[r] for r in c.groups[ex]))):
            return c.memo[key]
        ratios = self._paired(c, ex)
        if not ratios:
            return c.memo[key]
        devices = [c.t.device[r] for r in c.groups[ex]]
        if not all(d in c.ctx.noise for d in devices):
            return c.memo[key]  # its healthy noise is not measured yet: no paired bar to hold
        bar = max(self.unshared_ratio, math.exp(self.unshared_k * machine_noise(c.ctx.noise, devices)))
        together = math.exp(statistics.fmean(math.log(max(x, 1e-9)) for x in ratios))
        high = [x for x in ratios if x >= bar]
        if together >= bar and (not high or max(high) <= self.unshared_spread * min(high)):
            c.memo[key] = (len(high), len(ratios))
        return c.memo[key]

    def _over_peers(self, c: _Case, ex: tuple[int, int]) -> float:
        """``ex``'s measured compute over healthy, relative to the median of the other
        executors', over the iterations verified."""
        peers = [c.raw[e] for e in self._refs(c, ex)]
        if not peers:
            return 1.0  # nothing to compare with
        med = statistics.median(peers)
        return c.raw[ex] / med if med > 0 else math.inf

    def _refs(self, c: _Case, ex: tuple[int, int]) -> list[tuple[int, int]]:
        """The executors ``ex``'s compute is compared with (:func:`_references`)."""
        return _references(c.groups, ex, c.t, c.ctx.known_slow, 1.0 / (1.0 + self.compute_margin))

    def _margin(self, ctx: VerificationContext, t: _Totals, ranks: list[int],
                noise: Mapping[int, float] | None = None) -> float:
        """Relative compute excess that makes an executor a suspect: ``compute_margin``,
        or more where its devices' healthy timing is noisier (``noise_k`` of their noise
        scales, averaged down over the iterations verified). ``noise``: default
        ``ctx.noise`` (of the measured compute)."""
        noise = ctx.noise if noise is None else noise
        sig = max((noise.get(t.device[r], 0.0) for r in ranks), default=0.0)
        n = max(1, len(ctx.iterations))
        return max(self.compute_margin, min(self.max_margin, math.expm1(self.noise_k * sig / math.sqrt(n))))

    def _contended(self, t: _Totals, rank: int) -> bool:
        """Most of what ``rank`` lost in compute is time it waited for a CPU (it lost
        some: a rank at or under its prediction, found by its own compute, did not wait
        its way there)."""
        lost = t.measured[rank] - t.predicted[rank]
        return lost > 0 and t.waited(rank) >= self.waiting * lost

    def _peer_wait(self, c: _Case, ex: tuple[int, int]) -> float:
        """How much of their healthy compute the other executors lost waiting for a CPU
        (beyond their healthy share): see :meth:`_peers_share`."""
        t = c.t

        def share(r: int, p: IterationProfile | None, profiles: Mapping[int, IterationProfile] | None) -> float:
            pred = t.predicted.get(r, 0.0) if p is None else (t.rank_prediction(p, profiles or {}) or 0.0)
            if pred <= 0:
                return 0.0
            wait = t.compute_wait[r] if p is None else p.compute_wait_s
            return max(0.0, wait - t.wait_share.get(t.device[r], (0.0, 0.0))[0] * pred) / pred

        return self._peers_share(c, ex, share)

    def _peers_waiting(self, c: _Case, ex: tuple[int, int]) -> float:
        """How much of their measured compute the other executors spent waiting for a CPU
        (all of it, the healthy share included): how loaded the machine is around ``ex``
        (:meth:`_peers_share`)."""
        t = c.t

        def share(r: int, p: IterationProfile | None, profiles: Mapping[int, IterationProfile] | None) -> float:
            meas, wait = (t.measured[r], t.compute_wait[r]) if p is None else (compute_of(p), p.compute_wait_s)
            return min(1.0, wait / meas) if meas > 0 else 0.0

        return self._peers_share(c, ex, share)

    @staticmethod
    def _peers_share(c: _Case, ex: tuple[int, int],
                     share: Callable[[int, IterationProfile | None, Mapping[int, IterationProfile] | None], float],
                     ) -> float:
        """Median over the other executors of a rank share (their worst rank's), over
        the iterations verified taken together, and at most its median one iteration at
        a time: a load the peers bore in one iteration only (a hog on their core that
        just ended) is not the machine's."""
        peers = [ranks for e, ranks in c.groups.items() if e != ex]
        if not peers:
            return 0.0
        total = statistics.median(max(share(r, None, None) for r in ranks) for ranks in peers)
        each = []
        for profiles in c.ctx.iterations:
            vals = [max(share(r, profiles[r], profiles) for r in ranks if r in profiles)
                    for ranks in peers if any(r in profiles for r in ranks)]
            if vals:
                each.append(statistics.median(vals))
        return min(total, statistics.median(each)) if each else total

    def _shared_contention(self, c: _Case, ex: tuple[int, int]) -> bool:
        """A suspect slowed by contention whose peers lost ``shared_wait`` of their
        compute waiting for a CPU as well: the machine is contended, and how much each
        worker loses is the scheduler's unevenness, not a property of its device."""
        return all(self._contended(c.t, r) for r in c.groups[ex]) and self._peer_wait(c, ex) >= self.shared_wait

    def _above_peers(self, ctx: VerificationContext, t: _Totals, groups: dict[tuple[int, int], list[int]],
                     ex: tuple[int, int], margin: float,
                     measure: Callable[[IterationProfile], float] = compute_of, need: int = 0) -> bool:
        """Whether executor ``ex`` computed more than ``margin`` slower (relative to its
        healthy time) than the median of the other executors, over the iterations
        verified taken together and in most of them one by one (in at least ``need`` of
        them, where that is more). ``measure``: the compute compared
        (:func:`compute_of`, or :func:`own_compute_of` without the waiting for a CPU)."""
        own = measure is own_compute_of

        def ratio(profiles: Mapping[int, IterationProfile] | None, ranks: list[int]) -> float:
            if profiles is None:
                return max(t.qo(r) if own else t.q(r) for r in ranks)
            vals = []
            for r in ranks:
                p = profiles.get(r)
                pred = t.rank_prediction(p, profiles) if p is not None else None
                if p is not None and pred:
                    vals.append(measure(p) / pred)
            return max(vals) if vals else 1.0

        refs = _references(groups, ex, t, ctx.known_slow, 1.0 / (1.0 + self.compute_margin))
        if not refs:
            return False  # its only peers are known slow: no reference

        def above(profiles: Mapping[int, IterationProfile] | None) -> bool:
            mine = ratio(profiles, groups[ex])
            peers = [ratio(profiles, groups[e]) for e in refs]
            return mine > statistics.median(peers) * (1 + margin)

        if not above(None):
            return False
        each = [above(ps) for ps in ctx.iterations]
        return sum(each) * 2 > len(each) and sum(each) >= need

    def _suspects(self, groups: dict[tuple[int, int], list[int]], worst: dict[tuple[int, int], float],
                  margin: dict[tuple[int, int], float]) -> dict[tuple[int, int], list[int]]:
        """Executors well above healthy that carry a fair share of the worst excess: a
        rank 1.2x slow next to one 2x slow is noise (or a separate, minor matter), not
        the cause of this alarm."""
        top = max(worst.values(), default=1.0)
        return {ex: ranks for ex, ranks in groups.items()
                if worst[ex] > 1 + margin[ex] and worst[ex] - 1 >= self.share * (top - 1)}

    # ------------------------------------------------------------ compute
    def _compute(self, ctx: VerificationContext, t: _Totals, suspects: dict[tuple[int, int], list[int]]) -> Verdict:
        slow: dict[int, float] = {}
        notes: list[str] = []
        rounds, probe_s = 0, 0.0
        cause = "compute"
        contended: set[int] = set()
        executors: dict[tuple[int, int], list[int]] = defaultdict(list)
        for r, e in t.executor.items():
            executors[e].append(r)
        for (rep, stage), ranks in sorted(suspects.items()):
            # A rank slowed mostly by waiting for a CPU is slowed by its host: what it
            # delivers (its throughput) counts that waiting; a device slow by itself is
            # measured without it.
            contended.update(t.device[r] for r in ranks if self._contended(t, r))
            qs = {r: (t.q(r) if t.device[r] in contended else t.qd(r)) for r in ranks}
            where = f"replica {rep} stage {stage}"
            if len(ranks) == 1:
                r = ranks[0]
                # Its speed relative to the same stage's other replicas where they ran
                # faster than the model's healthy time (a model fitted on a busier
                # warm-up): what moving its micro-batches to them gains. Slowed by
                # contention, relative to them also where the machine's load slowed
                # them too: they bear that load wherever its work runs.
                fast = 1.0 / (1.0 + self.compute_margin)
                refs = set(_references(executors, (rep, stage), t, ctx.known_slow, fast))
                peers = [t.q(o) if t.device[r] in contended else t.qd(o) for o, e in t.executor.items()
                         if e[1] == stage and e in refs]
                ref = (statistics.median(peers) if t.device[r] in contended else
                       min(1.0, statistics.median(peers))) if peers else 1.0
                slow[t.device[r]] = _clip_p(ref / qs[r] if ref > 0 else 1.0 / qs[r])
                env = ctx.environment.get(t.device[r])
                w = t.waited(r)
                if t.device[r] in contended:
                    notes.append(f"{where}: compute {qs[r]:.2f}x healthy on its only rank {r}, "
                                 f"{w:.3f} s of it waiting for a CPU other processes held (host contention)"
                                 + (f"; its node's CPU contention {env:.2f}x" if env is not None else ""))
                else:
                    notes.append(f"{where}: compute {qs[r]:.2f}x healthy on its only rank {r}"
                                 + (f" without the {w:.3f} s it waited for a CPU" if w > 0 else "")
                                 + (f" (its own compute, all waiting for a CPU taken out, {t.qo(r):.2f}x)"
                                    if t.qo(r) > qs[r] * (1 + self.compute_margin) else "")
                                 + (f" (its node's CPU contention {env:.2f}x)" if env is not None else ""))
                continue
            lo = min(qs.values())
            if max(qs.values()) > lo * (1 + self.spread):
                for r, q in qs.items():
                    if q > lo * (1 + self.spread) and q > 1 + self.compute_margin:
                        slow[t.device[r]] = _clip_p(1.0 / q)
                notes.append(f"{where}: ranks differ in compute ({', '.join(f'{r}: {q:.2f}x' for r, q in sorted(qs.items()))})")
                continue
            devices = sorted(t.device[r] for r in ranks)
            qg = statistics.median(qs.values())
            ahead = self._ahead_in_chunks(ctx, ranks)
            if ahead and len(ahead) < len(ranks):
                # Alike over the iterations, but not chunk by chunk: the others waited
                # inside their collectives for these ranks' slow chunks.
                for r in ahead:
                    slow[t.device[r]] = _clip_p(1.0 / qs[r])
                notes.append(f"{where}: TP group {qg:.2f}x slow alike, but rank(s) {ahead} computed a chunk "
                             f"{1 + self.LEAD:.1f}x or more slower than every other member's same chunk in each "
                             "iteration verified, which none of the others did: those waited for them in the "
                             "group's collectives")
                continue
            if ctx.prober is None or not getattr(ctx.prober, "measures_compute", True):
                for d in devices:
                    slow[d] = _clip_p(1.0 / qg)
                notes.append(f"{where}: TP group uniformly {qg:.2f}x slow; no prober to split it")
                continue
            res = ctx.prober.probe_compute(devices)
            rounds, probe_s = rounds + 1, probe_s + res.elapsed_s
            found = {d: p for d, p in res.throughput().items() if p < 1 - self.probe_margin}
            if found:
                slow.update(found)
                notes.append(f"{where}: TP group {qg:.2f}x slow, compute probe names {sorted(found)}")
                continue
            res = ctx.prober.probe_links(devices)
            rounds, probe_s = rounds + 1, probe_s + res.elapsed_s
            found = {d: p for d, p in res.throughput().items() if p < 1 - self.probe_margin}
            if found:
                slow.update(found)
                cause = "communication"
                notes.append(f"{where}: TP group {qg:.2f}x slow but computes at full speed; link probe names {sorted(found)}")
            else:
                notes.append(f"{where}: TP group {qg:.2f}x slow, probes found nothing")
        if not slow:
            return Verdict({}, "unknown", "; ".join(notes), rounds, probe_s)
        if cause == "compute" and set(slow) <= contended:
            cause = "contention"
        ev = f"{cause} slowdown: " + "; ".join(notes) + f" -> {_fmt(slow)}"
        return Verdict(slow, cause, ev, rounds, probe_s)  # type: ignore[arg-type]

    #: How much slower than every other member's same chunk a TP rank's chunk must be to
    #: lead it (:meth:`_ahead_in_chunks`).
    LEAD = 0.5

    @staticmethod
    def _ahead_in_chunks(ctx: VerificationContext, ranks: list[int]) -> list[int]:
        """The ranks of one TP group that, in every iteration verified, computed some
        chunk (a micro-batch's forward or backward) more than ``1 + LEAD`` times as long
        as every other member's same chunk. A member slowed by itself is slow in each of
        its chunks; a member that only waits for it does so inside the group's
        collectives, after its first chunk of the iteration (the iterations start
        together), so it is never far slower than the slow member in the same chunk. A
        group slowed alike (a slow TP link, a member slowed inside each chunk's own
        collectives) leads in no chunk: the profiles cannot split it."""
        leads = {r: 0 for r in ranks}
        for profiles in ctx.iterations:
            chunks: dict[int, dict[tuple[int, int, int], float]] = {}
            for r in ranks:
                p = profiles.get(r)
                if p is None:
                    return []
                chunks[r] = {}
                for mb in p.microbatches:
                    chunks[r][(mb.owner, mb.mb, 0)] = mb.forward_s
                    chunks[r][(mb.owner, mb.mb, 1)] = mb.backward_s
            common = {k for k in set.intersection(*(set(c) for c in chunks.values()))
                      if all(c[k] > 0 for c in chunks.values())} if chunks else set()
            for r in ranks:
                if any(chunks[r][k] > (1 + ProfileVerifier.LEAD) * max(chunks[o][k] for o in ranks if o != r)
                       for k in common):
                    leads[r] += 1
        n = len(ctx.iterations)
        return sorted(r for r, k in leads.items() if n and k == n)

    # ------------------------------------------------------------ communication
    def _waited_for(self, t: _Totals, heavy: list[int], excess: Mapping[int, float]) -> dict[int, float]:
        """The other ranks whose compute kept ``heavy`` waiting: rank -> seconds its
        compute exceeded its prediction beyond the heavy ranks' own excess, where that
        is at least half of every heavy rank's excess outside compute. A rank idle at a
        collective (the DP all-reduce, a pipeline receive) while a peer computes longer
        has exactly that excess outside compute: it is the waiting one, not the slow one."""
        lost = {r: t.measured[r] - t.predicted.get(r, 0.0) for r in t.measured}
        found: dict[int, float] = {}
        for o in t.measured:
            if o in heavy:
                continue
            lead = min(lost[o] - lost[h] for h in heavy)
            if all(excess[h] > 0 for h in heavy) and lead >= 0.5 * max(excess[h] for h in heavy):
                found[o] = lead
        return found

    def _communication(self, ctx: VerificationContext, t: _Totals, probe_only: bool = False,
                       dismissed: set[tuple[int, int]] | None = None) -> Verdict:
        outside = {r: t.device_outside(r) for r in t.outside}
        excess = {r: outside[r] - t.expected_outside.get(r, 0.0) for r in outside}
        top = 0.0 if probe_only else max(excess.values(), default=0.0)
        slowdown = t.iteration_measured / t.iteration_predicted if t.iteration_predicted > 0 else None
        if top > 0:
            heavy = [r for r, e in excess.items() if e >= 0.5 * top]
            # Time outside compute is mostly time blocked on peers: when the peers
            # waited for a CPU about as long, the excess is their contention, not a link.
            peers_waited = max((t.waited(o) + t.outside_waited(o) for o in excess if o not in heavy), default=0.0)
            if peers_waited >= self.waiting * top:
                return Verdict({}, "unknown", "time outside compute exceeds the expected on ranks "
                               f"{sorted(heavy)}, but their peers waited {peers_waited:.3f} s for a CPU other "
                               "processes held: the machine is contended, not a link",
                               rule="communication-peers-waited")
            # ... and a slow link of those ranks holds them back in every iteration; the
            # sum of a few iterations can single out a rank that one long wait hit.
            each = t.outside_excess_each()
            n = max(1, len(each))
            steady = [all(e.get(r, 0.0) >= 0.5 * max(max(e.values(), default=0.0), excess[r] / n) for r in heavy)
                      for e in each]
            concentrated = len(heavy) <= max(1, int(self.concentrated * len(excess))) and len(heavy) < len(excess)
            if concentrated and len(each) > 1 and sum(steady) < max(len(each) - 1, len(each) // 2 + 1):
                unsteady = (f"time outside compute exceeds the expected on ranks {sorted(heavy)} over the "
                            f"iterations verified, but in only {sum(steady)} of {len(each)} of them one by one: "
                            "not a steady slow link")
                if ctx.prober is None:
                    return Verdict({}, "unknown", unsteady, rule="communication-not-steady")
                concentrated = False  # a link probe decides
            waited_for = self._waited_for(t, heavy, excess) if concentrated else {}
            if waited_for:
                # The heavy ranks waited for a peer's compute: never blame them. A peer
                # measurably slower in its own compute (the waiting for a CPU taken out)
                # than the ranks that waited for it is the slow device; one slower only
                # by waiting for a CPU that a rule above put down to the machine is not.
                slower = {o for o in waited_for if t.executor[o] not in (dismissed or set())
                          and min(max(t.qd(o), t.qo(o)) / max(1e-9, max(t.qd(h), t.qo(h)))
                                  for h in heavy) > 1 + self.compute_margin}
                lines = ", ".join(f"rank {o} computed {waited_for[o]:.3f} s longer" for o in sorted(waited_for))
                if not slower:
                    return Verdict({}, "unknown", f"time outside compute exceeds the expected on ranks {sorted(heavy)}, "
                                   f"which waited for their peers' compute ({lines}), and no peer is slower in its own "
                                   "compute by the margin: not a link, not a device", rule="communication-waited-for-peer")
                groups: dict[tuple[int, int], list[int]] = defaultdict(list)
                for o in sorted(slower):
                    groups[t.executor[o]].append(o)
                v = self._compute(ctx, t, dict(groups))
                # A peer slower than the ranks that waited (which ran faster than their
                # fit while it lagged) but at its peers' speed (p 1 by this measure) is
                # not slow: a report naming it at full speed plans around a healthy device.
                full = {d for d, p in v.slow.items() if p >= 1.0 / (1.0 + self.compute_margin)}
                if full and v.confirmed:
                    v = replace(v, slow={d: p for d, p in v.slow.items() if d not in full},
                                evidence=f"{v.evidence}; devices {sorted(full)} left out: at their peers' speed")
                if v.confirmed:
                    return replace(v, evidence=f"ranks {sorted(heavy)} waited outside compute for slower peers "
                                                  f"({lines}); {v.evidence}", rule="compute-waited-for")
                return replace(v, rule="communication-waited-for-peer")
            if concentrated:
                slow = {}
                for r in heavy:
                    exp, meas = t.expected_outside.get(r, 0.0), outside[r]
                    p = exp / meas if exp > 0 and meas > 0 else (1.0 / slowdown if slowdown else 0.5)
                    slow[t.device[r]] = _clip_p(p)
                ev = (
                    f"communication slowdown: compute healthy on every rank; time outside compute "
                    f"exceeds the expected on ranks {sorted(heavy)} only -> {_fmt(slow)}"
                )
                return Verdict(slow, "communication", ev, rule="communication-by-profiles")
        if ctx.prober is None:
            return Verdict({}, "unknown", "compute healthy everywhere and no prober to localise a link",
                           rule="communication-no-prober")
        devices = sorted(set(t.device.values()))
        res = ctx.prober.probe_links(devices)
        found = {d: p for d, p in res.throughput().items() if p < 1 - self.probe_margin}
        if not found:
            return Verdict({}, "unknown", "compute healthy everywhere; link probe found no slow link", 1, res.elapsed_s,
                           rule="communication-probe")
        ev = (
            "communication slowdown: compute healthy on every rank, waiting spread over the job; "
            f"link probe over {len(devices)} devices -> {_fmt(found)}"
        )
        return Verdict(found, "communication", ev, 1, res.elapsed_s, rule="communication-probe")


class GreyhoundVerifier:
    """The baseline's verification (docs/design.md §7): profile everything, fixed ratio thresholds.

    :param compute_factor: compute straggler above this x the median (2.0).
    :param comm_factor: communication straggler above this x the median (1.1).
    :param link_rounds: link-probe rounds, one per kind of communication group (TP, PP,
        DP); default: the kinds present in the profiles.
    """

    name = "greyhound"

    def __init__(self, *, compute_factor: float = 2.0, comm_factor: float = 1.1, link_rounds: int | None = None) -> None:
        if compute_factor <= 1 or comm_factor <= 1:
            raise ValueError("compute_factor and comm_factor must be > 1")
        self.compute_factor, self.comm_factor, self.link_rounds = compute_factor, comm_factor, link_rounds

    @staticmethod
    def _stragglers(times: dict[int, float], factor: float) -> dict[int, float]:
        if not times:
            return {}
        med = statistics.median(times.values())
        return {d: _clip_p(med / x) for d, x in times.items() if med > 0 and x > factor * med}

    def _rounds(self, profiles: list[IterationProfile]) -> int:
        if self.link_rounds is not None:
            return self.link_rounds
        ex = {(p.replica, p.stage) for p in profiles}
        tp = len(profiles) > len(ex)
        pp = len({s for _, s in ex}) > 1
        dp = len({r for r, _ in ex}) > 1
        return max(1, tp + pp + dp)

    def verify(self, ctx: VerificationContext) -> Verdict:
        if not ctx.iterations:
            return Verdict({}, "unknown", "no profiles to verify")
        last = list(ctx.iterations[-1].values())
        devices = sorted({p.device for p in last})
        if ctx.prober is not None:
            comp = ctx.prober.probe_compute(devices)
            rounds, probe_s = 1, comp.elapsed_s
            c_slow = self._stragglers(dict(comp.times), self.compute_factor)
            m_slow: dict[int, float] = {}
            for _ in range(self._rounds(last)):
                links = ctx.prober.probe_links(devices)
                rounds, probe_s = rounds + 1, probe_s + links.elapsed_s
                for d, p in self._stragglers(dict(links.times), self.comm_factor).items():
                    m_slow[d] = min(p, m_slow.get(d, 1.0))
            how = "probes"
        else:
            rounds, probe_s = 0, 0.0
            comp_t: dict[int, float] = defaultdict(float)
            comm_t: dict[int, float] = defaultdict(float)
            for profiles in ctx.iterations:
                for p in profiles.values():
                    comp_t[p.device] += sum(mb.forward_s + mb.backward_s for mb in p.microbatches)
                    comm_t[p.device] += p.comm_s
            c_slow = self._stragglers(comp_t, self.compute_factor)
            m_slow = self._stragglers(comm_t, self.comm_factor)
            how = "profiles"
        if c_slow:
            return Verdict(c_slow, "compute", f"compute stragglers (> {self.compute_factor}x median, {how}): {_fmt(c_slow)}", rounds, probe_s)
        if m_slow:
            return Verdict(m_slow, "communication", f"communication stragglers (> {self.comm_factor}x median, {how}): {_fmt(m_slow)}", rounds, probe_s)
        return Verdict({}, "unknown", f"no straggler found ({how})", rounds, probe_s)


def make_profile_verifier(**options: Any) -> ProfileVerifier:
    """Factory registered as ``resihp``."""
    return ProfileVerifier(**options)


def make_greyhound_verifier(**options: Any) -> GreyhoundVerifier:
    """Factory registered as ``greyhound``."""
    return GreyhoundVerifier(**options)
