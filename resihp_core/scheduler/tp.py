"""TP adaptation: selective device exclusion (docs/design.md §4.1).

For every TP group that has a fail-stopped or slow member, or runs below its nominal
degree, the stage picks new members from the *pool*: the group's surviving members
plus the standbys on the nodes of its home group (``PlannerState.home``).

- Candidate degrees: powers of two from ``k_min`` to ``min(|pool|, nominal degree)``,
  where ``k_min`` is the larger of the configured minimum and the smallest degree
  whose shard of the stage (its layers, parameters, optimizer state and in-flight
  activations) fits every chosen device's memory.
- For each degree k, the k pool devices with the highest normalised throughput p_i;
  the group's throughput is ``k * min p_i``. The degree with the highest throughput
  wins.
- **Tie-break: the larger degree.** With p = {1, 1, 1, 0.5}, k = 4 gives 4 x 0.5 = 2
  and k = 2 gives 2 x 1 = 2: we keep k = 4. Equal throughput, but the larger degree
  holds half the memory per device (room for layers moved by the PP stage and
  activations of work migrated by the DP stage) and, when it is the current degree,
  needs no re-sharding or communicator change at all. Ties are judged with a relative
  tolerance of 1e-9.
- Members among equally fast devices: current members first (in their current order),
  then lower device ids, so an unchanged choice leaves the plan unchanged.
- Pool devices left out become **intra-node standbys**; a later failure on the same
  node draws from them, and a group below its nominal degree is refilled from them
  (after a fail-stop, or when a repaired device rejoins).
- No feasible degree (pool empty or too small for the memory): the group becomes
  empty and its stage work migrates to the stage's DP peers (spread here round-robin,
  fastest peers first; the DP stage then balances it).
- A group left below its nominal throughput is also emptied when its peers can absorb
  its share with a smaller bottleneck, after layer repartition, than keeping it
  (:func:`_early_drops`; typical with many replicas). :func:`drop_stage`, run after
  PP and DP, re-checks the remaining slow groups with the simulator.
- Every replica of a stage lost, or an empty group on an adapter that cannot migrate
  work across replicas: :class:`RestoreRequired` (the planner restores from the last
  checkpoint).

Restricted by capabilities: without both ``tp_resize`` and ``heterogeneous_tp`` the
degree stays nominal; a failed member can still be replaced by a same-node standby,
and otherwise the whole group is dropped.
"""

from __future__ import annotations

from typing import Sequence

from resihp_core.plan import Migration, ParallelPlan
from resihp_core.scheduler.state import PlannerState, RestoreRequired

__all__ = ["choose_group", "drop_groups", "drop_slots", "drop_stage", "spread_migrations", "tp_stage"]

_TIE = 1e-9


def _degrees(lo: int, hi: int) -> list[int]:
    out, k = [], 1
    while k <= hi:
        if k >= lo:
            out.append(k)
        k *= 2
    return out


def choose_group(
    state: PlannerState,
    replica: int,
    stage: int,
    pool: Sequence[int],
    current: Sequence[int],
    *,
    resize: bool = True,
) -> tuple[int, ...]:
    """The TP group for slot (``replica``, ``stage``) chosen from ``pool`` (see module
    docstring); ``()`` when no degree is feasible."""
    nominal = state.nominal_degree(replica, stage)
    layers = state.plan.layers(stage)
    pos = {d: i for i, d in enumerate(current)}
    ranked = sorted(pool, key=lambda d: (-state.throughput(d), pos.get(d, len(pos)), d))
    degrees = _degrees(state.k_min, min(len(ranked), nominal)) if resize else (
        [nominal] if len(ranked) >= nominal else [])
    heads = state.plan.num_heads
    best: tuple[int, ...] = ()
    best_value = 0.0
    for k in degrees:
        if heads and heads % k:
            continue
        chosen = ranked[:k]
        if not state.fits(tuple(chosen), layers, stage):
            continue
        value = k * min(state.throughput(d) for d in chosen)
        if value <= 0:
            continue
        # Ascending k: a later (larger) degree wins ties.
        if not best or value >= best_value * (1 - _TIE):
            best, best_value = tuple(chosen), value
    if not best:
        return ()
    kept = [d for d in current if d in best]
    return tuple(kept + sorted(d for d in best if d not in pos))


