"""A slowed device verified healthy again (docs/detector.md, "Acting on a slowdown").

Once a device is known slow (reported in this generation, or planned around with its
speed ``p``), the healthy-time model predicts its compute with ``p`` put back in
(:mod:`resihp_core.detector.model`), so while it stays slow its peer excess
(:func:`~resihp_core.detector.localise.peer_excess`) is about 0, and once it is back at
full speed about ``log p``. :class:`RecoveryWatch` calls a device healthy again when its
excess is below ``log(p) / 2`` (nearer full speed than its known speed) in ``k``
consecutive iterations; the detector then reports it with throughput 1.0, and the
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
    """

    k: int = 5
    slowest: float = 0.9
    _run: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"RecoveryWatch.k must be >= 1, got {self.k}")

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
            if excess[d] <= 0.5 * math.log(p):
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
