"""A slowed device verified healthy again (docs/detector.md, "Acting on a slowdown").

Once a device is known slow (reported in this generation, or planned around with its
speed ``p``), the healthy-time model predicts its compute with ``p`` put back in
(:mod:`resihp_core.detector.model`), so while it stays slow its peer excess
(:func:`~resihp_core.detector.localise.peer_excess`) is about 0, and once it is back at
full speed about ``log p`` — or up to ``log(allowance * p)``: a device left with fewer
micro-batches than its peers computes each slower than the model's estimate from its
peers (about 1.3x measured, more on some hosts), and where its own warm-up ran lighter
than ``p`` that estimate is what the model holds (:mod:`resihp_core.detector.model`).
:class:`RecoveryWatch` calls a device healthy again when its excess is below
:meth:`RecoveryWatch.bar` (halfway between slow as known and that full speed, and at
least a quarter of ``log p`` below 0, so a still-slow device's noise does not count) in
``k`` consecutive iterations; the detector then reports it with throughput 1.0, and the
supervisor plans back to the better layout when that pays (runtime/controller/payback.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

__all__ = ["RecoveryWatch"]


@dataclass
class RecoveryWatch:
    """Counts, per known-slow device, consecutive iterations it ran nearer full speed.

    :param k: iterations in a row before a device is healthy again.
    :param slowest: only devices known slower than this are watched (a device at 0.95
        is inside the timing noise either way).
    :param allowance: how much slower than the model's estimate a device back at full
        speed may compute in its new layout (module docstring).
    """

    k: int = 5
    slowest: float = 0.9
    allowance: float = 1.3
    _run: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"RecoveryWatch.k must be >= 1, got {self.k}")
        if self.allowance < 1.0:
            raise ValueError(f"RecoveryWatch.allowance must be >= 1, got {self.allowance}")

    def bar(self, p: float) -> float:
        """Peer excess at or below which a device known at speed ``p`` ran nearer full
        speed than ``p``: halfway to ``log(allowance * p)``, at most ``log(p) / 4``."""
        return min(0.5 * math.log(self.allowance * p), 0.25 * math.log(p))

    def reset(self) -> None:
        self._run.clear()

    def update(self, speeds: Mapping[int, float], excess: Mapping[int, float]) -> list[int]:
        """Feed one iteration's peer excess; returns the devices healthy again now."""
        back: list[int] = []
        for d in list(self._run):
            if d not in speeds or speeds[d] >= self.slowest:
                del self._run[d]
        for d, p in speeds.items():
            if not 0 < p < self.slowest or d not in excess:
                continue
            if excess[d] <= self.bar(p):
                self._run[d] = self._run.get(d, 0) + 1
            else:
                self._run[d] = 0
            if self._run[d] >= self.k:
                back.append(d)
                del self._run[d]
        return sorted(back)

    def runs(self) -> dict[int, int]:
        """Device -> iterations in a row it has looked healthy (for tests and logs)."""
        return dict(self._run)
