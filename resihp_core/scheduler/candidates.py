"""Whole-plan candidates: every peer system's move, judged next to the progressive plan.

Why: the progressive stages (TP -> PP -> DP -> drop) each take the best local step,
and a sequence of local steps can miss a plan another system would simply pick. On
TP8 PP16 DP128 (16,384 GPUs) the TP stage's first step halves the hit group (8 -> 4)
and every replica's synchronous step waits for that pipeline, while dropping the hit
replica and spreading its micro-batches over the other 127 adds about one micro-batch
to some replicas. So after the stages, the planner also builds each peer's move on
the same state and keeps whichever plan the evaluator (the planner's simulator)
predicts fastest; the progressive plan wins ties. The planner is then never slower,
by its own simulator, than any of these moves:

- ``keep``: the plan as it was (what a system without fail-slow handling runs), when
  it uses no failed device;
- ``drop-replica``: every replica with a failed or slow device leaves the plan, its
  micro-batches spread round-robin over the other replicas (torchft's replica-group
  drop, with the global batch kept); built from the plan before the stages and from
  the stages' plan (whose replicas a repair made whole again stay);
- ``shed-k``: the progressive plan's groups, but each replica with a failed, slow or
  shrunk group keeps only its first ``k`` micro-batches (``k`` = half of them,
  :data:`SHED_FRACTIONS`); the rest run whole (every
  stage) on healthy replicas, one per replica in turn. A shrunk pipeline that runs
  fewer micro-batches no longer gates the step, and its healthy devices keep working;
- ``drop-group``: every TP group with a failed or slow device leaves the plan, its
  work spread over the stage's peers (ReCycle, Oobleck);
- ``dp-only`` / ``pp-only``: micro-batch migration alone or layer repartition alone
  (Greyhound's first two levels), lost groups dropped as above.

- ``restage-pp{P}``: whole replicas of ``P`` stages over the survivors, layers split
  evenly, the same global batch re-split (more micro-batches per replica when there
  are fewer replicas), for adapters that declare ``restage`` and cannot keep a partial
  replica busy: after a kill on PP2 x DP2 the stages drop the hit replica and leave its
  survivor on standby, while PP3 x DP1 keeps all three busy (:func:`restage`). Judged
  on its own workload features (the same micro-batches in the new replica shape).

Restores (a fresh layout from a checkpoint) are not candidates here: they lose work,
which an iteration-time comparison cannot weigh.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from resihp_core.plan import Migration, ParallelPlan, PlanError
from resihp_core.scheduler.evaluate import Features
from resihp_core.scheduler.state import PlannerError, PlannerState, RestoreRequired

__all__ = ["SHED_FRACTIONS", "drop_replicas", "peer_candidates", "restage", "shed_replicas"]

#: Fractions of its micro-batches a hit replica keeps in the ``shed-k`` candidates.
SHED_FRACTIONS = (0.5,)


def _unhealthy(state: PlannerState) -> set[int]:
    return set(state.failed) | {d for d, p in state.speeds.items() if p < 1.0} | {
        d for d, p in state.link_speeds.items() if p < 1.0}


def _hit_replicas(state: PlannerState, plan: ParallelPlan) -> list[int]:
    """Replicas with a failed or slow device, an empty group, or a group below its
    nominal degree."""
    bad = _unhealthy(state)
    out = []
    for r, rep in enumerate(plan.tp_groups):
        for s, g in enumerate(rep):
            if not g or any(d in bad for d in g) or len(g) < state.nominal_degree(r, s):
                out.append(r)
                break
    return out


def drop_replicas(plan: ParallelPlan, replicas: list[int], failed: frozenset[int]) -> ParallelPlan:
    """``plan`` with every group of ``replicas`` emptied (alive members become
    standbys) and all their micro-batches spread round-robin over the other replicas,
    the same peer for every stage of a micro-batch."""
    from resihp_core.scheduler.tp import drop_slots

    return drop_slots(plan, {(r, s) for r in replicas for s in range(plan.pp)}, failed)


def shed_replicas(plan: ParallelPlan, replicas: list[int], keep: int) -> ParallelPlan:
    """``plan`` where each of ``replicas`` runs only its micro-batches ``0..keep-1``;
    the others run at every stage on the remaining replicas, one per replica in turn
    (those that already receive the fewest first). Migrations of kept micro-batches
    stay as they were; a receiver with no group at some stage is skipped."""
    hit = set(replicas)
    m, pp = plan.num_microbatches, plan.pp
    peers = [r for r in range(plan.dp) if r not in hit and all(plan.tp_groups[r])]
    if not peers:
        raise RestoreRequired("no healthy replica to take shed micro-batches")
    migs = [mg for mg in plan.migrations if not (mg.replica in hit and mg.mb >= keep)]
    load = {r: 0 for r in peers}
    for mg in migs:
        if mg.to in load and mg.stage == 0:
            load[mg.to] += 1
    order = sorted(peers, key=lambda r: (load[r], r))
    i = 0
    for r in sorted(hit):
        for j in range(keep, m):
            e = order[i % len(order)]
            i += 1
            migs.extend(Migration(s, r, j, e) for s in range(pp))
    return plan.with_(migrations=tuple(migs))


def peer_candidates(before: PlannerState, after: PlannerState) -> list[tuple[str, ParallelPlan]]:
    """The peer moves (module docstring) for the report folded into ``before`` (its
    plan is the plan before the stages ran), next to the stages' result ``after``."""
    from resihp_core.scheduler.baselines import dp_only, pp_only
    from resihp_core.scheduler.tp import drop_groups

    prev, plan = before.plan, after.plan
    out: list[tuple[str, ParallelPlan]] = []

    def add(name: str, make: Callable[[], ParallelPlan | None]) -> None:
        try:
            cand = make()
        except (RestoreRequired, PlannerError, PlanError):
            return
        if cand is not None:
            out.append((name, cand))

    if before.failed.isdisjoint(prev.devices()):
        out.append(("keep", prev))
    if not before.capabilities.migrates(prev.pp) or prev.dp < 2:
        return out
    hit_prev = _hit_replicas(before, prev)
    if hit_prev and len(hit_prev) < prev.dp:
        add("drop-replica", lambda: drop_replicas(prev, hit_prev, before.failed))
        add("drop-group", lambda: drop_groups(prev, _unhealthy(before), before.failed))
    hit = _hit_replicas(after, plan)
    if hit and len(hit) < plan.dp:
        # The stages' plan with its still-hit replicas dropped: after a repair the
        # stages grow every emptied group back, the repaired replica whole, the others
        # shrunk; this keeps the first and drops the rest again.
        add("drop-replica", lambda: drop_replicas(plan, hit, after.failed))
        m = plan.num_microbatches
        for keep in sorted({int(m * f) for f in SHED_FRACTIONS}, reverse=True):
            add(f"shed-{keep}", lambda k=keep: shed_replicas(plan, hit, k))
    if before.thorough:  # two more stage runs: affordable on small jobs only
        base = replace(before, notes=())
        add("dp-only", lambda: dp_only(base))
        add("pp-only", lambda: pp_only(base))
    return out


