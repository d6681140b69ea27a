"""The honest optimum of small instances: every plan the planner can reach, simulated.

Why: the MILP of :mod:`resihp_core.scheduler.exact` is exact only under its own
bottleneck model, which ignores pipeline fill/drain order, in-flight caps and the P2P
time of migrated work; judged by the DAG simulator its "optimum" can be slower than
the planner's plan. For small instances (pp <= 4, dp <= 2, tp <= 4) the plan space the
planner searches is small enough to enumerate and *simulate* completely:

- **TP exclusions**: for every affected (replica, stage) slot, each option of
  :func:`~resihp_core.scheduler.exact.tp_options` (every feasible power-of-two degree
  with its fastest members, or emptying the group when work can migrate);
- **layer partitions**: every split of the layers into ``pp`` contiguous non-empty
  ranges within memory (:func:`~resihp_core.scheduler.pp.layer_limits`);
- **migration counts**: for every stage with an affected slot, how many of that
  replica's micro-batches its DP peer runs (0..m, evenly spread over the iteration,
  as :func:`~resihp_core.scheduler.exact.spread` places them; all m when the slot is
  empty).

Each candidate is judged by the failed state's evaluator (the simulator with the
devices' speeds and links), the same judge the planner uses. Not enumerated (stated
limits): migrations out of a healthy replica into an affected one, and which
micro-batches move beyond even spreading.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from resihp_core.plan import Migration, ParallelPlan, PlanError, ranges_from_counts

__all__ = ["Optimum", "compositions", "enumerate_plans", "optimum"]


@dataclass(frozen=True)
class Optimum:
    """Best simulated plan of the enumerated space.

    :param plan: the best plan; :param time: its simulated iteration seconds;
    :param candidates: plans simulated; :param seconds: wall time spent."""

    plan: ParallelPlan
    time: float
    candidates: int
    seconds: float


def compositions(total: int, parts: int, limits: list[int] | None = None) -> list[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers (in order), each at
    most its limit."""
    out = []
    for cuts in itertools.combinations(range(1, total), parts - 1):
        c = tuple(b - a for a, b in zip((0, *cuts), (*cuts, total)))
        if limits is None or all(x <= lim for x, lim in zip(c, limits)):
            out.append(c)
    return out


def enumerate_plans(state: Any, *, max_candidates: int = 200_000) -> list[ParallelPlan]:
    """The plan space of the module docstring for ``state`` (failures already applied
    to its health; ``state.plan`` the pre-failure plan)."""
    from resihp_core.scheduler.exact import spread, tp_options
    from resihp_core.scheduler.pp import layer_limits

    plan = state.plan
    dp, pp, m = plan.dp, plan.pp, plan.num_microbatches
    if dp > 2:
        raise ValueError(f"enumeration supports dp <= 2, got dp={dp}")
    opts = tp_options(state)
    slots = [(r, s) for r in range(dp) for s in range(pp)]
    affected = [i for i, o in enumerate(opts) if len(o) > 1 or o[0] != plan.group(*slots[i])]
    parts = compositions(plan.num_layers, pp, layer_limits(state, plan))
    n = 1
    for i in affected:
        n *= len(opts[i])
    n *= len(parts) * max(1, (m + 1) ** len(affected) if dp > 1 else 1)
    if n > max_candidates:
        raise ValueError(f"{n} candidates exceed max_candidates={max_candidates}")
    failed = frozenset(state.failed)
    out: list[ParallelPlan] = []
    for choice in itertools.product(*[opts[i] for i in affected]):
        groups = [list(plan.tp_groups[r]) for r in range(dp)]
        for i, g in zip(affected, choice):
            r, s = slots[i]
            groups[r][s] = tuple(g)
        tg = tuple(tuple(rep) for rep in groups)
        used = {d for rep in tg for g in rep for d in g}
        if len(used) != sum(len(g) for rep in tg for g in rep):
            continue  # a standby picked twice
        standbys = tuple(d for d in sorted(state.topology.ids) if d not in used and d not in failed)
        count_sets = [(m,) if not tg[slots[i][0]][slots[i][1]] else (range(m + 1) if dp > 1 else (0,))
                      for i in affected]
        for counts in itertools.product(*count_sets):
            migs: list[Migration] = []
            ok = True
            for i, c in zip(affected, counts):
                r, s = slots[i]
                peer = 1 - r if dp > 1 else r
                if c and (dp == 1 or not tg[peer][s]):
                    ok = False
                    break
                migs += [Migration(s, r, j, peer) for j in spread(c, m)]
            if not ok:
                continue
            if dp > 1 and not tg[0][0] and not tg[1][0]:
                continue
            for part in parts:
                try:
                    out.append(plan.with_(tp_groups=tg, layer_ranges=ranges_from_counts(part),
                                          migrations=tuple(sorted(set(migs))), standbys=standbys,
                                          excluded=failed))
                except PlanError:
                    continue
    return out


def optimum(state: Any, *, max_candidates: int = 200_000) -> Optimum:
    """Simulate every enumerated plan with ``state``'s evaluator; the fastest wins."""
    t0 = time.perf_counter()
    best: tuple[float, ParallelPlan] | None = None
    plans = enumerate_plans(state, max_candidates=max_candidates)
    n = 0
    for p in plans:
        if state.memory_violations(p):
            continue
        t = state.evaluator.time(p)
        n += 1
        if best is None or t < best[0]:
            best = (t, p)
    if best is None:
        raise ValueError("no feasible plan in the enumerated space")
    return Optimum(best[1], best[0], n, time.perf_counter() - t0)
