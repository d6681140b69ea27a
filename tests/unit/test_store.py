"""The authenticated job store: torch.distributed semantics, credentials, plan keys,
the bound address, and ``resihp run``'s own correctness check."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from resihp_core.protocol import PlanUpdate, client_handshake_sync, node_credential  # noqa: E402
from resihp_core.runtime import session  # noqa: E402
from resihp_core.runtime.store import StoreClient, StoreError, worker_store_identity  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SECRET = "store-test-secret"


def worker(address: str, node: int = 0, device: int = 0, key: str | None = None, **kw) -> StoreClient:
    return StoreClient(address, key or node_credential(SECRET, node), worker_store_identity(node, device),
                       timeout_s=kw.pop("timeout_s", 10.0), **kw)


def test_store_semantics_match_torch(hosted) -> None:
    store, address = hosted
    c = worker(address)
    c.set("a", "x")
    assert c.get("a") == b"x" and store.get("a") == b"x"
    assert c.add("n", 2) == 2 and store.add("n", 3) == 5
    assert c.compare_set("v", "", "commit") == b"commit"  # absent key: expected "" sets it
    assert c.compare_set("v", "", "abort") == b"commit"  # exactly one verdict
    assert c.check(["a", "v"]) and not c.check(["a", "missing"])
    c.set_timeout(datetime.timedelta(seconds=0.2))
    with pytest.raises(dist.DistStoreError, match="timed out"):
        c.get("missing")
    threading.Timer(0.1, lambda: store.set("late", "1")).start()
    c.wait(["late"], datetime.timedelta(seconds=5))
    # get_within: waits for the key under its own bound (not the client's 0.2 s), one round trip
    threading.Timer(0.4, lambda: store.set("later", "2")).start()
    assert c.get_within("later", 5.0) == b"2"
    with pytest.raises(dist.DistStoreError, match="timed out"):
        c.get_within("never", 0.1)
    assert c.delete_key("a") and not c.check(["a"])
    c.close()


def test_store_client_is_a_dist_store_for_gloo_rendezvous(hosted) -> None:
    """init-ing gloo through PrefixStore over two StoreClients (two ranks, two threads)."""
    _, address = hosted
    out: dict[int, list[float]] = {}

    def rank(r: int) -> None:
        c = worker(address, 0, r)
        pg = dist.ProcessGroupGloo(dist.PrefixStore("gen0/", c), r, 2, datetime.timedelta(seconds=20))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t.tolist()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [3.0] * 3, 1: [3.0] * 3}


def test_forged_plan_commit_and_stop_without_credentials_are_rejected(hosted, caplog) -> None:
    store, address = hosted
    caplog.set_level(logging.INFO, logger="resihp.store")
    session.post_plan(store, PlanUpdate(generation=0, stop=True))
    # A process without the job's credentials: the store's own client with a guess ...
    with pytest.raises(StoreError, match="refused"):
        worker(address, key="guessed-secret")
    # ... another node's credential claiming node 0 ...
    with pytest.raises(StoreError, match="refused"):
        worker(address, 0, key=node_credential(SECRET, 1))
    # ... and torch's own TCPStore client (the old, open protocol), from another process.
    host, port = address.rsplit(":", 1)
    code = ("import datetime, torch.distributed as d\n"
            f"s = d.TCPStore({host!r}, {port}, is_master=False, timeout=datetime.timedelta(seconds=3))\n"
            "s.set('plan/latest', '7'); s.set('ctl0/verdict0', 'commit')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert session.latest_generation(store) == 0 and not store.check(["ctl0/verdict0"])
    assert "event=auth_refused listener=store" in caplog.text
    assert store.server.refused >= 3


def test_workers_may_not_write_plan_keys(hosted, caplog) -> None:
    store, address = hosted
    caplog.set_level(logging.WARNING, logger="resihp.store")
    session.post_plan(store, PlanUpdate(generation=0, stop=True))
    c = worker(address, 0, 0)
    stop = PlanUpdate(generation=1, stop=True)
    with pytest.raises(StoreError, match="may not write plan keys"):
        session.post_plan(c, stop)
    with pytest.raises(StoreError, match="may not write plan keys"):
        c.compare_set("plan/latest", "0", "1")
    assert session.latest_generation(c) == 0 and not store.check(["plan/1"])
    assert "event=store_write_refused identity=worker:0:0" in caplog.text
    # The controller (job secret) may post remotely.
    ctl = StoreClient(address, SECRET, "controller", timeout_s=10)
    session.post_plan(ctl, stop)
    assert session.latest_generation(store) == 1


def test_connect_reads_the_credential_from_the_environment(hosted, monkeypatch) -> None:
    store, address = hosted
    monkeypatch.setenv("RESIHP_SECRET", node_credential(SECRET, 2))
    monkeypatch.setenv("RESIHP_NODE", "2")
    monkeypatch.setenv("RESIHP_DEVICE", "5")
    c = session.connect(address, 10)
    assert c.identity == "worker:2:5"
    c.set("ctl0/ready/5", "{}")
    assert store.check(["ctl0/ready/5"])
    monkeypatch.delenv("RESIHP_SECRET")
    with pytest.raises(RuntimeError, match="RESIHP_SECRET"):
        session.connect(address, 10)


def test_the_store_listens_only_on_the_chosen_address(hosted) -> None:
    store, address = hosted
    host, port = address.rsplit(":", 1)
    assert host == "127.0.0.1"
    assert store.server._sock.getsockname()[0] == "127.0.0.1"
    # Another loopback address of this machine reaches every interface's listeners,
    # but not this one.
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.2", int(port)), timeout=2).close()
    socket.create_connection(("127.0.0.1", int(port)), timeout=2).close()


def test_import_resihp_core_store_free_of_torch_at_package_import() -> None:
    code = "import sys, resihp_core, resihp_core.runtime.session; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ), timeout=60)


def until(pred, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def test_connections_hold_no_thread_and_a_write_wakes_only_its_key(hosted) -> None:
    """The server is one event loop: open connections add no thread to its process; a
    blocked read parks under its key alone, and a write from the controller's own
    process completes only that read."""
    store, address = hosted
    threads = threading.active_count()
    idle = [worker(address, device=d) for d in range(32)]
    until(lambda: store.server.connections >= 32)
    assert threading.active_count() == threads
    got: dict[int, bytes] = {}
    readers = [threading.Thread(target=lambda d=d: got.__setitem__(d, idle[d].get_within(f"k{d}", 20)))
               for d in range(3)]
    for t in readers:
        t.start()
    until(lambda: store.server.table.waiting() >= 3)
    assert store.server.table.waiting() == 3
    store.set("k1", "one")
    readers[1].join(10)
    assert got == {1: b"one"} and store.server.table.waiting() == 2
    store.set("k0", "zero")
    store.set("k2", "two")
    for t in readers:
        t.join(10)
    assert got == {0: b"zero", 1: b"one", 2: b"two"} and store.server.table.waiting() == 0
    for c in idle:
        c.close()


def test_a_write_from_a_peer_wakes_its_parked_readers_and_a_read_out_of_time_leaves_no_waiter(hosted) -> None:
    """A write that arrives over the network (served on the store's own loop, as the
    add that completes an iteration's count is) wakes the reads parked under its key;
    a parked read whose time runs out fails and leaves nothing registered."""
    store, address = hosted
    readers = [worker(address, device=d) for d in range(3)]
    writer = worker(address, device=3)
    got: dict[int, bytes] = {}
    threads = [threading.Thread(target=lambda d=d: got.__setitem__(d, readers[d].get_within("verdict", 20)))
               for d in range(3)]
    for t in threads:
        t.start()
    until(lambda: store.server.table.waiting() >= 3)
    writer.set("verdict", "commit")
    for t in threads:
        t.join(10)
    assert got == {d: b"commit" for d in range(3)} and store.server.table.waiting() == 0
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="timed out"):
        readers[0].get_within("never", 0.3)
    assert 0.25 <= time.monotonic() - t0 < 5
    assert store.server.table.waiting() == 0
    readers[1].set("later", "x")  # the connection that timed out serves on
    assert readers[0].get("later") == b"x"
    for c in (*readers, writer):
        c.close()


def test_a_hostile_frame_ends_only_its_own_connection(hosted) -> None:
    """An authenticated peer announcing a frame over the limit, or sending bytes that
    are not msgpack, loses its connection; the server and other connections go on."""
    store, address = hosted
    good = worker(address, device=0)
    for junk in (struct.pack(">I", 1 << 30), struct.pack(">I", 3) + b"\xc1\xc1\xc1"):
        host, port = address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=5)
        client_handshake_sync(sock, node_credential(SECRET, 0), worker_store_identity(0, 1), role="worker")
        sock.sendall(junk)
        sock.settimeout(5)
        assert sock.recv(16) == b""  # closed by the server, no reply
        sock.close()
    good.set("still", "here")
    assert store.get("still") == b"here"
    good.close()


def test_a_client_reset_over_the_handshake_limit_dials_again(hosted) -> None:
    """Thousands of ranks dialling at once meet the store's limit of pending handshakes:
    the ones over it are reset, and the client dials again within its connect deadline
    instead of failing the worker."""
    from resihp_core.runtime.store import MAX_PENDING_HANDSHAKES

    store, address = hosted
    host, port = address.rsplit(":", 1)
    hogs = [socket.create_connection((host, int(port)), timeout=5) for _ in range(MAX_PENDING_HANDSHAKES)]
    until(lambda: len(store.server._gate.pending) == MAX_PENDING_HANDSHAKES)
    got: list[StoreClient] = []
    t = threading.Thread(target=lambda: got.append(worker(address, device=3, connect_timeout_s=20)))
    t.start()
    until(lambda: store.server.refused >= 1)  # reset at least once while the hogs hold every slot
    for h in hogs:
        h.close()
    t.join(20)
    assert got, "the client gave up instead of dialling again"
    got[0].set("after", "reset")
    assert store.get("after") == b"reset"
    got[0].close()
