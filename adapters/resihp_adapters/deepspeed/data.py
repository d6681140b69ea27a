"""Micro-batches addressed by (iteration, replica, micro-batch).

A DeepSpeed job normally feeds each pipeline an iterator; after a failure nobody knows
which samples an iterator already consumed, and migrated work must read *another*
replica's micro-batch. ResiHP instead takes a map-style dataset and a collate function
and computes every micro-batch's sample indices from its address, so a recovered or
migrated micro-batch is exactly the one the fault-free run would have read.

The index layout is the one DeepSpeed's pipeline engine gets from its
``DistributedSampler(shuffle=False)`` over ``replicas`` data-parallel ranks (the
engine's own ``training_data`` loader): replica ``r``'s k-th micro-batch (k counted over
iterations) holds the sampler's positions ``k * micro_batch_size + i``, repeating the
epoch as DeepSpeed's ``RepeatingLoader`` does. With ``shuffle`` it is the order
``engine.deepspeed_io(dataset)`` gives: ``DistributedSampler(shuffle=True, seed=seed)``
at epoch 0 on every pass (DeepSpeed's loader never advances the epoch). ``replicas`` is
the job's *nominal* DP degree (fixed for the job), so a replica keeps its share of the
data when the plan's replica count changes. An epoch whose per-replica length is not a
multiple of the micro-batch size ends in a short batch under DeepSpeed; here batches run
on into the next pass instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

__all__ = ["MicroBatchSource"]


@dataclass(frozen=True)
class MicroBatchSource:
    """Addresses micro-batches of ``dataset`` (anything with ``__getitem__`` and
    ``__len__``); ``collate_fn`` turns a list of samples into DeepSpeed's
    ``(inputs, labels)`` batch. Wraps around the dataset (epochs) by modulo."""

    dataset: Any
    collate_fn: Callable[[list[Any]], Any]
    micro_batch_size: int
    num_microbatches: int
    replicas: int
    shuffle: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "num_microbatches", "replicas"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"MicroBatchSource.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.dataset) < 1:
            raise ValueError("MicroBatchSource.dataset is empty")

    def indices(self, iteration: int, replica: int, mb: int) -> list[int]:
        """Dataset indices of micro-batch ``mb`` of ``replica`` in ``iteration``."""
        if not (0 <= replica < self.replicas):
            raise ValueError(f"replica {replica} is outside the job's {self.replicas} replicas")
        if not (0 <= mb < self.num_microbatches):
            raise ValueError(f"micro-batch {mb} is outside 0..{self.num_microbatches - 1}")
        if iteration < 0:
            raise ValueError(f"iteration must be >= 0, got {iteration}")
        k = iteration * self.num_microbatches + mb
        n = len(self.dataset)
        per_replica = -(-n // self.replicas)  # DistributedSampler pads to a multiple of replicas
        order = self._order()
        out = []
        for i in range(self.micro_batch_size):
            pos = (k * self.micro_batch_size + i) % per_replica
            g = (pos * self.replicas + replica) % n
            out.append(order[g] if order is not None else g)
        return out

    def _order(self) -> list[int] | None:
        """The shuffled dataset order (``DistributedSampler``'s, epoch 0), or None."""
        if not self.shuffle:
            return None
        cached = self.__dict__.get("_perm")
        if cached is None:
            import torch

            g = torch.Generator()
            g.manual_seed(int(self.seed))
            cached = torch.randperm(len(self.dataset), generator=g).tolist()
            object.__setattr__(self, "_perm", cached)
        return cached

    def micro_batch(self, iteration: int, replica: int, mb: int) -> Any:
        """The collated micro-batch at this address."""
        return self.collate_fn([self.dataset[i] for i in self.indices(iteration, replica, mb)])

    def iterator(self, replica: int, start_iteration: int = 0) -> Any:
        """The same micro-batches as an endless iterator, in DeepSpeed's order (for the
        stock engine's ``train_batch(data_iter)``)."""
        it = start_iteration
        while True:
            for j in range(self.num_microbatches):
                yield self.micro_batch(it, replica, j)
            it += 1

    @staticmethod
    def default_collate(samples: Sequence[Any]) -> Any:
        """torch's default collate (a list of ``(x, y)`` becomes ``(X, Y)``)."""
        from torch.utils.data import default_collate

        return default_collate(list(samples))
