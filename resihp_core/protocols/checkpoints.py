"""What an adapter reports of a checkpoint write it finished (``Adapter.checkpoint_status``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CheckpointWrite"]


@dataclass(frozen=True)
class CheckpointWrite:
    """One finished write of this worker's part of checkpoint ``iteration``.

    :param error: None when written (and verified); else why not. The worker reports a
        failed write as a storage fault: never fatal (docs/checkpoints.md).
    :param pruned: older checkpoints this writer removed (the sealing writer prunes).
    """

    iteration: int
    error: str | None = None
    bytes: int = 0
    seconds: float = 0.0
    pruned: tuple[int, ...] = ()
