"""The generation watch through the node agent: the job store sees one parked wait, one
connection and one plan read per node and generation whatever the number of the node's
workers, every worker hears of each new generation and gets its plan, and a worker
whose agent goes away watches the store itself."""

from __future__ import annotations

import time
from typing import Callable

from resihp_core.config import DetectorConfig
from resihp_core.protocol import PlanUpdate, node_credential
from resihp_core.runtime import session
from resihp_core.runtime.agent import NodeAgent
from resihp_core.runtime.loop import LoopThread
from resihp_core.runtime.store import StoreClient, StoreServer, worker_store_identity
from resihp_core.runtime.worker import GenerationWatch
from resihp_core.runtime.worker.node_watch import AgentFeed

SECRET = "node-watch-test-secret"
NODE = 2
CRED = node_credential(SECRET, NODE)
WORKERS = 6


def _post(store: session.KeyValueStore, g: int) -> None:
    session.post_plan(store, PlanUpdate(generation=g, devices=tuple(range(WORKERS)), stop=True))


def _until(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.01)


def test_a_nodes_workers_share_one_store_watch_and_fall_back_when_the_agent_goes() -> None:
    server = StoreServer("127.0.0.1", SECRET)
    store = server.local()
    own: list[int] = []  # workers that opened a store connection to watch it themselves

    def connect(device: int) -> Callable[[], session.KeyValueStore]:
        def make() -> session.KeyValueStore:
            own.append(device)
            return StoreClient(server.address, CRED, worker_store_identity(NODE, device), timeout_s=30.0)
        return make

    try:
        with LoopThread("test-node-watch") as lt:
            agent = NodeAgent(NODE, None, "", DetectorConfig(heartbeat_interval_s=0.05), credential=CRED)
            lt.run(agent.start())
            try:
                _post(store, 0)
                lt.call(agent.generations.use_store, server.address)
                watches = [GenerationWatch(session.LazyConnection(connect(d)),
                                           agent=AgentFeed(agent.worker_address or "", CRED, d, d))
                           for d in range(WORKERS)]
                _until(lambda: all(w.latest == 0 for w in watches), "every worker hears of generation 0")
                _post(store, 1)
                _until(lambda: all(w.latest == 1 for w in watches), "every worker hears of generation 1")
                assert all(w.plan(1) == PlanUpdate(generation=1, devices=tuple(range(WORKERS)), stop=True)
                           for w in watches)  # relayed: read from the store once for the node
                assert agent.generations.stats.plan_reads == 2
                _until(lambda: server.table.waiting() == 1, "one parked wait (the agent's) for generation 2")
                assert server.connections == 1 and own == []  # the agent's watch only
                assert agent.generations.stats.subscribers == WORKERS
                # The agent goes away: each worker watches the store itself and still
                # learns the next generation.
                lt.run(agent.stop(goodbye=False))
                _until(lambda: all(w.direct for w in watches), "every worker falls back to the store")
                _post(store, 2)
                _until(lambda: all(w.latest == 2 for w in watches), "every worker hears of generation 2")
                assert all(w.plan(2) is None for w in watches)  # each reads it from the store itself
                assert sorted(own) == list(range(WORKERS))
            finally:
                lt.run(agent.stop(goodbye=False))
    finally:
        server.close()
