"""Online change-point detection over the iteration-time series (docs/design.md §3.2).

Three detectors behind :class:`~resihp_core.detector.ChangePointDetector`:

* :class:`BOCPD` — Bayesian online change-point detection (Adams & MacKay, 2007) with
  a constant hazard, on log iteration times (a slowdown is multiplicative, and the log
  compresses the heavy right tail of workload-induced fluctuation): Normal-Gamma runs
  around a robustly estimated noise scale, with an outlier component. The
  run-length posterior is truncated to ``max_run`` hypotheses, so an update costs
  O(max_run) numpy work. A change is declared when the posterior mass of "the current
  run started at least ``min_run`` and at most ``window`` observations ago, after at
  least ``min_history`` observations of the old regime" exceeds ``threshold``:
  requiring ``min_run >= 2`` observations in the new regime keeps a single spike (one
  iteration with an unusually long document) from being declared a change.
* :class:`CUSUM` — two-sided cumulative-sum test on standardised log times, with the
  reference level and a robust scale (median absolute successive difference) learned
  online. O(1) per update.
* :class:`GreyhoundChangePoint` — the comparison baseline: BOCPD on the raw series with
  the published post-processing of Greyhound (docs/design.md §7): posterior > 0.8, observations
  with |z| > 3 dropped as outliers, change points at least 10 iterations apart and
  shifting the mean by at least 10 %.

No library is used: the maintained change-point libraries for Python are offline
(``ruptures``) or unmaintained; these are a few dozen lines of numpy each.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from resihp_core.detector import ChangePoint

__all__ = ["BOCPD", "CUSUM", "GreyhoundChangePoint", "make_bocpd", "make_cusum", "make_greyhound"]


def _check(name: str, value: float, lo: float, hi: float = math.inf, *, lo_open: bool = False) -> None:
    ok = (value > lo if lo_open else value >= lo) and value <= hi and math.isfinite(value)
    if not ok:
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value!r}")


def _positive_obs(x: float) -> float:
    x = float(x)
    if not (math.isfinite(x) and x > 0):
        raise ValueError(f"observations must be finite and > 0 (seconds), got {x!r}")
    return x


class BOCPD:
    """Bayesian online change-point detection with a truncated run-length posterior.

    Model: within a run, observations (log iteration times by default) are Normal with
    unknown mean and variance (Normal-Gamma conjugate prior: the mean centred on the
    recent level, ``kappa0`` pseudo-observations strong; the variance around the noise
    scale estimated robustly from recent successive differences, ``alpha0`` strong), so
    a new regime may also be noisier than the old one — a slowdown's impact varies with
    the workload. The prior is re-evaluated with the current noise estimate for every
    hypothesis at every step (each run keeps only its own sum of squares), so the
    estimate drifting cannot favour young runs over old ones. Heavy tails are handled by
    an explicit outlier component (probability ``outlier``) and by winsorising the
    residuals absorbed into existing runs.

    :param hazard: prior probability of a change at any observation (1 / expected run).
    :param threshold: posterior mass of a change needed to declare it.
    :param min_run: observations in the new regime before a change can be declared
        (2 = one confirming observation).
    :param min_history: observations of the old regime needed before it.
    :param window: only changes at most this many observations old count (None: any
        within the posterior's reach). A change that has not become probable within 32
        observations is absorbed; beyond that "a change long ago" and "no change" are
        the same hypothesis, and counting them made stationary series fire.
    :param max_run: run-length hypotheses kept (older ones are dropped).
    :param noise: noise scale (std of log x, or relative std of x when ``log=False``)
        assumed until ``noise_window`` observations give an estimate.
    :param min_noise: floor of the noise scale (same units).
    :param kappa0: prior strength of a new run's mean, in observations (small = a new
        regime may be anywhere).
    :param alpha0: prior strength of the variance (1: a heavy-tailed Student-t
        predictive for young runs).
    :param clip: existing runs absorb residuals winsorised at this many noise scales.
    :param outlier: probability that an observation is an outlier (explained by the
        broad prior predictive under every run): a single extreme iteration then costs
        the old regime a bounded factor instead of ending it.
    :param log: model log(x) (default) instead of x.
    """

    def __init__(
        self,
        *,
        hazard: float = 0.01,
        threshold: float = 0.8,
        min_run: int = 2,
        min_history: int = 5,
        window: int | None = 32,
        max_run: int = 256,
        noise: float = 0.05,
        min_noise: float = 0.005,
        noise_window: int = 64,
        kappa0: float = 0.01,
        alpha0: float = 1.0,
        clip: float = 6.0,
        outlier: float = 0.01,
        log: bool = True,
    ) -> None:
        _check("hazard", hazard, 0.0, 1.0, lo_open=True)
        _check("threshold", threshold, 0.0, 1.0)
        _check("noise", noise, 0.0, lo_open=True)
        _check("min_noise", min_noise, 0.0, lo_open=True)
        _check("kappa0", kappa0, 0.0, lo_open=True)
        _check("alpha0", alpha0, 0.0, lo_open=True)
        _check("clip", clip, 0.0, lo_open=True)
        _check("outlier", outlier, 0.0, 0.5)
        if not (1 <= min_run < max_run and min_history >= 1 and noise_window >= 4):
            raise ValueError(
                f"need 1 <= min_run < max_run, min_history >= 1, noise_window >= 4; got "
                f"{min_run}, {max_run}, {min_history}, {noise_window}"
            )
        if window is not None and not min_run <= window < max_run:
            raise ValueError(f"need min_run <= window < max_run, got window={window}")
        self.hazard, self.threshold = float(hazard), float(threshold)
        self.min_run, self.min_history, self.max_run = int(min_run), int(min_history), int(max_run)
        self.window = window
        self.noise, self.min_noise, self.noise_window = float(noise), float(min_noise), int(noise_window)
        self.kappa0, self.alpha0 = float(kappa0), float(alpha0)
        self.clip, self.outlier = float(clip), float(outlier)
        self.log = bool(log)
        self._lh, self._l1h = math.log(self.hazard), math.log1p(-self.hazard)
        self._lo = math.log(outlier) if outlier > 0 else -math.inf
        self._l1o = math.log1p(-outlier)
        # Entry j of the state is the run holding j observations (j = 0: a new run):
        # kappa = kappa0 + j, alpha = alpha0 + j/2; tabulate what depends on j only.
        j = np.arange(self.max_run + 1, dtype=float)
        kappa = self.kappa0 + j
        alpha = self.alpha0 + 0.5 * j
        self._scale_factor = (kappa + 1.0) / (alpha * kappa)  # scale^2 = beta * this
        self._nu = 2.0 * alpha
        self._lgam = np.array([math.lgamma(a + 0.5) - math.lgamma(a) for a in alpha])
        self._expo = alpha + 0.5
        self._mu_gain = 1.0 / (kappa + 1.0)  # mu += d * gain when a run absorbs y
        self._ss_gain = kappa / (2.0 * (kappa + 1.0))  # ss += d^2 * gain
        self.reset()

    # ------------------------------------------------------------ state
    def reset(self) -> None:
        self.n = 0  # observations seen since reset (indices keep counting across rebases)
        self._local = 0  # observations in the current posterior (since reset or rebase)
        self._hist: deque[tuple[int, float]] = deque(maxlen=self.max_run + 8)
        self._recent: deque[float] = deque(maxlen=self.noise_window)
        self._logr = np.zeros(0)  # log P(run holds k+1 observations), k = 0..
        self._mu = np.zeros(0)
        self._ss = np.zeros(0)  # each run's sum of squares (its beta without the prior)
        self._level: float | None = None  # EWMA of y: centre of a new run's prior
        self._reported: set[int] = set()

    def _y(self, x: float) -> float:
        x = _positive_obs(x)
        return math.log(x) if self.log else x

    def _x(self, y: float) -> float:
        return math.exp(y) if self.log else y

    def rebase(self, index: int) -> None:
        """Restart the posterior from the observations since ``index`` (the new level)."""
        keep = [(i, y) for i, y in self._hist if i >= index]
        n, reported, recent = self.n, self._reported, self._recent
        self.reset()
        for i, y in keep:
            self._absorb(y)
            self._hist.append((i, y))
        self.n = n
        self._recent = recent
        self._reported = {r for r in reported if r >= index}
        self._reported.add(index)

    @property
    def run_length_posterior(self) -> np.ndarray:
        """P(the current run holds k+1 observations), k = 0.. (a copy)."""
        return np.exp(self._logr)

    def noise_scale(self) -> float:
        """The noise std all runs assume: robust, from recent successive differences
        (until 16 observations, never below the configured ``noise``)."""
        ys = list(self._recent)
        level = abs(self._level) if (self._level is not None and not self.log) else 1.0
        default = self.noise * level
        if len(ys) < 4:
            s = default
        else:
            diffs = sorted(abs(b - a) for a, b in zip(ys, ys[1:]))
            s = 1.4826 * diffs[len(diffs) // 2] / math.sqrt(2.0)
            if len(ys) < 16:
                s = max(s, default)
        return max(s, self.min_noise * level)

    # ------------------------------------------------------------ update
    def _absorb(self, y: float) -> np.ndarray:
        """One Bayesian step; returns the new run-length posterior (probabilities)."""
        if self._level is None:
            self._level = y
        s = self.noise_scale()
        beta0 = self.alpha0 * s * s  # the *current* prior, for every hypothesis alike
        size = self._logr.size
        n = size + 1
        mu = np.empty(n)
        ss = np.empty(n)
        mu[0], ss[0] = self._level, 0.0
        mu[1:], ss[1:] = self._mu, self._ss
        d = y - mu
        nu = self._nu[:n]
        scale2 = (beta0 + ss) * self._scale_factor[:n]
        lp = (self._lgam[:n] - 0.5 * np.log(nu * math.pi * scale2)
              - self._expo[:n] * np.log1p(d * d / (nu * scale2)))
        if self.outlier > 0 and n > 1:
            lp[1:] = np.logaddexp(self._l1o + lp[1:], self._lo + lp[0])
        logr = np.empty(n)
        logr[0] = lp[0] + (self._lh if size else 0.0)
        logr[1:] = self._logr + lp[1:] + self._l1h
        if n > self.max_run:
            n = self.max_run
            logr, mu, ss, d = logr[:n], mu[:n], ss[:n], d[:n]
        m = logr.max()
        post = np.exp(logr - m)
        tot = post.sum()
        post /= tot
        self._logr = logr - (m + math.log(tot))
        # Existing runs absorb a winsorised residual; the new run takes y as it is.
        c = self.clip * s
        d[1:] = np.clip(d[1:], -c, c)
        self._ss = ss + d * d * self._ss_gain[:n]
        self._mu = mu + d * self._mu_gain[:n]
        self._level = 0.8 * self._level + 0.2 * y
        self._local += 1
        return post

    def update(self, x: float) -> ChangePoint | None:
        y = self._y(x)
        i = self.n
        self.n += 1
        self._hist.append((i, y))
        post = self._absorb(y)
        self._recent.append(y)
        # Runs of min_run .. hi observations: a change after min_history old observations
        # within the window the posterior covers (once it is truncated, its longest run
        # stands for "no change in the last max_run observations" and never counts).
        hi = min(self._local, post.size) - self.min_history
        if self.window is not None:
            hi = min(hi, self.window)
        lo = self.min_run
        if hi < lo:
            return None
        recent = post[lo - 1: hi]
        p = float(recent.sum())
        if p <= self.threshold:
            return None
        run = lo + int(np.argmax(recent))  # observations in the new run
        onset = i - run + 1
        if any(abs(onset - r) <= 1 for r in self._reported):
            return None
        self._reported.add(onset)
        if len(self._reported) > 64:
            self._reported = set(sorted(self._reported)[-32:])
        return self._change(onset, i, p)

    def _change(self, onset: int, at: int, p: float) -> ChangePoint:
        after = [y for j, y in self._hist if j >= onset]
        before = [y for j, y in self._hist if j < onset][-32:]
        mean = lambda ys: self._x(sum(ys) / len(ys)) if ys else float("nan")  # noqa: E731
        return ChangePoint(index=onset, detected_at=at, probability=p, before=mean(before), after=mean(after))


class CUSUM:
    """Two-sided CUSUM on standardised (log) observations.

    The reference level is the mean of the first ``warmup`` observations, then an EWMA
    (weight ``ewma``) of the observations made while neither sum is above ``h / 2``; the scale is a
    robust estimate from successive differences over the last ``scale_window``
    observations (insensitive to level shifts), floored at ``min_scale``.

    :param h: decision threshold on the cumulative sum, in standard deviations.
    :param k: allowance (half the smallest shift of interest, in standard deviations).
        The defaults (h = 6, k = 1) target shifts of >= 2 standard deviations, i.e. the
        slowdowns that matter, and rarely fire on a stationary series.
    """

    def __init__(
        self,
        *,
        h: float = 6.0,
        k: float = 1.0,
        warmup: int = 10,
        ewma: float = 0.05,
        scale_window: int = 32,
        min_scale: float = 0.01,
        min_run: int = 2,
        log: bool = True,
    ) -> None:
        _check("h", h, 0.0, lo_open=True)
        _check("k", k, 0.0)
        _check("ewma", ewma, 0.0, 1.0, lo_open=True)
        _check("min_scale", min_scale, 0.0, lo_open=True)
        if warmup < 2 or scale_window < 4 or min_run < 1:
            raise ValueError("need warmup >= 2, scale_window >= 4, min_run >= 1")
        self.h, self.k, self.warmup, self.ewma = float(h), float(k), int(warmup), float(ewma)
        self.scale_window, self.min_scale, self.min_run = int(scale_window), float(min_scale), int(min_run)
        self.log = bool(log)
        self.reset()

    def reset(self) -> None:
        self.n = 0
        self._hist: deque[tuple[int, float]] = deque(maxlen=max(self.scale_window, 64))
        self._ref: float | None = None
        self._pos = self._neg = 0.0
        self._pos_start = self._neg_start = 0

    def _y(self, x: float) -> float:
        x = _positive_obs(x)
        return math.log(x) if self.log else x

    def _x(self, y: float) -> float:
        return math.exp(y) if self.log else y

    def _scale(self) -> float:
        ys = [y for _, y in self._hist][-self.scale_window:]
        if len(ys) < 3:
            return self.min_scale
        diffs = sorted(abs(b - a) for a, b in zip(ys, ys[1:]))
        mad = diffs[len(diffs) // 2]
        return max(self.min_scale, 1.4826 * mad / math.sqrt(2.0))

    def rebase(self, index: int) -> None:
        after = [y for i, y in self._hist if i >= index]
        if after:
            self._ref = sum(after) / len(after)
        self._pos = self._neg = 0.0

    def update(self, x: float) -> ChangePoint | None:
        y = self._y(x)
        i = self.n
        self.n += 1
        if self.n <= self.warmup:
            self._hist.append((i, y))
            if self.n == self.warmup:
                self._ref = sum(v for _, v in self._hist) / len(self._hist)
            return None
        assert self._ref is not None
        sigma = self._scale()
        self._hist.append((i, y))
        z = (y - self._ref) / sigma
        if self._pos == 0.0:
            self._pos_start = i
        if self._neg == 0.0:
            self._neg_start = i
        self._pos = max(0.0, self._pos + z - self.k)
        self._neg = max(0.0, self._neg - z - self.k)
        if max(self._pos, self._neg) < 0.5 * self.h:  # not inside a large excursion
            self._ref += self.ewma * (y - self._ref)
        for s, start in ((self._pos, self._pos_start), (self._neg, self._neg_start)):
            if s > self.h and i - start + 1 >= self.min_run:
                before = self._x(self._ref)
                after_ys = [v for j, v in self._hist if j >= start]
                after = self._x(sum(after_ys) / len(after_ys))
                self._pos = self._neg = 0.0  # report once; rebase() moves the reference
                return ChangePoint(index=start, detected_at=i, probability=1.0, before=before, after=after)
        return None


class GreyhoundChangePoint:
    """The baseline's detector: BOCPD with Greyhound's published post-processing.

    * observations with |z| > ``outlier_z`` against the recent accepted ones are dropped
      (two such in a row on the same side are kept: that is a level shift, not an
      outlier — otherwise no large change could ever be seen);
    * a change point needs posterior > ``threshold`` (0.8), must come at least
      ``min_gap`` (10) observations after the previous one and must shift the mean by
      at least ``min_shift`` (10 %).
    """

    def __init__(
        self,
        *,
        hazard: float = 0.01,
        threshold: float = 0.8,
        outlier_z: float = 3.0,
        min_gap: int = 10,
        min_shift: float = 0.10,
        zwindow: int = 20,
        **bocpd: Any,
    ) -> None:
        self.threshold, self.outlier_z = float(threshold), float(outlier_z)
        self.min_gap, self.min_shift, self.zwindow = int(min_gap), float(min_shift), int(zwindow)
        self._bocpd = BOCPD(hazard=hazard, threshold=threshold, log=False, **bocpd)
        self.reset()

    def reset(self) -> None:
        self._bocpd.reset()
        self.n = 0
        self._accepted: deque[float] = deque(maxlen=self.zwindow)
        self._held: tuple[int, float, int] | None = None  # (index, x, sign)
        self._map: deque[int] = deque(maxlen=self._bocpd.max_run + 64)  # fed obs -> our index
        self._last_cp: int | None = None
        self.dropped = 0

    def _offset(self) -> int:
        """Inner observation number of ``self._map[0]``."""
        return self._bocpd.n - len(self._map)

    def rebase(self, index: int) -> None:
        k = next((k for k, i in enumerate(self._map) if i >= index), len(self._map))
        self._bocpd.rebase(self._offset() + k)

    def _feed(self, i: int, x: float) -> ChangePoint | None:
        self._accepted.append(x)
        self._map.append(i)
        cp = self._bocpd.update(x)
        if cp is None:
            return None
        onset = self._map[min(len(self._map) - 1, max(0, cp.index - self._offset()))]
        if self._last_cp is not None and i - self._last_cp < self.min_gap:
            return None
        if abs(cp.shift) < self.min_shift:
            return None
        self._last_cp = i
        return ChangePoint(index=onset, detected_at=i, probability=cp.probability, before=cp.before, after=cp.after)

    def update(self, x: float) -> ChangePoint | None:
        x = _positive_obs(x)
        i = self.n
        self.n += 1
        acc = list(self._accepted)
        if len(acc) >= 5:
            mean = sum(acc) / len(acc)
            sd = math.sqrt(sum((a - mean) ** 2 for a in acc) / (len(acc) - 1)) or 1e-12
            z = (x - mean) / sd
            if abs(z) > self.outlier_z:
                sign = 1 if z > 0 else -1
                if self._held is not None and self._held[2] == sign:
                    hi, hx, _ = self._held
                    self._held = None
                    cp = self._feed(hi, hx)
                    cp2 = self._feed(i, x)
                    return cp or cp2
                self._held = (i, x, sign)
                self.dropped += 1
                return None
        self._held = None
        return self._feed(i, x)


# ------------------------------------------------------------------ factories
def make_bocpd(*, threshold: float = 0.8, hazard: float = 0.01, **options: Any) -> BOCPD:
    """Factory registered as ``bocpd`` (``threshold``/``hazard`` from the configuration)."""
    return BOCPD(threshold=threshold, hazard=hazard, **options)


def make_cusum(*, threshold: float | None = None, hazard: float | None = None, **options: Any) -> CUSUM:
    """Factory registered as ``cusum``. ``threshold``/``hazard`` (posterior-probability
    settings of the Bayesian detectors) do not apply and are ignored; pass ``h``/``k``."""
    return CUSUM(**options)


def make_greyhound(*, threshold: float = 0.8, hazard: float = 0.01, **options: Any) -> GreyhoundChangePoint:
    """Factory registered as ``greyhound`` (the baseline's published parameters)."""
    return GreyhoundChangePoint(threshold=threshold, hazard=hazard, **options)
