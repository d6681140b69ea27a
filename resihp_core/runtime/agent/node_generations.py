"""The node's generation watch: one blocked store wait per node tells every worker of
the node that a newer plan generation is posted (the worker's half:
:class:`resihp_core.runtime.worker.GenerationWatch`).

Why: each worker notices a superseded generation mid-iteration through a watch that
blocks in the job store on the next generation's plan key. Made by every worker, that
is one store connection and one parked wait per rank (16,384 at 16,384 ranks), and each
rank then reads the new plan (164 KB at 16,384 ranks) from the store; relayed by the
agent it is one wait and one plan read per node, and the workers hear of it over
their node-local connection to the agent (docs/worker-protocol.md, "The generation watch through the
node agent").

A worker's watch connection identifies as ``generation:<device>:<rank>:<pid>``; the
agent answers ``Ack(generation=g, what="generation")`` with the newest generation it
knows at once (if any is posted), again at each newer one, and at least every
``wait_s`` (30 s) while nothing changes (a worker takes a silent agent for a frozen
one and watches the store itself). After each notice it sends the generation's
:class:`~resihp_core.protocol.PlanUpdate`, read once for the node: a worker entering
the generation takes it from there instead of reading it from the store (N reads of a
plan that grows with N would be N² bytes through the one store host). It answers
``Error("no_store")`` and closes when it has no job store (or lost it): the worker then
watches the store itself, as it does when the agent goes away. A worker sends nothing
on this connection; anything it sends is refused, counted and the connection closed.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import threading
from dataclasses import dataclass

from resihp_core.protocol import Ack, Error, ProtocolError, encode_frame, read_msg, write_msg
from resihp_core.protocol.framing import HEADER_BYTES, MAX_FRAME_BYTES
from resihp_core.runtime import session
from resihp_core.runtime.store_wire import WireError, WireStore

__all__ = ["NodeGenerations", "WatchStats"]

_LENGTH = struct.Struct(">I")  # the frame header of resihp_core.protocol.framing
assert _LENGTH.size == HEADER_BYTES


def frame_bytes(payload: bytes) -> bytes:
    """A frame of an already encoded message (a plan as the store holds it)."""
    return _LENGTH.pack(len(payload)) + payload

logger = logging.getLogger("resihp.agent")


@dataclass
class WatchStats:
    subscribers: int = 0  # worker watch connections open now
    notices: int = 0  # generation notices written to workers
    store_waits: int = 0  # blocked store waits made (one per generation or per wait_s)
    plan_reads: int = 0  # plans read from the store (one per generation)
    plans_sent: int = 0  # plans handed to workers
    refused: int = 0  # connections that sent something (a worker sends nothing here)


class NodeGenerations:
    """Relays the newest plan generation to one node's workers (on the agent's loop).

    :param node: this node's id (the store identity ``agent:<node>``).
    :param credential: this node's credential.
    :param wait_s: one store request per ``wait_s`` while nothing changes.
    """

    def __init__(self, node: int, credential: str, *, wait_s: float = 30.0) -> None:
        self.node, self._credential, self.wait_s = node, credential, wait_s
        self.store_address: str | None = None
        self.latest = -1  # the newest generation the watch read (-1: none yet)
        self.plan: tuple[int, bytes] | None = None  # the newest generation and its plan's frame, read once
        self.stats = WatchStats()
        self._writers: set[asyncio.StreamWriter] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._store: WireStore | None = None
        self._stop: threading.Event | None = None
        self._failed = False  # the store watch ended: workers watch the store themselves

    # ------------------------------------------------------------ set-up
    def use_store(self, address: str) -> None:
        """Watch the job store at ``address`` (call on the agent's loop)."""
        if address == self.store_address and not self._failed:
            return
        self._end_watch()
        self.store_address, self._failed = address, False
        self._loop = asyncio.get_running_loop()
        self._stop = stop = threading.Event()
        threading.Thread(target=self._watch, args=(address, stop), daemon=True,
                         name=f"resihp-node{self.node}-generation").start()

    def close(self) -> None:
        self._end_watch()
        for w in list(self._writers):
            w.close()

    def _end_watch(self) -> None:
        if self._stop is not None:
            self._stop.set()
        store, self._store = self._store, None
        if store is not None:
            store.close()  # breaks the blocked wait

    # ------------------------------------------------------------ the store side (a thread)
    def _watch(self, address: str, stop: threading.Event) -> None:
        try:
            store = WireStore(address, self._credential, f"agent:{self.node}", timeout_s=self.wait_s + 30.0,
                              connect_timeout_s=30.0)
        except (OSError, WireError) as e:
            self._ended(stop, e)
            return
        if stop.is_set():
            store.close()
            return
        self._store = store
        try:
            latest = session.latest_generation(store)
            self._notice(stop, latest)
            self._relay_plan(stop, store, latest)
            while not stop.is_set():
                self.stats.store_waits += 1
                if session.wait_posted(store, latest + 1, self.wait_s):
                    # The newest, not the next (plan/<g> is written before plan/latest,
                    # which exists once any generation's does: one read, not a check and a read).
                    latest = max(latest + 1, int(store.get(session.PLAN_LATEST)) if latest >= 0
                                 else session.latest_generation(store))
                    self._notice(stop, latest)
                    self._relay_plan(stop, store, latest)
                else:  # nothing new: say so anyway, a worker takes a silent agent for a frozen one
                    self._notice(stop, latest, again=True)
        except Exception as e:  # noqa: BLE001 - the store went away (or the watch was ended)
            self._ended(stop, e)

    def _notice(self, stop: threading.Event, generation: int, again: bool = False) -> None:
        if generation >= 0 and not stop.is_set() and self._loop is not None:
            self._loop.call_soon_threadsafe(self._broadcast, stop, generation, again)

    def _relay_plan(self, stop: threading.Event, store: WireStore, generation: int) -> None:
        """Read generation ``generation``'s plan once for the node and hand it to its
        workers as it is stored (a ``PlanUpdate``'s encoding: the agent does not decode
        it, each worker decodes and checks it as it would from the store; they read it
        from the store themselves if it does not come)."""
        if generation < 0 or stop.is_set() or self._loop is None:
            return
        raw = session.plan_bytes(store, generation)
        self.stats.plan_reads += 1
        if len(raw) > MAX_FRAME_BYTES:  # the workers read it from the store themselves
            logger.warning("event=plan_not_relayed node=%d generation=%d bytes=%d", self.node, generation, len(raw))
            return
        self._loop.call_soon_threadsafe(self._broadcast_plan, stop, generation, frame_bytes(raw))

    def _ended(self, stop: threading.Event, exc: BaseException) -> None:
        if not stop.is_set() and self._loop is not None:
            logger.info("event=generation_watch_lost node=%d reason=%r", self.node, str(exc))
            self._loop.call_soon_threadsafe(self._lost, stop)

    # ------------------------------------------------------------ the workers' side (the loop)
    def _broadcast(self, stop: threading.Event, generation: int, again: bool = False) -> None:
        if stop.is_set() or generation < self.latest or (generation == self.latest and not again):
            return
        self.latest = generation
        frame = encode_frame(Ack(generation=generation, what=session.GENERATION_NOTICE))
        for w in list(self._writers):
            if not w.is_closing():
                w.write(frame)
                self.stats.notices += 1

    def _broadcast_plan(self, stop: threading.Event, generation: int, frame: bytes) -> None:
        if stop.is_set() or (self.plan is not None and generation <= self.plan[0]):
            return
        self.plan = (generation, frame)
        for w in list(self._writers):
            if not w.is_closing():
                w.write(frame)
                self.stats.plans_sent += 1

    def _lost(self, stop: threading.Event) -> None:
        """The store watch ended: the workers watch the store themselves from now on."""
        if stop is not self._stop:
            return
        self._failed = True
        for w in list(self._writers):
            w.close()

    async def serve(self, device: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """``device``'s watch connection: the newest generation now and at each newer one."""
        if self.store_address is None or self._failed:
            await write_msg(writer, Error("no_store", f"agent {self.node} watches no job store"))
            writer.close()
            return
        self._writers.add(writer)
        self.stats.subscribers += 1
        try:
            if self.latest >= 0:
                await write_msg(writer, Ack(generation=self.latest, what=session.GENERATION_NOTICE))
                self.stats.notices += 1
            if self.plan is not None:
                writer.write(self.plan[1])
                await writer.drain()
                self.stats.plans_sent += 1
            msg = await read_msg(reader)
            if msg is not None:
                self.stats.refused += 1
                logger.warning("event=generation_watch_refused node=%d device=%d reason=%r", self.node, device,
                               f"a worker sent a {type(msg).__name__} on its watch connection")
        except (ProtocolError, ConnectionError, OSError) as e:
            logger.info("event=generation_watch_closed node=%d device=%d reason=%r", self.node, device, str(e))
        finally:
            self.stats.subscribers -= 1
            self._writers.discard(writer)
            writer.close()
