"""A worker's commits through its node agent (the agent's half: ``runtime/agent/node_commits.py``).

The worker sends its iteration report to the agent and gets the verdict back; the
agent posts the node's reports and adds the node's executors to the commit counter in
one store request. Where the agent takes no commits (none, or it has no job store yet)
the worker commits to the store itself, as before. If the connection breaks after a
request was sent, its add may have landed: the worker then reads the verdict from the
store and never adds again (docs/worker-protocol.md).
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from resihp_core.protocol import (
    AuthError,
    CommitRequest,
    CommitVerdict,
    Error,
    IterationReport,
    ProtocolError,
    client_handshake_sync,
    recv_msg,
    send_msg,
)
from resihp_core.protocols.store import KeyValueStore
from resihp_core.runtime import session
from resihp_core.runtime.heartbeat import COMMITS, parse_address

__all__ = ["ENV_NODE_COMMITS", "NodeCommit", "direct_commit"]

logger = logging.getLogger("resihp.worker")

#: "0" turns commits through the node agent off (each worker commits to the store itself)
ENV_NODE_COMMITS = "RESIHP_NODE_COMMITS"


def direct_commit(store: KeyValueStore, report: IterationReport, executors: int, *, timeout_s: float,
                  hold_s: float, check: Callable[[], bool] | None, fingerprint: str | None = None) -> str:
    """This worker's own report (and SDC ``fingerprint``), counter add and verdict wait
    (no agent in between), in one store request where the store can
    (:func:`session.commit_batch`)."""
    g, i = report.generation, report.iteration
    if hold_s > 0 and not session.wait_controller(store, hold_s):
        return session.decide(store, g, i, check=lambda: False)  # abort, unless committed already
    got = session.commit_batch(store, g, i, [report], executors, may_decide=check is None, timeout_s=timeout_s,
                               fingerprints=None if fingerprint is None else {report.device: fingerprint})
    return session.decide(store, g, i, check) if got == session.DECIDE else got


class NodeCommit:
    """One worker's commit connection to its agent (used from one thread at a time)."""

    def __init__(self, address: str, credential: str, device: int, rank: int, *,
                 connect_timeout: float = 5.0) -> None:
        self.address = parse_address(address)
        self._credential = credential
        self.identity = f"{COMMITS}{device}:{rank}:{os.getpid()}"
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self.available = True  # False once the agent said it takes no commits
        self.through_agent = 0  # commits the agent carried
        self.direct = 0  # commits made to the store directly

    @classmethod
    def from_env(cls, env: dict[str, str], device: int) -> NodeCommit | None:
        """The worker's agent connection, if its environment names an agent and commits
        through it are not turned off."""
        if not env.get("RESIHP_AGENT_ADDR") or env.get(ENV_NODE_COMMITS, "1") == "0":
            return None
        return cls(env["RESIHP_AGENT_ADDR"], env.get("RESIHP_SECRET", ""), device,
                   int(env.get("RESIHP_RANK", str(device))))

    def commit(self, store: KeyValueStore, report: IterationReport, executors: int, *, timeout_s: float,
               hold_s: float = 0.0, check: Callable[[], bool] | None = None, fingerprint: str | None = None) -> str:
        """The iteration's verdict (``commit`` / ``abort``), through the agent where it
        takes commits, else directly through ``store``; ``fingerprint`` (this executor's
        SDC fingerprint) is posted with the report either way."""
        g, i = report.generation, report.iteration

        def direct() -> str:
            self.direct += 1
            return direct_commit(store, report, executors, timeout_s=timeout_s, hold_s=hold_s, check=check,
                                 fingerprint=fingerprint)

        sock = self._connection()
        if sock is None:
            return direct()
        try:
            send_msg(sock, CommitRequest(report, executors, check is not None, hold_s, timeout_s, fingerprint))
        except OSError as e:  # an incomplete frame is never served: commit directly
            self._drop(e)
            return direct()
        try:
            reply = recv_msg(sock, timeout=timeout_s + hold_s + 30.0)
        except (OSError, ProtocolError) as e:
            reply = None
            self._drop(e)
        if isinstance(reply, Error):  # sent before the agent reads any request: nothing was added
            logger.info("event=node_commit_unavailable agent=%s reason=%r", self.address, reply.detail)
            self.available = False
            self._drop(None)
            return direct()
        if not isinstance(reply, CommitVerdict) or (reply.generation, reply.iteration) != (g, i):
            # The agent may have added this executor before it went away: never add again.
            self._drop(None)
            return session.await_verdict(store, g, i, timeout_s)
        self.through_agent += 1
        if reply.verdict == "decide":
            return session.decide(store, g, i, check)
        return reply.verdict

    def close(self) -> None:
        self._drop(None)

    def _connection(self) -> socket.socket | None:
        if self._sock is not None or not self.available:
            return self._sock
        sock: socket.socket | None = None
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.connect_timeout)
                sock.connect(self.address)
            else:
                sock = socket.create_connection(self.address, timeout=self.connect_timeout)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client_handshake_sync(sock, self._credential, self.identity, role="worker",
                                  timeout=self.connect_timeout)
            sock.settimeout(None)
        except (OSError, AuthError, ProtocolError) as e:
            logger.info("event=node_commit_unavailable agent=%s reason=%r", self.address, str(e))
            if sock is not None:
                sock.close()
            self.available = False  # this process commits to the store itself from now on
            return None
        self._sock = sock
        return sock

    def _drop(self, exc: BaseException | None) -> None:
        if self._sock is not None:
            if exc is not None:
                logger.info("event=node_commit_lost agent=%s reason=%r", self.address, str(exc))
            try:
                self._sock.close()
            except OSError:
                pass
            self._sock = None
