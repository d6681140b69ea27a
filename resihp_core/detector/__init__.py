"""The Detector (docs/design.md §3): fail-stop from heartbeats, fail-slow from change points.

Two independent halves:

* **fail-stop** — :mod:`.failstop` is the pure logic a node agent runs over its workers'
  heartbeats (missed beats, connection loss, process exit, hang with a timeout learned
  from observed step times). The sockets around it live in :mod:`resihp_core.runtime`.
* **fail-slow** — the controller feeds the per-iteration, per-rank
  :class:`~resihp_core.protocol.IterationProfile` s to a :class:`FailSlowDetector`:

  1. a :class:`ChangePointDetector` (:mod:`.changepoint`: BOCPD, CUSUM) watches the
     iteration-time series;
  2. on a change point, the workload-aware detector (:mod:`.failslow`) predicts the
     *healthy* time of the iterations since the change for their actual documents and
     the current plan (:mod:`.model`); if measured / predicted stays below
     ``1 + slow_threshold`` the change is benign workload fluctuation: the point is
     removed from the series and nothing is verified;
  3. otherwise a :class:`VerificationStrategy` (:mod:`.verify`) localises the slow
     device(s) and the cause from the per-rank profiles, asking a :class:`Prober` for
     active measurements only where the profiles cannot decide, and the result becomes
     a :class:`~resihp_core.protocol.FailureReport`.

  The Greyhound-like baseline (every change point is verified) implements the same
  :class:`FailSlowDetector` interface, for comparison.

This module only defines the interfaces and small value types; it imports nothing heavy
(numpy is imported by the submodules that compute). Change-point detectors and
verification strategies are registered as named factories through the plugin hooks
``resihp_register_changepoint_detectors`` / ``resihp_register_verification_strategies``
(built-ins in :mod:`.builtin`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from resihp_core.plan import ParallelPlan
    from resihp_core.protocol import FailureReport, IterationProfile

__all__ = [
    "Cause",
    "ChangePoint",
    "ChangePointDetector",
    "Detection",
    "DetectorStats",
    "FailSlowDetector",
    "ProbeResult",
    "Prober",
    "ProfileSet",
    "VerificationContext",
    "VerificationStrategy",
    "Verdict",
]

Cause = Literal["compute", "communication", "contention", "unknown"]

#: The profiles of one iteration: rank -> what that rank measured.
ProfileSet = Mapping[int, "IterationProfile"]


# ------------------------------------------------------------------ change points
@dataclass(frozen=True)
class ChangePoint:
    """A change in the level of a series.

    ``index`` is the (0-based) observation where the new regime starts and
    ``detected_at`` the observation at which the detector became sure, both counted in
    the detector's own updates since its last :meth:`ChangePointDetector.reset`.
    ``probability`` is the posterior probability of the change (Bayesian methods) or
    1.0 (methods without one). ``before`` and ``after`` are mean levels, in the units of
    the observations, of the old and the new regime.
    """

    index: int
    detected_at: int
    probability: float
    before: float
    after: float

    @property
    def shift(self) -> float:
        """Relative change of the mean level: after / before - 1."""
        return self.after / self.before - 1.0 if self.before else float("inf")


@runtime_checkable
class ChangePointDetector(Protocol):
    """Online change-point detection over a scalar series (iteration times).

    Implementations keep bounded state: each :meth:`update` costs O(1) or O(window).
    """

    def update(self, x: float) -> ChangePoint | None:
        """Add the next observation; return a change point when one is detected (each
        change is reported once)."""
        ...

    def rebase(self, index: int) -> None:
        """The change starting at observation ``index`` was judged (benign or handled):
        forget the old regime, so the series continues from the new level and the same
        change is not reported again."""
        ...

    def reset(self) -> None:
        """Forget everything (a new plan generation starts a new series)."""
        ...


# ------------------------------------------------------------------ verification
@dataclass(frozen=True)
class ProbeResult:
    """What an active probe measured: ``times`` maps device -> seconds of the probe
    (a fixed compute kernel, or a fixed transfer over the device's link).
    ``reference`` is the healthy time of the same probe when known (e.g. measured at job
    start); without it a device is compared with the median of the probed devices.
    ``elapsed_s`` is the wall time training was paused for the probe."""

    times: Mapping[int, float]
    reference: float | None = None
    elapsed_s: float = 0.0

    def throughput(self) -> dict[int, float]:
        """Normalised throughput per probed device: healthy time / measured, in (0, 1]."""
        if not self.times:
            return {}
        ref = self.reference
        if ref is None:
            ordered = sorted(self.times.values())
            ref = ordered[len(ordered) // 2]
        return {d: _clip_p(ref / t) if t > 0 else 1.0 for d, t in self.times.items()}


@runtime_checkable
class Prober(Protocol):
    """Runs active measurements on devices when profiles cannot localise a slowdown.

    In the runtime the workers run the probes (the adapter's job); the benchmark uses a
    simulated prober. Both calls pause training for ``ProbeResult.elapsed_s``.
    """

    def probe_compute(self, devices: Sequence[int]) -> ProbeResult:
        """Time a fixed compute kernel on each device (in parallel)."""
        ...

    def probe_links(self, devices: Sequence[int]) -> ProbeResult:
        """Time a fixed transfer over each device's link(s) (in parallel)."""
        ...


@dataclass(frozen=True)
class Verdict:
    """The outcome of a verification: ``slow`` maps each slow device to its normalised
    throughput p in (0, 1]; empty when nothing was found (a false alarm).
    ``probe_rounds`` / ``probe_s`` count the active probes it took. ``more``: nothing
    found *yet* — the evidence needs this many iterations since the onset (a slowdown
    that is only waiting for a CPU on a loaded machine; docs/detector.md "False reports
    on a loaded machine"); the detector verifies again once they are there. ``rule``:
    the verification rule that decided (``verify.RULES``; "" for other strategies)."""

    slow: Mapping[int, float]
    cause: Cause = "unknown"
    evidence: str = ""
    probe_rounds: int = 0
    probe_s: float = 0.0
    more: int = 0
    rule: str = ""

    @property
    def confirmed(self) -> bool:
        return bool(self.slow)


@dataclass(frozen=True)
class VerificationContext:
    """Everything a verification strategy may use.

    ``iterations`` are the per-rank profiles of the iterations since the change point
    (oldest first), ``before`` those of healthy iterations just before it (may be
    empty). ``model`` is the detector's healthy-time model (:class:`.model.WorkloadModel`)
    when it has one, ``prober`` the active prober when available.
    """

    generation: int
    iterations: Sequence[ProfileSet]
    before: Sequence[ProfileSet] = ()
    model: object | None = None
    prober: Prober | None = None
    plan: ParallelPlan | None = None
    threshold: float = 0.25
    # Per device: how much its node's CPU contention (a probe outside the job) rose from
    # before the change to these iterations; absent = not measured. Evidence only: each
    # rank's own waiting for a CPU is in its profiles (detector/environment.py).
    environment: Mapping[int, float] = field(default_factory=dict)
    # Per device: the robust spread of its healthy compute relative to its peers (log
    # scale; detector/localise.py); thresholds scale with it. Absent = not measured.
    noise: Mapping[int, float] = field(default_factory=dict)
    # Per device: the same spread of its *own* compute (compute without the time it was
    # runnable but waited for a CPU other processes held): on a loaded host that waiting
    # is most of the noise, and a device slow by itself stands out in its own compute
    # long before it does in its measured one. Absent = not measured.
    own_noise: Mapping[int, float] = field(default_factory=dict)
    # Devices known slow (reported, or planned around with their speed): their compute
    # over healthy has an estimated speed in it, and one back at full speed reads far
    # faster than healthy: running faster than known, they are no reference for their
    # peers (verify._references; detector/recovery.py).
    known_slow: frozenset[int] = frozenset()


@runtime_checkable
class VerificationStrategy(Protocol):
    """Localises a suspected fail-slow: which device(s), compute or communication."""

    def verify(self, ctx: VerificationContext) -> Verdict: ...


# ------------------------------------------------------------------ the fail-slow detector
@dataclass
class DetectorStats:
    """Counters of a fail-slow detector since it was built (across generations)."""

    iterations: int = 0
    change_points: int = 0
    predictions: int = 0
    benign: int = 0
    verifications: int = 0
    reports: int = 0
    probe_rounds: int = 0
    probe_s: float = 0.0
    verify_cpu_s: float = 0.0


@dataclass(frozen=True)
class Detection:
    """What one observed iteration led to.

    ``action``: ``"none"`` (no change point), ``"warmup"`` (the model is still being
    fitted, or the iteration was skipped), ``"suppressed"`` (a change point too close to
    the previous retained one), ``"benign"`` (filtered out by the predictor),
    ``"cleared"`` (verified, nothing found: a false alarm), ``"pending"`` (a change too
    young to verify, looked at again next iteration), ``"faded"`` (the slowdown
    was gone by the end of its verification window: nothing to verify), ``"reported"``,
    ``"recovered"`` (a known-slow device healthy again: a report with throughput 1.0).
    ``notice``: a line for the job's user, said once (the console prints it): what the
    detector cannot judge on this job, e.g. slowdowns below the bar its iterations'
    noise sets (docs/detector.md "Short or noisy iterations").
    """

    iteration: int
    measured: float
    action: str = "none"
    change_point: ChangePoint | None = None
    predicted: float | None = None
    ratio: float | None = None
    verdict: Verdict | None = None
    report: FailureReport | None = None
    onset: int | None = None
    notes: tuple[str, ...] = field(default=())
    notice: str = ""


@runtime_checkable
class FailSlowDetector(Protocol):
    """Consumes one iteration's per-rank profiles at a time; may emit a failure report."""

    stats: DetectorStats

    def observe(self, iteration: int, profiles: ProfileSet) -> Detection: ...

    def reset(self, generation: int, *, plan: ParallelPlan | None = None,
              speeds: Mapping[int, float] | None = None) -> None: ...


def _clip_p(p: float) -> float:
    """Normalised throughput clipped into (0, 1] (a floor keeps it a valid wire value)."""
    if p != p:  # NaN
        return 1.0
    return min(1.0, max(1e-3, p))
