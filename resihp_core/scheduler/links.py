"""Moving traffic off a slow host link, or saying why not (docs/detector.md "Slow links").

A communication fail-slow that names every device of a node is that node's interface
(:func:`~.evaluate.node_links`): only transfers that leave the node are slow. What
crosses it depends on where the layout puts each executor, so the planner also judges
the same layout with its TP groups placed otherwise, next to the stages' plan and the
peer moves (:meth:`~.planner.Planner._best_of`):

- ``place-replicas``: each replica's stages on as few nodes as possible, the slow
  nodes' groups in the last replicas: pipeline boundaries stay inside nodes, the DP
  reductions cross;
- ``place-stages``: each stage's replicas on as few nodes as possible: the DP
  reductions stay inside nodes, the pipeline boundaries cross;
- ``place-replicas-off``: the first, with the replicas held wholly by slow nodes
  dropped (their micro-batches spread over the others): nothing crosses the link,
  the node's devices stand by;
- ``off-node``: a whole-replica layout on the other nodes' devices (as a restore
  layout, the same global batch), for adapters that re-stage.

Moving a group to another stage moves its state (layers, optimizer state) by global
layer index, as re-staging does, so the placements need an adapter that declares
``restage`` and ``layer_repartition``; dropping replicas needs micro-batch migration
(whole micro-batches: ``uneven_dp``), which the planner's checks hold every candidate to.
The evaluator decides. :func:`describe` then says what still crosses each slow link
in the chosen plan, and why, in the decision's reason (and so in the job's events).
"""

from __future__ import annotations

from dataclasses import replace

from resihp_core.plan import ParallelPlan, PlanError
from resihp_core.scheduler.evaluate import Evaluator, Features
from resihp_core.scheduler.state import PlannerError, PlannerState, RestoreRequired

__all__ = ["crossings", "describe", "link_candidates", "off_node"]


def _can_place(state: PlannerState) -> bool:
    caps = state.capabilities
    return caps.restage and caps.layer_repartition


def _placeable(plan: ParallelPlan) -> bool:
    """Every slot holds a group of one degree and no work migrates: groups can trade slots."""
    groups = [g for rep in plan.tp_groups for g in rep]
    return bool(groups) and all(groups) and len({len(g) for g in groups}) == 1 and not plan.migrations


def _place(state: PlannerState, plan: ParallelPlan, replica_major: bool) -> ParallelPlan:
    """``plan``'s groups re-placed: healthy nodes' groups first, in node order, filling
    the slots replica by replica (``replica_major``) or stage by stage."""
    slow = state.evaluator.node_links
    node = state.node
    groups = sorted((g for rep in plan.tp_groups for g in rep),
                    key=lambda g: (min(slow.get(node(d), 1.0) for d in g) < 1.0, min(node(d) for d in g), g))
    slots = ([(r, s) for r in range(plan.dp) for s in range(plan.pp)] if replica_major
             else [(r, s) for s in range(plan.pp) for r in range(plan.dp)])
    at = dict(zip(slots, groups))
    tp_groups = tuple(tuple(at[(r, s)] for s in range(plan.pp)) for r in range(plan.dp))
    return plan.with_(tp_groups=tp_groups)


def link_candidates(state: PlannerState, plan: ParallelPlan) -> list[tuple[str, ParallelPlan]]:
    """The re-placements of ``plan`` (module docstring) when some node's link is slow
    and the adapter can move state between devices; empty otherwise."""
    from resihp_core.scheduler.candidates import drop_replicas

    slow = state.evaluator.node_links
    if not slow or not _can_place(state) or not _placeable(plan):
        return []
    out: list[tuple[str, ParallelPlan]] = []
    try:
        by_replica = _place(state, plan, True)
        out += [("place-replicas", by_replica), ("place-stages", _place(state, plan, False))]
    except (PlanError, ValueError):
        return out
    off = [r for r, rep in enumerate(by_replica.tp_groups)
           if all(state.node(d) in slow for g in rep for d in g)]
    if off and len(off) < plan.dp:  # the planner's checks keep it only where the adapter runs it
        try:
            out.append(("place-replicas-off", drop_replicas(by_replica, off, state.failed)))
        except (RestoreRequired, PlannerError, PlanError):
            pass
    return out


