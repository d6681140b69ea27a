"""Built-in detection plugins: change-point detectors and verification strategies.

Listed in :data:`resihp_core.plugins.BUILTINS`. Registration imports nothing heavy: each
factory imports its module (numpy) when it is first called. All implementations are
``trylast``, so a plugin registering the same name replaces the built-in.

Change-point detectors (factories take ``threshold`` and ``hazard`` from the
configuration, plus their own options):

* ``bocpd`` — Bayesian online change-point detection on log iteration times (default);
* ``cusum`` — two-sided CUSUM on standardised log iteration times;
* ``greyhound`` — the baseline's BOCPD with Greyhound's published post-processing.

Verification strategies: ``resihp`` (profiles first, targeted probes) and
``greyhound`` (probe everything, 2x / 1.1x median thresholds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from resihp_core.hookspecs import hookimpl

if TYPE_CHECKING:
    from resihp_core.plugins import FactoryRegistry


def _bocpd(**options: Any) -> Any:
    from resihp_core.detector.changepoint import make_bocpd

    return make_bocpd(**options)


def _cusum(**options: Any) -> Any:
    from resihp_core.detector.changepoint import make_cusum

    return make_cusum(**options)


def _greyhound(**options: Any) -> Any:
    from resihp_core.detector.changepoint import make_greyhound

    return make_greyhound(**options)


def _resihp_verifier(**options: Any) -> Any:
    from resihp_core.detector.verify import make_profile_verifier

    return make_profile_verifier(**options)


def _greyhound_verifier(**options: Any) -> Any:
    from resihp_core.detector.verify import make_greyhound_verifier

    return make_greyhound_verifier(**options)


@hookimpl(trylast=True)
def resihp_register_changepoint_detectors(registry: FactoryRegistry) -> None:
    registry.register("bocpd", _bocpd)
    registry.register("cusum", _cusum)
    registry.register("greyhound", _greyhound)


@hookimpl(trylast=True)
def resihp_register_verification_strategies(registry: FactoryRegistry) -> None:
    registry.register("resihp", _resihp_verifier)
    registry.register("greyhound", _greyhound_verifier)