def spread_migrations(
    tp_groups: Sequence[Sequence[Sequence[int]]],
    num_microbatches: int,
    weight: dict[tuple[int, int], float] | None = None,
    room: dict[tuple[int, int], int] | None = None,
) -> tuple[Migration, ...]:
    """Round-robin every micro-batch of each empty (replica, stage) over that stage's
    non-empty peers, heaviest ``weight`` first (ties: lower replica), skipping peers
    whose ``room`` (items their memory allows, default unbounded) is used up. Raises
    :class:`RestoreRequired` when a stage has no peer left or no room."""
    dp, pp = len(tp_groups), len(tp_groups[0])
    out: list[Migration] = []
    for s in range(pp):
        empty = [r for r in range(dp) if not tp_groups[r][s]]
        if not empty:
            continue
        peers = [r for r in range(dp) if tp_groups[r][s]]
        if not peers:
            raise RestoreRequired(f"every replica of stage {s} has lost its devices")
        if weight:
            peers.sort(key=lambda r: (-weight.get((r, s), 1.0), r))
        load = {r: num_microbatches for r in peers}
        i = 0
        for r in empty:
            for j in range(num_microbatches):
                for _ in range(len(peers)):
                    e = peers[i % len(peers)]
                    i += 1
                    if room is None or load[e] < room.get((e, s), 1 << 30):
                        break
                else:
                    raise RestoreRequired(
                        f"stage {s}: no peer has memory for micro-batch ({r}, {j}) of a lost group")
                load[e] += 1
                out.append(Migration(s, r, j, e))
    return tuple(out)


def _unhealthy(state: PlannerState) -> frozenset[int]:
    """Failed devices and devices with a compute or link throughput below 1."""
    return state.failed | {d for d, p in state.speeds.items() if p < 1.0} | {
        d for d, p in state.link_speeds.items() if p < 1.0}


def _needs_attention(state: PlannerState, r: int, s: int, group: tuple[int, ...],
                     unhealthy: frozenset[int]) -> bool:
    if len(group) < state.nominal_degree(r, s):
        return True
    return any(d in unhealthy for d in group)


def tp_stage(state: PlannerState) -> PlannerState:
    """Selective exclusion for every affected TP group; returns the adapted state."""
    plan, home, caps = state.plan, state.home, state.capabilities
    resize = caps.tp_resize and caps.heterogeneous_tp
    free = [d for d in plan.standbys if d not in state.failed]
    groups = [list(rep) for rep in plan.tp_groups]
    unhealthy = _unhealthy(state)
    slots = [
        (r, s) for r in range(plan.dp) for s in range(plan.pp)
        if _needs_attention(state, r, s, plan.group(r, s), unhealthy)
    ]
    # Worst first: it draws the standbys first.
    slots.sort(key=lambda rs: (
        state.group_throughput(tuple(d for d in plan.group(*rs) if d not in state.failed))
        / state.nominal_degree(*rs), rs))
    notes: list[str] = []
    for r, s in slots:
        cur = plan.group(r, s)
        members = [d for d in cur if d not in state.failed]
        nodes = {state.node(d) for d in home.group(r, s) + cur}
        extra = [d for d in free if state.node(d) in nodes]
        chosen = choose_group(state, r, s, members + extra, cur, resize=resize)
        left = [d for d in members if d not in chosen]
        free = [d for d in free if d not in chosen] + left
        groups[r][s] = list(chosen)
        if tuple(chosen) != cur:
            lost = [d for d in cur if d in state.failed]
            why = []
            if lost:
                why.append("fail-stop " + ",".join(map(str, lost)))
            if left:
                why.append("standby " + ",".join(
                    f"{d}(p={state.throughput(d):.2f})" for d in left))
            added = [d for d in chosen if d not in cur]
            if added:
                why.append("drew " + ",".join(map(str, added)))
            notes.append(
                f"replica {r} stage {s}: TP {len(cur)} -> {len(chosen)}"
                + (f" ({'; '.join(why)})" if why else "")
            )
    if caps.migrates(plan.pp) and plan.dp > 1:
        for r, s in _early_drops(state, groups):
            free += [d for d in groups[r][s]]
            notes.append(f"replica {r} stage {s}: TP {len(groups[r][s])} -> 0 (slow group dropped: "
                         "its peers absorb its share with a smaller bottleneck)")
            groups[r][s] = []
    empty = [(r, s) for r in range(plan.dp) for s in range(plan.pp) if not groups[r][s]]
    if empty and not caps.migrates(plan.pp):
        raise RestoreRequired(
            f"replica {empty[0][0]} stage {empty[0][1]} has no feasible TP group and the "
            "adapter cannot migrate work across replicas"
        )
    weight = None
    if empty:
        weight = {(r, s): state.group_throughput(tuple(groups[r][s]))
                  for r in range(plan.dp) for s in range(plan.pp) if groups[r][s]}
    room = None
    if empty:
        room = {(r, s): state.memory.max_items(
                    state.min_capacity(tuple(groups[r][s])), plan.layers(s), len(groups[r][s]),
                    plan.schedule, s, plan.pp)
                for r in range(plan.dp) for s in range(plan.pp) if groups[r][s]}
    forced = spread_migrations(groups, plan.num_microbatches, weight, room)
    new = plan.with_(
        tp_groups=tuple(tuple(tuple(g) for g in rep) for rep in groups),
        migrations=forced,
        standbys=tuple(free),
        excluded=frozenset(d for d in state.failed if d in state.topology.ids),
    )
    note = "tp: " + ("; ".join(notes) if notes else "no change")
    return state.with_plan(new, note)