def restage(state: PlannerState, busy: int) -> list[tuple[str, ParallelPlan, Features]]:
    """Whole-replica layouts with another stage count than ``state.plan``'s that place
    more than ``busy`` devices (what the plan they compete with places), each with its
    workload features (its replica count differs): empty unless the adapter declares
    ``restage`` and ``layer_repartition`` and ``busy`` leaves a survivor idle.
    ``state`` holds the plan before the report, failures folded in: each new stage goes
    to the devices holding most of its layers, so the state moves from the survivors.
    Stage counts run from 1 to the layer count (or the survivors); each must fit in
    memory (as a restore layout)."""
    from resihp_core.scheduler.planner import _restore_groups, layout_on

    caps = state.capabilities
    if not (caps.restage and caps.layer_repartition):
        return []
    alive = state.topology.ids - state.failed
    if busy >= len(alive):
        return []
    cur = state.plan
    total = cur.dp * cur.num_microbatches
    degree = max((len(g) for rep in state.home.tp_groups for g in rep), default=1)
    out: list[tuple[str, ParallelPlan, Features]] = []
    for pp in range(1, min(cur.num_layers, len(alive)) + 1):
        if pp == cur.pp:
            continue
        best = _restore_groups(state, cur, pp, total, [degree])
        if best is None or best[0] * pp * best[1] <= busy:
            continue
        try:
            plan, feats = layout_on(state, pp, best)
        except (PlannerError, PlanError):
            continue
        out.append((f"restage-pp{pp}", plan, feats))
    return out
