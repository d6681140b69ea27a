"""Communicators of one plan generation, heterogeneous-TP point-to-point and DP reduction.

Per generation (docs/design.md §5.3): a default process group over the generation's
devices rendezvousing under the store prefix ``gen<g>/``, with an explicit short timeout,
plus the TP groups of every executor and the DP *chunk* groups of every stage. The world
is derived from the live one where the backend can (kept, split or shrunk:
:mod:`resihp_adapters.torchkit.regroup`), else rebuilt. Old groups that go are
destroyed and every Python reference to them dropped: gloo closes sockets only when the
last reference goes, and peers blocked on a dead generation only fail fast once their
neighbours actually close (docs/design.md §5.3).

P2P (docs/design.md §5.1): between a sender TP group of degree ks and a receiver group of degree
kr, with N = max(ks, kr) the tensor is split into N chunks along tokens; chunk i goes
once from sender ``i*ks//N`` to receiver ``i*kr//N``; receivers then all-gather inside
their group. DP reduction (docs/design.md §5.2): with K the largest TP degree among a stage's
replicas, chunk c of every parameter is reduced by the group holding it in each
replica — the finest common sharding — so replicas of different TP degree stay exact.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from resihp_core.plan import ParallelPlan
from resihp_adapters.torchkit import regroup
from resihp_adapters.torchkit.device import CPU, Placement, release_world

__all__ = ["Communicators", "build_communicators", "release", "p2p_tag"]


@dataclass
class Communicators:
    """Everything one worker needs to talk in generation ``generation``."""

    generation: int
    rank_of: dict[int, int]  # device -> rank
    tp: dict[tuple[int, int], dist.ProcessGroup | None] = field(default_factory=dict)
    dp_chunks: dict[int, list[tuple[tuple[int, ...], dist.ProcessGroup | None]]] = field(default_factory=dict)
    pending: list = field(default_factory=list)
    # Where tensors live and travel (docs/gpu.md); CPU and gloo unless given.
    placement: Placement = CPU
    devices: tuple[int, ...] = ()  # the world's members (sorted: rank = index)
    rendezvous: regroup.GenerationRendezvous | None = None  # the world's store
    choice: regroup.Choice | None = None  # how this generation's world was made
    timings: dict[str, float] = field(default_factory=dict)  # agree_s, world_s, subgroups_s

    def parent(self) -> regroup.Parent:
        """This world as a parent the next generation may derive from."""
        return regroup.Parent(self.generation, self.devices, dist.distributed_c10d._world.group_count)

    def subgroups(self) -> list[dist.ProcessGroup]:
        return [g for g in self.tp.values() if g is not None] + [
            g for chunks in self.dp_chunks.values() for _, g in chunks if g is not None]

    def report(self) -> dict[str, float | str]:
        """The choice and its timings, for the worker's ready record and log."""
        out: dict[str, float | str] = dict(self.timings)
        if self.choice is not None:
            out["comm_path"] = self.choice.path
        return out


