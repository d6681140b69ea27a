"""The controller: the Detector's central part (docs/design.md §3).

A :class:`Controller` accepts one persistent, authenticated connection per node agent
(identity ``agent:<node>``) and

* keeps each node's latest :class:`~resihp_core.protocol.AgentState` — its cost grows
  with the number of nodes, not devices;
* declares **fail-stop**: a worker an agent reports dead (missed beats, lost
  connection, process exit, hang), and *every* device of a node whose agent's
  connection drops (at once) or that sends nothing for ``agent_timeout_s`` (a silent
  partition);
* runs the **fail-slow** pipeline: it gathers the per-rank
  :class:`~resihp_core.protocol.IterationProfile` s forwarded by the agents, and once
  every expected rank has reported an iteration it hands that iteration to a
  :class:`~resihp_core.detector.FailSlowDetector` (by default
  :func:`~resihp_core.detector.failslow.build_failslow_detector` from the
  configuration), on a worker thread so a verification never delays heartbeat
  handling;
* publishes what it learns to one sink (:mod:`resihp_core.protocols.events`): every
  :class:`~resihp_core.protocol.FailureReport` (also logged as one structured line),
  each fail-slow :class:`~resihp_core.detector.Detection`, each agent's
  :class:`~resihp_core.protocol.WorkerProcess` (a worker started or ended), a node lost
  (:class:`~resihp_core.protocols.events.NodeLost`) or back
  (:class:`~resihp_core.protocols.events.NodeBack`). Without a sink they are kept in an
  :class:`~resihp_core.protocols.events.EventLog` (:attr:`Controller.sink`).

Each device is reported fail-stopped once per plan generation; :meth:`Controller.set_generation`
starts a new one (new series for the fail-slow detector, with the new plan).

It is also the launcher's switchboard: :meth:`Controller.send` delivers a
:class:`~resihp_core.protocol.LaunchWorkers` or
:class:`~resihp_core.protocol.SignalWorker` to a node's agent; the job routes the
``WorkerProcess`` and ``NodeLost`` events to
:class:`~resihp_core.runtime.processes.AgentProcesses`.

The Scheduler side (what to do with a report) is not here.

Run it alone (reports printed as JSON lines)::

    RESIHP_SECRET=... python -m resihp_core.runtime.controller [--host H] [--port P] [--address-file F]
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Mapping

from resihp_core.config import DetectorConfig
from resihp_core.protocol import (
    Ack,
    LinkProbe,
    AgentState,
    AuthError,
    Error,
    FailureReport,
    Hello,
    IterationProfile,
    ProfileBatch,
    Message,
    NodeRejoin,
    ProtocolError,
    WorkerProcess,
    WorkerSummary,
    node_credential,
    read_msg,
    server_handshake,
    write_msg,
)
from resihp_core.protocols.events import ControllerEvent, EventLog, NodeBack, NodeLost, Sink
from resihp_core.runtime.gate import MAX_PENDING_HANDSHAKES, PreAuthGate
from resihp_core.runtime.heartbeat import ANNOUNCE, BYE

if TYPE_CHECKING:
    from resihp_core.detector import Detection, FailSlowDetector
    from resihp_core.plan import ParallelPlan
    from resihp_core.plugins import Plugins

__all__ = ["Controller", "NodeView", "main"]

logger = logging.getLogger("resihp.controller")


@dataclass
class NodeView:
    """What the controller knows about one node."""

    node: int
    connected: bool = True
    finished: bool = False
    last_seen: float = 0.0  # controller's monotonic clock
    state: AgentState | None = None
    devices: set[int] = field(default_factory=set)  # every device ever reported by its agent
    running: set[int] = field(default_factory=set)  # workers its agent launched and saw no end of
    environment: float = 0.0  # CPU contention its agent's probe last measured (0 = none)
    paused: set[int] = field(default_factory=set)  # devices whose workers are stopped, fenced, not killed

    def workers(self) -> dict[int, WorkerSummary]:
        return {w.device: w for w in self.state.workers} if self.state is not None else {}


class Controller:
    """The job's detector hub (see the module docstring).

    :param config: detector settings (heartbeat interval and miss limit set the default
        agent timeout; the fail-slow settings build the default detector).
    :param secret: the job secret.
    :param host, port: where agents connect (loopback by default; port 0 = any).
    :param sink: called on the controller's loop with each event (see the module
        docstring); None: an :class:`~resihp_core.protocols.events.EventLog`.
    :param plugins: the plugins the default fail-slow detector is built with.
    :param failslow: the fail-slow detector (any :class:`FailSlowDetector`, e.g. from
        :func:`~resihp_core.detector.failslow.build_failslow_detector` with a plan-aware
        model and a prober); None: built from ``config``; ``False``: no fail-slow
        detection.
    :param agent_timeout_s: a node whose agent sent nothing for this long is lost;
        default ``max(10.0, 2 x miss_limit x interval)`` (agents send every interval).
    :param expected_ranks: ranks whose profiles make an iteration complete; default: the
        ranks the agents report alive.
    :param node_devices: the job's topology, node id -> its devices: an agent of another
        node is refused at the handshake, and a message about a device of another node
        is dropped and logged (``event=identity_violation``). None: any node id (tests).
    :param handshake_timeout, max_pending_handshakes: bounds on connections that have
        not authenticated yet (see :mod:`resihp_core.runtime.gate`).
    :param incarnation: this controller process's id, announced to every agent as it
        connects (``Ack(what="controller:<id>")``): an agent that lost its controller
        re-attaches its live workers to a new incarnation and fences them for the same
        one (docs/failover.md). "": no announcement.
    """

    def __init__(
        self,
        config: DetectorConfig | None = None,
        secret: str | bytes = "",
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        sink: Sink | None = None,
        plugins: Plugins | None = None,
        failslow: FailSlowDetector | None | bool = None,
        generation: int = 0,
        agent_timeout_s: float | None = None,
        expected_ranks: set[int] | None = None,
        handshake_timeout: float = 5.0,
        max_pending_handshakes: int = MAX_PENDING_HANDSHAKES,
        node_devices: Mapping[int, Iterable[int]] | None = None,
        incarnation: str = "",
    ) -> None:
        if not secret:
            raise ValueError("the job secret must not be empty")
        self.config = config or DetectorConfig()
        self._secret = secret
        self.host, self.port = host, port
        self.sink: Sink = EventLog() if sink is None else sink
        self._plugins = plugins
        self.generation = generation
        # A dead agent is seen at once (its connection closes); the timeout only catches a
        # silent partition, so it errs long: 1 s falsely lost agents on a loaded 2-core machine.
        self.agent_timeout_s = agent_timeout_s or self.config.agent_silence()
        self.handshake_timeout = handshake_timeout
        self.expected_ranks = set(expected_ranks) if expected_ranks else None
        self._failslow_arg = failslow
        self.failslow: FailSlowDetector | None = None
        self.nodes: dict[int, NodeView] = {}
        self.messages = 0
        self._stopped: set[int] = set()  # devices reported fail-stopped, until seen alive again
        self._alive: set[int] | None = None  # _alive_ranks, until what it reads changes
        self._pending: dict[int, dict[int, IterationProfile]] = {}
        self._done_iters: set[int] = set()
        self._last_complete = -1
        self._fs_queue: asyncio.Queue[tuple[int, int, dict[int, IterationProfile], dict[int, float]]] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._conns: dict[int, asyncio.StreamWriter] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="resihp-failslow")
        self._loop: asyncio.AbstractEventLoop | None = None
        self.address: tuple[str, int] | None = None
        self._stopping = False
        self.node_devices: dict[int, frozenset[int]] | None = (
            None if node_devices is None else {int(n): frozenset(ds) for n, ds in node_devices.items()})
        self.rejected = 0  # messages dropped because they spoke about another node's devices
        self.malformed = 0  # agent connections closed for a frame that is not a valid message
        self._gate = PreAuthGate("controller", max_pending_handshakes)
        self.incarnation = incarnation
        self._echoes: dict[tuple[int, int], asyncio.Future[None]] = {}  # (node, seq) -> its link probe's echo
        self._echo_seq = 0

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> tuple[str, int]:
        self._loop = asyncio.get_running_loop()
        self._fs_queue = asyncio.Queue()
        if self._failslow_arg is None or self._failslow_arg is True:
            from resihp_core.detector.failslow import build_failslow_detector

            self.failslow = build_failslow_detector(self.config, plugins=self._plugins, generation=self.generation)
        elif self._failslow_arg is not False:
            self.failslow = self._failslow_arg  # type: ignore[assignment]
        if self.failslow is not None and getattr(self.failslow, "prober", False) is None:
            # Without a prober a slow link that every rank waits on cannot be localised
            # (docs/detector.md "Slow links"): time each host's link through its agent.
            from resihp_core.runtime.controller.linkprobe import NodeLinkProber

            self.failslow.prober = NodeLinkProber(self)  # type: ignore[attr-defined]
        self._server = await asyncio.start_server(self._serve_agent, self.host, self.port)
        sock = self._server.sockets[0].getsockname()
        self.address = (sock[0], sock[1])
        self._tasks = [
            asyncio.create_task(self._failslow_loop(), name="controller-failslow"),
        ]
        logger.info("event=controller_started address=%s:%d generation=%d", *self.address, self.generation)
        return self.address

    async def stop(self) -> None:
        self._stopping = True
        self._gate.close_all()
        if self._server is not None:
            self._server.close()
        for t in self._tasks:
            t.cancel()
        for w in list(self._conns.values()):
            w.close()
        # Let the connection handlers see the closed streams and end by themselves: a
        # handler cancelled inside asyncio's start_server callback is logged as an error
        # by Python 3.11.
        handlers = list(self._handlers)
        if handlers:
            _, pending = await asyncio.wait(handlers, timeout=1.0)
            for t in pending:
                t.cancel()
        await asyncio.gather(*self._tasks, *handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
        self._pool.shutdown(wait=False)

    async def finish(self, timeout: float = 10.0) -> list[int]:
        """End the job for every connected agent: each is told goodbye, reaps its
        workers and leaves (exit status 0). Returns the nodes still connected after
        ``timeout`` seconds."""
        self._stopping = True
        for node, w in list(self._conns.items()):
            with contextlib.suppress(Exception):
                await write_msg(w, Ack(what=BYE))
        deadline = time.monotonic() + timeout
        while self._conns and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._conns:
            logger.warning("event=agents_linger nodes=%s", sorted(self._conns))
        return sorted(self._conns)

    @property
    def address_text(self) -> str:
        assert self.address is not None, "controller not started"
        return f"{self.address[0]}:{self.address[1]}"

    # ------------------------------------------------------------ agents' launchers
    async def send(self, node: int, msg: Message) -> None:
        """Deliver ``msg`` to node ``node``'s agent; ``ConnectionError`` if it is not connected."""
        writer = self._conns.get(node)
        if writer is None:
            raise ConnectionError(f"the agent of node {node} is not connected")
        await write_msg(writer, msg)

    async def echo_nodes(self, nodes: Iterable[int], nbytes: int, rounds: int, timeout_s: float,
                         clear_s: float = 0.5) -> dict[int, float]:
        """Seconds of the fastest of ``rounds`` round trips of ``nbytes`` through each
        node's agent (all nodes at once); ``timeout_s`` for a node that does not answer.
        A node ``clear_s`` slower than the fastest after a round is not probed again."""
        loop = asyncio.get_running_loop()
        payload = os.urandom(nbytes)
        nodes = sorted(set(nodes))
        best: dict[int, float] = {}

        async def one(node: int) -> float:
            self._echo_seq += 1
            key = (node, self._echo_seq)
            fut: asyncio.Future[None] = loop.create_future()
            self._echoes[key] = fut
            t0 = time.monotonic()
            try:
                await self.send(node, LinkProbe(seq=key[1], payload=payload))
                await asyncio.wait_for(fut, timeout_s)
                return time.monotonic() - t0
            except (ConnectionError, OSError, asyncio.TimeoutError):
                return timeout_s
            finally:
                self._echoes.pop(key, None)

        for _ in range(max(1, rounds)):
            # Another round only for nodes that may be jitter: one far above the fastest
            # (``clear_s``) or timed out is slow enough, and each round on it takes that long.
            fastest = min(best.values(), default=0.0)
            todo = [n for n in nodes if best.get(n, 0.0) < min(timeout_s, fastest + clear_s)]
            got = await asyncio.gather(*(one(n) for n in todo))
            for n, t in zip(todo, got):
                best[n] = min(best.get(n, t), t)
        return best

    def node_of(self, devices: Iterable[int]) -> dict[int, int]:
        """Device -> the node whose connected agent runs it (devices of no connected node left out)."""
        out: dict[int, int] = {}
        for node, view in self.nodes.items():
            if view.connected:
                for d in view.devices:
                    out[d] = node
        return {d: out[d] for d in devices if d in out}

    async def wait_for_agents(self, nodes: set[int], timeout: float) -> None:
        """Return once an agent of every node in ``nodes`` is connected, else raise
        ``TimeoutError`` naming the missing nodes."""
        deadline = time.monotonic() + timeout
        while not nodes <= self._conns.keys():
            if time.monotonic() > deadline:
                missing = sorted(nodes - self._conns.keys())
                raise TimeoutError(f"no agent connected for node(s) {missing} within {timeout:.0f} s")
            await asyncio.sleep(0.02)

    def connected_nodes(self) -> set[int]:
        """Nodes whose agent is connected now."""
        return set(self._conns)

    def workers_up(self) -> set[int]:
        """Devices whose workers connected agents report alive (heartbeating)."""
        out: set[int] = set()
        for v in self.nodes.values():
            if v.connected:
                out |= {d for d, w in v.workers().items() if w.alive and w.reason != "finished"}
        return out

    # ------------------------------------------------------------ generations
    def set_generation(self, generation: int, *, plan: ParallelPlan | None = None,
                       speeds: Mapping[int, float] | None = None,
                       expected_ranks: set[int] | None = None) -> None:
        """A new plan generation: the fail-slow series restarts with ``plan`` (and the
        known slow ``speeds``). A device reported fail-stopped stays reported across
        generations until a worker of it is seen alive again (relaunched, resumed), so
        each failure is reported and logged once. Call on the loop."""
        self.generation = generation
        self._pending.clear()
        self._done_iters.clear()
        self._last_complete = -1
        if expected_ranks is not None:
            self.expected_ranks = set(expected_ranks)
            self._alive = None
        if self.failslow is not None:
            fs = self.failslow
            self._pool.submit(fs.reset, generation, plan=plan, speeds=speeds)

    # ------------------------------------------------------------ reports
    def _publish(self, event: ControllerEvent) -> None:
        try:
            self.sink(event)
        except Exception:  # noqa: BLE001 - an observer's bug must not stop detection
            logger.exception("the controller's event sink failed on %s", type(event).__name__)

    def _emit(self, report: FailureReport) -> None:
        logger.info(  # the console says it once, through the job's events
            "event=failure_report generation=%d failure=%s devices=%s cause=%s evidence=%r",
            report.generation, report.failure, list(report.devices), report.cause, report.evidence,
        )
        self._publish(report)

    def _fail_stop(self, devices: list[int], evidence: str, paused: Iterable[int] = ()) -> None:
        new = sorted(d for d in devices if d not in self._stopped)
        if not new:
            return
        self._stopped.update(new)
        self._alive = None
        self._emit(FailureReport(
            generation=self.generation, failure="fail-stop", devices=tuple(new),
            evidence=evidence[:4000], time=max(0.0, time.time()),
            paused=tuple(d for d in new if d in set(paused)),
        ))

    # ------------------------------------------------------------ agents
    async def _serve_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        node: int | None = None
        why = "connection closed"
        try:
            if not self._gate.admit(writer):
                return
            try:
                try:
                    hello = await server_handshake(reader, writer, self._agent_key, timeout=self.handshake_timeout)
                finally:
                    self._gate.done(writer)
                node = self._agent_node(hello)
            except AuthError as e:
                if not self._stopping:
                    logger.warning("event=auth_refused listener=controller reason=%r", str(e))
                return
            view = self.nodes.get(node)
            if view is not None and view.connected and node in self._conns:
                await write_msg(writer, Error("duplicate-node", f"an agent for node {node} is already connected"))
                node = None
                return
            back = view is not None and not view.connected and not view.finished
            self.nodes[node] = view = view or NodeView(node)
            view.connected, view.finished, view.last_seen = True, False, time.monotonic()
            self._alive = None
            self._conns[node] = writer
            logger.info("event=agent_connected node=%d", node)
            if self.incarnation:
                await write_msg(writer, Ack(what=ANNOUNCE + self.incarnation))
            if back:  # lost earlier: its old workers are gone (fenced, or died with the old agent)
                view.state = None  # what it said before it was cut off is stale
                self._offer(view, ())
            why = await self._agent_messages(view, reader)
        except (ProtocolError, ConnectionError, OSError) as e:
            why = f"connection error: {e!r}"
            if isinstance(e, ProtocolError) and node is not None:
                self.malformed += 1
                logger.warning("event=malformed_message node=%d error=%r", node, str(e))
        except asyncio.CancelledError:
            why = ""
            raise
        finally:
            if task is not None:
                self._handlers.discard(task)
            writer.close()
            if node is not None and self._conns.get(node) is writer:
                del self._conns[node]
                view = self.nodes[node]
                view.connected = False
                self._alive = None
                if why and not view.finished and not self._stopping:
                    self._node_lost(view, why)

    async def _agent_messages(self, view: NodeView, reader: asyncio.StreamReader) -> str:
        while True:
            try:
                msg = await read_msg(reader, self.agent_timeout_s)
            except TimeoutError:
                return f"agent silent for {self.agent_timeout_s:.2f} s"
            if msg is None:
                return "agent connection closed"
            self.messages += 1
            view.last_seen = time.monotonic()
            if isinstance(msg, AgentState):
                if self._foreign(view, msg, [w.device for w in msg.workers]):
                    continue
                self._on_state(view, msg)
            elif isinstance(msg, IterationProfile):
                if self._foreign(view, msg, [msg.device]):
                    continue
                self._on_profile(msg)
            elif isinstance(msg, ProfileBatch):
                if self._foreign(view, msg, [p.device for p in msg.profiles]):
                    continue
                for p in msg.profiles:
                    self._on_profile(p)
            elif isinstance(msg, FailureReport):
                if self._foreign(view, msg, list(msg.devices) + list(msg.throughput)):
                    continue
                self._emit(msg)
            elif isinstance(msg, WorkerProcess):
                if msg.node != view.node:
                    logger.warning("event=identity_violation node=%d claimed_node=%d message=WorkerProcess",
                                   view.node, msg.node)
                    self.rejected += 1
                    continue
                if self._foreign(view, msg, [msg.device]):
                    continue
                if msg.returncode is None and not msg.error:
                    view.devices.add(msg.device)
                    view.running.add(msg.device)
                else:
                    view.running.discard(msg.device)
                self._publish(msg)
            elif isinstance(msg, LinkProbe):
                fut = self._echoes.get((view.node, msg.seq))
                if fut is not None and not fut.done() and msg.node == view.node:
                    fut.set_result(None)
            elif isinstance(msg, NodeRejoin):
                if msg.node != view.node:
                    logger.warning("controller: agent of node %d offered node %d", view.node, msg.node)
                    self.rejected += 1
                    continue
                self._offer(view, msg.devices)
            elif isinstance(msg, Ack) and msg.what == BYE:
                view.finished = True
                logger.info("event=agent_left node=%d", view.node)
                return ""
            else:
                logger.debug("controller: ignoring %s from node %d", type(msg).__name__, view.node)

    def _agent_key(self, hello: Hello) -> str:
        """The key an agent must prove: its node's credential, for a node of the job."""
        node = self._parse_agent(hello)
        if self.node_devices is not None and node not in self.node_devices:
            raise AuthError(f"node {node} is not in the job's topology (nodes {sorted(self.node_devices)})")
        return node_credential(self._secret, node)

    @staticmethod
    def _parse_agent(hello: Hello) -> int:
        role, _, ident = hello.identity.partition(":")
        if hello.role != "agent" or role != "agent" or not ident.isdigit() or len(ident) > 9:
            raise AuthError(f"bad identity: expected agent:<node>, got {hello.identity!r}")
        return int(ident)

    def _agent_node(self, hello: Hello) -> int:
        return self._parse_agent(hello)

    def _foreign(self, view: NodeView, msg: Message, devices: list[int]) -> bool:
        """True (and logged) if ``msg`` speaks about devices outside the agent's node."""
        if self.node_devices is None:
            return False
        own = self.node_devices.get(view.node, frozenset())
        bad = sorted({d for d in devices if d not in own})
        if not bad:
            return False
        logger.warning("event=identity_violation node=%d message=%s foreign_devices=%s own_devices=%s",
                       view.node, type(msg).__name__, bad, sorted(own))
        self.rejected += 1
        return True

    def _offer(self, view: NodeView, devices: tuple[int, ...], *, only: bool = False) -> None:
        """A node cut off earlier is back: offer its devices to be planned in again
        (``only``: just ``devices``, e.g. workers back from a pause)."""
        devs = tuple(sorted(set(devices) if only else set(devices) | view.devices))
        logger.warning("event=node_back node=%d devices=%s", view.node, list(devs))
        if devs:
            self._publish(NodeBack(view.node, devs))

    def _on_state(self, view: NodeView, state: AgentState) -> None:
        if state.node != view.node:
            logger.warning("controller: agent of node %d sent a state for node %d", view.node, state.node)
            self.rejected += 1
            return
        if view.state is None or _liveness(view.state) != _liveness(state):
            self._alive = None
        view.state = state
        view.environment = state.environment
        dead = []
        for w in state.workers:
            view.devices.add(w.device)
            if not w.alive:
                dead.append(w)
            elif w.reason != "finished" and w.device in self._stopped:
                self._stopped.discard(w.device)  # a new life of the device: its next failure is news
                self._alive = None
        for w in dead:
            self._fail_stop([w.device], f"node {view.node}: device {w.device} (rank {w.rank}) {w.reason}; "
                                        f"last progress iteration {w.iteration} step {w.step}",
                            paused=[w.device] if _is_paused(w) else [])
        self._note_pauses(view, state)
        if dead:
            self._recheck_pending()

    def _note_pauses(self, view: NodeView, state: AgentState) -> None:
        """Paused workers (stopped, fenced, not killed) that the agent says are healthy
        again are offered back, like the devices of a healed node (docs/detector.md)."""
        back = []
        for w in state.workers:
            if _is_paused(w):
                view.paused.add(w.device)
            elif w.device in view.paused:
                view.paused.discard(w.device)
                if w.alive:
                    back.append(w.device)
        if back:
            logger.warning("event=worker_resumed node=%d devices=%s", view.node, back)
            self._offer(view, tuple(back), only=True)

    def _node_lost(self, view: NodeView, why: str) -> None:
        if view.state is not None:
            devices = {d for d, w in view.workers().items() if w.reason != "finished"}
        else:
            devices = set(view.devices)
        devices = sorted(devices | view.running)  # launched, not yet heard from, also lost
        logger.error("event=node_lost node=%d reason=%r devices=%s", view.node, why, devices)
        if devices:  # reported before its workers are marked dead, so the report says why
            self._fail_stop(devices, f"node {view.node} lost: {why}")
        self._publish(NodeLost(view.node))
        self._recheck_pending()

    # ------------------------------------------------------------ fail-slow
    def _alive_ranks(self) -> set[int]:
        """Ranks whose profiles complete an iteration: ``expected_ranks`` (or every rank
        an agent reports) minus the ranks of devices that failed or left. Kept until an
        agent's workers, a connection or the stopped devices change: with a profile per
        rank and iteration, recomputing it per profile costs ranks squared per iteration."""
        if self._alive is None:
            self._alive = self._compute_alive_ranks()
        return self._alive

    def _compute_alive_ranks(self) -> set[int]:
        reported: set[int] = set()
        gone: set[int] = set()
        for v in self.nodes.values():
            for d, w in v.workers().items():
                if v.connected and w.alive and w.reason != "finished" and d not in self._stopped:
                    reported.add(w.rank)
                else:
                    gone.add(w.rank)
        base = self.expected_ranks if self.expected_ranks is not None else reported
        return base - (gone - reported)

    def _on_profile(self, p: IterationProfile) -> None:
        if self.failslow is None or p.generation != self.generation:
            return
        if p.iteration in self._done_iters or p.iteration <= self._last_complete - 8:
            return
        got = self._pending.setdefault(p.iteration, {})
        got[p.rank] = p
        if len(got) >= len(self._alive_ranks()):  # else it cannot be complete yet
            self._recheck_pending()

    def _recheck_pending(self) -> None:
        if not self._pending or self._fs_queue is None:
            return
        expected = self._alive_ranks()
        for it in sorted(self._pending):
            got = self._pending[it]
            if expected and expected <= got.keys():
                del self._pending[it]
                self._done_iters.add(it)
                self._last_complete = max(self._last_complete, it)
                env = {d: v.environment for v in self.nodes.values() for d in v.devices if v.environment > 0}
                self._fs_queue.put_nowait((self.generation, it, {r: got[r] for r in sorted(got)}, env))
        # Iterations far behind the newest complete one will never complete (a rank died).
        for it in [i for i in self._pending if i < self._last_complete - 8]:
            del self._pending[it]
        if len(self._done_iters) > 1024:
            self._done_iters = {i for i in self._done_iters if i > self._last_complete - 64}

    async def _failslow_loop(self) -> None:
        assert self._fs_queue is not None and self._loop is not None
        while True:
            gen, it, profiles, env = await self._fs_queue.get()
            fs = self.failslow
            if fs is None or gen != self.generation:
                continue
            try:
                det = await self._loop.run_in_executor(self._pool, _observe, fs, it, profiles, env)
            except Exception:  # noqa: BLE001 - a detector bug must not stop fail-stop handling
                logger.exception("fail-slow detector failed on iteration %d", it)
                continue
            self._publish(det)
            if det.report is not None and gen == self.generation:
                self._emit(det.report)


