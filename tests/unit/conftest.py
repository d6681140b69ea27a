"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def hosted(request):
    """An authenticated job store on loopback, keyed by the test module's ``SECRET``:
    ``(store, address)``; closed after the test."""
    from resihp_core.runtime import session

    store, address = session.host("127.0.0.1", secret=request.module.SECRET)
    try:
        yield store, address
    finally:
        store.server.close()
