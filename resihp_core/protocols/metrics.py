"""What observers hear of each committed iteration (the ``resihp_iteration_finished`` hook)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationMetrics"]


@dataclass
class IterationMetrics:
    """One committed iteration, as the controller saw it.

    :param seconds: wall time from the previous commit to this one.
    :param samples: samples trained in it (every replica's micro-batches).
    :param phase: the run's label for when it ran ("running", or a fault's phase).
    """

    iteration: int
    loss: float
    seconds: float
    samples: int
    generation: int
    phase: str
