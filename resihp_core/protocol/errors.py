"""The two errors of the wire protocol; see :mod:`resihp_core.protocol`."""

from __future__ import annotations

__all__ = ["ProtocolError", "AuthError"]


class ProtocolError(ValueError):
    """A frame is malformed, truncated, oversized or of an unknown kind; close the stream."""


class AuthError(ProtocolError):
    """The handshake failed: wrong or missing secret, wrong version, silent peer."""
