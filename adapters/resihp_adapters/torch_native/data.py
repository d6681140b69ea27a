"""Deterministic token batches: any rank can rebuild any micro-batch of any iteration.

Global micro-batch ``g`` of iteration ``i`` is ``[batch, seq_len + 1]`` token ids drawn
from a generator seeded by ``(seed, i, g)``; inputs are the first ``seq_len`` tokens and
targets the last ``seq_len``. A plan's micro-batch ``(owner replica, mb)`` is global
micro-batch ``owner * num_microbatches + mb``, so a reference run (any split, one
process) sees exactly the same tokens, and a plan with fewer replicas but more
micro-batches each covers the same global batch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DataSpec", "micro_batch"]


@dataclass(frozen=True)
class DataSpec:
    vocab_size: int
    seq_len: int = 16
    batch: int = 2  # sequences per micro-batch
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "batch"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"DataSpec.{name} must be an int >= 1, got {v!r}")

    @property
    def tokens_per_microbatch(self) -> int:
        return self.batch * self.seq_len


def micro_batch(spec: DataSpec, iteration: int, g: int) -> tuple[Tensor, Tensor]:
    """(inputs, targets) of global micro-batch ``g`` of ``iteration``, both ``[batch, seq_len]``."""
    key = hashlib.sha256(f"resihp-torch-native-data/{spec.seed}/{iteration}/{g}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") & (2**63 - 1))
    t = torch.randint(0, spec.vocab_size, (spec.batch, spec.seq_len + 1), generator=gen)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()
