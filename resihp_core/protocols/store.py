"""The job store as the session, the workers and the controller use it."""

from __future__ import annotations

import datetime
from typing import Protocol

__all__ = ["KeyValueStore", "WatchableStore"]


class KeyValueStore(Protocol):
    """What the session needs of a job store: the ``torch.distributed.Store`` calls our
    own :class:`~resihp_core.runtime.store.StoreClient` implements too."""

    def set(self, key: str, value: str | bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def check(self, keys: list[str]) -> bool: ...
    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None: ...
    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes: ...
    def delete_key(self, key: str) -> bool: ...


class WatchableStore(KeyValueStore, Protocol):
    """ResiHP's own store (:mod:`resihp_core.runtime.store`): it can also block until
    any one of several keys exists."""

    def wait_any(self, keys: list[str], timeout_s: float) -> int: ...
