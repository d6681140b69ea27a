"""Commits through the node agent: a node's executors reach the job store in one request,
the verdict is the commit protocol's (everywhere or nowhere, first verdict stands), and
hostile requests are refused and counted without stopping the agent."""

from __future__ import annotations

import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator

import pytest

from resihp_core.config import DetectorConfig
from resihp_core.protocol import (
    CommitRequest,
    IterationReport,
    client_handshake_sync,
    node_credential,
    recv_msg,
    send_msg,
)
from resihp_core.runtime import session
from resihp_core.runtime.agent import NodeAgent
from resihp_core.runtime.heartbeat import parse_address
from resihp_core.runtime.loop import LoopThread
from resihp_core.runtime.store import StoreServer
from resihp_core.runtime.worker.node_commit import NodeCommit, direct_commit

SECRET = "node-commit-test-secret"
NODE = 1
CRED = node_credential(SECRET, NODE)
CFG = DetectorConfig(heartbeat_interval_s=0.05)


@pytest.fixture
def node() -> Iterator[tuple[NodeAgent, StoreServer, LoopThread]]:
    server = StoreServer("127.0.0.1", SECRET)
    with LoopThread("test-node-commits") as lt:
        agent = NodeAgent(NODE, None, "", CFG, credential=CRED)
        lt.run(agent.start())
        try:
            yield agent, server, lt
        finally:
            lt.run(agent.stop(goodbye=False))
            server.close()


def _report(g: int, i: int, d: int) -> IterationReport:
    return IterationReport(generation=g, iteration=i, device=d, replica=d, stage=0, loss=float(d))


def _commit_all(agent: NodeAgent, store: session.KeyValueStore, devices: list[int], executors: int,
                g: int = 0, i: int = 0, check: dict[int, Callable[[], bool]] | None = None,
                fingerprints: dict[int, str] | None = None) -> dict[int, str]:
    clients = {d: NodeCommit(agent.worker_address or "", CRED, d, d) for d in devices}
    check, fps = check or {}, fingerprints or {}
    with ThreadPoolExecutor(len(devices)) as pool:
        futs = {d: pool.submit(c.commit, store, _report(g, i, d), executors, timeout_s=20.0, check=check.get(d),
                               fingerprint=fps.get(d))
                for d, c in clients.items()}
        out = {d: f.result(timeout=30) for d, f in futs.items()}
    for c in clients.values():
        assert c.through_agent == 1 and c.direct == 0
        c.close()
    return out


def test_a_nodes_executors_commit_in_one_store_request_with_a_direct_one(node) -> None:
    agent, server, _ = node
    agent.commits.use_store(server.address)
    store = server.local()
    # Device 9 (another node) commits directly; the three of this node through the agent.
    other = ThreadPoolExecutor(1).submit(direct_commit, store, _report(0, 0, 9), 4, timeout_s=20.0, hold_s=0.0,
                                         check=None)
    got = _commit_all(agent, store, [0, 1, 2], executors=4)
    assert got == {0: "commit", 1: "commit", 2: "commit"} and other.result(timeout=30) == "commit"
    assert int(store.get(session._done(0, 0))) == 4
    assert {d: r.loss for d, r in ((d, session.get_report(store, 0, 0, d)) for d in (0, 1, 2, 9))} == \
        {0: 0.0, 1: 1.0, 2: 2.0, 9: 9.0}
    # All at once (one check, one multi-get), and with a device that posted none (left out).
    assert {d: r.loss for d, r in session.get_reports(store, 0, 0, [9, 0, 1, 2]).items()} == \
        {9: 9.0, 0: 0.0, 1: 1.0, 2: 2.0}
    assert {d: r.loss for d, r in session.get_reports(store, 0, 0, [5, 2]).items()} == {2: 2.0}
    assert agent.commits.stats.requests == 3 and 1 <= agent.commits.stats.batches <= 3


def test_fingerprints_ride_in_the_nodes_commit_request_and_the_deciding_check_reads_them_all(node) -> None:
    """SDC fingerprints travel in the commit requests: the agent sets them in its one
    store request, before the add, so the executor whose add completes the count finds
    every one; every store request is the agent's (a batch, or a wait for the verdict)."""
    agent, server, _ = node
    agent.commits.use_store(server.address)
    store = server.local()
    seen: list[dict[int, str]] = []

    def check() -> bool:
        seen.append(session.get_fingerprints(store, 0, 0, [0, 1, 2]))
        return True

    every = {d: check for d in (0, 1, 2)}
    stats = agent.commits.stats
    before = (server.served, stats.batches, stats.verdict_waits)
    fps = {d: f'{{"digest": "d{d}"}}' for d in (0, 1, 2)}
    assert _commit_all(agent, store, [0, 1, 2], executors=3, check=every,
                       fingerprints=fps) == dict.fromkeys((0, 1, 2), "commit")
    served, batches, waits = (server.served - before[0], stats.batches - before[1],
                              stats.verdict_waits - before[2])
    assert served == batches + waits and batches <= 3  # no store request of a rank's own
    assert seen == [fps]  # one check, by the executor that completed the count, with all three
    # Without ResiHP's store (no one-request commit): set one by one, still before the add.
    import torch.distributed as dist

    plain = dist.HashStore()
    assert session.commit_batch(plain, 0, 0, [_report(0, 0, 4)], 2, may_decide=True, timeout_s=0.2,
                                fingerprints={4: "fp4"}) == "abort"  # one of two: no verdict came
    assert session.get_fingerprints(plain, 0, 0, [4, 5]) == {4: "fp4"}


