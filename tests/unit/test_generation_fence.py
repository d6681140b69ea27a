"""The generation fence on the workers' job store (docs/worker-protocol.md): a wait in a
superseded generation's rendezvous ends at once, a late peer of the current generation
is still met after the collective time-out, and other keys keep their own time-outs."""

from __future__ import annotations

import datetime
import threading
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from resihp_core.protocol import PlanUpdate, node_credential  # noqa: E402
from resihp_core.runtime import session  # noqa: E402
from resihp_core.runtime.store import StoreClient, worker_store_identity  # noqa: E402

pytestmark = pytest.mark.timeout(60)
SECRET = "fence-test-secret"


def client(address: str, device: int = 0) -> StoreClient:
    return StoreClient(address, node_credential(SECRET, 0), worker_store_identity(0, device), timeout_s=30.0)


def fenced(address: str, device: int, patience_s: float = 10.0):
    c = client(address, device)
    return session.generation_fenced(c, lambda: session.latest_generation(c), patience_s=patience_s, poll_s=0.05)


def test_rendezvous_keys_are_recognised() -> None:
    assert session.rendezvous_generation(["gen13//4//cpu//0/1"]) == 13
    assert session.rendezvous_generation(["/gen7//0//cpu//0/0"]) == 7
    assert session.rendezvous_generation(["ctl3/verdict0", "plan/latest", "generation"]) is None


def test_a_rendezvous_of_a_superseded_generation_ends_at_once(hosted) -> None:
    """Rank 0 of generation 3 waits for a rank 1 that never comes (the collective
    time-out is 20 s); generation 4 is posted: rank 0 leaves within a fraction of a second."""
    store, address = hosted
    session.post_plan(store, PlanUpdate(generation=3, stop=True))
    got: dict[str, object] = {}

    def rank0() -> None:
        t0 = time.monotonic()
        f = fenced(address, 0)  # held: a store torch holds is only as alive as its Python object
        try:
            dist.ProcessGroupGloo(dist.PrefixStore("gen3/", f), 0, 2, datetime.timedelta(seconds=20))
        except Exception as e:  # noqa: BLE001 - what we look at
            got["error"] = e
        got["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=rank0)
    t.start()
    time.sleep(0.5)
    assert t.is_alive()  # still waiting: its generation is current
    posted = time.monotonic()
    session.post_plan(store, PlanUpdate(generation=4, stop=True))
    t.join(15)
    assert not t.is_alive()
    assert "superseded by generation 4" in str(got["error"]), got
    assert time.monotonic() - posted < 3.0 and got["seconds"] < 10.0


def test_a_late_peer_of_the_current_generation_is_still_met(hosted) -> None:
    """The collective time-out is 1 s, rank 1 comes 2.5 s late: unfenced, rank 0 would
    have timed out (and left its key for rank 1 to pass on); fenced, both meet."""
    store, address = hosted
    session.post_plan(store, PlanUpdate(generation=5, stop=True))
    out: dict[int, object] = {}

    def rank(r: int, delay: float) -> None:
        time.sleep(delay)
        f = fenced(address, r)
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("gen5/", f), r, 2, datetime.timedelta(seconds=1))
            t = torch.full((2,), float(r + 1))
            pg.allreduce([t]).wait()
            out[r] = t.tolist()
        except Exception as e:  # noqa: BLE001
            out[r] = e

    threads = [threading.Thread(target=rank, args=(0, 0.0)), threading.Thread(target=rank, args=(1, 2.5))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {0: [3.0, 3.0], 1: [3.0, 3.0]}


def test_an_unfenced_rendezvous_times_out_on_a_late_peer(hosted) -> None:
    """The control: the same late peer against the plain store times rank 0 out."""
    _, address = hosted
    c = client(address)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError, match="timed out"):
        dist.ProcessGroupGloo(dist.PrefixStore("gen5/", c), 0, 2, datetime.timedelta(seconds=1))
    assert time.monotonic() - t0 < 10


def test_other_keys_keep_their_own_timeouts(hosted) -> None:
    store, address = hosted
    f = fenced(address, 0, patience_s=30.0)
    t0 = time.monotonic()
    with pytest.raises(dist.DistStoreError):
        f.wait(["ctl3/verdict0"], datetime.timedelta(seconds=0.3))
    assert time.monotonic() - t0 < 5
    store.set("ctl3/verdict0", "commit")
    f.wait(["ctl3/verdict0"], datetime.timedelta(seconds=1))
    assert f.get("ctl3/verdict0") == b"commit" and f.add("n", 2) == 2 and f.check(["n"])


def test_wait_generation_blocks_until_the_next_plan(hosted) -> None:
    store, address = hosted
    c = client(address)
    assert session.wait_generation(c, -1, 0.2) == -1  # nothing posted: time-out, same answer
    threading.Timer(0.3, lambda: session.post_plan(store, PlanUpdate(generation=0, stop=True))).start()
    t0 = time.monotonic()
    assert session.wait_generation(c, -1, 10.0) == 0
    assert time.monotonic() - t0 < 5
    session.post_plan(store, PlanUpdate(generation=1, stop=True))
    session.post_plan(store, PlanUpdate(generation=2, stop=True))
    assert session.wait_generation(c, 0, 10.0) == 2  # the newest, not the next
