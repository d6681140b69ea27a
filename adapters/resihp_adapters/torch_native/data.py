"""The job's data (``[data]``, ``job.data``) as torch_native micro-batches.

Like every adapter, torch_native trains on the job's :class:`~resihp_core.data.DataSource`
(docs/data.md): micro-batch ``(iteration, replica, mb)`` is a packed sequence of
``token_budget`` tokens whose document lengths and token ids depend only on that
address, so any rank can rebuild any micro-batch and a reference run sees the same
batches. A plan's micro-batch ``(owner, mb)`` of a plan with ``m`` micro-batches per
replica is global micro-batch ``g = owner * m + mb``, read at the source's address
``divmod(g, job.num_microbatches)``: a plan with fewer replicas but more micro-batches
each covers the same global batch.

A micro-batch is one sequence (batch dimension 1) with what the model needs to keep
documents apart: ``pos`` (RoPE positions, restarting at 0 in every document piece) and
``mask`` (block-diagonal causal attention, ``[1, N, N]``). Both are plain tensors handed
to every stage as keyword arguments of the pipeline step (torch's pipeline runtime
passes kwargs to all stages; only activations travel between them). Labels are the next
token inside each piece; the last token of a piece has none (``IGNORE_INDEX``). The loss
of an iteration is the summed cross-entropy over the whole global batch divided by its
labelled-token count (:meth:`Batches.label_count`), so it is the same however the
micro-batches are spread.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import torch
from torch import Tensor

from resihp_core.data import DataSource

__all__ = ["IGNORE_INDEX", "Batches", "MicroBatch", "job_source", "labels_for", "document_mask", "positions"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class MicroBatch:
    tokens: Tensor  # [1, N] int64
    labels: Tensor  # [1, N] int64, IGNORE_INDEX at the end of each document piece
    pos: Tensor  # [1, N] RoPE positions (model dtype)
    mask: Tensor  # [1, N, N] bool: True where attention is allowed
    lengths: tuple[int, ...]

    def kwargs(self) -> dict[str, Tensor]:
        """What every stage's forward takes besides its activations."""
        return {"pos": self.pos, "mask": self.mask}


def _check(lengths: Sequence[int], n: int) -> None:
    if not lengths or any(int(x) < 1 for x in lengths) or sum(lengths) != n:
        raise ValueError(f"document lengths {tuple(lengths)!r} must be ints >= 1 summing to {n}")


def labels_for(tokens: Tensor, lengths: Sequence[int]) -> Tensor:
    """Next-token labels of a packed ``[N]`` sequence inside each document piece."""
    _check(lengths, tokens.shape[0])
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:-1] = tokens[1:]
    ends = torch.cumsum(torch.tensor(list(lengths)), 0) - 1
    labels[ends] = IGNORE_INDEX
    return labels


def positions(lengths: Sequence[int], dtype: torch.dtype) -> Tensor:
    """``[N]`` positions restarting at 0 in every document piece."""
    return torch.cat([torch.arange(int(n), dtype=dtype) for n in lengths])


def document_mask(lengths: Sequence[int]) -> Tensor:
    """``[N, N]`` block-diagonal causal mask (a token sees earlier tokens of its piece)."""
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(list(lengths)))
    n = doc.shape[0]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return causal & (doc[:, None] == doc[None, :])


def job_source(job: Any, vocab_size: int) -> DataSource:
    """The job's data source, built once per process from ``job.data`` (the resolved
    ``[data]`` section the controller sends; ``token_budget`` must be in it)."""
    from resihp_core.data import create_source

    return create_source(dict(job.data), dp=job.dp, num_microbatches=job.num_microbatches, seed=job.seed,
                         vocab_size=vocab_size)


@dataclass(frozen=True)
class Batches:
    """Micro-batches of ``source`` for a model of dtype ``dtype`` (a hashable cache key)."""

    source: DataSource
    dtype: torch.dtype = torch.float64

    @property
    def token_budget(self) -> int:
        return self.source.token_budget

    @property
    def global_microbatches(self) -> int:
        return self.source.dp * self.source.num_microbatches

    def address(self, owner: int, mb: int, per_replica: int) -> tuple[int, int]:
        """The source's ``(replica, mb)`` of a plan's micro-batch (see the module docstring)."""
        g = owner * per_replica + mb
        if not 0 <= g < self.global_microbatches:
            raise ValueError(f"micro-batch {mb} of replica {owner} (plan of {per_replica} per replica) is "
                             f"outside the job's global batch of {self.global_microbatches}")
        return divmod(g, self.source.num_microbatches)

    def lengths(self, iteration: int, owner: int, mb: int, per_replica: int) -> tuple[int, ...]:
        return tuple(self.source.lengths(iteration, *self.address(owner, mb, per_replica)))

    def micro_batch(self, iteration: int, owner: int, mb: int, per_replica: int) -> MicroBatch:
        return _micro_batch(self, iteration, *self.address(owner, mb, per_replica))

    def label_count(self, iteration: int) -> int:
        """Labelled tokens of the whole global batch: every micro-batch's summed loss is
        divided by this one number wherever it runs."""
        return _label_count(self, iteration)


@lru_cache(maxsize=64)
def _micro_batch(b: Batches, iteration: int, replica: int, j: int) -> MicroBatch:
    import numpy as np

    lengths = tuple(int(x) for x in b.source.lengths(iteration, replica, j))
    tokens = torch.from_numpy(np.asarray(b.source.tokens(iteration, replica, j), dtype=np.int64).copy())
    return MicroBatch(tokens[None], labels_for(tokens, lengths)[None], positions(lengths, b.dtype)[None],
                      document_mask(lengths)[None], lengths)


@lru_cache(maxsize=16)
def _label_count(b: Batches, iteration: int) -> int:
    return b.source.label_count(iteration)