def test_an_abort_from_the_controller_reaches_every_waiting_executor(node) -> None:
    agent, server, _ = node
    agent.commits.use_store(server.address)
    store = server.local()
    # 3 executors, only 2 come: the controller aborts the generation (a peer died).
    t = threading.Timer(0.3, session.abort_generation, (store, 0, 0))
    t.start()
    assert _commit_all(agent, store, [0, 1], executors=3) == {0: "abort", 1: "abort"}
    t.join()


def test_the_executor_with_a_check_decides_and_a_failed_check_aborts_everywhere(node) -> None:
    agent, server, _ = node
    agent.commits.use_store(server.address)
    store = server.local()
    calls: list[int] = []

    def bad() -> bool:
        calls.append(1)
        return False

    assert _commit_all(agent, store, [0, 1], executors=2, check={1: bad}) == {0: "abort", 1: "abort"}
    assert calls == [1]  # the check ran once, in the executor that completed the count


def test_a_forged_or_malformed_commit_is_refused_and_the_agent_serves_on(node) -> None:
    agent, server, _ = node
    agent.commits.use_store(server.address)
    store = server.local()
    addr = parse_address(agent.worker_address or "")
    assert isinstance(addr, tuple)
    # A commit connection of device 0 asking for device 5's iteration: refused, closed.
    s = socket.create_connection(addr, timeout=5)
    client_handshake_sync(s, CRED, "commit:0:0:1", role="worker")
    send_msg(s, CommitRequest(_report(0, 0, 5), 1))
    assert recv_msg(s, timeout=5) is None  # closed without a verdict
    s.close()
    # Garbage after the handshake: the connection is dropped.
    s = socket.create_connection(addr, timeout=5)
    client_handshake_sync(s, CRED, "commit:0:0:1", role="worker")
    s.sendall(b"\x00\x00\x00\x04junk")
    assert recv_msg(s, timeout=5) is None
    s.close()
    assert agent.commits.stats.refused == 1
    assert not store.check([session._done(0, 0)])  # nothing was added
    assert _commit_all(agent, store, [0], executors=1) == {0: "commit"}


def test_an_agent_without_a_store_lets_its_workers_commit_directly(node) -> None:
    agent, server, _ = node
    store = server.local()
    c = NodeCommit(agent.worker_address or "", CRED, 0, 0)
    assert c.commit(store, _report(0, 0, 0), 1, timeout_s=10.0) == "commit"
    assert (c.through_agent, c.direct, c.available) == (0, 1, False)
    assert c.commit(store, _report(0, 1, 0), 1, timeout_s=10.0) == "commit"  # no second try
    assert c.direct == 2


def test_a_nodes_add_and_its_verdict_wait_are_one_store_request() -> None:
    """``commit_batch`` over the wire: a node whose add does not complete the count is
    parked in the store until the verdict, in the request that added it; the add that
    completes it commits there (or, when its node must check first, is told to decide);
    a verdict that never comes is written ``abort``; the first verdict stands."""
    from resihp_core.runtime.store import StoreClient

    server = StoreServer("127.0.0.1", SECRET)
    clients = [StoreClient(server.address, node_credential(SECRET, n), f"agent:{n}") for n in range(3)]
    try:
        def batch(n: int, i: int, executors: int, may_decide: bool = True, timeout_s: float = 20.0) -> str:
            return session.commit_batch(clients[n], 0, i, [_report(0, i, 2 * n), _report(0, i, 2 * n + 1)],
                                        executors, may_decide=may_decide, timeout_s=timeout_s)

        served = server.served
        with ThreadPoolExecutor(3) as pool:
            parked = [pool.submit(batch, n, 0, 6) for n in (0, 1)]
            assert batch(2, 0, 6) == "commit"  # completes the count: the store commits
            assert [f.result(timeout=20) for f in parked] == ["commit", "commit"]
        assert server.served - served == 3  # one request per node: add, decide and wait together
        assert {d for d, r in session.get_reports(server.local(), 0, 0, list(range(6))).items()} == set(range(6))

        # The node that completes the count has an executor to check: it is told to decide.
        with ThreadPoolExecutor(1) as pool:
            parked_one = pool.submit(batch, 0, 1, 4)
            done = session._done(0, 1)
            server.local().wait([done])  # its add landed first
            assert batch(1, 1, 4, may_decide=False) == session.DECIDE
            assert not parked_one.done()
            assert session.decide(clients[1], 0, 1, lambda: False) == "abort"
            assert parked_one.result(timeout=20) == "abort"

        # Nobody completes the count: the wait ends and the iteration is aborted; a
        # later add that completes it reads the abort that stands.
        assert batch(0, 2, 4, timeout_s=0.3) == "abort"
        assert batch(1, 2, 4) == "abort"
    finally:
        for c in clients:
            c.close()
        server.close()


def test_a_malformed_commit_request_is_refused_without_a_write() -> None:
    from resihp_core.runtime.store import StoreClient, StoreError

    server = StoreServer("127.0.0.1", SECRET)
    c = StoreClient(server.address, CRED, f"agent:{NODE}")
    try:
        with pytest.raises(StoreError):  # "may decide" must be a boolean
            c._call("commit", ["r"], [b"x"], "n", 1, 1, "v", 1, 1.0)
        with pytest.raises(StoreError):  # the plan is the controller's
            c2 = StoreClient(server.address, CRED, f"agent:{NODE}")
            try:
                c2.add_and_await(["plan/0"], [b"x"], "n", 1, 1, "v", True, 1.0)
            finally:
                c2.close()
        assert not server.local().check(["r"]) and not server.local().check(["plan/0"])
    finally:
        c.close()
        server.close()