def drop_groups(plan: ParallelPlan, bad: set[int], failed: frozenset[int]) -> ParallelPlan:
    """``plan`` with every TP group that contains a device of ``bad`` emptied (its
    alive devices become standbys) and the emptied slots' work spread evenly over
    their peers: what systems that drop whole TP groups do."""
    slots = {(r, s) for r, s in plan.executors() if any(d in bad for d in plan.group(r, s))}
    return drop_slots(plan, slots, failed)


def drop_slots(plan: ParallelPlan, slots: set[tuple[int, int]], failed: frozenset[int],
               room: dict[tuple[int, int], int] | None = None) -> ParallelPlan:
    """``plan`` with the TP groups of ``slots`` ((replica, stage) pairs) emptied, their
    alive devices made standbys, and every micro-batch of the emptied slots spread
    round-robin over the stage's peers (replacing all other migrations)."""
    groups = [list(rep) for rep in plan.tp_groups]
    standbys = [d for d in plan.standbys if d not in failed]
    for r, s in sorted(slots):
        standbys += [d for d in groups[r][s] if d not in failed]
        groups[r][s] = []
    forced = spread_migrations(groups, plan.num_microbatches, room=room)
    return plan.with_(
        tp_groups=tuple(tuple(tuple(g) for g in rep) for rep in groups),
        migrations=forced,
        standbys=tuple(standbys),
        excluded=frozenset(failed),
    )


def _bottleneck_work(state: PlannerState, plan: ParallelPlan) -> float:
    """The busiest executor's compute (seconds) under the per-item model."""
    import numpy as np

    ic = state.evaluator.item_cost(plan)
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    layers = np.array([plan.layers(s) for s in range(pp)], float)
    ex = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
    for mig in plan.migrations:
        ex[mig.stage, mig.replica, mig.mb] = mig.to
    sidx = np.arange(pp)[:, None, None]
    inv_q = np.where(np.isfinite(ic.inv_q), ic.inv_q, 0.0)
    t = layers[:, None, None] * (ic.base * inv_q[sidx, ex] + ic.comm[sidx, ex])
    work = np.zeros((pp, dp))
    np.add.at(work, (np.broadcast_to(sidx, ex.shape), ex), t)
    return float(work.max())


def _minmax_bottleneck(weights, total: int) -> float:
    from resihp_core.scheduler.pp import minmax_counts

    c = minmax_counts(weights, total)
    return float("inf") if c is None else max(n * w for n, w in zip(c, weights))