def build_communicators(
    store: dist.Store, generation: int, devices: list[int], me: int, plan: ParallelPlan,
    timeout_s: float, backend: str = "gloo", placement: Placement | None = None,
    previous: Communicators | None = None, caps: regroup.Capabilities | None = None,
) -> Communicators:
    """Make generation ``generation``'s world over ``devices`` (sorted: rank = index) and
    every TP and DP-chunk group, in the same order on every rank. The world is derived
    from ``previous`` (this worker's live communicators, None after a failure) where
    every member holds the same one and the backend can (module docstring of
    :mod:`~resihp_adapters.torchkit.regroup`), else rebuilt. ``placement``
    (docs/gpu.md) decides the backend and where tensors travel; without one, CPU
    tensors over ``backend``. ``caps``: the backend's capabilities as probed unless
    given (tests force a path with them)."""
    pl = placement or CPU
    if placement is not None:
        backend = placement.init_backend
    devices = sorted(devices)
    timeout = datetime.timedelta(seconds=timeout_s)
    t0 = time.perf_counter()
    live = previous is not None and previous.rendezvous is not None and dist.is_initialized()
    parent = previous.parent() if live and previous is not None else None
    caps = caps or regroup.probe(pl.backend)
    # Only a backend that can derive votes (every member computes the same
    # ``releases_blocked``: it follows from the job's backend and torch).
    agreed = caps.releases_blocked and regroup.agree(store, generation, me, devices, parent, timeout)
    choice = regroup.choose(caps, parent, devices, agreed)
    t1 = time.perf_counter()
    rank_of = {d: i for i, d in enumerate(devices)}
    if choice.path == "rebuild" or previous is None or previous.rendezvous is None:
        if previous is not None:  # nothing of the old groups may outlive the release
            _forget(previous)
        release(pl)
        rendezvous = regroup.GenerationRendezvous(store, generation)
        # Bound to its device under NCCL: torch then makes subgroups by splitting the
        # world's communicator, and the world can later be shrunk.
        bind = {"device_id": pl.device} if pl.backend == "nccl" else {}
        dist.init_process_group(backend, store=rendezvous, rank=rank_of[me], world_size=len(devices),
                                timeout=timeout, **bind)
    else:
        rendezvous = previous.rendezvous
        _end_subgroups(previous)
        rendezvous.advance(generation)
        if choice.path == "shrink":
            regroup.shrink_world(choice.excluded)
    previous = None  # no reference to the old subgroups survives this frame
    t2 = time.perf_counter()
    comms = Communicators(generation, rank_of, placement=pl, devices=tuple(devices), rendezvous=rendezvous,
                          choice=choice)
    for r, s in plan.executors():
        g = plan.group(r, s)
        comms.tp[(r, s)] = _group([rank_of[d] for d in g], timeout) if len(g) > 1 else None
    for s in range(plan.pp):
        holders = [(r, plan.group(r, s)) for r in range(plan.dp) if plan.group(r, s)]
        k = max(len(g) for _, g in holders)
        chunks = []
        for c in range(k):
            members = tuple(sorted({g[c * len(g) // k] for _, g in holders}))
            pg = _group([rank_of[d] for d in members], timeout) if len(members) > 1 else None
            chunks.append((members, pg))
        comms.dp_chunks[s] = chunks
    comms.timings = {"agree_s": t1 - t0, "world_s": t2 - t1, "subgroups_s": time.perf_counter() - t2}
    return comms


def _end_subgroups(comms: Communicators) -> None:
    """End the subgroups of a world that is kept (NCCL ones aborted: a destroy would wait
    for work queued with a peer that is gone) and drop the references to them."""
    nccl = comms.placement.backend == "nccl"
    for pg in comms.subgroups():
        try:
            if nccl:
                dist.distributed_c10d._abort_process_group(pg)
            else:
                dist.destroy_process_group(pg)
        except Exception:  # noqa: BLE001 - a broken group still has to go
            pass
    _forget(comms)


def _forget(comms: Communicators) -> None:
    comms.tp.clear()
    comms.dp_chunks.clear()
    comms.pending.clear()


def _group(ranks: list[int], timeout: datetime.timedelta) -> dist.ProcessGroup:
    return dist.new_group(sorted(ranks), timeout=timeout, use_local_synchronization=False)


def release(placement: Placement = CPU) -> None:
    """End every process group and collect them, so gloo closes their sockets (NCCL
    communicators are aborted: :func:`~resihp_adapters.torchkit.device.release_world`)."""
    release_world(placement)


def p2p_tag(kind: int, stage: int, owner: int, mb: int, chunk: int, plan: ParallelPlan) -> int:
    """A tag unique per message of one iteration (kind 0 = activation, 1 = gradient)."""
    return ((((kind * plan.pp + stage) * plan.dp + owner) * plan.num_microbatches + mb) * 64) + chunk


def send_chunks(x: Tensor, src_group: tuple[int, ...], my_tp: int, dst_group: tuple[int, ...],
                comms: Communicators, tag: int) -> None:
    """Issue (non-blocking) this sender's chunks of ``x`` per the docs/design.md §5.1 rule."""
    ks, kr = len(src_group), len(dst_group)
    n = max(ks, kr)
    parts = x.chunk(n, 0)
    for i in range(n):
        if i * ks // n == my_tp:
            dst = comms.rank_of[dst_group[i * kr // n]]
            comms.pending.append(dist.isend(comms.placement.to_wire(parts[i].contiguous()), dst, tag=tag + i))


def recv_chunks(shape: tuple[int, ...], dtype: torch.dtype, src_group: tuple[int, ...],
                my_tp: int, dst_group: tuple[int, ...], comms: Communicators,
                tp_group: dist.ProcessGroup | None, tag: int) -> Tensor:
    """Receive this rank's chunks and all-gather the full tensor inside the TP group."""
    ks, kr = len(src_group), len(dst_group)
    n = max(ks, kr)
    if shape[0] % n:
        raise ValueError(f"{shape[0]} tokens do not split into {n} P2P chunks")
    rows = shape[0] // n
    mine = [i for i in range(n) if i * kr // n == my_tp]
    pl = comms.placement
    local = torch.empty((rows * len(mine),) + tuple(shape[1:]), dtype=dtype, device=pl.wire)
    works = []
    for j, i in enumerate(mine):
        src = comms.rank_of[src_group[i * ks // n]]
        works.append(dist.irecv(local[j * rows : (j + 1) * rows], src, tag=tag + i))
    for w in works:
        w.wait()
    if kr == 1:
        return pl.to_home(local)
    parts = [torch.empty_like(local) for _ in range(kr)]
    dist.all_gather(parts, local, group=tp_group)
    return pl.to_home(torch.cat(parts, 0))


def reduce_grads(stage: int, my_device: int, my_tp: int, my_deg: int,
                 grads: list[tuple[Tensor, int | None]], comms: Communicators) -> None:
    """Sum ``grads`` (this rank's shard gradients with their shard dims, None =
    replicated) over every replica of ``stage``, chunk group by chunk group."""
    chunks = comms.dp_chunks[stage]
    k = len(chunks)
    per = k // my_deg  # chunks this rank's shard holds
    # Replicated gradients enter every chunk group with their local value; the sum
    # from the first group is kept (the others only serve peers of other degrees).
    local = [g.clone() if d is None else None for g, d in grads]
    first = True
    for c in range(my_tp * per, (my_tp + 1) * per):
        members, pg = chunks[c]
        if pg is None:
            continue
        i = c - my_tp * per
        flat = torch.cat([
            (lv if d is None else g.chunk(per, d)[i]).reshape(-1)
            for (g, d), lv in zip(grads, local)
        ])
        wire = comms.placement.to_wire(flat)
        dist.all_reduce(wire, group=pg)
        flat = comms.placement.to_home(wire)
        pos = 0
        for g, d in grads:
            view = g if d is None else g.chunk(per, d)[i]
            n = view.numel()
            if d is not None or first:
                view.copy_(flat[pos : pos + n].view_as(view))
            pos += n
        first = False


def wait_pending(comms: Communicators) -> None:
    for w in comms.pending:
        w.wait()
    comms.pending.clear()
