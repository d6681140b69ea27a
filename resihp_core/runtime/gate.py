"""Bounded resources for connections that have not authenticated yet.

A listener (the controller's for agents, an agent's for workers) admits at most
``max_pending`` connections that are still in their handshake; one more is closed at
once, without reading a byte. Together with the handshake's small frame limit
(:data:`~resihp_core.protocol.auth.HANDSHAKE_MAX_FRAME_BYTES`) and time-out, what an
unauthenticated peer can make a listener hold is bounded by
``max_pending x (handshake frame limit + socket buffers)``, whatever the peer announces.
At shutdown :meth:`PreAuthGate.close_all` closes every pending handshake so that its
handler ends quietly (see docs/security.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio

__all__ = ["PreAuthGate", "MAX_PENDING_HANDSHAKES"]

MAX_PENDING_HANDSHAKES = 64

logger = logging.getLogger("resihp.gate")


class PreAuthGate:
    """Counts a listener's connections in their handshake and refuses those over the limit."""

    def __init__(self, name: str, max_pending: int = MAX_PENDING_HANDSHAKES) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self.max_pending = max_pending
        self.pending: set[asyncio.StreamWriter] = set()
        self.refused = 0
        self.closing = False

    def admit(self, writer: asyncio.StreamWriter) -> bool:
        """Whether this new connection may start its handshake (else it is closed)."""
        if self.closing or len(self.pending) >= self.max_pending:
            self.refused += 1
            if not self.closing and (self.refused == 1 or self.refused % 100 == 0):
                logger.warning("event=handshake_limit listener=%s pending=%d refused_total=%d",
                               self.name, len(self.pending), self.refused)
            writer.close()
            return False
        self.pending.add(writer)
        return True

    def done(self, writer: asyncio.StreamWriter) -> None:
        """The handshake of ``writer`` ended (either way)."""
        self.pending.discard(writer)

    def close_all(self) -> None:
        """Shutdown: refuse new connections and close every pending handshake."""
        self.closing = True
        for w in list(self.pending):
            w.close()
        self.pending.clear()
