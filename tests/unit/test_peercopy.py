"""Memory copies on peers (resihp_core.runtime.peercopy): the buddy rule, the
controller's choice of a complete copy, and two holders in one process exchanging a
copy over their side channel (what a restore reads back is the snapshot, bit for bit)."""

from __future__ import annotations

import json

import pytest

from resihp_core.plan import ParallelPlan
from resihp_core.runtime import peercopy
from resihp_core.runtime.peercopy import MemoryCopy, MemoryPiece, PeerCopies, PeerCopyError, buddy_of

torch = pytest.importorskip("torch")
from resihp_core.runtime.store import LocalStore, _Table  # noqa: E402 - imports torch


def test_the_buddy_is_on_another_node_and_holds_another_stage_when_there_is_one():
    node = {0: 0, 1: 0, 2: 1, 3: 1}
    stage = {0: 0, 1: 1, 2: 0, 3: 1}.get
    assert buddy_of(0, node, node, stage) == 3  # 1 is on its node, 2 holds its stage
    assert buddy_of(3, node, node, stage) == 0  # round the ring
    assert buddy_of(2, node, node, lambda d: 0) == 0  # every device holds stage 0: another node first
    assert buddy_of(0, [0, 1], {0: 0, 1: 0}, stage) == 1  # one node: the copy survives a process only
    assert buddy_of(0, [0], node, stage) is None
    # After a reconfiguration the ring is the new generation's: device 3 gone, 0's buddy is 2.
    assert buddy_of(0, [0, 1, 2], node, {0: 0, 1: 1, 2: None}.get) == 2


def _held(store: LocalStore, device: int, entries: list[list]) -> None:
    store.set(peercopy.HELD_KEY.format(device), json.dumps(entries))


def test_the_restore_point_is_the_newest_iteration_every_part_of_which_a_live_worker_holds():
    store = LocalStore(_Table(), timeout_s=5.0)
    store.set(peercopy.MODEL_KEY, json.dumps(["embed", "head"]))
    # device 0 holds its own embed (TP 2 parts, iterations 6 and 7); device 2 holds
    # device 1's head at 6 only (7 was in flight when 1 died), device 3 a stale head at 7.
    _held(store, 0, [[0, 6, 1, "embed", 0, 2], [0, 6, 1, "embed", 1, 2], [0, 7, 1, "embed", 0, 2],
                     [0, 7, 1, "embed", 1, 2]])
    _held(store, 2, [[1, 6, 1, "head", 0, 1]])
    _held(store, 3, [[1, 7, 0, "head", 0, 1]])
    committed_in = {i: 1 for i in range(8)}  # 7 was trained again in generation 1: 3's copy is stale
    assert peercopy.memory_restore_point(store, [0, 2, 3], 8, committed_in) == (6, {"embed": [0, 0], "head": [2]})
    assert peercopy.memory_restore_point(store, [0, 2, 3], 7, committed_in) == (6, {"embed": [0, 0], "head": [2]})
    assert peercopy.memory_restore_point(store, [0, 3], 8, committed_in) is None  # 2 died too
    assert peercopy.memory_restore_point(store, [0, 2], 6, committed_in) is None  # nothing before 6
    assert peercopy.memory_restore_point(store, [0, 2, 3], 8, {i: 0 for i in range(8)})[0] == 7


def _copy(value: float, tp_parts: int = 1) -> MemoryCopy:
    return MemoryCopy(tuple(MemoryPiece("layers.0", t, tp_parts,
                                        {"layers.0.w": (torch.full((2, 3), value + t, dtype=torch.float64),
                                                        torch.zeros(2, 3, dtype=torch.float64))})
                            for t in range(tp_parts)), ("layers.0",))


@pytest.mark.timeout(60)
def test_a_copy_reaches_the_buddy_and_reads_back_exactly_while_the_stale_one_is_dropped():
    store = LocalStore(_Table(), timeout_s=5.0)
    a = PeerCopies(0, store, node=0, timeout_s=5.0)
    b = PeerCopies(1, store, node=1, timeout_s=5.0)
    plan = ParallelPlan.uniform(tp=1, pp=2, dp=1, num_layers=2, num_microbatches=1)
    for it, gen in ((4, 0), (5, 0), (6, 0), (5, 1)):  # 5 and 6 of generation 0, then 5 trained again
        a.offer(it, gen, _copy(float(it * 10 + gen)), [0, 1], plan)
        assert a.idle(30)
    assert a.sent == 4
    held = json.loads(store.get(peercopy.HELD_KEY.format(1)))
    # 6 of generation 0 was dropped by the new history's 5; the newest three are kept
    assert sorted((e[1], e[2]) for e in held) == [(4, 0), (5, 1)]
    assert peercopy.memory_restore_point(store, [1], 7, {5: 1}) == (5, {"layers.0": [1]})
    (piece,) = a.reader(5, {"layers.0": [1]})("layers.0")  # over the side channel from device 1
    assert torch.equal(piece.tensors["layers.0.w"][0], torch.full((2, 3), 51.0, dtype=torch.float64))
    with pytest.raises(PeerCopyError, match="holds no memory copy of iteration 6"):
        a.reader(6, {"layers.0": [1]})("layers.0")
    # Re-laid out, the source hands over another component of the same state: merged,
    # so a peer still reading the piece it held before finds it.
    a.offer(5, 2, MemoryCopy((MemoryPiece("layers.1", 0, 1, {"layers.1.w": (torch.ones(2),)}),), ("layers.0",)),
            [0, 1], plan)
    assert a.idle(30)
    held = json.loads(store.get(peercopy.HELD_KEY.format(1)))
    assert sorted((e[1], e[2], e[3]) for e in held) == [(4, 0, "layers.0"), (5, 1, "layers.0"), (5, 2, "layers.1")]
    (piece,) = a.reader(5, {"layers.0": [1]})("layers.0")
    assert piece.tensors["layers.0.w"][0][0, 0].item() == 51.0
    # A client without the token read from the store is refused (the job's processes only).
    store.set(peercopy.ADDR_KEY.format(1), json.dumps({**json.loads(store.get(peercopy.ADDR_KEY.format(1))),
                                                       "token": "guess"}))
    with pytest.raises(PeerCopyError, match="device 1"):
        a.reader(5, {"layers.0": [1]})("layers.0")
    a.close()
    b.close()
