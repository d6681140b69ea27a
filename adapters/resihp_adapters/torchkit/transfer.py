"""The state-transfer plan every torch adapter needs when a plan changes: which device
sends which part of which component's shard to whom (parameters and optimizer state
move together, sharded the same way), for any old/new TP degree and layer ranges.

A *component* is the unit that moves (a layer, the embedding, the head): the adapter
says which components each stage holds; everything else is plan arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

from resihp_core.adapter import StateLost
from resihp_core.plan import ParallelPlan

__all__ = ["NoSurvivingCopy", "Transfer", "transfer_plan"]

ComponentsOf = Callable[[ParallelPlan, int], list[str]]


class NoSurvivingCopy(StateLost, LookupError):
    """No live device holds a complete copy of a component: the contract's state-lost
    signal (the supervisor restores from a checkpoint)."""


@dataclass(frozen=True)
class Transfer:
    """Move the overlap of ``src`` device's shard (src_tp of src_deg) of ``component``
    into ``dst`` device's shard (dst_tp of dst_deg). ``src == dst`` is a local copy."""

    component: str
    src: int
    src_tp: int
    src_deg: int
    dst: int
    dst_tp: int
    dst_deg: int


def _holders(plan: ParallelPlan, component: str, components_of_stage: ComponentsOf,
             ) -> list[tuple[int, tuple[int, ...]]]:
    """(replica, TP group) of every executor holding ``component`` in ``plan``."""
    out = []
    for r, s in plan.executors():
        if component in components_of_stage(plan, s):
            out.append((r, plan.group(r, s)))
    return sorted(out)


def transfer_plan(old: ParallelPlan, new: ParallelPlan, alive: Iterable[int],
                  components_of_stage: ComponentsOf) -> list[Transfer]:
    """Every shard movement that takes the state of ``old`` (on the ``alive`` devices)
    to the layout of ``new``. Deterministic, so senders and receivers compute it alone.

    A device that already holds exactly the shard it needs keeps it. Otherwise the
    source is the replica's own old TP group for that component when all its members
    are alive, else the lowest-numbered replica whose group is: all replicas hold the
    same state after a completed iteration. Raises :class:`NoSurvivingCopy` (a
    ``LookupError`` and the contract's ``StateLost``) naming the component
    when no complete copy survives (the caller must restore from a checkpoint).
    """
    alive = set(alive)
    out: list[Transfer] = []
    for r, s in new.executors():
        group = new.group(r, s)
        for comp in components_of_stage(new, s):
            holders = _holders(old, comp, components_of_stage)
            whole = [(rr, g) for rr, g in holders if all(d in alive for d in g)]
            for t, dev in enumerate(group):
                mine = [(rr, g) for rr, g in holders if dev in g]
                if mine and len(mine[0][1]) == len(group) and mine[0][1].index(dev) == t:
                    continue  # already holds exactly this shard
                if not whole:
                    raise NoSurvivingCopy(
                        f"no surviving complete copy of {comp} (needed by replica {r} stage {s})"
                    )
                src_g = next((g for rr, g in whole if rr == r), whole[0][1])
                k_old, k_new = len(src_g), len(group)
                for u, src in enumerate(src_g):
                    # Shards [u/k_old, (u+1)/k_old) and [t/k_new, (t+1)/k_new) overlap?
                    if u * k_new < (t + 1) * k_old and t * k_old < (u + 1) * k_new:
                        out.append(Transfer(comp, src, u, k_old, dev, t, k_new))
    return out
