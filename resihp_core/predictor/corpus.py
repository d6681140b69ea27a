"""Synthetic variable-length corpus packed into fixed-budget micro-batches.

Why: the micro-batch time predictor (docs/design.md §3.3) only matters because real corpora have
long-tailed document lengths. Packing to a fixed token budget N keeps the linear cost
constant, while attention cost follows Σ l_i² and so varies from micro-batch to
micro-batch. This module produces such workloads reproducibly, without torch or numpy
(:mod:`random` is deterministic across platforms for a given seed), so the detector,
the simulator and the benchmarks can all draw the same micro-batches.

Packing is a greedy stream: documents are drawn one after another and appended to the
current micro-batch; the document that overflows the budget is split, its head closes
the micro-batch and its tail opens the next one. A document longer than N therefore
spans several micro-batches. Every micro-batch sums to exactly N tokens.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Iterator

__all__ = [
    "CorpusError",
    "CorpusSpec",
    "DISTRIBUTIONS",
    "Workload",
    "iteration_workload",
    "packed_microbatches",
    "sample_lengths",
    "sum_sq",
]

#: Supported length distributions. ``lognormal``: median ``scale``, log-std ``shape``.
#: ``pareto``: minimum ``scale``, tail index ``shape`` (smaller = heavier tail).
#: ``fixed``: every document has length ``scale`` (useful as a control: no variation).
DISTRIBUTIONS = ("lognormal", "pareto", "fixed")

#: (replica, micro-batch) -> document lengths of that packed micro-batch.
Workload = dict[tuple[int, int], tuple[int, ...]]


class CorpusError(ValueError):
    """Invalid corpus parameters; the message names the parameter at fault."""


@dataclass(frozen=True)
class CorpusSpec:
    """How documents are drawn and packed. Validated at construction.

    Lengths are drawn from ``distribution`` (see :data:`DISTRIBUTIONS`), rounded to
    integers and clamped to ``[min_len, max_len]``; ``token_budget`` is N, the exact
    number of tokens of every packed micro-batch.
    """

    distribution: str = "lognormal"
    scale: float = 512.0
    shape: float = 1.0
    min_len: int = 16
    max_len: int = 8192
    token_budget: int = 4096
    seed: int = 0

    def __post_init__(self) -> None:
        if self.distribution not in DISTRIBUTIONS:
            raise CorpusError(
                f"distribution must be one of {', '.join(DISTRIBUTIONS)}, got {self.distribution!r}"
            )
        if not (isinstance(self.scale, (int, float)) and math.isfinite(self.scale) and self.scale > 0):
            raise CorpusError(f"scale must be a finite number > 0, got {self.scale!r}")
        if not (isinstance(self.shape, (int, float)) and math.isfinite(self.shape) and self.shape > 0):
            raise CorpusError(f"shape must be a finite number > 0, got {self.shape!r}")
        for name in ("min_len", "max_len", "token_budget", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise CorpusError(f"{name} must be an int, got {v!r}")
        if self.min_len < 1:
            raise CorpusError(f"min_len must be >= 1, got {self.min_len}")
        if self.max_len < self.min_len:
            raise CorpusError(f"max_len={self.max_len} is smaller than min_len={self.min_len}")
        if self.token_budget < 1:
            raise CorpusError(f"token_budget must be >= 1, got {self.token_budget}")

    def _draw(self, rng: random.Random) -> int:
        if self.distribution == "lognormal":
            x = rng.lognormvariate(math.log(self.scale), self.shape)
        elif self.distribution == "pareto":
            x = self.scale * rng.paretovariate(self.shape)
        else:
            x = self.scale
        return max(self.min_len, min(self.max_len, int(round(x))))


def _rng(spec: CorpusSpec, stream: str) -> random.Random:
    # String seeds are hashed with SHA-512 by `random`: stable across runs and
    # independent of PYTHONHASHSEED.
    return random.Random(f"resihp-corpus/{spec.seed}/{stream}")


def _packed(spec: CorpusSpec, rng: random.Random) -> Iterator[tuple[int, ...]]:
    n = spec.token_budget
    carry = 0  # tokens of a split document still to place
    while True:
        mb: list[int] = []
        room = n
        while room:
            doc = carry if carry else spec._draw(rng)
            carry = 0
            take = min(doc, room)
            mb.append(take)
            room -= take
            carry = doc - take
        yield tuple(mb)


def _check_count(name: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise CorpusError(f"{name} must be an int >= {minimum}, got {value!r}")


def sample_lengths(spec: CorpusSpec, count: int, *, stream: str = "docs") -> list[int]:
    """``count`` raw (unpacked) document lengths, deterministic in ``(spec.seed, stream)``."""
    _check_count("count", count, 0)
    rng = _rng(spec, stream)
    return [spec._draw(rng) for _ in range(count)]


def packed_microbatches(
    spec: CorpusSpec, count: int, *, stream: str = "main"
) -> list[tuple[int, ...]]:
    """The first ``count`` packed micro-batches of the stream ``(spec.seed, stream)``.

    Each tuple lists the document (or document-piece) lengths of one micro-batch, in
    order; they sum to exactly ``spec.token_budget``.
    """
    _check_count("count", count, 0)
    gen = _packed(spec, _rng(spec, stream))
    return [next(gen) for _ in range(count)]


def iteration_workload(
    spec: CorpusSpec, iteration: int, dp: int, num_microbatches: int
) -> Workload:
    """The micro-batches of one training iteration: ``(replica, mb) -> lengths``.

    Deterministic per ``(spec.seed, iteration)`` and independent of other iterations,
    so any iteration can be regenerated directly (e.g. by the detector, to predict the
    healthy time of the iteration it just measured). Replica ``r`` takes micro-batches
    ``r*m .. r*m+m-1`` of the iteration's packed stream.
    """
    _check_count("iteration", iteration, 0)
    _check_count("dp", dp, 1)
    _check_count("num_microbatches", num_microbatches, 1)
    mbs = packed_microbatches(spec, dp * num_microbatches, stream=f"iteration/{iteration}")
    return {
        (r, j): mbs[r * num_microbatches + j] for r in range(dp) for j in range(num_microbatches)
    }


def sum_sq(lengths: tuple[int, ...] | list[int]) -> int:
    """Σ l_i²: the attention-cost feature of a micro-batch."""
    return sum(l * l for l in lengths)
