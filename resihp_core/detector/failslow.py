"""Fail-slow detectors: the workload-aware one (ResiHP) and the change-point-only baseline.

Both consume one iteration at a time — the per-rank
:class:`~resihp_core.protocol.IterationProfile` s of that iteration — and may return a
:class:`~resihp_core.protocol.FailureReport` inside the :class:`~resihp_core.detector.Detection`.

:class:`WorkloadAwareDetector` (docs/design.md §3.2)::

    iteration time --> change-point detector --(change)--> predict healthy time of the
    iterations since the change, for their documents and the current plan
        measured <= (1 + slow_threshold) x predicted  -> benign: rebase the series, no verification
        otherwise                                      -> verification -> FailureReport

The healthy time comes from ``predict_healthy(iteration, profiles) -> seconds`` (any
callable; by default the detector's own :class:`~.model.WorkloadModel`, fitted on the
first ``warmup_iterations`` iterations of each plan generation). The ratio is the
median over the iterations since the change, so one odd iteration decides nothing.
``min_gap`` iterations must separate two verifications (benign change points are
removed from the series and do not count).

By default the change-point detector watches the iteration time *normalised* by its
healthy prediction (``series="normalised"``) rather than the raw time: the workload's
own fluctuation then no longer hides or imitates a slowdown, and the filter above still
decides what is worth verifying. ``series="raw"`` is the literal reading of docs/design.md §3.2
(predictions only at change points); the benchmark reports both.

:class:`ChangePointOnlyDetector` is the Greyhound-like baseline: every change point
(:class:`~.changepoint.GreyhoundChangePoint`) is verified
(:class:`~.verify.GreyhoundVerifier`).

Next to the iteration-time path, a per-device path (:class:`~.localise.PeerExcessWatch`,
docs/detector.md): each rank's compute over its healthy prediction, relative to the
other executors', against the noise of its own healthy history; a device above it for
``verify_window`` iterations in a row is verified at once, however little the iteration
time moved (small models, DP replicas). A second watch does the same on each rank's own
compute (without the time it waited for a CPU), which stays steady on a loaded host where
the waiting swamps the measured compute. Verification gets each device's noise of both.

A failure already reported (same devices and cause, throughput within 10 %) is not
reported again; after a report its devices' throughput is given to the model, so the
prediction of later iterations expects them to be slow.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping

from resihp_core.detector import (
    ChangePoint,
    ChangePointDetector,
    Detection,
    DetectorStats,
    Prober,
    ProfileSet,
    VerificationContext,
    VerificationStrategy,
    Verdict,
)
from resihp_core.detector.environment import environment_change
from resihp_core.detector.localise import (
    PeerExcessWatch,
    confined,
    machine_noise,
    own_compute_of,
    peer_excess,
    peers_waiting,
    unshared_waiting,
)
from resihp_core.detector.model import ModelNotReady, WorkloadModel, measured_iteration_time
from resihp_core.detector.recovery import RecoveryWatch

if TYPE_CHECKING:
    from resihp_core.config import DetectorConfig
    from resihp_core.plan import ParallelPlan
    from resihp_core.plugins import Plugins
    from resihp_core.protocol import FailureReport

__all__ = [
    "ChangePointOnlyDetector",
    "WorkloadAwareDetector",
    "build_baseline_detector",
    "build_failslow_detector",
    "changepoint_options",
]

logger = logging.getLogger("resihp.detector")

PredictHealthy = Callable[[int, ProfileSet], float]


class _Base:
    """Bookkeeping shared by both detectors: history, observation -> iteration map,
    generation, report de-duplication."""

    name = "base"

    def __init__(
        self,
        changepoint: ChangePointDetector,
        verifier: VerificationStrategy,
        *,
        prober: Prober | None = None,
        generation: int = 0,
        plan: ParallelPlan | None = None,
        skip_first: int = 1,
        history: int = 32,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if skip_first < 0 or history < 4:
            raise ValueError("need skip_first >= 0 and history >= 4")
        self.changepoint, self.verifier, self.prober = changepoint, verifier, prober
        self.skip_first, self.clock = skip_first, clock
        self.stats = DetectorStats()
        self._history_len = history
        self._reset_state(generation, plan)

    def _reset_state(self, generation: int, plan: ParallelPlan | None) -> None:
        self.generation, self.plan = generation, plan
        self.changepoint.reset()
        self._seen = 0
        self._hist: deque[tuple[int, float, ProfileSet]] = deque(maxlen=self._history_len)
        self._fed: deque[tuple[int, int]] = deque(maxlen=4096)  # (observation, iteration)
        self._obs = 0
        self._reported: dict[tuple[int, str], float] = {}
        self._last_retained: int | None = None
        self._env: dict[int, Mapping[int, float]] = {}  # iteration -> device -> node contention

    def note_environment(self, iteration: int, contention: Mapping[int, float]) -> None:
        """The CPU contention of each device's node (a probe outside the job) when
        ``iteration`` completed; verification quotes its rise across a change as
        evidence (the deciding measure is each rank's own waiting for a CPU, in its
        profile: detector/environment.py)."""
        self._env[iteration] = dict(contention)
        if len(self._env) > 2 * self._history_len:
            for k in sorted(self._env)[: len(self._env) - self._history_len]:
                del self._env[k]

    def _environment(self, onset: int) -> dict[int, float]:
        after = [self._env[it] for it, _, _ in self._hist if it >= onset and it in self._env]
        before = [self._env[it] for it, _, _ in self._hist if it < onset and it in self._env][-8:]
        return environment_change(before, after) if after and before else {}

    def _feed(self, iteration: int, measured: float) -> Any:
        self._fed.append((self._obs, iteration))
        self._obs += 1
        return self.changepoint.update(measured)

    def _iteration_of(self, obs: int) -> int:
        for o, it in self._fed:
            if o >= obs:
                return it
        return self._fed[-1][1]

    def _obs_of(self, iteration: int) -> int:
        for o, it in self._fed:
            if it >= iteration:
                return o
        return self._fed[-1][0]

    def _verify(self, iterations: list[ProfileSet], before: list[ProfileSet], model: object | None,
                threshold: float, environment: Mapping[int, float] | None = None,
                noise: Mapping[int, float] | None = None, own_noise: Mapping[int, float] | None = None,
                known_slow: frozenset[int] = frozenset()) -> Verdict:
        ctx = VerificationContext(
            generation=self.generation, iterations=iterations, before=before, model=model,
            prober=self.prober, plan=self.plan, threshold=threshold, environment=environment or {},
            noise=noise or {}, own_noise=own_noise or {}, known_slow=known_slow,
        )
        t0 = time.process_time()
        verdict = self.verifier.verify(ctx)
        self.stats.verify_cpu_s += time.process_time() - t0
        self.stats.verifications += 1
        self.stats.probe_rounds += verdict.probe_rounds
        self.stats.probe_s += verdict.probe_s
        return verdict

    def _known(self, verdict: Verdict) -> bool:
        return all(
            (d, verdict.cause) in self._reported and p >= 0.9 * self._reported[(d, verdict.cause)]
            for d, p in verdict.slow.items()
        )

    def _report(self, verdict: Verdict) -> FailureReport:
        from resihp_core.protocol import FailureReport

        for d, p in verdict.slow.items():
            self._reported[(d, verdict.cause)] = p
        self.stats.reports += 1
        report = FailureReport(
            generation=self.generation,
            failure="fail-slow",
            devices=tuple(sorted(verdict.slow)),
            cause=verdict.cause,
            throughput={d: float(p) for d, p in verdict.slow.items()},
            evidence=verdict.evidence[:4000],
            time=max(0.0, self.clock()),
        )
        logger.info(  # the console says it once, through the job's events
            "event=failure_report generation=%d failure=fail-slow detector=%s devices=%s cause=%s throughput=%s",
            report.generation, self.name, list(report.devices), report.cause,
            {d: round(p, 3) for d, p in report.throughput.items()},
        )
        return report

    def _window(self, onset: int) -> tuple[list[tuple[int, float, ProfileSet]], list[ProfileSet]]:
        after = [h for h in self._hist if h[0] >= onset]
        before = [h[2] for h in self._hist if h[0] < onset][-3:]
        return after, before


class WorkloadAwareDetector(_Base):
    """ResiHP's fail-slow detector (see the module docstring).

    :param changepoint: the change-point detector.
    :param verifier: the verification strategy (:class:`~.verify.ProfileVerifier`).
    :param predict_healthy: ``(iteration, profiles) -> healthy seconds``; default: ``model``.
    :param model: the healthy model used by verification (and by default for the
        prediction); default: a :class:`~.model.WorkloadModel` fitted on the warm-up.
    :param prober: active prober for verification, if any.
    :param slow_threshold: verify only if measured > (1 + this) x predicted.
    :param min_gap: iterations between two verifications; also how long a change judged
        benign stays under watch (see below).
    :param series: what the change-point detector watches: ``"normalised"`` (default)
        the measured / predicted-healthy ratio of every iteration, ``"raw"`` the
        iteration time itself (docs/design.md §3.2 read literally; predictions only at change
        points). Normalising first removes the workload's fluctuation from the series,
        so a slowdown that starts while the documents happen to get shorter is not
        masked; a prediction costs milliseconds on the controller.
    :param skip_first: iterations of each generation ignored (start-up, compilation).
    :param verify_window: iterations since the onset a change must span before it is
        verified (the onset included: 3 keeps the detection latency <= 3 iterations);
        one whose last iteration is healthy again has faded and is not verified.
    :param loaded_share: a machine is loaded when a device's peers spent at least this
        share of their measured compute waiting for a CPU (see ``loaded_window``).
    :param loaded_window: iterations a device slower than its peers only by its waiting
        for a CPU must stay so on a loaded machine before it is verified (a contention
        slowdown there is found within this many iterations; docs/detector.md "False
        reports on a loaded machine").
    :param unpinned_window: the same for a device that shares its CPUs with its peers
        (not pinned to cores of its own, or CPUs not reported): its waiting is where the
        scheduler put it, so it must last longer (docs/detector.md "Pinned or unpinned").
    :param unshared_ratio: a confined device on a loaded machine is verified after
        ``verify_window`` iterations, not ``loaded_window``, when in each of them it
        computed at least this much (and ``exp(unshared_k * sigma)``, sigma the host's
        healthy paired noise) slower than its peers under the same load, the slowest of
        all, by waiting for a CPU that was ``neighbour_share`` or more of its compute and
        that its peers did not do, by about the same ratio each time, where the host's
        healthy history rarely came that high (:meth:`_neighbour`; docs/detector.md
        "Contention its peers do not share"): a neighbour on its own cores, not the
        scheduler's luck.
    :param unshared_k: see ``unshared_ratio``.
    :param neighbour_share: see ``unshared_ratio``.
    :param healthy_iterations: iterations at full speed after which a known-slow device
        is reported healthy again (detector/recovery.py).
    :param settle_iterations: iterations after a generation's fit during which its
        warm-up may still be found unhealthy and refitted (:meth:`_resettle`: a worker
        that resumed or restored cold ran slower than its peers through the warm-up).
    :param since_window: iterations past the fit a device slower than its peers through
        the whole warm-up (:attr:`WorkloadModel.slower_than_peers`) must stay slow before
        it is verified: a worker resumed cold runs so for a few.

    A change judged benign is removed from the series (the detector is rebased) but
    stays under watch for ``min_gap`` iterations: if the median ratio since its onset
    climbs above the threshold as more iterations arrive, it is verified then.
    """

    name = "resihp"

    def __init__(
        self,
        changepoint: ChangePointDetector,
        verifier: VerificationStrategy,
        *,
        predict_healthy: PredictHealthy | None = None,
        model: WorkloadModel | None = None,
        prober: Prober | None = None,
        slow_threshold: float = 0.25,
        min_gap: int = 10,
        warmup_iterations: int = 3,
        series: str = "normalised",
        skip_first: int = 1,
        history: int = 32,
        generation: int = 0,
        plan: ParallelPlan | None = None,
        clock: Callable[[], float] = time.time,
        verify_window: int = 3,
        local: PeerExcessWatch | None = None,
        loaded_share: float = 0.25,
        loaded_window: int = 6,
        unpinned_window: int = 12,
        unshared_ratio: float = 1.3,
        unshared_k: float = 2.0,
        neighbour_share: float = 0.5,
        healthy_iterations: int = 5,
        settle_iterations: int = 10,
        since_window: int = 5,
    ) -> None:
        if (not slow_threshold > 0 or min_gap < 1 or verify_window < 1 or loaded_window < verify_window
                or unpinned_window < loaded_window):
            raise ValueError("need slow_threshold > 0, min_gap >= 1, "
                             "1 <= verify_window <= loaded_window <= unpinned_window")
        self.verify_window, self.loaded_share, self.loaded_window = verify_window, loaded_share, loaded_window
        self.unpinned_window = unpinned_window
        if not unshared_ratio > 1 or unshared_k < 0 or not 0 < neighbour_share < 1:
            raise ValueError(f"need unshared_ratio > 1, unshared_k >= 0 and 0 < neighbour_share < 1, got "
                             f"{unshared_ratio!r}, {unshared_k!r}, {neighbour_share!r}")
        self.unshared_ratio, self.unshared_k, self.neighbour_share = unshared_ratio, unshared_k, neighbour_share
        if settle_iterations < 0:
            raise ValueError(f"settle_iterations must be >= 0, got {settle_iterations}")
        self.settle_iterations = settle_iterations
        self.since_window = max(since_window, verify_window)
        self.local = local if local is not None else PeerExcessWatch(window=verify_window, floor=slow_threshold)
        # The same watch on each rank's own compute (without its waiting for a CPU):
        # steady where the host is loaded, so a slow DP replica is found in time there
        # too (docs/detector.md "DP-only jobs").
        self.own = PeerExcessWatch(window=verify_window, floor=slow_threshold)
        # A known-slow device back at full speed for k iterations is reported healthy
        # again (detector/recovery.py), so the plan can return to the better layout.
        self.recovery = RecoveryWatch(k=healthy_iterations)
        if series not in ("normalised", "raw"):
            raise ValueError(f"series must be 'normalised' or 'raw', got {series!r}")
        self.slow_threshold, self.min_gap, self.series = slow_threshold, min_gap, series
        self.model = model if model is not None else WorkloadModel(plan=plan, warmup_iterations=warmup_iterations)
        self.model.peer_margin = 1.0 + slow_threshold  # slow since the warm-up began: as slow as slow is
        self._predict = predict_healthy
        self._said_resolution = False  # once per detector, not per generation
        super().__init__(changepoint, verifier, prober=prober, generation=generation, plan=plan,
                         skip_first=skip_first, history=history, clock=clock)

    def _reset_state(self, generation: int, plan: ParallelPlan | None) -> None:
        super()._reset_state(generation, plan)
        self._pred: dict[int, float] = {}
        self._watch: tuple[int, int] | None = None  # (onset, until iteration) of a benign change
        self._more = 0  # iterations since its onset the watched change needs (Verdict.more)
        self._opening: list[float] = []  # the normalised series' first values: its healthy level
        self._fit_at: int | None = None  # the iteration whose warm-up fit the model holds
        self._settle_until = -1  # last iteration at which that warm-up may be found unhealthy
        self._since_unjudged: set[int] = set()  # slow since the warm-up began, not verified yet
        if hasattr(self, "local"):
            self.local.reset()
            self.own.reset()
            self.recovery.reset()

    def _feed_normalised(self, iteration: int, ratio: float) -> Any:
        if len(self._opening) < 4:
            self._opening.append(ratio)
        return self._feed(iteration, ratio)

    def predict_healthy(self, iteration: int, profiles: ProfileSet) -> float:
        """Healthy seconds of ``iteration`` (cached per iteration)."""
        if iteration in self._pred:
            return self._pred[iteration]
        self.stats.predictions += 1
        if self._predict is not None:
            t = float(self._predict(iteration, profiles))
        else:
            t = self.model.predict_healthy(iteration, profiles)
        self._pred[iteration] = t
        if len(self._pred) > 2 * self._history_len:
            for k in sorted(self._pred)[: len(self._pred) - self._history_len]:
                del self._pred[k]
        return t

    def reset(self, generation: int, *, plan: ParallelPlan | None = None,
              speeds: Mapping[int, float] | None = None) -> None:
        """A new plan generation: new series, new warm-up (the model is refitted with the
        known ``speeds`` divided out, and those slow devices are not reported again)."""
        self.model.reset(plan=plan, speeds=speeds)
        self._reset_state(generation, plan)
        for d, p in (speeds or {}).items():
            self._reported[(d, "compute")] = p
            self._reported[(d, "contention")] = p

    def _ratio_since(self, onset: int) -> tuple[float, float | None]:
        after, _ = self._window(onset)
        ratios = []
        predicted = None
        for it, m, ps in after:
            predicted = self.predict_healthy(it, ps)
            ratios.append(m / predicted)
        return (statistics.median(ratios) if ratios else 1.0), predicted

    def observe(self, iteration: int, profiles: ProfileSet) -> Detection:
        self.stats.iterations += 1
        measured = measured_iteration_time(profiles)
        if self._seen < self.skip_first:
            self._seen += 1
            return Detection(iteration, measured, "warmup")
        self._hist.append((iteration, measured, profiles))
        if not self.model.ready:
            self.model.add_warmup(profiles)
            if self.series == "raw":
                cp = self._feed(iteration, measured)
                if cp is not None:
                    self.changepoint.rebase(cp.index)
            if self.model.ready:
                self._open_series(iteration)
            return Detection(iteration, measured, "warmup")
        if iteration <= self._settle_until:
            refit = self._resettle(iteration, measured)
            if refit is not None:
                return refit
        det = self._observe_series(iteration, measured, profiles)
        if det.report is None and det.action not in ("cleared", "known"):
            local = self._observe_local(iteration, measured, profiles)
            if local is not None:
                det = local
        if det.report is None:
            back = self._healthy_again(iteration, measured, profiles)
            if back is not None:
                return back
        if not self._said_resolution:
            notice = self._resolution(profiles)
            if notice is not None:
                self._said_resolution = True
                if notice:
                    logger.info("event=failslow_resolution generation=%d iteration=%d %s",
                                self.generation, iteration, notice)
                    det = replace(det, notice=notice)
        return det

    #: Healthy values of each device's peer excess the resolution notice is judged on.
    RESOLUTION_HISTORY = 8
    #: Slowdowns relative to the peers the job's user is told are not found when the
    #: per-device bar is above them (issue #33's target: 1.3x).
    RESOLUTION_TARGET = 1.3

    def _resolution(self, profiles: ProfileSet) -> str | None:
        """Once every device's healthy noise is measured on ``RESOLUTION_HISTORY``
        iterations: "" where the per-device path flags a device from
        ``RESOLUTION_TARGET`` times its peers or less, else the line telling the user
        which slowdowns this job's iterations are too short or too noisy for
        (docs/detector.md "Short or noisy iterations"); None while still measuring."""
        devices = sorted({p.device for p in profiles.values()})
        if len(devices) < 2 or any(self.local.healthy_count(d) < self.RESOLUTION_HISTORY for d in devices):
            return None
        bars = {d: math.exp(self.local.threshold(d)) for d in devices}
        worst = max(bars.values())
        if worst <= self.RESOLUTION_TARGET * (1 + 1e-9):
            return ""
        seconds = statistics.median(m for _, m, _ in self._hist)
        sigma = statistics.median(self.local.sigma(d) for d in devices)
        return (f"fail-slow detection: iterations of {seconds:.3g} s vary too much from one to the next to judge "
                f"slowdowns under {worst:.2f}x: a device is flagged once it computes {min(bars.values()):.2f}x-"
                f"{worst:.2f}x its peers (their healthy noise, sigma {sigma:.2f} in log ratio); smaller "
                "slowdowns (a 1.3x noisy neighbour) are not found on this job. Longer iterations (more "
                "micro-batches or tokens per iteration) or a quieter host lower the bar")

    def _open_series(self, iteration: int) -> None:
        """The model was just fitted on the iterations in the history (this generation's
        warm-up): they open the normalised series and the watches' healthy histories."""
        self._fit_at = iteration
        if self._settle_until < 0:
            self._settle_until = iteration + self.settle_iterations
        if self.series == "normalised":
            # The warm-up iterations are healthy by assumption: they open the
            # normalised series, so a slowdown right after warm-up still shows as a
            # change from ~1.0 rather than as the series' first level.
            try:
                for it, m, ps in self._hist:
                    cp = self._feed_normalised(it, m / self.predict_healthy(it, ps))
                    if cp is not None:
                        self.changepoint.rebase(cp.index)
            except ModelNotReady:
                pass
        # ... and give each device's peer excess its first healthy values. A device slow
        # since the warm-up began (fitted to its peers' cost) was never healthy here: it
        # gets its peers' typical values, so its slowdown is judged as one.
        since = self._slow_since_warmup()
        self._since_unjudged = set(since)
        try:
            for it, _, ps in self._hist:
                healthy = self.model.rank_compute
                self.local.update(it, _as_peers(peer_excess(ps, healthy, unreliable=self._known_slow()), since))
                self.own.update(it, _as_peers(peer_excess(ps, healthy, own_compute_of, self._known_slow()), since))
        except ModelNotReady:
            pass

    def _faster_than_fit(self, rows: list[ProfileSet]) -> dict[tuple[int, int], tuple[float, float]]:
        """Executors that ran faster than their fit, and than the executors at their fit,
        by the detector's margin (``1 + slow_threshold``) in every one of ``rows``, where
        in each row no executor ran slower than its fit by that margin and some ran at
        it: executor -> (median own compute over its fit, over the others'). Own compute
        (the waiting for a CPU taken out, the healthy waiting taken out of the fit) keeps
        a loaded host's scheduling out of it; needing executors at their fit keeps out
        load the whole machine sheds at once; none slower keeps a slowdown that starts
        just then from being refitted away. Executors with a known-slow device are left
        out: running faster than their estimated speed is what the recovery watch looks
        for."""
        slow = self._known_slow()
        bar = 1.0 / (1.0 + self.slow_threshold)
        seen: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for ps in rows:
            level: dict[tuple[int, int], list[float]] = {}
            skip: set[tuple[int, int]] = set()
            compute = self.model.rank_compute
            for p in ps.values():
                ex = (p.replica, p.stage)
                if p.device in slow:
                    skip.add(ex)
                share = self.model.wait_share.get(p.device, (0.0, 0.0))[0]
                healthy = compute(p) * (1.0 - min(share, 0.9))
                if healthy > 0:
                    level.setdefault(ex, []).append(own_compute_of(p) / healthy)
            per_ex = {ex: statistics.median(v) for ex, v in level.items() if ex not in skip}
            steady = [r for r in per_ex.values() if bar < r < 1.0 / bar]
            if not steady or any(r >= 1.0 / bar for r in per_ex.values()):
                return {}
            ref = statistics.median(steady)
            for ex, r in per_ex.items():
                if r <= bar and r / ref <= bar:
                    seen.setdefault(ex, []).append((r, r / ref))
        return {ex: (statistics.median(r for r, _ in v), statistics.median(q for _, q in v))
                for ex, v in seen.items() if len(v) == len(rows)}

    def _resettle(self, iteration: int, measured: float) -> Detection | None:
        """Refit a generation whose warm-up was not healthy (docs/detector.md "Paused
        workers come back"). The warm-up is healthy by assumption; a worker that resumed
        or restored cold breaks it by running slower than its peers through it, and the
        fit then takes that slowness as its healthy speed. Once it warms up it runs
        faster than its fit while its peers run at theirs, so each healthy peer looks
        slower than its reference by the transient: the peer would be reported. An
        executor faster than its fit and than its peers by the detector's margin in each
        of the last ``warmup_iterations`` iterations after the fit is that case (a real
        slowdown makes the slowed device slower than its fit, never its peers faster):
        the model is refitted on those iterations and the series and watches restart
        from them. Only within ``settle_iterations`` of the generation's first fit."""
        w = self.model.warmup_iterations
        recent = list(self._hist)[-w:]
        if self._fit_at is None or len(recent) < w or recent[0][0] <= self._fit_at:
            return None
        try:
            fast = self._faster_than_fit([ps for _, _, ps in recent])
        except ModelNotReady:
            return None
        if not fast:
            return None
        note = ("the warm-up was not healthy: " + ", ".join(
            f"replica {r} stage {s} ran at {x:.2f}x its fit ({q:.2f}x its peers')" for (r, s), (x, q) in sorted(fast.items())
        ) + f" in each of iterations {recent[0][0]}-{recent[-1][0]}; refitted on them")
        logger.info("event=warmup_refit generation=%d iteration=%d %s", self.generation, iteration, note)
        self.model.reset(plan=self.model.plan, speeds=self.model.speeds)
        for _, _, ps in recent:
            self.model.add_warmup(ps)
        self.changepoint.reset()
        self._fed.clear()
        self._obs = 0
        self._opening = []
        self._pred.clear()
        self._watch, self._more = None, 0
        self.local.reset()
        self.own.reset()
        self._hist = deque(recent, maxlen=self._history_len)
        if self.series == "raw":
            for it, m, _ in recent:
                self._feed(it, m)
        if self.model.ready:
            self._open_series(iteration)
        return Detection(iteration, measured, "warmup", notes=(note,))

    def _known_slow(self) -> set[int]:
        """Devices the model knows slow (a report, or the plan's speeds) and the recovery
        watch follows, and those slow since this generation's warm-up: no reference for
        their peers."""
        return ({d for d, p in self.model.speeds.items() if p < self.recovery.slowest}
                | self._slow_since_warmup())

    def _past_known(self, verdict: Verdict) -> Verdict:
        """Known-slow devices found slower than their known speed ``p``. Their
        predictions carry ``p``, so the verdict's ``p`` is relative to it: the device's
        own speed is that times the known one, what the report and the plan need. That
        holds for a device slower than known since the warm-up
        (:attr:`WorkloadModel.slower_than_peers`) and for one that slowed further
        during the generation by the model's ``known_margin`` (relative ``p`` at most its
        inverse). Less than that is left relative, as known (the comparison with the
        known speed takes it for the same slowdown): a device left with fewer
        micro-batches computes each up to the recovery watch's allowance slower than
        its estimate, and re-reporting it would shrink its work again."""
        speeds, bar, since = self.model.speeds, 1.0 / self.model.known_margin, self._slow_since_warmup()
        past = {d for d, p in verdict.slow.items() if speeds.get(d, 1.0) < 1.0 and (p <= bar or d in since)}
        if not past:
            return verdict
        known = "; ".join(f"device {d} known at p={speeds[d]:.2f}: p={p:.2f} of that is {p * speeds[d]:.2f} "
                          "of full speed" for d, p in sorted(verdict.slow.items()) if d in past)
        return replace(verdict, slow={d: p * speeds[d] if d in past else p for d, p in verdict.slow.items()},
                       evidence=f"{verdict.evidence} ({known})")

    def _slow_since_warmup(self) -> set[int]:
        """Devices of the executors the model found slower than their peers throughout
        its warm-up (:attr:`WorkloadModel.slower_than_peers`)."""
        return {d for ex in self.model.slower_than_peers for d in self.model.group_of(ex)}

    def _onset_past_blip(self, onset: int, devices: set[int]) -> int:
        """``onset``, moved one iteration on when each flagged device computed
        ``slow_threshold`` above its peers in every later iteration of the window by some
        measure (its measured compute, or its own without the waiting for a CPU, against
        the healthy model) but not by all of those measures in that iteration: the
        per-device watch started its run on noise just before the slowdown (it judges a
        device against its own healthy level, and a small own compute on a loaded host
        swings by 1.4x). That iteration carries none of the slowdown; rules that ask for
        it in every iteration verified read it as the slowdown's absence and cleared a
        device that stayed slow, and the device's speed came out too high."""
        after, _ = self._window(onset)
        if len(after) < 2 or not devices:
            return onset
        bar, slow = math.log1p(self.slow_threshold), self._known_slow()
        rows: list[dict[int, tuple[bool, bool]]] = []  # per iteration, per device: (measured, own) above
        try:
            for _, _, ps in after:
                healthy = self.model.rank_compute
                measured = peer_excess(ps, healthy, unreliable=slow)
                own = peer_excess(ps, healthy, own_compute_of, slow)
                rows.append({d: (measured.get(d, -math.inf) > bar, own.get(d, -math.inf) > bar) for d in devices})
        except ModelNotReady:
            return onset
        for d in devices:
            steady = [k for k in (0, 1) if all(row[d][k] for row in rows[1:])]  # its slowdown's measures
            if not steady or all(rows[0][d][k] for k in steady):
                return onset  # not steadily slow, or slow in the first iteration already
        return after[1][0]

    def _healthy_again(self, iteration: int, measured: float, profiles: ProfileSet) -> Detection | None:
        """Known-slow devices back at full speed for ``healthy_iterations``: reported with
        throughput 1.0, their known speed dropped (docs/detector.md "Acting on a slowdown")."""
        from resihp_core.protocol import FailureReport

        speeds = {d: p for d, p in self.model.speeds.items() if p < self.recovery.slowest}
        if not speeds:
            return None
        try:
            excess = peer_excess(profiles, self.model.rank_compute, unreliable=self._known_slow())
        except ModelNotReady:
            return None
        back = self.recovery.update(speeds, excess)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("event=recovery_watch generation=%d iteration=%d %s", self.generation, iteration,
                         " ".join(f"device={d} p={p:.2f} excess={excess.get(d, float('nan')):.3f} "
                                  f"bar={self.recovery.bar(p):.3f} run={self.recovery.runs().get(d, 0)}"
                                  for d, p in speeds.items()))
        if not back:
            return None
        k = self.recovery.k
        evidence = "; ".join(f"device {d} known at p={speeds[d]:.2f} ran at {math.exp(-excess[d]) * speeds[d]:.2f} "
                             f"of its peers' speed in {k} iterations in a row: healthy again" for d in back)
        self.model.set_speeds({d: 1.0 for d in back})
        self._pred.clear()
        for key in [key for key in self._reported if key[0] in back]:
            del self._reported[key]
        self.local.forget(back)
        self.own.forget(back)
        report = FailureReport(generation=self.generation, failure="fail-slow", devices=tuple(back),
                               cause="compute", throughput={d: 1.0 for d in back}, evidence=evidence,
                               time=max(0.0, self.clock()))
        logger.info("event=healthy_again generation=%d iteration=%d devices=%s", self.generation, iteration, back)
        return Detection(iteration, measured, "recovered", report=report, notes=(evidence,))

    def _observe_series(self, iteration: int, measured: float, profiles: ProfileSet) -> Detection:
        """The iteration-time path: change point, workload filter, verification."""
        try:
            if self.series == "normalised":
                cp = self._feed_normalised(iteration, measured / self.predict_healthy(iteration, profiles))
            else:
                cp = self._feed(iteration, measured)
        except ModelNotReady as e:
            return Detection(iteration, measured, "warmup", notes=(str(e),))
        if cp is None:
            return self._watching(iteration, measured)
        self.stats.change_points += 1
        onset = self._iteration_of(cp.index)
        if self._last_retained is not None and iteration - self._last_retained < self.min_gap:
            self.changepoint.rebase(cp.index)
            return Detection(iteration, measured, "suppressed", cp, onset=onset)
        try:
            ratio, predicted = self._ratio_since(onset)
        except ModelNotReady as e:
            self.changepoint.rebase(cp.index)
            return Detection(iteration, measured, "warmup", cp, onset=onset, notes=(str(e),))
        self.changepoint.rebase(cp.index)
        if ratio <= 1.0 + self.slow_threshold:
            self.stats.benign += 1
            self._watch = (onset, iteration + self.min_gap)
            return Detection(iteration, measured, "benign", cp, predicted, ratio, onset=onset)
        return self._verify_change(iteration, measured, cp, onset, ratio, predicted)

    def _observe_local(self, iteration: int, measured: float, profiles: ProfileSet) -> Detection | None:
        """The per-device path (detector/localise.py): a device whose compute, relative
        to its peers', stays above its own healthy noise for ``verify_window``
        iterations is verified at once, however little the iteration time moved."""
        try:
            # Known-slow devices are no reference for their peers: a speed estimate a
            # little off, or a device back at full speed, makes every peer look slow
            # (the CI run of the duty cycle that ends reported its healthy peer).
            slow = self._known_slow()
            healthy = self.model.rank_compute
            excess = peer_excess(profiles, healthy, unreliable=slow)
            own = peer_excess(profiles, healthy, own_compute_of, slow)
        except ModelNotReady:
            return None
        # The noise verification reads is each device's before this iteration; only an
        # iteration that can find a device needs it (a robust sigma of every device's
        # history, the watches' largest cost at thousands of ranks).
        may = self.local.may_find() or self.own.may_find()
        noise, own_noise = (self.local.noise(), self.own.noise()) if may else ({}, {})
        own_found = self.own.update(iteration, own)
        found = self.local.update(iteration, excess, self._evidence_needed(own_found))
        for d, at in own_found.items():
            found[d] = min(at, found.get(d, at))
            excess[d] = max(excess.get(d, own[d]), own[d])
        for d in [d for d in found if d in self._since_unjudged]:
            if max(self.local.flagged(d), self.own.flagged(d)) < self.since_window:
                # Slow since the warm-up began: a worker resumed cold runs so for a few
                # iterations; it must stay slow past the fit for since_window.
                self.local.extend(d, self.since_window)
                self.own.extend(d, self.since_window)
                del found[d]
        if not found:
            return None
        self._since_unjudged -= set(found)
        onset = min(found.values())
        later = self._onset_past_blip(onset, set(found))
        if later != onset and len(self._window(later)[0]) < self.verify_window:
            # Its first iteration was noise: the runs go on until the window from the
            # real onset is full.
            for d in found:
                self.local.extend(d, self.local.flagged(d) + 1)
                self.own.extend(d, self.own.flagged(d) + 1)
            return Detection(iteration, measured, "pending", None, None, None, onset=later,
                             notes=(f"iteration {onset} was not slow by the measures its later iterations are: "
                                    f"the slowdown began at {later}",))
        onset = later
        after, before = self._window(onset)
        verdict = self._past_known(self._verify([h[2] for h in after], before, self.model, self.slow_threshold,
                                                self._environment(onset), noise, own_noise,
                                                frozenset(self._known_slow())))
        if verdict.more > len(after):
            # Too few iterations for this evidence: the runs must go on that long.
            for d in found:
                self.local.extend(d, verdict.more)
                self.own.extend(d, verdict.more)
            return Detection(iteration, measured, "pending", None, None, None, verdict, onset=onset)
        self._last_retained = iteration
        self._watch = None
        ratio, predicted = self._ratio_since(onset)
        note = "devices " + ", ".join(
            f"{d} ({math.exp(excess[d]):.2f}x its peers, noise {noise.get(d, 0.0):.3f})" for d in sorted(found)
        ) + f" slower than their peers since iteration {onset}"
        logger.info("event=failslow_verified generation=%d iteration=%d onset=%d path=local confirmed=%s rule=%s "
                    "evidence=%r", self.generation, iteration, onset, verdict.confirmed, verdict.rule,
                    verdict.evidence[:300])
        if verdict.cause == "communication" and not set(verdict.slow) <= set(found):
            # The watch saw compute above its peers on these devices; a link of other
            # devices is not what it found (docs/detector.md "False reports on a loaded machine").
            verdict = replace(verdict, slow={}, cause="unknown",
                              evidence=f"the flagged devices {sorted(found)} are not slow in compute; "
                                       f"not reporting a link of others ({verdict.evidence[:300]})")
        # Judged: the flagged devices' histories restart at their current level.
        self.local.forget(set(found) | set(verdict.slow))
        self.own.forget(set(found) | set(verdict.slow))
        if not verdict.confirmed:
            return Detection(iteration, measured, "cleared", None, predicted, ratio, verdict, onset=onset,
                             notes=(note,))
        if self._known(verdict):
            return Detection(iteration, measured, "known", None, predicted, ratio, verdict, onset=onset, notes=(note,))
        report = self._report(verdict)
        if verdict.cause in ("compute", "contention"):
            self.model.set_speeds(verdict.slow)
            self._pred.clear()
        return Detection(iteration, measured, "reported", None, predicted, ratio, verdict, report, onset=onset,
                         notes=(note,))

    def _evidence_needed(self, own_found: Mapping[int, int]) -> Callable[[int, list[int]], int]:
        """Iterations a run of the measured-compute watch must span (docs/detector.md
        "False reports on a loaded machine"). A device above its peers only in measured
        compute — its own compute, the waiting for a CPU taken out, is not — is slowed
        by waiting. Where its peers waited for a CPU ``loaded_share`` of their compute or
        more in those iterations, the machine is loaded and which rank waits longest
        changes from one iteration to the next: three in a row happen by chance, so the
        run must last ``loaded_window`` iterations (a hog on the device's own cores keeps
        it waiting in every one) — unless the run itself carries what chance does not
        give (:meth:`_neighbour`): then ``verify_window``. A device that shares its CPUs
        with its peers (not pinned to cores of its own, or CPUs not reported) must last
        ``unpinned_window``: its waiting is the scheduler's choice, not a hog on its
        cores (docs/detector.md "Pinned or unpinned"). Elsewhere ``verify_window``."""
        def needed(device: int, iterations: list[int]) -> int:
            if device in own_found or self.own.flagged(device) >= len(iterations):
                return self.verify_window
            byit = {it: ps for it, _, ps in self._hist}
            rows = [byit[it] for it in iterations if it in byit]
            if not confined(rows, [device]):
                return self.unpinned_window
            shares = [peers_waiting(ps, device) for ps in rows]
            if shares and statistics.median(shares) >= self.loaded_share:
                return self.verify_window if self._neighbour(device, rows) else self.loaded_window
            return self.verify_window
        return needed

    def _neighbour(self, device: int, rows: list[ProfileSet]) -> bool:
        """Whether a confined ``device``'s run on a loaded machine is a neighbour on its
        own cores by evidence chance does not give, in every iteration of it
        (:func:`~.localise.unshared_waiting`), against the paired bar verification holds
        it to (``max(unshared_ratio, exp(unshared_k * sigma))``, sigma the host's healthy
        paired noise: :func:`~.localise.machine_noise`), and where the host's healthy
        history reaches the run's lowest paired ratio in at most ``NEIGHBOUR_TAIL`` of its
        iterations. A device whose own history holds fewer than ``NEIGHBOUR_HISTORY``
        healthy values is not judged so."""
        noise = self.local.noise()
        if self.local.healthy_count(device) < self.NEIGHBOUR_HISTORY or len(rows) < self.verify_window:
            return False
        bar = max(self.unshared_ratio, math.exp(self.unshared_k * machine_noise(noise, [device])))
        try:
            seen = unshared_waiting(rows, device, self.model.rank_compute, bar, share=self.neighbour_share)
        except ModelNotReady:
            return False
        if seen is None:
            return False
        # The paired bar stands on the spread of the host's healthy noise; a host whose
        # load hops between ranks has a heavy tail that spread does not show (one rank
        # in four 2x its peers, a different one each time): there a run this high is
        # what its chance gives, and it keeps the loaded machine's window.
        low = min(r for r, _ in seen)
        tail = self.local.rate_above(math.log(low))
        if tail > self.NEIGHBOUR_TAIL:
            return False
        logger.info("event=failslow_neighbour generation=%d device=%d bar=%.2f tail=%.3f run=%s", self.generation,
                    device, bar, tail, ", ".join(f"{r:.2f}x its peers waiting {100 * w:.0f} %" for r, w in seen))
        return True

    #: Healthy values the device's own history must hold (since it last restarted: the
    #: warm-up, or a run judged) for :meth:`_neighbour`: the spread and the tail of fewer
    #: cannot say how rarely the host gives a run this high (a device whose earlier run
    #: on a loaded host was judged and cleared restarts with a few values).
    NEIGHBOUR_HISTORY = 8
    #: Largest share of the host's healthy peer excesses (every device's history) that
    #: may reach a run's lowest paired ratio for :meth:`_neighbour` to take the run as
    #: evidence: three such iterations in a row then happen by chance about once in
    #: 8 000 runs of a device.
    NEIGHBOUR_TAIL = 0.05

    def _persistent_excess(self, iteration: int, measured: float) -> Detection:
        """Backstop for a change the change-point detector cannot place: every one of the
        last ``min_gap`` iterations ran more than ``slow_threshold`` above its healthy
        prediction, relative to the level the series opened at (healthy by assumption).
        Change-point detection needs enough history before the change (a slowdown right
        after warm-up has little) and a noise estimate the new regime has not inflated;
        this test needs neither."""
        recent = list(self._hist)[-self.min_gap:]
        if (self.series != "normalised" or len(recent) < self.min_gap or len(self._opening) < 2
                or (self._last_retained is not None and iteration - self._last_retained < self.min_gap)):
            return Detection(iteration, measured)
        level = (1.0 + self.slow_threshold) * statistics.median(self._opening)
        try:
            if any(m <= level * self.predict_healthy(it, ps) for it, m, ps in recent):
                return Detection(iteration, measured)
        except ModelNotReady:
            return Detection(iteration, measured)
        onset = recent[0][0]
        ratio, predicted = self._ratio_since(onset)
        det = self._verify_change(iteration, measured, None, onset, ratio, predicted)
        return replace(det, notes=det.notes + (f"sustained excess since iteration {onset}",))

    def _watching(self, iteration: int, measured: float) -> Detection:
        """Re-judge a recent benign change as its iterations accumulate."""
        if self._watch is None:
            return self._persistent_excess(iteration, measured)
        onset, until = self._watch
        if iteration > until:
            self._watch, self._more = None, 0
            return Detection(iteration, measured)
        try:
            ratio, predicted = self._ratio_since(onset)
        except ModelNotReady:
            return Detection(iteration, measured)
        if ratio <= 1.0 + self.slow_threshold:
            return Detection(iteration, measured)
        return self._verify_change(iteration, measured, None, onset, ratio, predicted)

    def _verify_change(self, iteration: int, measured: float, cp: ChangePoint | None, onset: int,
                       ratio: float, predicted: float | None) -> Detection:
        self._watch = None
        if cp is not None:
            self._more = 0  # a new change: what an earlier one needed does not carry over
        after, before = self._window(onset)
        if len(after) < max(self.verify_window, self._more):
            # Too early to tell a lasting slowdown from a blip: look again next iteration.
            self._watch = (onset, iteration + max(self.min_gap, self.verify_window))
            return Detection(iteration, measured, "pending", cp, predicted, ratio, onset=onset)
        if self.verify_window >= 2:
            # A slowdown that is over by the end of its verification window (a short
            # burst of load) is no device failure; keep watching in case it returns.
            it, m, ps = after[-1]
            try:
                last = m / self.predict_healthy(it, ps)
            except ModelNotReady:
                last = ratio
            if last <= 1.0 + self.slow_threshold:
                self._watch = (onset, iteration + self.min_gap)
                return Detection(iteration, measured, "faded", cp, predicted, ratio, onset=onset,
                                 notes=(f"iteration {it} ran at {last:.2f}x healthy again: the slowdown faded",))
        env = self._environment(onset)
        verdict = self._past_known(self._verify([h[2] for h in after], before, self.model, self.slow_threshold,
                                                env, self.local.noise(), self.own.noise(),
                                                frozenset(self._known_slow())))
        if verdict.more > len(after):
            # Not enough iterations for this evidence yet: verify again when there are.
            self._watch = (onset, iteration + max(self.min_gap, verdict.more))
            self._more = verdict.more
            return Detection(iteration, measured, "pending", cp, predicted, ratio, verdict, onset=onset)
        self._more = 0
        self._last_retained = iteration
        logger.info("event=failslow_verified generation=%d iteration=%d onset=%d ratio=%.2f confirmed=%s rule=%s "
                    "evidence=%r", self.generation, iteration, onset, ratio, verdict.confirmed, verdict.rule,
                    verdict.evidence[:300])
        if not verdict.confirmed:
            return Detection(iteration, measured, "cleared", cp, predicted, ratio, verdict, onset=onset)
        if self._known(verdict):
            return Detection(iteration, measured, "known", cp, predicted, ratio, verdict, onset=onset)
        report = self._report(verdict)
        self.local.forget(set(verdict.slow))
        self.own.forget(set(verdict.slow))
        if verdict.cause in ("compute", "contention"):
            self.model.set_speeds(verdict.slow)
            self._pred.clear()
        return Detection(iteration, measured, "reported", cp, predicted, ratio, verdict, report, onset=onset)


class ChangePointOnlyDetector(_Base):
    """The Greyhound-like baseline: every change point is verified."""

    name = "greyhound"

    def reset(self, generation: int, *, plan: ParallelPlan | None = None,
              speeds: Mapping[int, float] | None = None) -> None:
        self._reset_state(generation, plan)

    def observe(self, iteration: int, profiles: ProfileSet) -> Detection:
        self.stats.iterations += 1
        measured = measured_iteration_time(profiles)
        if self._seen < self.skip_first:
            self._seen += 1
            return Detection(iteration, measured, "warmup")
        self._hist.append((iteration, measured, profiles))
        cp = self._feed(iteration, measured)
        if cp is None:
            return Detection(iteration, measured)
        self.stats.change_points += 1
        onset = self._iteration_of(cp.index)
        after, before = self._window(onset)
        verdict = self._verify([h[2] for h in after] or [profiles], before, None, 0.0)
        self.changepoint.rebase(cp.index)
        if not verdict.confirmed:
            return Detection(iteration, measured, "cleared", cp, verdict=verdict, onset=onset)
        if self._known(verdict):
            return Detection(iteration, measured, "known", cp, verdict=verdict, onset=onset)
        report = self._report(verdict)
        return Detection(iteration, measured, "reported", cp, verdict=verdict, report=report, onset=onset)


def _as_peers(excess: dict[int, float], devices: set[int]) -> dict[int, float]:
    """``excess`` with each of ``devices`` given the median of the others' values."""
    rest = [x for d, x in excess.items() if d not in devices]
    if not devices or not rest:
        return excess
    typical = statistics.median(rest)
    return {d: typical if d in devices else x for d, x in excess.items()}


# ------------------------------------------------------------------ construction
def changepoint_options(config: DetectorConfig) -> dict[str, Any]:
    """What the configuration says to every change-point factory (hook contract)."""
    return {"threshold": config.changepoint_threshold, "hazard": config.changepoint_hazard}


def build_failslow_detector(
    config: DetectorConfig | None = None,
    *,
    plugins: Plugins | None = None,
    predict_healthy: PredictHealthy | None = None,
    model: WorkloadModel | None = None,
    prober: Prober | None = None,
    plan: ParallelPlan | None = None,
    verification: str = "resihp",
    generation: int = 0,
    **changepoint_extra: Any,
) -> WorkloadAwareDetector:
    """The configured workload-aware detector: change-point method
    ``config.changepoint_method`` and verification strategy ``verification``, looked up
    in the plugin registries (so a plugin can replace either)."""
    from resihp_core.config import DetectorConfig
    from resihp_core.plugins import get_plugins

    config = config or DetectorConfig()
    plugins = plugins or get_plugins()
    cpd = plugins.changepoint_detectors().create(
        config.changepoint_method, **changepoint_options(config), **changepoint_extra
    )
    verifier = plugins.verification_strategies().create(verification)
    if model is None:
        model = WorkloadModel(plan=plan, warmup_iterations=config.warmup_iterations)
    return WorkloadAwareDetector(
        cpd, verifier, predict_healthy=predict_healthy, model=model, prober=prober,
        slow_threshold=config.slow_threshold, min_gap=config.min_changepoint_gap,
        warmup_iterations=config.warmup_iterations, generation=generation, plan=plan,
    )


def build_baseline_detector(
    config: DetectorConfig | None = None,
    *,
    plugins: Plugins | None = None,
    prober: Prober | None = None,
    generation: int = 0,
) -> ChangePointOnlyDetector:
    """The Greyhound-like baseline (its published parameters; ``hazard`` from config)."""
    from resihp_core.config import DetectorConfig
    from resihp_core.plugins import get_plugins

    config = config or DetectorConfig()
    plugins = plugins or get_plugins()
    cpd = plugins.changepoint_detectors().create("greyhound", hazard=config.changepoint_hazard)
    verifier = plugins.verification_strategies().create("greyhound")
    return ChangePointOnlyDetector(cpd, verifier, prober=prober, generation=generation)

