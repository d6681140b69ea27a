"""Training data of the reference backend: any worker can rebuild any micro-batch.

Micro-batch ``(owner, mb)`` of iteration ``i`` comes from the job's
:class:`~resihp_core.data.DataSource` (the ``[data]`` section: the synthetic corpus,
local text files, a plugin's source): its document lengths and token ids depend only
on ``(i, owner, mb)``, so migrated work needs no data movement and a reference run
sees exactly the same batches. Labels are next-token ids within each document.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from resihp_core.data import DataSource
from resihp_adapters.megatron_ref.model import IGNORE_INDEX, make_labels

__all__ = ["DataSpec", "MicroBatch", "label_count", "lengths_of", "micro_batch"]


@dataclass(frozen=True)
class DataSpec:
    """The job's data as a hashable cache key: the source (one object per process and
    configuration, see :func:`resihp_core.data.create_source`) and its batch split."""

    source: DataSource

    @property
    def dp(self) -> int:  # data shards of the global batch (the plan's replicas, failed or not)
        return self.source.dp

    @property
    def num_microbatches(self) -> int:
        return self.source.num_microbatches

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size


@dataclass(frozen=True)
class MicroBatch:
    tokens: Tensor  # [N] int64
    labels: Tensor  # [N] int64, IGNORE_INDEX at document ends
    lengths: tuple[int, ...]


def lengths_of(spec: DataSpec, iteration: int, owner: int, mb: int) -> tuple[int, ...]:
    return spec.source.lengths(iteration, owner, mb)


def micro_batch(spec: DataSpec, iteration: int, owner: int, mb: int) -> MicroBatch:
    import numpy as np

    lengths = lengths_of(spec, iteration, owner, mb)
    tokens = torch.from_numpy(np.array(spec.source.tokens(iteration, owner, mb), dtype=np.int64))
    return MicroBatch(tokens, make_labels(tokens, lengths), lengths)


@lru_cache(maxsize=8)
def label_count(spec: DataSpec, iteration: int) -> int:
    """Labelled tokens in the whole global batch: the loss is their mean, so every
    micro-batch's summed loss is divided by this one number wherever it runs."""
    return spec.source.label_count(iteration)


assert IGNORE_INDEX < 0
