"""Statistics the benchmarks share: medians with distribution-free intervals, paired
comparisons normalised by each run's own healthy phase, and measurement noise floors.

Why these choices (docs/benchmarks.md has the long form):

* two jobs run one after the other on a shared machine do not run at the same speed even
  before any fault. Dividing the faulty phase of each run by its *own* healthy phase
  (``retained``) cancels that, and the ratio of retained fractions is what is compared;
  the ratio of the two healthy phases (the *control*) says whether the normalisation
  had anything large to cancel: a pair whose control is off by more than its noise is
  flagged and left out of the median;
* repetitions are few (3-7), so the interval around a median is the order-statistic
  (binomial) one, which assumes nothing about the distribution and states the
  confidence it actually reaches (with 3 repetitions the min-max range is a 75 %
  interval, not a 95 % one).

Plain Python (no numpy): the benchmarks and their unit test import it cheaply.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Sequence

__all__ = ["MedianCI", "median_ci", "rel_se", "retained", "Pair", "PairedRatio", "paired_ratio",
           "floor_corrected", "loadavg", "machine"]


@dataclass(frozen=True)
class MedianCI:
    """A median with a distribution-free interval (``confidence`` is the one reached)."""

    median: float
    lo: float
    hi: float
    confidence: float
    n: int

    def to_dict(self) -> dict[str, float]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "confidence": self.confidence, "n": self.n}

    def text(self, fmt: str = "{:.3f}", unit: str = "") -> str:
        if self.n == 0:
            return "-"
        m, lo, hi = (fmt.format(v) + unit for v in (self.median, self.lo, self.hi))
        if self.n == 1:
            return f"{m} (1 run)"
        return f"{m} [{lo} .. {hi}, {100 * self.confidence:.0f} % CI, n={self.n}]"


def _binom_cdf(k: int, n: int) -> float:
    """P(Binomial(n, 1/2) <= k)."""
    return sum(math.comb(n, i) for i in range(0, k + 1)) / 2 ** n


def median_ci(xs: Sequence[float], confidence: float = 0.95) -> MedianCI:
    """Median of ``xs`` and the order-statistic interval ``[x_(k), x_(n-k+1)]`` with the
    largest ``k`` whose coverage ``1 - 2·P(B <= k-1)`` (B ~ Binomial(n, 1/2)) is at least
    ``confidence``; when no ``k`` reaches it (few values), the min-max range and the
    coverage it has."""
    v = sorted(float(x) for x in xs)
    n = len(v)
    if n == 0:
        return MedianCI(math.nan, math.nan, math.nan, 0.0, 0)
    med = statistics.median(v)
    if n == 1:
        return MedianCI(med, v[0], v[0], 0.0, 1)
    best_k, best_cov = 1, 1 - 2 * _binom_cdf(0, n)
    for k in range(1, n // 2 + 1):
        cov = 1 - 2 * _binom_cdf(k - 1, n)
        if cov >= confidence:
            best_k, best_cov = k, cov
        else:
            break
    return MedianCI(med, v[best_k - 1], v[n - best_k], best_cov, n)


def rel_se(xs: Sequence[float]) -> float:
    """Standard error of the mean of ``xs`` relative to the mean (0 for < 2 values)."""
    if len(xs) < 2:
        return 0.0
    m = statistics.fmean(xs)
    return statistics.stdev(xs) / math.sqrt(len(xs)) / abs(m) if m else math.inf


def retained(faulty: float, healthy: float) -> float:
    """Fraction of its own healthy throughput a run keeps in its faulty phase."""
    if healthy <= 0:
        raise ValueError(f"healthy throughput must be > 0, got {healthy}")
    return faulty / healthy


@dataclass(frozen=True)
class Pair:
    """One repetition: run A (e.g. ResiHP) and run B (e.g. no mitigation), each as
    (healthy-phase, faulty-phase) throughput, with the relative standard errors of the
    healthy throughputs (from their per-iteration spread)."""

    a_healthy: float
    a_faulty: float
    b_healthy: float
    b_faulty: float
    a_healthy_rse: float = 0.0
    b_healthy_rse: float = 0.0

    @property
    def ratio(self) -> float:
        return retained(self.a_faulty, self.a_healthy) / retained(self.b_faulty, self.b_healthy)

    @property
    def control(self) -> float:
        return self.a_healthy / self.b_healthy

    @property
    def control_noise(self) -> float:
        """Relative standard error of the control (the two healthy phases' combined)."""
        return math.hypot(self.a_healthy_rse, self.b_healthy_rse)


@dataclass
class PairedRatio:
    ratio: MedianCI  # over the pairs not flagged
    control: MedianCI  # over all pairs
    ratios: list[float] = field(default_factory=list)
    controls: list[float] = field(default_factory=list)
    flagged: list[int] = field(default_factory=list)  # indices of pairs left out
    tolerance: list[float] = field(default_factory=list)  # per pair: |control - 1| allowed
    raw_ratio: MedianCI | None = None  # unnormalised faulty / faulty, for comparison

    def to_dict(self) -> dict:
        return {"ratio": self.ratio.to_dict(), "control": self.control.to_dict(), "ratios": self.ratios,
                "controls": self.controls, "flagged": self.flagged, "control_tolerance": self.tolerance,
                "raw_ratio": self.raw_ratio.to_dict() if self.raw_ratio else None}


def paired_ratio(pairs: Sequence[Pair], *, sigmas: float = 3.0, floor: float = 0.02,
                 confidence: float = 0.95) -> PairedRatio:
    """Median ratio of retained fractions over ``pairs``, leaving out (flagging) every
    pair whose control differs from 1 by more than ``max(sigmas · noise, floor)``: the
    two runs did not run alike before the fault, so dividing them measures the machine.
    ``floor`` is the systematic healthy-phase difference accepted between the two runs
    (e.g. the detector's own cost in the run that has it)."""
    ratios = [p.ratio for p in pairs]
    controls = [p.control for p in pairs]
    tol = [max(sigmas * p.control_noise, floor) for p in pairs]
    flagged = [i for i, (c, t) in enumerate(zip(controls, tol)) if abs(c - 1) > t]
    kept = [r for i, r in enumerate(ratios) if i not in flagged]
    raw = [p.a_faulty / p.b_faulty for p in pairs]
    return PairedRatio(median_ci(kept, confidence), median_ci(controls, confidence), ratios, controls,
                       flagged, tol, median_ci(raw, confidence))


def floor_corrected(mape_pct: float, floor_pct: float) -> float:
    """The model's own error once the measurement's noise is accounted for.

    If measured = truth · (1 + e) with noise e independent of the model's error m, the
    mean absolute relative error is about sqrt(m² + e²) (both roughly normal, the means
    of |·| scale alike), so m ≈ sqrt(MAPE² - floor²); 0 when the MAPE is within the floor.
    Here ``floor_pct`` is the mean absolute error the noise alone makes
    (sqrt(2/π) · relative standard error)."""
    return math.sqrt(max(0.0, mape_pct ** 2 - floor_pct ** 2))


def loadavg() -> list[float] | None:
    try:
        import os

        return [round(x, 2) for x in os.getloadavg()]
    except (OSError, AttributeError):
        return None


def machine() -> dict[str, object]:
    """What the figures were measured on (CPU model, cores, memory, kernel, Python)."""
    import os
    import platform

    info: dict[str, object] = {"cores": os.cpu_count(), "platform": platform.platform(),
                               "python": platform.python_version()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            info["memory_gib"] = round(kb / 2 ** 20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info
