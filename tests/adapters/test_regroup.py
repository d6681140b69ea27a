"""Which path a generation's communicators take (torchkit.regroup, docs/gpu.md): the rule
by backend capability, with NCCL's shrink and split reached without a GPU, the members'
vote, and the rendezvous that follows a kept world into newer generations."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch.distributed as dist

from resihp_adapters.torchkit.regroup import (NCCL_SHRINK_MIN, Capabilities, GenerationRendezvous, Parent, agree,
                                              choose, probe)

NCCL_SHRINKS = Capabilities("nccl", torch_shrink=True, backend_shrinks=True, nccl_version=(2, 27, 3),
                            backend_splits=True, releases_blocked=True)
GLOO = Capabilities("gloo")  # as probed: no shrink, no split, no release of a blocked peer
GLOO_RELEASING = Capabilities("gloo", releases_blocked=True)  # what tests pass to reach ``keep``
PARENT = Parent(generation=4, devices=(0, 1, 2, 3), group_count=7)


def test_a_subset_of_the_live_world_shrinks_where_nccl_can_and_excludes_the_left_out_ranks():
    c = choose(NCCL_SHRINKS, PARENT, [3, 0, 1], agreed=True)
    assert c.path == "shrink" and c.excluded == (2,)


@pytest.mark.parametrize("caps,why", [
    (Capabilities("nccl", True, True, (2, 26, 5), releases_blocked=True), "NCCL (2, 26, 5) < 2.27"),
    (Capabilities("nccl", False, True, (2, 28, 0), releases_blocked=True), "no shrink_group"),
    (Capabilities("nccl", True, False, (2, 28, 0), releases_blocked=True), "does not support"),
    (Capabilities("nccl", True, True, (2, 28, 0), releases_blocked=False), "released only by closing"),
    (GLOO_RELEASING, "no shrink_group"),
    (GLOO, "released only by closing"),
])
def test_a_subset_rebuilds_where_the_backend_cannot_shrink_saying_why(caps, why):
    c = choose(caps, PARENT, [0, 1, 3], agreed=True)
    assert c.path == "rebuild" and why in c.reason and c.excluded == ()


def test_same_members_keep_the_world_split_where_the_backend_splits_else_made_anew_and_gloo_rebuilds():
    assert choose(NCCL_SHRINKS, PARENT, [3, 2, 1, 0], agreed=True).path == "split"
    assert choose(GLOO_RELEASING, PARENT, [0, 1, 2, 3], agreed=True).path == "keep"
    assert choose(GLOO, PARENT, [0, 1, 2, 3], agreed=True).path == "rebuild"


@pytest.mark.parametrize("parent,devices,agreed,words", [
    (None, [0, 1], True, "no live group"),
    (PARENT, [0, 1], False, "do not all hold"),
    (PARENT, [0, 1, 2, 3, 4], True, "[4] join"),
    (PARENT, [0, 1, 5], True, "[5] join"),
])
def test_everything_else_rebuilds(parent, devices, agreed, words):
    c = choose(NCCL_SHRINKS, parent, devices, agreed)
    assert c.path == "rebuild" and words in c.reason


def test_shrink_needs_nccl_2_27():
    assert NCCL_SHRINK_MIN == (2, 27, 0)
    assert not Capabilities("nccl", True, True, (2, 26, 9)).can_shrink
    assert Capabilities("nccl", True, True, (2, 27, 0)).can_shrink


def test_probe_without_a_world_knows_only_torch():
    caps = probe("gloo")
    assert caps.torch_shrink == hasattr(dist.distributed_c10d, "shrink_group")
    assert not caps.backend_shrinks and not caps.backend_splits and not caps.releases_blocked


def _vote(store: dist.Store, parents: dict[int, Parent | None]) -> dict[int, bool]:
    out: dict[int, bool] = {}
    devices = sorted(parents)

    def one(d: int) -> None:
        out[d] = agree(store, 5, d, devices, parents[d], datetime.timedelta(seconds=10))

    threads = [threading.Thread(target=one, args=(d,)) for d in devices]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_the_vote_agrees_only_when_every_member_holds_the_same_world():
    assert _vote(dist.HashStore(), {d: PARENT for d in range(4)}) == {d: True for d in range(4)}
    other = Parent(4, (0, 1, 2, 3), 8)  # one member made a group more: its names would not meet
    assert _vote(dist.HashStore(), {0: PARENT, 1: PARENT, 2: other, 3: PARENT}) == {d: False for d in range(4)}
    assert _vote(dist.HashStore(), {0: PARENT, 1: None, 2: PARENT, 3: PARENT}) == {d: False for d in range(4)}


def test_a_kept_world_rendezvous_moves_to_the_new_generation():
    inner = dist.HashStore()
    rdv = GenerationRendezvous(inner, 3)
    rdv.set("a", "1")
    rdv.advance(4)
    rdv.set("b", "2")
    assert inner.check(["gen3/a", "gen4/b"]) and not inner.check(["gen4/a"])
    twin = rdv.clone()
    rdv.advance(6)
    assert twin.generation == 6  # a clone (a shrunk world's store) follows the world
    assert rdv.add("c", 2) == 2 and inner.get("gen6/c") == b"2"


@pytest.mark.parametrize("gpus,note", [(0, "not run: no GPU here"), (1, "skipped: needs >= 2 GPUs")])
def test_gpu_check_rows_that_need_several_gpus_say_why_they_did_not_run(monkeypatch, tmp_path, gpus, note):
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import gpu_check

    monkeypatch.setattr(gpu_check, "_gpus", lambda: gpus)
    for row in (gpu_check.comm_shrink(tmp_path), gpu_check.comm_abort(tmp_path)):
        assert row.note.startswith(note) and row.exact is None and row.seconds == 0.0, row
