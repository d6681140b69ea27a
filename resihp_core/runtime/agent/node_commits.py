"""The node's commits: its executors' reports (with their SDC fingerprints), their
commit-counter add and their wait for the verdict reach the job store as one request
per node and iteration.

Why: with every rank posting its report, adding to the counter and waiting for the
verdict itself, the job store (one process) serves three requests per rank and
iteration: about 49,000 per iteration at 16,384 ranks. Through the agent it serves one
per node (docs/worker-protocol.md, "Commits through the node agent").

The semantics are the commit protocol's (:func:`resihp_core.runtime.session.commit`):
the counter sums, so executors that reach the agent together are added in one batch
and a straggler in a later one; whoever's add completes the count decides (an executor
that must run its cross-replica check first is told ``decide`` and decides itself);
every executor gets the first verdict written. An agent that dies between its add and
the verdict leaves its workers to read the verdict from the store themselves (the
node is reported lost, the generation aborted).

Every request is hostile until checked: a request for another device than the
connection's, or with disagreeing executor counts, is refused and counted, and the
connection is closed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from resihp_core.protocol import CommitRequest, CommitVerdict, Error, ProtocolError, read_msg, write_msg
from resihp_core.runtime import session
from resihp_core.runtime.store_wire import WireError, WireStore

T = TypeVar("T")

__all__ = ["NodeCommits"]

logger = logging.getLogger("resihp.agent")

#: how long the first executor's request waits for the node's others before the batch
#: leaves without them (they follow in a batch of their own: the counter sums)
LINGER_S = 0.002
#: iterations whose verdicts are kept for stragglers
KEEP = 8


@dataclass
class _Iteration:
    """One (generation, iteration) on this node."""

    executors: int
    pending: list[tuple[CommitRequest, asyncio.Future[str]]] = field(default_factory=list)
    waiting: list[asyncio.Future[str]] = field(default_factory=list)
    checker: asyncio.Future[str] | None = None  # a waiting executor that must check before a commit
    verdict: str | None = None
    watched: bool = False  # a store wait for the verdict is under way
    flush: asyncio.TimerHandle | None = None


@dataclass
class CommitStats:
    requests: int = 0  # executors' commit requests served
    batches: int = 0  # store requests that posted reports, added to a counter and waited for the verdict
    verdict_waits: int = 0  # separate store waits for a verdict (after an executor was told to decide)
    refused: int = 0  # requests refused as malformed or forged


class NodeCommits:
    """Serves the commit connections of one node's workers (on the agent's loop).

    :param node: this node's id (the store identity ``agent:<node>``).
    :param credential: this node's credential (the store accepts it for this node).
    """

    def __init__(self, node: int, credential: str, *, linger_s: float = LINGER_S,
                 on_wait: Callable[[int, bool], None] | None = None) -> None:
        self.node, self._credential, self.linger_s = node, credential, linger_s
        self.on_wait = on_wait  # (device, waiting): a device's wait for a verdict began / ended
        self.store_address: str | None = None
        self.stats = CommitStats()
        self._free: list[WireStore] = []
        self._threads = ThreadPoolExecutor(16, thread_name_prefix=f"resihp-node{node}-commit")
        self._iterations: dict[tuple[int, int], _Iteration] = {}
        self._connections = 0
        self._writers: set[asyncio.StreamWriter] = set()

    # ------------------------------------------------------------ set-up
    def use_store(self, address: str) -> None:
        """The job store this node's workers commit to (from the controller's launch)."""
        if address != self.store_address:
            self.store_address = address
            for s in self._free:
                s.close()
            self._free.clear()

    def close(self) -> None:
        for w in list(self._writers):
            w.close()
        for s in self._free:
            s.close()
        self._free.clear()
        self._threads.shutdown(wait=False, cancel_futures=True)

    def _store(self) -> WireStore:
        if self._free:
            return self._free.pop()
        assert self.store_address is not None
        return WireStore(self.store_address, self._credential, f"agent:{self.node}",
                         timeout_s=600.0, connect_timeout_s=30.0)

    # ------------------------------------------------------------ one worker's connection
    async def serve(self, device: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer ``device``'s commit requests, one at a time, until it closes."""
        self._connections += 1
        self._writers.add(writer)
        try:
            while True:
                msg = await read_msg(reader)
                if msg is None:
                    return
                if self.store_address is None:  # answered before anything is added: it commits itself
                    await write_msg(writer, Error("no_store", f"agent {self.node} has no job store to commit to"))
                    return
                if not isinstance(msg, CommitRequest) or msg.report.device != device:
                    self.stats.refused += 1
                    logger.warning("event=commit_refused node=%d device=%d reason=%r", self.node, device,
                                   f"a {type(msg).__name__} for device "
                                   f"{getattr(getattr(msg, 'report', None), 'device', '?')}")
                    return
                try:
                    if self.on_wait is not None:
                        self.on_wait(device, True)
                    try:
                        verdict = await self._commit(msg)
                    finally:
                        if self.on_wait is not None:
                            self.on_wait(device, False)
                except ValueError as e:  # disagreeing executor counts
                    self.stats.refused += 1
                    logger.warning("event=commit_refused node=%d device=%d reason=%r", self.node, device, str(e))
                    return
                await write_msg(writer, CommitVerdict(msg.report.generation, msg.report.iteration, verdict))
        except (ProtocolError, ConnectionError, OSError, WireError) as e:
            # The worker reads the verdict from the store itself (its add may have landed).
            logger.info("event=commit_connection_closed node=%d device=%d reason=%r", self.node, device, str(e))
        finally:
            self._connections -= 1
            self._writers.discard(writer)

    # ------------------------------------------------------------ batching
    def _commit(self, req: CommitRequest) -> asyncio.Future[str]:
        key = (req.report.generation, req.report.iteration)
        it = self._iterations.get(key)
        if it is None:
            it = self._iterations[key] = _Iteration(req.executors)
            self._prune()
        if req.executors != it.executors:
            raise ValueError(f"device {req.report.device} counts {req.executors} executors of iteration "
                             f"{key[1]} in generation {key[0]}, its node's others {it.executors}")
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.stats.requests += 1
        if it.verdict is not None:
            fut.set_result(it.verdict)  # a straggler of a decided iteration: its add changes nothing
            return fut
        it.pending.append((req, fut))
        if len(it.pending) >= self._connections:  # every connected executor asked: go now
            self._flush(key)
        elif it.flush is None:
            it.flush = asyncio.get_running_loop().call_later(self.linger_s, self._flush, key)
        return fut

    def _prune(self) -> None:
        while len(self._iterations) > KEEP:
            old = next(iter(self._iterations))
            it = self._iterations[old]
            if it.pending or it.waiting:
                return
            del self._iterations[old]

    def _flush(self, key: tuple[int, int]) -> None:
        it = self._iterations[key]
        if it.flush is not None:
            it.flush.cancel()
            it.flush = None
        batch, it.pending = it.pending, []
        if batch:
            asyncio.get_running_loop().create_task(self._send(key, it, batch))

    async def _send(self, key: tuple[int, int], it: _Iteration,
                    batch: list[tuple[CommitRequest, asyncio.Future[str]]]) -> None:
        """Post the batch's reports and its add, and wait for the verdict, in one store
        request (:func:`session.commit_batch`): a node whose add does not complete the
        count is parked in the store until the verdict exists. The batch that completes
        it commits there, unless an executor of this node must check first: that one is
        told ``decide`` and the rest wait for what it decides."""
        loop = asyncio.get_running_loop()
        reqs = [r for r, _ in batch]
        futs = [f for _, f in batch]
        if it.checker is None:
            it.checker = next((f for r, f in batch if r.check), None)
        try:
            verdict = await loop.run_in_executor(self._threads, self._add, key, reqs, it.executors,
                                                 it.checker is None)
        except Exception as e:  # noqa: BLE001 - store lost: each worker reads the verdict itself
            for f in futs:
                if not f.done():
                    f.set_exception(WireError(f"node {self.node}: {e}"))
            return
        self.stats.batches += 1
        if verdict is None:  # held and no controller came: aborted
            self._resolve(it, futs, session.CommitResult.ABORTED)
            return
        if verdict != session.DECIDE:
            self._resolve(it, futs, verdict)
            return
        checker = it.checker
        assert checker is not None  # the store decides itself when no executor checks
        if not checker.done():
            checker.set_result("decide")  # it runs its check and decides
        if checker in it.waiting:
            it.waiting.remove(checker)
        it.waiting.extend(f for f in futs if f is not checker)
        if it.verdict is not None:  # read while this batch was being added
            self._resolve(it, [], it.verdict)
            return
        if it.waiting and not it.watched:
            it.watched = True
            wait_s = max(r.wait_s for r in reqs)
            try:
                verdict = await loop.run_in_executor(self._threads, self._await, key, wait_s)
            except Exception as e:  # noqa: BLE001
                it.watched = False
                waiting, it.waiting = it.waiting, []
                for f in waiting:
                    if not f.done():
                        f.set_exception(WireError(f"node {self.node}: {e}"))
                return
            self._resolve(it, [], verdict)

    def _resolve(self, it: _Iteration, futs: list[asyncio.Future[str]], verdict: str) -> None:
        it.verdict = verdict
        waiting, it.waiting = it.waiting, []
        for f in futs + waiting:
            if not f.done():
                f.set_result(verdict)

    # ------------------------------------------------------------ on the store (threads)
    def _with_store(self, fn: Callable[[WireStore], T]) -> T:
        """``fn`` on a store connection of the pool (one request at a time each)."""
        store = self._store()
        try:
            out = fn(store)
        except BaseException:
            store.close()
            raise
        self._free.append(store)
        return out

    def _add(self, key: tuple[int, int], reqs: list[CommitRequest], executors: int, may_decide: bool) -> str | None:
        """The batch's :func:`session.commit_batch`: its verdict, ``decide``, or None when
        held without a controller (aborted)."""
        hold = max(r.hold_s for r in reqs)
        wait_s = max(r.wait_s for r in reqs)

        def run(store: WireStore) -> str | None:
            if hold > 0 and not session.wait_controller(store, hold):
                session.decide(store, *key, check=lambda: False)  # abort, unless committed already
                return None
            return session.commit_batch(store, *key, [r.report for r in reqs], executors, may_decide=may_decide,
                                        timeout_s=wait_s, fingerprints={r.report.device: r.fingerprint for r in reqs
                                                                        if r.fingerprint is not None})

        return self._with_store(run)

    def _await(self, key: tuple[int, int], wait_s: float) -> str:
        self.stats.verdict_waits += 1
        started = time.monotonic()
        verdict = self._with_store(lambda store: session.await_verdict(store, *key, wait_s))
        logger.debug("node %d: verdict %s of %s after %.3f s", self.node, verdict, key, time.monotonic() - started)
        return verdict
