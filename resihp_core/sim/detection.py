"""Detection latency and false alarms, measured on the detectors themselves.

Why: a simulated policy must not be told about a fail-slow the moment it starts. How
long detection takes (in iterations) and how often a healthy job raises a suspicion
depend on the change-point detector, its filter and the noise of the iteration-time
series, so they are measured here by running the project's own detectors (created
through the plugin registry, with :class:`~resihp_core.config.DetectorConfig`'s
settings) over simulated iteration-time series:

- **ResiHP** watches the iteration time *normalised by its healthy prediction* (the
  workload-aware detector's default series): healthy ratios are 1 with measurement
  noise ``noise``; after the onset they are multiplied by the slowdown. A change point
  is reported when the median ratio since the change exceeds ``1 + slow_threshold``
  (the workload filter); otherwise it is benign and rebased, at no cost.
- **Adaptra** is given the same raw series and change-point rules as Greyhound, but
  its per-stage timing localises any real slowdown (no 2x / 1.1x threshold).
- **Greyhound** watches the raw iteration time, whose level also moves with the
  workload (coefficient of variation ``workload_cv``, measured from the job's packed
  corpus by :func:`workload_cv`), through its published change-point rules
  (:class:`~resihp_core.detector.changepoint.GreyhoundChangePoint`); every change point
  is verified, and verification flags a rank only when its time exceeds 2x the median
  (compute) or 1.1x (communication). A change point before the onset is a false alarm
  that costs one verification.

Simplified from the full detectors: per-rank profiles, the verifier's localisation and
the probers are not simulated; the slowed device is assumed to be localised correctly
once a report is made (the detector benchmark measures localisation separately).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

__all__ = ["DetectionEstimate", "estimate", "workload_cv"]

#: Healthy iterations fed before the onset (also the false-alarm window).
PRE_ONSET = 300
#: Iterations watched after the onset before giving up ("never detected").
HORIZON = 200


@dataclass(frozen=True)
class DetectionEstimate:
    """``latency`` iterations from the onset to the report (None: not detected within
    :data:`HORIZON`); ``false_alarms`` verifications per healthy iteration."""

    latency: int | None
    false_alarms: float


@lru_cache(maxsize=256)
def estimate(method: str, slowdown: float, cause: str, straggler: float, *, noise: float = 0.02,
             workload: float = 0.05, seed: int = 0) -> DetectionEstimate:
    """Detection of a slowdown that multiplies iteration time by ``slowdown`` (>= 1).

    :param method: ``"resihp"`` or ``"greyhound"``.
    :param cause: ``"compute"`` or ``"communication"``.
    :param straggler: how much slower the slowed rank's own work became (1/p or 1/c):
        what Greyhound's verification thresholds compare.
    :param noise: relative measurement noise of iteration times.
    :param workload: coefficient of variation of the healthy iteration time caused by
        the workload (only the raw series sees it).
    """
    import numpy as np

    from resihp_core.config import DetectorConfig
    from resihp_core.plugins import get_plugins

    if method not in ("resihp", "greyhound", "adaptra"):
        raise ValueError(f"detection method must be resihp, greyhound or adaptra, got {method!r}")
    cfg = DetectorConfig()
    rng = np.random.default_rng([seed, int(slowdown * 1e4), len(cause), 7 if method == "resihp" else 11])
    n = PRE_ONSET + HORIZON
    eps = rng.standard_normal(n) * noise
    level = np.ones(n)
    level[PRE_ONSET:] = slowdown
    reg = get_plugins().changepoint_detectors()
    if method == "resihp":
        det = reg.create(cfg.changepoint_method, threshold=cfg.changepoint_threshold,
                         hazard=cfg.changepoint_hazard)
        xs = level * (1.0 + eps)
    else:
        det = reg.create("greyhound", hazard=cfg.changepoint_hazard)
        wl = np.exp(rng.standard_normal(n) * workload - workload ** 2 / 2)
        xs = level * wl * (1.0 + eps)
    false = 0
    for i, x in enumerate(xs):
        cp = det.update(float(x))
        if cp is None:
            continue
        if method == "resihp":
            ratio = float(np.median(xs[max(0, cp.index):i + 1]))
            confirmed = ratio > 1.0 + cfg.slow_threshold
        else:
            limit = 2.0 if cause == "compute" else 1.1
            if method == "adaptra":
                limit = 1.0  # per-stage timings localise any real slowdown
            confirmed = i >= PRE_ONSET and straggler > limit
            if i < PRE_ONSET:
                false += 1  # a verification that finds no straggler
        if confirmed and i >= PRE_ONSET:
            return DetectionEstimate(i - PRE_ONSET + 1, false / PRE_ONSET)
        if confirmed:
            false += 1
        det.rebase(i + 1)
    return DetectionEstimate(None, false / PRE_ONSET)


@lru_cache(maxsize=64)
def workload_cv(model: str, dp: int, m: int, tokens: int, seed: int = 0, iterations: int = 24) -> float:
    """Coefficient of variation, across iterations, of the slowest replica's compute
    (α·N + β·Σl² summed over its micro-batches) on the job's long-tailed corpus."""
    from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
    from resihp_core.sim.cluster import ALL_MODELS

    spec = ALL_MODELS[model]
    alpha, beta = 2.0 * spec.params_per_layer, 2.0 * spec.hidden  # FLOPs: the planner's model
    corpus = CorpusSpec(token_budget=tokens, seed=seed)
    dp_s, m_s = min(dp, 4), min(m, 32)
    vals = []
    for it in range(iterations):
        w = iteration_workload(corpus, it, dp_s, m_s)
        per = [sum(alpha * sum(w[(r, j)]) + beta * sum(x * x for x in w[(r, j)]) for j in range(m_s))
               for r in range(dp_s)]
        vals.append(max(per))
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1))
    return sd / mean


def describe(est: DetectionEstimate) -> dict[str, Any]:
    return {"latency_iterations": est.latency, "false_alarms_per_iteration": est.false_alarms}
