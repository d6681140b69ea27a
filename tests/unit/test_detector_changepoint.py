"""Online change-point detectors: BOCPD, CUSUM and the Greyhound-like baseline."""

from __future__ import annotations

import math

import numpy as np
import pytest

from resihp_core.detector import ChangePointDetector
from resihp_core.detector.changepoint import (
    BOCPD,
    CUSUM,
    GreyhoundChangePoint,
    make_bocpd,
    make_cusum,
    make_greyhound,
)


def series(n: int, *, noise: float = 0.05, seed: int = 0, level: float = 2.0) -> np.ndarray:
    return level * np.exp(np.random.default_rng(seed).normal(0.0, noise, n))


def run(det: ChangePointDetector, xs, rebase: bool = True) -> list:
    out = []
    for x in xs:
        cp = det.update(float(x))
        if cp is not None:
            out.append(cp)
            if rebase:
                det.rebase(cp.index)
    return out


DETECTORS = [BOCPD, CUSUM, GreyhoundChangePoint]


@pytest.mark.parametrize("make", DETECTORS)
def test_detectors_implement_the_interface(make) -> None:
    assert isinstance(make(), ChangePointDetector)


@pytest.mark.parametrize("make", DETECTORS)
@pytest.mark.parametrize("factor", [1.54, 2.2, 0.6])
def test_a_step_is_found_fast_with_its_onset(make, factor: float) -> None:
    xs = series(120, seed=1)
    xs[80:] *= factor
    cps = run(make(), xs)
    after = [cp for cp in cps if cp.detected_at >= 80]
    assert after, "the step was not detected"
    cp = after[0]
    assert cp.detected_at - 80 + 1 <= 3, cp  # within three iterations of the onset
    assert abs(cp.index - 80) <= 1, cp
    assert cp.shift == pytest.approx(factor - 1, rel=0.25)
    assert not [c for c in cps if c.detected_at < 80 and abs(c.shift) > 0.25]


@pytest.mark.parametrize("make", [BOCPD, CUSUM])
def test_stationary_noise_rarely_fires(make) -> None:
    false = sum(len(run(make(), series(300, noise=0.08, seed=s))) for s in range(10))
    assert false <= 5  # over 3000 observations


def test_bocpd_ignores_a_single_spike() -> None:
    xs = series(100, seed=2)
    xs[60] *= 1.8  # one iteration with an unusually long document
    assert run(BOCPD(), xs) == []


def test_bocpd_accumulates_evidence_for_a_modest_shift() -> None:
    xs = series(200, noise=0.1, seed=3)
    xs[120:] *= 1.2  # two standard deviations: needs several observations
    cps = run(BOCPD(), xs)
    assert [cp for cp in cps if 120 <= cp.detected_at <= 140]


def test_bocpd_reports_a_change_once_and_rebase_forgets_it() -> None:
    det = BOCPD()
    xs = series(100, seed=4)
    xs[50:] *= 1.6
    cps = run(det, xs, rebase=False)
    assert len([c for c in cps if c.index >= 49]) == 1
    det2 = BOCPD()
    cps2 = run(det2, xs, rebase=True)
    assert len(cps2) == 1
    assert det2.n == 100


def test_bocpd_state_is_bounded() -> None:
    det = BOCPD(max_run=64)
    for x in series(500, seed=5):
        det.update(float(x))
    assert det.run_length_posterior.size <= 64
    assert det.run_length_posterior.sum() == pytest.approx(1.0)


def test_bocpd_noise_scale_adapts_to_the_series() -> None:
    det = BOCPD()
    for x in series(64, noise=0.2, seed=6):
        det.update(float(x))
    assert 0.1 < det.noise_scale() < 0.35
    quiet = BOCPD()
    for x in series(64, noise=0.001, seed=6):
        quiet.update(float(x))
    assert quiet.noise_scale() == pytest.approx(quiet.min_noise)


def test_raw_series_mode_works_in_seconds() -> None:
    xs = series(100, seed=7, level=30.0)
    xs[60:] *= 1.5
    cps = run(BOCPD(log=False), xs)
    assert cps and abs(cps[0].index - 60) <= 1


def test_cusum_rebase_moves_the_reference() -> None:
    det = CUSUM()
    xs = series(150, seed=8)
    xs[60:] *= 1.5
    cps = run(det, xs)
    assert len(cps) == 1 and abs(cps[0].index - 60) <= 2


def test_greyhound_drops_outliers_and_needs_a_real_shift() -> None:
    det = GreyhoundChangePoint()
    xs = series(200, noise=0.02, seed=9)
    xs[50] *= 2.0  # isolated outlier: dropped
    xs[120:] *= 1.05  # a 5 % shift: below the 10 % minimum
    assert run(det, xs) == []
    assert det.dropped >= 1


def test_greyhound_minimum_gap_between_change_points() -> None:
    det = GreyhoundChangePoint()
    xs = series(200, noise=0.02, seed=10)
    xs[100:] *= 1.5
    xs[104:] *= 1.5  # a second step 4 iterations later: inside the 10-iteration gap
    cps = run(det, xs)
    assert len(cps) == 1


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
@pytest.mark.parametrize("make", DETECTORS)
def test_bad_observations_are_rejected(make, bad: float) -> None:
    with pytest.raises(ValueError):
        make().update(bad)


@pytest.mark.parametrize("kwargs", [
    {"hazard": 0.0}, {"hazard": 1.5}, {"threshold": 2.0}, {"noise": 0.0}, {"min_run": 0},
    {"max_run": 1}, {"window": 1000},
])
def test_bocpd_validates_parameters(kwargs) -> None:
    with pytest.raises(ValueError):
        BOCPD(**kwargs)


def test_cusum_validates_parameters() -> None:
    with pytest.raises(ValueError):
        CUSUM(h=0)
    with pytest.raises(ValueError):
        CUSUM(warmup=1)


def test_factories_take_the_configured_options() -> None:
    assert make_bocpd(threshold=0.9, hazard=0.02).threshold == 0.9
    assert isinstance(make_cusum(threshold=0.8, hazard=0.01, h=7.0), CUSUM)
    g = make_greyhound(threshold=0.8, hazard=0.01)
    assert (g.min_gap, g.min_shift, g.outlier_z) == (10, 0.10, 3.0)