def off_node(state: PlannerState) -> tuple[str, ParallelPlan, Features] | None:
    """A whole-replica layout of the job's stage count on the devices of the nodes whose
    link is not slow (the same global batch re-split), with its workload features; None
    when the adapter cannot re-stage or those devices cannot hold it."""
    from resihp_core.scheduler.planner import _restore_groups, layout_on

    slow = state.evaluator.node_links
    if not slow or not _can_place(state):
        return None
    behind = frozenset(d for d in state.topology.ids if state.node(d) in slow)
    away = replace(state, failed=state.failed | behind)
    cur = state.plan
    best = _restore_groups(away, cur, cur.pp, cur.dp * cur.num_microbatches,
                           [max((len(g) for rep in state.home.tp_groups for g in rep), default=1)])
    if best is None:
        return None
    try:
        plan, feats = layout_on(away, cur.pp, best)
    except (PlannerError, PlanError):
        return None
    in_use = set(plan.devices())
    plan = plan.with_(excluded=frozenset(state.failed),
                      standbys=tuple(d for d in sorted(state.topology.ids) if d not in in_use and d not in state.failed))
    return "off-node", plan, feats


def crossings(ev: Evaluator, plan: ParallelPlan, node: int) -> list[str]:
    """What in ``plan`` crosses ``node``'s interface: pipeline boundaries between
    executors on different nodes, DP reductions and TP groups that span nodes."""
    of = ev.node_of
    out: list[str] = []
    for r in range(plan.dp):
        for s in range(1, plan.pp):
            nodes = {of(d) for d in plan.group(r, s - 1) + plan.group(r, s)}
            if len(nodes) > 1 and node in nodes:
                out.append(f"the pipeline boundary of replica {r} between stages {s - 1} and {s}")
    for s in range(plan.pp):
        nodes = {of(d) for r in range(plan.dp) for d in plan.group(r, s)}
        if len(nodes) > 1 and node in nodes:
            out.append(f"the DP reduction of stage {s}")
    for r, s in plan.executors():
        nodes = {of(d) for d in plan.group(r, s)}
        if len(nodes) > 1 and node in nodes:
            out.append(f"the TP group of replica {r} stage {s}")
    for mg in plan.migrations:
        nodes = {of(d) for d in plan.group(mg.replica, mg.stage) + plan.group(mg.to, mg.stage)}
        if len(nodes) > 1 and node in nodes:
            out.append("micro-batches migrated across it")
            break
    return out


def describe(state: PlannerState, tried: dict[str, float], chosen: str) -> list[str]:
    """One line per slow node link: what the chosen plan (``state.plan``, by the move
    ``chosen``) still sends across it and why, or that it sends nothing. ``tried``: the
    link moves judged, name -> predicted seconds per iteration."""
    ev = state.evaluator
    plan = state.plan
    t = ev.time(plan)
    nodes = state.topology.nodes()
    out: list[str] = []
    for n, p in sorted(ev.node_links.items()):
        link = f"the link of node {n} (devices {list(nodes[n])}, {p:.2g} of its bandwidth)"
        across = crossings(ev, plan, n)
        used = any(state.node(d) == n for d in plan.devices())
        alts = ", ".join(f"{k} {v:.4g}s/it" for k, v in sorted(tried.items(), key=lambda kv: kv[1]))
        if not across:
            how = ("its devices stand by" if not used else
                   "pipeline boundaries and DP reductions stay inside nodes")
            out.append(f"traffic moved off {link} by {chosen}: {how}, predicted {t:.4g}s/it")
            continue
        if chosen in tried:
            out.append(f"traffic moved off {link} by {chosen}, leaving {', '.join(across)} across it "
                       f"(predicted {t:.4g}s/it; the layouts tried: {alts})")
            continue
        if set(ev.node_links) >= {state.node(d) for d in plan.devices()}:
            why = "every node the plan uses has a slow link: any layout on more than one node crosses one"
        elif not _can_place(state):
            why = ("the adapter cannot move stages between devices (placing them otherwise needs restage "
                   "and layer_repartition)")
        elif not _placeable(plan):
            why = "the plan's groups differ in degree or its work migrates, so its groups are not re-placed"
        else:
            why = (f"no layout found keeps it free and runs faster (this plan {t:.4g}s/it; "
                   f"{alts or 'no layout without it fits'})")
        out.append(f"{link} still carries {', '.join(across)}: {why}")
    return out
