"""The healthy-time model the fail-slow filter and the verification use (docs/design.md §3.2-3.4).

A :class:`WorkloadModel` is fitted per plan generation from the profiles of the first
``warmup_iterations`` observed iterations: for every executor (replica, stage) the
micro-batch cost ``T = α·N + β·Σ l²`` (forward and backward separately,
:func:`~resihp_core.predictor.cost.fit_stage`) from the micro-batches it ran, with their
documents. Then, for any later iteration and *its* documents:

* :meth:`WorkloadModel.rank_compute` — the healthy compute seconds of one rank
  (what verification compares a rank's measured compute with);
* :meth:`WorkloadModel.predict_healthy` — the healthy iteration time. With a plan and a
  topology/shape (an :class:`~resihp_core.predictor.predict.IterationPredictor`), the
  pipeline DAG is simulated for this iteration's micro-batches; without one, the
  slowest executor's predicted compute stands in for the critical path. Either way the
  raw prediction is multiplied by a calibration factor, the median of measured / raw
  over the warm-up iterations, which absorbs what the model does not see (framework
  overhead, a link model that does not match the machine).

Known slow devices (``speeds``: device -> p from earlier reports) are put back into
predictions, so a device that is already reported does not keep looking slow. The
recovery watch (detector/recovery.py) reads a device back at full speed as about
``log p`` faster than that prediction, which holds only if its healthy cost is healthy.
Dividing ``p`` out of its own warm-up gives that only where it ran at ``p`` then; a
slowdown that comes and goes (a duty-cycled worker, one whose slowdown ends during the
warm-up) runs lighter, and the fit would take that lighter level for its slow one. So
its healthy cost is the larger of its own warm-up with ``p`` divided out and the cost of
its stage's executors with no known-slow device (DP replicas do the same work per
micro-batch) times its own speed relative to them when it was last fitted healthy. A
stage with no such executor keeps the first.

An executor that ran ``peer_margin`` times slower than its stage's other executors in
every warm-up iteration was slow before the generation began (:meth:`WorkloadModel._slow_from_start`):
its own warm-up is no healthy speed, and its peers' cost stands in for it.

numpy is needed (the fit and the simulator); import this module lazily.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import defaultdict
from typing import TYPE_CHECKING, Mapping

from resihp_core.detector.environment import wait_shares
from resihp_core.predictor.cost import CostModel, CostModelError, StageCost, fit_stage
from resihp_core.predictor.simulator import SimulationError

if TYPE_CHECKING:
    from resihp_core.detector import ProfileSet
    from resihp_core.plan import ParallelPlan, Topology
    from resihp_core.predictor.cost import LinkModel
    from resihp_core.predictor.predict import IterationPredictor, ModelShape
    from resihp_core.protocol import IterationProfile

__all__ = ["ModelNotReady", "WorkloadModel", "measured_iteration_time"]

Executor = tuple[int, int]  # (replica, stage)
Sample = tuple[tuple[int, ...], float, float]  # a micro-batch's document lengths, forward s, backward s


class ModelNotReady(RuntimeError):
    """The model has not seen its warm-up iterations yet (or could not fit them)."""


def measured_iteration_time(profiles: ProfileSet) -> float:
    """The iteration's wall time: the slowest rank's (ranks end together at the DP sync)."""
    if not profiles:
        raise ValueError("no profiles for this iteration")
    return max(p.iteration_s for p in profiles.values())


def _mean_cost(samples: list[tuple[tuple[int, ...], float, float]], layers: int, tp: int) -> StageCost:
    """Linear-only fallback (β = 0) when α and β cannot be separated."""
    n = sum(sum(l) for l, _, _ in samples)
    f = sum(x for _, x, _ in samples)
    b = sum(x for _, _, x in samples)
    return StageCost(alpha_f=f / n, beta_f=0.0, alpha_b=b / n, beta_b=0.0, ref_layers=layers, ref_tp=tp)


_TERMS = ("alpha_f", "beta_f", "gamma_f", "delta_f", "alpha_b", "beta_b", "gamma_b", "delta_b")


def _mean_stage_cost(costs: list[StageCost], scale: float = 1.0) -> StageCost:
    """The mean of one stage's fitted costs (DP replicas), normalised to TP degree 1,
    times ``scale``."""
    k = len(costs)
    terms = {t: scale * sum(getattr(c, t) * c.ref_tp for c in costs) / k for t in _TERMS}
    return StageCost(**terms, ref_layers=costs[0].ref_layers, ref_tp=1, w_fraction=costs[0].w_fraction)


def _one_column(xs: list[float], ts: list[float]) -> float:
    den = sum(x * x for x in xs)
    return max(0.0, sum(x * t for x, t in zip(xs, ts)) / den) if den > 0 else 0.0


def _fit_nonnegative(samples: list[tuple[tuple[int, ...], float, float]], layers: int, tp: int) -> StageCost:
    """Least squares of T = α·N + β·Σl² with α, β >= 0 (noisy warm-ups can make an
    unconstrained fit negative, which would predict negative times)."""
    c = fit_stage(samples, ref_layers=layers, ref_tp=tp, intercept=False)
    if min(c.alpha_f, c.beta_f, c.alpha_b, c.beta_b) >= 0:
        return c
    ns = [float(sum(l)) for l, _, _ in samples]
    ss = [float(sum(x * x for x in l)) for l, _, _ in samples]
    out = {}
    for key, idx in (("f", 1), ("b", 2)):
        ts = [s[idx] for s in samples]
        a, b = getattr(c, f"alpha_{key}"), getattr(c, f"beta_{key}")
        if b < 0:
            a, b = _one_column(ns, ts), 0.0
        elif a < 0:
            a, b = 0.0, _one_column(ss, ts)
        out[f"alpha_{key}"], out[f"beta_{key}"] = a, b
    return StageCost(**out, ref_layers=layers, ref_tp=tp)


class WorkloadModel:
    """Healthy compute and iteration time for an iteration's actual documents.

    :param plan: the current plan (layers per stage, TP degrees; with ``predictor`` the
        pipeline is simulated).
    :param predictor: an :class:`IterationPredictor` whose topology, shape and links are
        used (its cost model is replaced by the fitted one); or give ``topology`` and
        ``shape`` (and optionally ``links``).
    :param warmup_iterations: iterations fitted before predictions are available.
    :param speeds: known normalised throughput of slow devices (device -> p).
    :param calibrate: multiply predictions by median(measured / raw) over the warm-up.
    :param peer_margin: an executor that computed this much slower than its stage's
        other executors in every warm-up iteration is slow since the warm-up began
        (:attr:`slower_than_peers`): its healthy cost is theirs.
    :param known_margin: the same for an executor with a known-slow device, its known
        speed divided out: above ``peer_margin`` by how much slower than its peers'
        estimate a device left with fewer micro-batches computes each (the recovery
        watch's allowance, detector/recovery.py).
    """

    def __init__(
        self,
        *,
        plan: ParallelPlan | None = None,
        predictor: IterationPredictor | None = None,
        topology: Topology | None = None,
        shape: ModelShape | None = None,
        links: LinkModel | None = None,
        warmup_iterations: int = 3,
        speeds: Mapping[int, float] | None = None,
        calibrate: bool = True,
        peer_margin: float = 1.25,
        known_margin: float = 1.25 * 1.3,
    ) -> None:
        if warmup_iterations < 1:
            raise ValueError(f"warmup_iterations must be >= 1, got {warmup_iterations}")
        if predictor is not None:
            topology, shape, links = predictor.topology, predictor.shape, predictor.links
        self.topology, self.shape, self.links = topology, shape, links
        self.warmup_iterations = warmup_iterations
        self.calibrate = calibrate
        if not peer_margin > 1.0:
            raise ValueError(f"peer_margin must be > 1, got {peer_margin}")
        self.peer_margin = peer_margin
        if not known_margin >= peer_margin:
            raise ValueError(f"known_margin must be >= peer_margin, got {known_margin}")
        self.known_margin = known_margin
        # device group -> its healthy compute relative to its stage's other executors at
        # the last fit where none of them was known slow (kept across generations)
        self.relative: dict[tuple[int, ...], float] = {}
        # The detector's thread changes the model; the supervisor's reads it through
        # fitted_predictor() only: the lock gives that one reader a whole fit.
        self._lock = threading.RLock()
        # rank_compute's memo, (replica, stage, work) -> seconds, for the model as it
        # stands: emptied by every change of what it answers from (the fit, the known
        # speeds, the plan) and when it holds more than a few iterations' executors.
        self._computed: dict[tuple[object, ...], float] = {}
        self.reset(plan=plan, speeds=speeds)

    # ------------------------------------------------------------ state
    def reset(self, *, plan: ParallelPlan | None = None, speeds: Mapping[int, float] | None = None) -> None:
        """Start a new generation: forget the fit, collect a new warm-up."""
        with self._lock:
            self._reset(plan, speeds)

    def _reset(self, plan: ParallelPlan | None, speeds: Mapping[int, float] | None) -> None:
        self._computed.clear()
        self.plan = plan
        self.speeds: dict[int, float] = dict(speeds or {})
        self._warm: list[ProfileSet] = []
        self.costs: dict[Executor, StageCost] = {}
        self.calibration = 1.0
        self.fit_error: str | None = None
        self._predictor: IterationPredictor | None = None
        self._group: dict[Executor, tuple[int, ...]] = {}
        # device -> share of compute / of time outside compute spent waiting for a CPU
        # in the warm-up: the waiting the healthy predictions contain (detector/environment.py)
        self.wait_share: dict[int, tuple[float, float]] = {}
        # executor -> its pace over its peers' (median over the warm-up), where at least
        # peer_margin in every warm-up iteration: slow since the generation began
        self.slower_than_peers: dict[Executor, float] = {}

    def set_speeds(self, speeds: Mapping[int, float]) -> None:
        """Known slow devices changed (a report): predictions include them from now on."""
        with self._lock:
            self.speeds.update(speeds)
            self._predictor = None
            self._computed.clear()

    @property
    def ready(self) -> bool:
        return bool(self.costs)

    def add_warmup(self, profiles: ProfileSet) -> bool:
        """Collect one warm-up iteration; fits when enough are collected. Returns ready."""
        if self.ready:
            return True
        if profiles:
            self._warm.append(dict(profiles))
        if len(self._warm) >= self.warmup_iterations:
            with self._lock:
                self._fit()
        return self.ready

    # ------------------------------------------------------------ fitting
    def _executor_group(self, ex: Executor) -> tuple[int, ...]:
        r, s = ex
        if self.plan is not None and r < self.plan.dp and s < self.plan.pp and self.plan.group(r, s):
            return self.plan.group(r, s)
        return self._group.get(ex, ())

    def group_of(self, ex: Executor) -> tuple[int, ...]:
        """The devices of executor ``ex`` (replica, stage)."""
        return self._executor_group(ex)

    def _degree(self, ex: Executor) -> int:
        r, s = ex
        if self.plan is not None and r < self.plan.dp and s < self.plan.pp and self.plan.group(r, s):
            return self.plan.degree(r, s)
        return 1

    def _layers(self, stage: int) -> int:
        return self.plan.layers(stage) if self.plan is not None and stage < self.plan.pp else 1

    def _group_speed(self, ex: Executor) -> float:
        g = self._executor_group(ex)
        return min((self.speeds.get(d, 1.0) for d in g), default=1.0)

    def _fit(self) -> None:
        samples: dict[Executor, list[tuple[tuple[int, ...], float, float]]] = defaultdict(list)
        devices: dict[Executor, set[int]] = defaultdict(set)
        for profiles in self._warm:
            for p in profiles.values():
                ex = (p.replica, p.stage)
                devices[ex].add(p.device)
                for mb in p.microbatches:
                    if mb.doc_lengths:
                        samples[ex].append((tuple(mb.doc_lengths), mb.forward_s, mb.backward_s))
        self._group = {ex: tuple(sorted(ds)) for ex, ds in devices.items()}
        costs: dict[Executor, StageCost] = {}
        problems: list[str] = []
        for ex, ss in samples.items():
            speed = self._group_speed(ex)
            healthy = [(l, f * speed, b * speed) for l, f, b in ss]  # as if at p = 1
            layers, tp = self._layers(ex[1]), self._degree(ex)
            try:
                costs[ex] = _fit_nonnegative(healthy, layers, tp)
            except CostModelError as e:
                problems.append(f"replica {ex[0]} stage {ex[1]}: {e}")
                if healthy:
                    costs[ex] = _mean_cost(healthy, layers, tp)
        if not costs:
            self.fit_error = "no micro-batch profiles with document lengths in the warm-up"
            self._warm.clear()
            return
        self.slower_than_peers = self._slow_from_start(costs)
        self._from_peers(costs, samples)
        self.costs = costs
        self._computed.clear()
        self.fit_error = "; ".join(problems) or None
        self.wait_share = wait_shares(self._warm)
        if self.calibrate:
            ratios = []
            for profiles in self._warm:
                try:
                    raw = self._raw_prediction(profiles)
                except (ModelNotReady, CostModelError, SimulationError, KeyError, ValueError):
                    continue
                if raw > 0:
                    ratios.append(measured_iteration_time(profiles) / raw)
            if ratios:
                self.calibration = statistics.median(ratios)
        self._warm.clear()

    def _samples_cost(self, cost: StageCost, ex: Executor, samples: list[Sample]) -> float:
        """Healthy seconds ``cost`` gives ``ex``'s micro-batches in ``samples`` (at p = 1)."""
        kw = dict(layers=self._layers(ex[1]), tp=self._degree(ex))
        return sum(cost.forward(l, **kw) + cost.backward(l, **kw) for l, _, _ in samples)

    def _slow_from_start(self, costs: Mapping[Executor, StageCost]) -> dict[Executor, float]:
        """Executors with no known-slow device that computed at least :attr:`peer_margin`
        times as slowly as the median of their stage's other such executors of the same
        TP degree, in every warm-up iteration: slow since the generation began. Each
        executor's pace in an iteration is its compute over what its stage's mean fit
        gives its micro-batches (so uneven work compares). Fitted to their own warm-up they would look healthy
        for good (a device slowed before a restore, or from the job's start); their
        healthy cost is their peers' instead (:meth:`_from_peers`), so the detector sees
        the slowdown. The same iteration's peers, and every iteration: load the host
        shares, or one iteration's burst of it, is no slowdown. It takes two peers at
        least: with one, which of the two is slow is a guess.

        An executor with a known-slow device is held to its known speed ``p``: it is
        slow since the warm-up began where its pace at ``p = 1`` (its pace times ``p``)
        was at least :attr:`known_margin` times its healthy peers' in every warm-up
        iteration. Fitted to its own warm-up it would be predicted at its new, lower
        speed and never reported again: a device more slowed than its report said (or
        slowed further before a restore) would keep the plan its old estimate made.
        One healthy peer is enough: the device is known slow already, the question is
        only by how much. Returns executor -> its median ratio (at ``p = 1``)."""
        from resihp_core.detector.localise import median_without

        candidates = {ex for ex in costs if self._group_speed(ex) >= 1.0}
        known = {ex for ex in costs if ex not in candidates}
        mean = {s: _mean_stage_cost([costs[e] for e in candidates if e[1] == s]) for s in {e[1] for e in candidates}}
        ratios: dict[Executor, list[float]] = defaultdict(list)
        for profiles in self._warm:
            mine: dict[Executor, list[Sample]] = defaultdict(list)
            for p in profiles.values():
                ex = (p.replica, p.stage)
                if ex in candidates or (ex in known and ex[1] in mean):
                    mine[ex] += [(tuple(mb.doc_lengths), mb.forward_s, mb.backward_s)
                                 for mb in p.microbatches if mb.doc_lengths]
            # (stage, TP degree) -> executor -> pace (at p = 1): a group of another
            # degree is not held to how the fit scales with the degree
            pace: dict[tuple[int, int], dict[Executor, float]] = defaultdict(dict)
            for ex, ss in mine.items():
                if (want := self._samples_cost(mean[ex[1]], ex, ss)) > 0:
                    pace[(ex[1], self._degree(ex))][ex] = sum(f + b for _, f, b in ss) * self._group_speed(ex) / want
            for paces in pace.values():
                pool = sorted(x for ex, x in paces.items() if ex in candidates)
                for ex, x in paces.items():
                    if ex in candidates:
                        base = median_without(pool, [x]) if len(pool) >= 3 else None
                    else:
                        base = statistics.median(pool) if pool else None
                    if base:
                        ratios[ex].append(x / base)
        return {ex: statistics.median(rs) for ex, rs in ratios.items()
                if len(rs) == len(self._warm)
                and min(rs) >= (self.peer_margin if ex in candidates else self.known_margin)}

    def _from_peers(self, costs: dict[Executor, StageCost], samples: Mapping[Executor, list[Sample]]) -> None:
        """A known-slow executor's healthy cost: its own warm-up with ``p`` divided out,
        or, where that is less, its stage's executors with no known-slow device times its
        own speed relative to those when last fitted healthy (:attr:`relative`; a worker
        on a busier core computes a little slower than its peers for good). A slowdown
        that comes and goes (a duty cycle, one that ends during the warm-up, one whose
        worker is often stopped while it waits for its peers after its micro-batches
        moved away) runs lighter than ``p`` through the warm-up, and its own samples
        with ``p`` divided out fit a level it does not return to (module docstring);
        where it ran at ``p`` its own samples are the better measure: they hold what the
        new layout costs it (left with fewer micro-batches than its peer, the duty-cycle
        test's worker computes each about 1.3x slower). An executor slow since the
        warm-up began (:meth:`_slow_from_start`) gets its peers' cost the same way.
        Healthy executors update :attr:`relative`."""
        healthy = [ex for ex in costs if self._group_speed(ex) >= 1.0 and ex not in self.slower_than_peers]
        for ex in healthy:
            others = [costs[e] for e in healthy if e[1] == ex[1] and e != ex]
            if others and samples.get(ex):
                base = self._samples_cost(_mean_stage_cost(others), ex, samples[ex])
                if base > 0:
                    self.relative[self._executor_group(ex)] = self._samples_cost(costs[ex], ex, samples[ex]) / base
        for ex in [ex for ex in costs if ex not in healthy]:
            others = [costs[e] for e in healthy if e[1] == ex[1]]
            if not others:
                continue
            peers = _mean_stage_cost(others, self.relative.get(self._executor_group(ex), 1.0))
            own = samples.get(ex, [])
            if (ex in self.slower_than_peers
                    or self._samples_cost(peers, ex, own) >= self._samples_cost(costs[ex], ex, own)):
                costs[ex] = peers

    # ------------------------------------------------------------ predictions
    def _cost(self, ex: Executor) -> StageCost:
        c = self.costs.get(ex)
        if c is not None:
            return c
        same_stage = [v for (r, s), v in self.costs.items() if s == ex[1]]
        if not same_stage:
            raise ModelNotReady(f"no fitted cost for replica {ex[0]} stage {ex[1]}")
        return same_stage[0]

    def rank_chunks(self, profile: IterationProfile) -> list[tuple[float, float]]:
        """Healthy (forward, backward) seconds of each micro-batch in ``profile``."""
        if not self.ready:
            raise ModelNotReady("the model is still in warm-up")
        ex = (profile.replica, profile.stage)
        c = self._cost(ex)
        kw = dict(layers=self._layers(profile.stage), tp=self._degree(ex), speed=self._group_speed(ex))
        out = []
        for mb in profile.microbatches:
            if not mb.doc_lengths:
                raise ModelNotReady(f"rank {profile.rank}: micro-batch {mb.mb} has no document lengths")
            out.append((c.forward(mb.doc_lengths, **kw), c.backward(mb.doc_lengths, **kw)))
        return out

    def rank_compute(self, profile: IterationProfile) -> float:
        """Healthy compute seconds (all forward + backward) of this rank's micro-batches.
        Taken once per executor and work while the model stands: every rank of a TP
        group runs the same micro-batches, and an iteration's ranks are asked again by
        the peer comparisons, the settle check and verification."""
        key = (profile.replica, profile.stage, tuple((mb.owner, mb.mb, mb.doc_lengths) for mb in profile.microbatches))
        got = self._computed.get(key)
        if got is None:
            if len(self._computed) > 16 * max(1, len(self.costs)):
                self._computed.clear()
            got = self._computed[key] = sum(f + b for f, b in self.rank_chunks(profile))
        return got

    def fitted_predictor(self) -> IterationPredictor | None:
        """The iteration predictor with this job's own fitted per-stage costs (for the
        Scheduler's evaluator), None before the warm-up is fitted."""
        with self._lock:
            try:
                return self._iteration_predictor() if self.ready else None
            except (ModelNotReady, CostModelError, ValueError, KeyError):
                return None

    def _iteration_predictor(self) -> IterationPredictor | None:
        if self.plan is None or self.topology is None or self.shape is None:
            return None
        if self._predictor is None:
            from resihp_core.predictor.predict import IterationPredictor

            stages = []
            for s in range(self.plan.pp):
                fitted = [(self._cost((r, s)), self._degree((r, s))) for r in range(self.plan.dp)
                          if self.plan.group(r, s) and (r, s) in self.costs]
                if not fitted:
                    fitted = [(self._cost((0, s)), 1)]
                stages.append(_mean_stage_cost([c for c, _ in fitted]))
            self._predictor = IterationPredictor(CostModel(tuple(stages)), self.topology, self.shape, self.links)
        return self._predictor

    def _workload(self, profiles: ProfileSet) -> dict[tuple[int, int], tuple[int, ...]]:
        out: dict[tuple[int, int], tuple[int, ...]] = {}
        for p in profiles.values():
            for mb in p.microbatches:
                if mb.doc_lengths and (mb.owner, mb.mb) not in out:
                    out[(mb.owner, mb.mb)] = tuple(mb.doc_lengths)
        return out

    def _raw_prediction(self, profiles: ProfileSet) -> float:
        if not self.ready:
            raise ModelNotReady("the model is still in warm-up")
        pred = self._iteration_predictor()
        if pred is not None:
            assert self.plan is not None
            workload = self._workload(profiles)
            need = {(r, j) for r in range(self.plan.dp) for j in range(self.plan.num_microbatches)}
            if need <= workload.keys():
                speeds = {d: p for d, p in self.speeds.items() if p < 1.0} or None
                try:
                    return pred.predict(self.plan, workload, speeds).iteration_time
                except (CostModelError, SimulationError) as e:
                    raise ModelNotReady(f"cannot simulate the plan: {e}") from e
        # Without a plan (or with micro-batches missing): the slowest executor's compute.
        per_ex: dict[Executor, float] = {}
        for p in profiles.values():
            ex = (p.replica, p.stage)
            if ex not in per_ex:
                per_ex[ex] = self.rank_compute(p)
        return max(per_ex.values())

    def predict_healthy(self, iteration: int, profiles: ProfileSet) -> float:
        """Healthy wall time of this iteration for its documents, under the current plan
        and the known device speeds (seconds). Raises :class:`ModelNotReady` in warm-up."""
        raw = self._raw_prediction(profiles)
        t = raw * self.calibration
        if not (math.isfinite(t) and t > 0):
            raise ModelNotReady(f"prediction is not a positive number: {t!r}")
        return t

    __call__ = predict_healthy
