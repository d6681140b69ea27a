"""Run an asyncio service (a :class:`~.controller.Controller`, a :class:`~.agent.NodeAgent`)
on a background thread, for synchronous callers: tests, a synchronous Scheduler, a
training process that hosts its node's agent.

    with LoopThread("controller") as loop:
        ctl = Controller(config, secret)
        loop.run(ctl.start())
        ...
        loop.run(ctl.stop())
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Awaitable, Callable, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on a daemon thread."""

    def __init__(self, name: str = "resihp-loop") -> None:
        self.name = name
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()

    def start(self) -> LoopThread:
        if self._thread is not None:
            raise RuntimeError(f"{self.name} already started")
        self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
        self._thread.start()
        self._ready.wait()
        return self

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self.loop = loop
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    def run(self, coro: Awaitable[T], timeout: float | None = 30.0) -> T:
        """Run ``coro`` on the loop and wait for its result (from another thread)."""
        if self.loop is None:
            raise RuntimeError(f"{self.name} is not running")
        fut = asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop (thread-safe; does not wait)."""
        if self.loop is None:
            raise RuntimeError(f"{self.name} is not running")
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop is not None and self._thread is not None:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
        self._thread = None

    def __enter__(self) -> LoopThread:
        return self.start() if self._thread is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
