"""A worker's generation watch through its node agent (the agent's half:
``runtime/agent/node_generations.py``).

The agent keeps one blocked store wait per node on the next plan key and tells each
worker of the node, over a node-local connection, the newest generation at once and
again at each newer one (and at least every ``wait_s`` while nothing changes, so a
frozen agent is noticed), each followed by the generation's plan, read once for the
node (the worker enters the generation without a store read). When the agent refuses (it has no job store), the connection
breaks (the agent died) or stays silent past :data:`SILENCE_S`, :meth:`AgentFeed.follow`
returns and the worker watches the store itself, as it did before the relay: a worker
whose agent is gone still learns every new generation and is fenced by it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Callable

from resihp_core.protocol import (
    Ack,
    AuthError,
    Error,
    PlanUpdate,
    ProtocolError,
    client_handshake_sync,
    recv_msg,
)
from resihp_core.runtime import session
from resihp_core.runtime.heartbeat import parse_address

__all__ = ["AgentFeed", "ENV_NODE_WATCH", "SILENCE_S"]

logger = logging.getLogger("resihp.worker")

#: "0" turns the generation watch through the node agent off (each worker watches the store)
ENV_NODE_WATCH = "RESIHP_NODE_WATCH"
#: no word from the agent this long (it sends one at least every 30 s): watch the store directly
SILENCE_S = 75.0


class AgentFeed:
    """One worker's generation-watch connection to its agent (used by one thread)."""

    def __init__(self, address: str, credential: str, device: int, rank: int, *,
                 connect_timeout: float = 5.0, silence_s: float = SILENCE_S) -> None:
        self.address = parse_address(address)
        self._credential = credential
        self.identity = f"{session.WATCH_IDENTITY}{device}:{rank}:{os.getpid()}"
        self.connect_timeout, self.silence_s = connect_timeout, silence_s
        self.notices = 0  # generation notices received
        self.plans = 0  # plans received
        self.ended = ""  # why the feed ended (then the worker watches the store itself)

    @classmethod
    def from_env(cls, env: dict[str, str], device: int) -> AgentFeed | None:
        """The worker's feed, if its environment names an agent and the relay is not
        turned off."""
        if not env.get("RESIHP_AGENT_ADDR") or env.get(ENV_NODE_WATCH, "1") == "0":
            return None
        return cls(env["RESIHP_AGENT_ADDR"], env.get("RESIHP_SECRET", ""), device,
                   int(env.get("RESIHP_RANK", str(device))))

    def follow(self, on_generation: Callable[[int], None], on_plan: Callable[[PlanUpdate], None]) -> None:
        """Call ``on_generation`` with each generation the agent announces and
        ``on_plan`` with each plan it relays; return when the feed ends (``self.ended``
        says why)."""
        sock: socket.socket | None = None
        try:
            if isinstance(self.address, str):
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.settimeout(self.connect_timeout)
                sock.connect(self.address)
            else:
                sock = socket.create_connection(self.address, timeout=self.connect_timeout)
            client_handshake_sync(sock, self._credential, self.identity, role="worker",
                                  timeout=self.connect_timeout)
            while True:
                msg = recv_msg(sock, timeout=self.silence_s)
                if isinstance(msg, Ack) and msg.what == session.GENERATION_NOTICE:
                    self.notices += 1
                    on_generation(msg.generation)
                elif isinstance(msg, PlanUpdate):
                    self.plans += 1
                    on_plan(msg)
                elif isinstance(msg, Error):
                    self.ended = f"{msg.code}: {msg.detail}"
                    return
                elif msg is None:
                    self.ended = "the agent closed the connection"
                    return
                else:
                    self.ended = f"the agent sent a {type(msg).__name__}"
                    return
        except (OSError, AuthError, ProtocolError) as e:
            self.ended = f"{type(e).__name__}: {e}"
        finally:
            if sock is not None:
                sock.close()
            if self.ended:
                logger.info("event=node_watch_ended agent=%s reason=%r", self.address, self.ended)