def _early_drops(state: PlannerState, groups: list[list[list[int]]]) -> list[tuple[int, int]]:
    """Slots to drop right away: a group running below nominal throughput whose share
    the stage's peers absorb with a smaller bottleneck than keeping it, once layers are
    repartitioned — compared on the min-max bottleneck of per-layer stage times (keep:
    the slowest group of each stage; drop: the peers, each carrying ``dp / peers`` of
    the stage's micro-batches). With many replicas this is what wins: a slow group,
    even relieved, gates its own pipeline, while a vanished one spreads thinly."""
    import numpy as np

    plan = state.plan
    if plan.pp == 1:
        # No pipeline for a slow group to gate: migration balances it exactly, and the
        # keep estimate here (no migration) would drop groups migration should relieve
        # (TP1 x PP1 x DP2 at p = 0.45: dropped 0.263 s, migrating 3 items 0.186 s,
        # simulated). drop_stage still compares dropping with the simulator afterwards.
        return []
    slots = [(r, s) for r in range(plan.dp) for s in range(plan.pp) if groups[r][s]
             and state.group_throughput(tuple(groups[r][s])) < state.nominal_degree(r, s) * (1 - 1e-9)]
    if not slots:
        return []
    out: list[tuple[int, int]] = []
    shaped = plan.with_(tp_groups=tuple(tuple(tuple(g) for g in rep) for rep in groups),
                        migrations=spread_migrations(groups, plan.num_microbatches),
                        standbys=(), excluded=frozenset())
    per = state.evaluator.item_cost(shaped).per_layer()  # [pp, dp]; inf = no devices
    alive = np.isfinite(per)

    def weights(mask: np.ndarray) -> np.ndarray:
        w = np.where(mask, per, -np.inf).max(axis=1) * plan.dp / mask.sum(axis=1)
        return w

    for r, s in sorted(slots, key=lambda rs: -per[rs[1], rs[0]]):
        if alive[s].sum() < 2:
            continue
        drop = alive.copy()
        drop[s, r] = False
        keep_t = _minmax_bottleneck(weights(alive), plan.num_layers)
        drop_t = _minmax_bottleneck(weights(drop), plan.num_layers)
        if drop_t < keep_t * (1 - 0.02):
            alive = drop
            out.append((r, s))
    return out


def drop_stage(state: PlannerState) -> PlannerState:
    """Escalation at the TP level, after TP -> PP -> DP: would dropping every TP group
    that runs below its nominal throughput (a slow member, or shrunk; its work spread
    round-robin over the stage's DP peers, the layer partition as before planning)
    beat the adapted plan?

    With many replicas it can: a slow group, even shrunk and relieved by migration,
    still gates its own replica's pipeline (1F1B keeps few micro-batches in flight),
    while a vanished one only adds ``1 / peers`` work to each peer. The candidate is
    simulated only when the per-item model says its busiest executor is less loaded
    than the adapted plan's; it is kept only if the simulator says it is faster."""
    plan = state.plan
    caps = state.capabilities
    if not caps.migrates(plan.pp) or plan.dp < 2:
        return state.with_plan(plan, "drop: skipped (no cross-replica migration)")
    slow = {(r, s) for r, s in plan.executors()
            if state.group_throughput(plan.group(r, s)) < state.nominal_degree(r, s) * (1 - 1e-9)}
    if not slow:
        return state.with_plan(plan, "drop: every TP group runs at its nominal throughput")
    prev = state.previous or plan
    try:
        cand = drop_slots(plan, slow, state.failed)
    except RestoreRequired:
        return state.with_plan(plan, "drop: would lose every replica of a stage")
    if prev.layer_ranges != cand.layer_ranges and prev.pp == cand.pp:
        alt = cand.with_(layer_ranges=prev.layer_ranges)
        if all(state.fits(g, alt.layers(s), s) for r, s in alt.executors() for g in [alt.group(r, s)]):
            cand = alt
    if state.memory_violations(cand):
        return state.with_plan(plan, "drop: the peers' memory cannot take the dropped work")
    if _bottleneck_work(state, cand) >= _bottleneck_work(state, plan) * (1 - 1e-2):
        return state.with_plan(plan, "drop: dropping slow groups cannot pay (per-item model)")
    t_plan, t_cand = state.evaluator.time(plan), state.evaluator.time(cand)
    if not t_cand < t_plan * (1 - 1e-9):
        return state.with_plan(plan, f"drop: kept slow groups ({t_plan:.4g}s vs {t_cand:.4g}s dropped)")
    dropped = sorted({(r, s) for r, s in plan.executors() if not cand.group(r, s)})
    return state.with_plan(
        cand,
        "drop: TP groups " + ", ".join(f"replica {r} stage {s}" for r, s in dropped)
        + f" dropped, work spread over peers ({t_plan:.4g}s -> {t_cand:.4g}s)",
    )
