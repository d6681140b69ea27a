"""FSDP2's gradient-reduction buffers kept across iterations on the host.

FSDP2 asks its reduce-scatter object for two flat buffers of the gradients' size per
reduction (the reduce-scatter input and output; the output's views become the sharded
gradients). On a GPU they come from the caching allocator and cost nothing. On the host
they come from ``malloc``: buffers that large are fresh ``mmap`` pages, so every
iteration the kernel faults in and zeroes twice the stage's gradient bytes, and that,
not the reduction, was most of what a replica's reduction cost next to DDP's (whose
buckets persist): 400,000 page faults and 0.7 s of CPU per iteration for a
68-million-parameter float64 stage (docs/benchmarks.md, "Where a fault-free iteration
goes").

:class:`PooledReduceScatter` hands out buffers it keeps, each again only once nothing
but the pool refers to its memory (the previous iteration's gradients, views of the
output, are gone by then: the engine zeroes them with ``set_to_none``); otherwise it
makes a new one, up to :data:`MAX_PER_SIZE` per size and dtype. The reduction itself is
torch's own (``reduce_scatter_single``), unchanged.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

__all__ = ["PooledReduceScatter", "MAX_PER_SIZE", "host_pooling_supported"]

#: buffers kept per (size, dtype): the input and output of one reduction, and one more
#: of each while FSDP still holds the last reduction's input for its event
MAX_PER_SIZE = 4


def _storage_users(t: torch.Tensor) -> int:
    """References to ``t``'s memory (tensors and views over it), less the temporary
    storage object this call makes."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) - 1


def host_pooling_supported() -> bool:
    """True where torch exposes a storage's reference count (the pool's only test of
    whether a buffer is free); without it FSDP's own allocation is kept."""
    return hasattr(torch._C, "_storage_Use_Count")


class PooledReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter with its buffers reused (host tensors only; a
    device tensor is left to the caching allocator)."""

    def __init__(self) -> None:
        super().__init__()
        self._pool: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}

    def allocate(self, size: Sequence[int | torch.SymInt], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        numel = 1
        for s in size:
            numel *= int(s)
        if torch.device(device).type != "cpu":
            return torch.empty(*size, dtype=dtype, device=device)
        kept = self._pool.setdefault((numel, dtype, torch.device(device)), [])
        for buf in kept:
            if _storage_users(buf) == 1:  # the pool's own reference: free
                return buf.view(*size)
        buf = torch.empty(numel, dtype=dtype, device=device)
        if len(kept) < MAX_PER_SIZE:
            kept.append(buf)
        return buf.view(*size)

    def buffers(self) -> int:
        """Buffers kept (for tests)."""
        return sum(len(v) for v in self._pool.values())
