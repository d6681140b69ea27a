"""The two errors of the wire protocol; see :mod:`resihp_core.protocol`."""

from __future__ import annotations

__all__ = ["ProtocolError", "AuthError", "HandshakeBroken"]


class ProtocolError(ValueError):
    """A frame is malformed, truncated, oversized or of an unknown kind; close the stream."""


class AuthError(ProtocolError):
    """The handshake failed: wrong or missing secret, wrong version, silent peer."""


class HandshakeBroken(AuthError):
    """The handshake broke off in transport (reset, closed, timed out, garbled) before
    the peer said yes or no: a peer that is restarting, not one that refused. Whoever
    dials again within a deadline may retry; a refusal is a plain :class:`AuthError`."""
