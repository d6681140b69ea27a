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
from typing import Any, Callable, Sequence

import torch
from torch import Tensor

from resihp_core.data import DataSource

__all__ = ["IGNORE_INDEX", "Batches", "MicroBatch", "UserData", "UserBatch", "job_source", "labels_for",
           "document_mask", "positions", "hf_batch", "hf_loss_sum", "hf_label_count"]

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

    @property
    def args(self) -> tuple[Tensor, ...]:
        """The first stage's positional input."""
        return (self.tokens,)

    @property
    def target(self) -> Tensor:
        """What the last stage's loss compares its output with."""
        return self.labels


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

    def denominator(self, iteration: int) -> float:
        """What every micro-batch's summed loss is divided by (the engine's data interface)."""
        return float(self.label_count(iteration))

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


# ------------------------------------------------------------------ the user's data
@dataclass(frozen=True)
class UserBatch:
    """One micro-batch of the user's data, as the pipeline takes it."""

    args: tuple[Tensor, ...]  # the first stage's input
    kw: dict[str, Tensor]  # every stage's keyword arguments (positions, masks)
    target: Tensor  # the last stage's loss target
    lengths: tuple[int, ...] = ()  # document lengths, for the Detector's profiles

    def kwargs(self) -> dict[str, Tensor]:
        return self.kw


class UserData:
    """The user's map-style ``dataset`` + ``collate_fn`` as addressable micro-batches.

    Global micro-batch ``g`` of iteration ``i`` is ``collate_fn`` of samples
    ``((i * G + g) * B + k) % len(dataset)`` for ``k < B`` (``G`` = the job's global
    micro-batches, ``B`` = ``micro_batch_size``): in order, wrapping around at the end,
    the same whatever plan runs it (shuffle the dataset beforehand if wanted). A plan's
    micro-batch ``(owner, mb)`` with ``m`` per replica is ``g = owner * m + mb``.

    ``prepare`` turns a collated batch into a :class:`UserBatch` (:func:`hf_batch` for
    Hugging Face causal LMs). ``count(target)`` gives the loss denominator's share of a
    micro-batch (labelled tokens): every micro-batch's loss is divided by the count of the
    whole global batch. Without ``count`` the loss is taken to be a mean per
    micro-batch and is divided by ``G``. Either way any layout takes the same step."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list], Any] | None, *, micro_batch_size: int,
                 global_microbatches: int, prepare: Callable[[Any], UserBatch],
                 count: Callable[[Tensor], int] | None = None) -> None:
        if not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__"):
            raise TypeError("dataset: a map-style dataset (__getitem__ and __len__) is needed, so that any "
                            "rank can read any micro-batch; an iterable dataset cannot be re-split")
        if len(dataset) < 1:
            raise ValueError("dataset is empty")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if collate_fn is None:
            from torch.utils.data import default_collate

            collate_fn = default_collate
        self.dataset, self.collate_fn = dataset, collate_fn
        self.micro_batch_size, self.global_microbatches = micro_batch_size, global_microbatches
        self.prepare, self.count = prepare, count
        self._cache: dict[tuple[int, int], UserBatch] = {}
        self._denoms: dict[int, float] = {}

    def global_batch(self, iteration: int, g: int) -> UserBatch:
        """Global micro-batch ``g`` of ``iteration``."""
        key = (iteration, g)
        if key not in self._cache:
            if len(self._cache) > 4 * self.global_microbatches:
                self._cache.clear()
            b, n = self.micro_batch_size, len(self.dataset)
            start = (iteration * self.global_microbatches + g) * b
            samples = [self.dataset[(start + k) % n] for k in range(b)]
            self._cache[key] = self.prepare(self.collate_fn(samples))
        return self._cache[key]

    def collated(self, iteration: int, g: int) -> Any:
        """Global micro-batch ``g`` of ``iteration`` as ``collate_fn`` made it (the user's
        loop, :mod:`.loop`): the same samples as :meth:`global_batch`."""
        if not 0 <= g < self.global_microbatches:
            raise ValueError(f"micro-batch {g} is outside the job's global batch of {self.global_microbatches}")
        b, n = self.micro_batch_size, len(self.dataset)
        start = (iteration * self.global_microbatches + g) * b
        return self.collate_fn([self.dataset[(start + k) % n] for k in range(b)])

    def micro_batch(self, iteration: int, owner: int, mb: int, per_replica: int) -> UserBatch:
        g = owner * per_replica + mb
        if not 0 <= g < self.global_microbatches:
            raise ValueError(f"micro-batch {mb} of replica {owner} (plan of {per_replica} per replica) is "
                             f"outside the job's global batch of {self.global_microbatches}")
        return self.global_batch(iteration, g)

    def denominator(self, iteration: int) -> float:
        if self.count is None:
            return float(self.global_microbatches)
        if iteration not in self._denoms:
            total = sum(int(self.count(self.global_batch(iteration, g).target))
                        for g in range(self.global_microbatches))
            self._denoms = {iteration: float(max(total, 1))}
        return self._denoms[iteration]


def hf_batch(dtype: torch.dtype) -> Callable[[Any], UserBatch]:
    """``prepare`` for Hugging Face causal LMs: a collated dict with ``input_ids``
    (``[B, T]``) and optionally ``labels`` (default: ``input_ids``; the model shifts
    them), ``attention_mask`` (``[B, T]`` padding) and ``position_ids``. Packed documents:
    positions that restart at 0 start a new document; attention stays inside a document
    (block-diagonal causal mask, handed to every stage as a 4-D additive mask)."""
    from resihp_adapters.torch_native.split import additive_mask

    def prepare(batch: Any) -> UserBatch:
        ids = batch["input_ids"]
        if ids.dim() == 1:
            ids = ids[None]
        b, t = ids.shape
        labels = batch.get("labels") if hasattr(batch, "get") else None
        labels = ids.clone() if labels is None else labels.reshape(b, t)
        pos = batch.get("position_ids") if hasattr(batch, "get") else None
        pos = torch.arange(t)[None].expand(b, -1).contiguous() if pos is None else pos.reshape(b, t)
        doc = torch.cumsum((pos == 0).to(torch.int64), dim=1)
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & (doc[:, :, None] == doc[:, None, :])
        pad = batch.get("attention_mask") if hasattr(batch, "get") else None
        if pad is not None:
            allowed = allowed & pad.reshape(b, t).bool()[:, None, :]
        starts = (pos[0] == 0).nonzero().flatten().tolist() + [t]
        lengths = tuple(int(e - s) for s, e in zip(starts, starts[1:]) if e > s)
        return UserBatch((ids,), {"position_ids": pos, "attention_mask": additive_mask(allowed, dtype)},
                         labels, lengths)

    return prepare


def hf_loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
    """Summed next-token cross-entropy, Hugging Face's way (``labels`` aligned with the
    inputs; position ``t`` predicts ``labels[t + 1]``; -100 is ignored), in float32 or
    wider."""
    import torch.nn.functional as F

    logits = logits[:, :-1]
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), reduction="sum",
                           ignore_index=IGNORE_INDEX)


def hf_label_count(labels: Tensor) -> int:
    """Labelled tokens :func:`hf_loss_sum` sums over."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())
