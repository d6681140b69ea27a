"""Deterministic training data: any worker can regenerate any micro-batch.

Micro-batch ``(owner, mb)`` of iteration ``i`` is a packed sequence from the synthetic
corpus (document lengths) with token ids drawn from a generator seeded by
``(seed, i, owner, mb)``. Because every rank can rebuild every micro-batch, migrated
work needs no data movement and a reference run sees exactly the same batches.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_adapters.megatron_ref.model import IGNORE_INDEX, make_labels

__all__ = ["DataSpec", "MicroBatch", "micro_batch", "label_count"]


@dataclass(frozen=True)
class DataSpec:
    corpus: CorpusSpec
    vocab_size: int
    dp: int  # data shards of the global batch (the plan's replicas, failed or not)
    num_microbatches: int
    seed: int = 0


@dataclass(frozen=True)
class MicroBatch:
    tokens: Tensor  # [N] int64
    labels: Tensor  # [N] int64, IGNORE_INDEX at document ends
    lengths: tuple[int, ...]


@lru_cache(maxsize=8)
def _workload(spec: DataSpec, iteration: int) -> dict[tuple[int, int], tuple[int, ...]]:
    return iteration_workload(spec.corpus, iteration, spec.dp, spec.num_microbatches)


def lengths_of(spec: DataSpec, iteration: int, owner: int, mb: int) -> tuple[int, ...]:
    return _workload(spec, iteration)[(owner, mb)]


def micro_batch(spec: DataSpec, iteration: int, owner: int, mb: int) -> MicroBatch:
    lengths = lengths_of(spec, iteration, owner, mb)
    key = hashlib.sha256(f"resihp-data/{spec.seed}/{iteration}/{owner}/{mb}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    tokens = torch.randint(0, spec.vocab_size, (sum(lengths),), generator=gen)
    return MicroBatch(tokens, make_labels(tokens, lengths), lengths)


@lru_cache(maxsize=8)
def label_count(spec: DataSpec, iteration: int) -> int:
    """Labelled tokens in the whole global batch: the loss is their mean, so every
    micro-batch's summed loss is divided by this one number wherever it runs."""
    total = 0
    for lengths in _workload(spec, iteration).values():
        total += sum(lengths) - len(lengths)
    return total


assert IGNORE_INDEX < 0
