"""What ResiHP ships for adapter and plugin authors' tests (``docs/adapters.md``):
the adapter conformance kit (:mod:`resihp_core.testing.conformance`)."""

from __future__ import annotations

__all__ = ["conformance"]