def _liveness(state: AgentState) -> tuple[tuple[int, int, bool, bool], ...]:
    """What of an agent's state decides which ranks are alive."""
    return tuple((w.device, w.rank, w.alive, w.reason == "finished") for w in state.workers)


def _is_paused(w: WorkerSummary) -> bool:
    """The agent fenced this worker as paused (stopped), not as dead."""
    return not w.alive and w.reason.startswith("paused:")


def _observe(fs: FailSlowDetector, iteration: int, profiles: dict[int, IterationProfile],
             env: dict[int, float]) -> Detection:
    """Hand the detector an iteration, with each device's node contention if it takes it."""
    note = getattr(fs, "note_environment", None)
    if note is not None and env:
        note(iteration, env)
    return fs.observe(iteration, profiles)


# ------------------------------------------------------------------ process entry point
def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m resihp_core.runtime.controller",
                                 description="ResiHP detector controller (reports as JSON lines)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--address-file", help="write host:port here once listening")
    ap.add_argument("--config", help="TOML/YAML configuration file")
    ap.add_argument("--secret-env", default="RESIHP_SECRET")
    ap.add_argument("--no-failslow", action="store_true", help="fail-stop detection only")
    ap.add_argument("--log-level", default="WARNING")
    return ap.parse_args(argv)


async def _amain(args: argparse.Namespace) -> int:
    import msgspec

    from resihp_core.config import load_config

    config = load_config(args.config).detector
    secret = os.environ.get(args.secret_env, "")
    if not secret:
        print(f"controller: the job secret is missing (set {args.secret_env})", file=sys.stderr)
        return 2

    from resihp_core.plugins import get_plugins

    plugins = get_plugins()

    def show(event: ControllerEvent) -> None:
        if isinstance(event, FailureReport):
            print(json.dumps(msgspec.to_builtins(event)), flush=True)
            plugins.notify_failure(event)

    ctl = Controller(config, secret, args.host, args.port, sink=show, plugins=plugins,
                     failslow=False if args.no_failslow else None)
    await ctl.start()
    if args.address_file:
        tmp = f"{args.address_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(ctl.address_text + "\n")
        os.replace(tmp, args.address_file)
    print(json.dumps({"listening": ctl.address_text}), flush=True)
    done = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, done.set)
    await done.wait()
    await ctl.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return asyncio.run(_amain(args))
    except OSError as e:
        print(f"controller: {e}", file=sys.stderr)
        return 1

