"""The exact solver for small instances: a mixed-integer program solved with HiGHS.

It measures how far the progressive heuristic is from the best plan, under a stated
model of iteration time (the *bottleneck model*), for small jobs only (it grows with
stages x replicas^2 x micro-batches binaries).

**Decisions.** For each affected TP slot, one of its TP options (every feasible
power-of-two degree with its fastest members, as the TP stage would pick them, or
dropping the group when work can migrate); the number of layers ``L_s`` of each stage
(shared by all replicas, ``1 <= L_s <= Lmax_s`` from memory); and for every stage s,
owner replica r and executor e, how many of r's micro-batches e runs at s: integer
``n[s,r,e]``. TP options are enumerated (one MILP per combination; the best wins), the
rest is the MILP.

**The bottleneck model.** With ``c[s,e,r]`` the per-layer F+B(+W) seconds of one of
replica r's micro-batches at stage s on executor e, priced at the mean over r's
micro-batches (:class:`~.evaluate.ItemCost`: TP degree, slowest member, TP all-reduces,
slow links), ``abar[s',e]`` the mean per-layer micro-batch time of replica e's own
executor at stage s' (the stage's mean where e has none) and ``rho_s`` the per-layer DP
reduction plus optimizer time of stage s::

    minimise T  subject to, for every stage s and executor e of s,
    T >= L_s * sum_r c[s,e,r] n[s,r,e]                   (its work)
         + sum_{s' != s} abar[s',e] L_s'                 (one micro-batch through the
                                                           other stages: fill + drain)
         + rho_s L_s                                     (gradient sync + step)
    sum_e n[s,r,e] = m;  sum_s L_s = layers;  1 <= L_s <= Lmax_s

Among optimal plans, a second pass picks one migrating the fewest micro-batches.
``L_s`` is one-hot encoded (``L_s = sum_v v d[s,v]``) and the product with the work
is written exactly in an extended formulation: ``w[s,r,e,v] = n[s,r,e] d[s,v]`` with
``sum_e w[s,r,e,v] = m d[s,v]``, so the work term is ``sum_v v sum_r c w`` (no big-M,
a tight relaxation). Which of
r's micro-batches move does not matter to the model; the plan spreads them evenly over
the iteration (what the progress-aware heuristic does too).

**Relation to the simulator.** For homogeneous stages and 1F1B this is the simulator's
closed form, ``(m + p - 1)(F + B)`` plus the reduction. It ignores the order in which
an executor runs its work, the 1F1B in-flight caps, and the P2P time of migrated
micro-batches, so it is optimistic about migration (the simulator is the judge of
plans; this model is the judge of *optimality*). :func:`model_time` evaluates any plan
under the same model, so the heuristic's gap is measured like-for-like, and the
benchmark also simulates the MILP's plan.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from resihp_core.plan import Migration, ParallelPlan, ranges_from_counts
from resihp_core.scheduler.pp import layer_limits
from resihp_core.scheduler.state import PlannerState
from resihp_core.scheduler.tp import _degrees, spread_migrations

__all__ = ["ExactResult", "model_time", "solve_exact", "tp_options"]


@dataclass(frozen=True)
class ExactResult:
    """The best plan under the bottleneck model.

    :param plan: the optimal plan (or the best found when not ``optimal``).
    :param model_time: its iteration time under the model (seconds).
    :param lower_bound: proven lower bound on the model optimum (HiGHS' dual bound;
        equals ``model_time`` within ``gap`` when ``optimal``).
    :param optimal: every MILP solved to proven optimality.
    :param solve_s: wall seconds spent.
    :param combinations: TP-option combinations solved.
    """

    plan: ParallelPlan | None
    model_time: float
    lower_bound: float
    optimal: bool
    solve_s: float
    combinations: int


def _model_terms(state: PlannerState, plan: ParallelPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c [pp, e, r] per-layer time of one of r's micro-batches on e, abar [pp, e],
    rho [pp]) for ``plan``'s groups; inf where e has no devices at s."""
    ev = state.evaluator
    ic = ev.item_cost(plan)
    pp, dp = plan.pp, plan.dp
    mean = ic.base.mean(axis=2)  # [pp, r]
    c = mean[:, None, :] * ic.inv_q[:, :, None] + ic.comm[:, :, None]
    own = np.full((pp, dp), np.nan)
    for r, s in plan.executors():
        own[s, r] = float(c[s, r, r])
    abar = np.where(np.isnan(own), np.nanmean(own, axis=1, keepdims=True), own)
    inp = ev.inputs(plan.with_(migrations=spread_migrations(plan.tp_groups, plan.num_microbatches)))
    layers = np.array([plan.layers(s) for s in range(pp)], float)
    rho = (np.asarray(inp["reduce_time"]) + np.asarray(inp["optimizer_time"])) / layers
    return c, abar, rho


def model_time(state: PlannerState, plan: ParallelPlan) -> float:
    """Iteration time of ``plan`` under the bottleneck model (see module docstring)."""
    c, abar, rho = _model_terms(state, plan)
    L = np.array([plan.layers(s) for s in range(plan.pp)], float)
    load = np.zeros((plan.pp, plan.dp))
    for (s, r, _), e in plan.executor_map().items():
        load[s, e] += c[s, e, r] * L[s]
    worst = 0.0
    for e, s in plan.executors():
        other = float(np.dot(abar[:, e], L) - abar[s, e] * L[s])
        worst = max(worst, load[s, e] + other + rho[s] * L[s])
    return worst


def spread(count: int, m: int) -> list[int]:
    """``count`` micro-batch indices out of ``m``, evenly spaced, ending at ``m - 1``."""
    if count <= 0:
        return []
    return sorted({m - 1 - int(i * m / count) for i in range(count)})


def tp_options(state: PlannerState) -> list[list[tuple[int, ...]]]:
    """For every (replica, stage) slot, in row-major order, its candidate TP groups:
    one (kept) for healthy slots, every feasible degree's fastest members (and ``()``
    when work may migrate) for affected ones."""
    plan = state.plan
    resize = state.capabilities.tp_resize and state.capabilities.heterogeneous_tp
    free = [d for d in plan.standbys if d not in state.failed]
    out: list[list[tuple[int, ...]]] = []
    for r in range(plan.dp):
        for s in range(plan.pp):
            cur = plan.group(r, s)
            affected = len(cur) < state.nominal_degree(r, s) or any(
                d in state.failed or state.throughput(d) < 1.0 for d in cur)
            if not affected:
                out.append([cur])
                continue
            nodes = {state.node(d) for d in state.home.group(r, s) + cur}
            pool = [d for d in cur if d not in state.failed] + [
                d for d in free if state.node(d) in nodes]
            pos = {d: i for i, d in enumerate(cur)}
            ranked = sorted(pool, key=lambda d: (-state.throughput(d), pos.get(d, len(pos)), d))
            nominal = state.nominal_degree(r, s)
            ks = _degrees(state.k_min, min(len(ranked), nominal)) if resize else (
                [nominal] if len(ranked) >= nominal else [])
            opts = [tuple(ranked[:k]) for k in ks
                    if not (plan.num_heads and plan.num_heads % k)]
            if state.capabilities.migrates(plan.pp) and plan.dp > 1:
                opts.append(())
            out.append(opts or [()])
    return out


class _Rows:
    """Row-wise sparse constraints for HiGHS."""

    def __init__(self) -> None:
        self.lo: list[float] = []
        self.hi: list[float] = []
        self.starts: list[int] = []
        self.idx: list[int] = []
        self.val: list[float] = []

    def add(self, cols: Sequence[int], vals: Sequence[float], lo: float, hi: float) -> None:
        self.starts.append(len(self.idx))
        self.idx.extend(cols)
        self.val.extend(vals)
        self.lo.append(lo)
        self.hi.append(hi)


def _solve_one(
    state: PlannerState, plan: ParallelPlan, time_limit: float, gap: float
) -> tuple[ParallelPlan | None, float, float, bool]:
    """(plan, its model time, the solver's proven lower bound, proven optimal)."""
    import highspy

    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    c, abar, rho = _model_terms(state, plan)
    lmax = [min(x, plan.num_layers - pp + 1) for x in layer_limits(state, plan)]
    if any(x < 1 for x in lmax) or sum(lmax) < plan.num_layers:
        return None, math.inf, math.inf, True
    execs = {s: [e for e in range(dp) if plan.group(e, s)] for s in range(pp)}
    inf = highspy.kHighsInf
    lb: list[float] = [0.0]  # T
    ub: list[float] = [inf]
    integ: list[int] = [0]
    col_w: dict[tuple[int, int, int, int], int] = {}
    col_d: dict[tuple[int, int], int] = {}

    def new_col(lo: float, hi: float, integer: bool) -> int:
        lb.append(lo), ub.append(hi), integ.append(int(integer))
        return len(lb) - 1

    for s in range(pp):
        for v in range(1, lmax[s] + 1):
            col_d[(s, v)] = new_col(0.0, 1.0, True)
            for r in range(dp):
                for e in execs[s]:
                    col_w[(s, r, e, v)] = new_col(0.0, float(m), True)
    rows = _Rows()
    rows.add([col_d[(s, v)] for s in range(pp) for v in range(1, lmax[s] + 1)],
             [float(v) for s in range(pp) for v in range(1, lmax[s] + 1)],
             plan.num_layers, plan.num_layers)
    for s in range(pp):
        rows.add([col_d[(s, v)] for v in range(1, lmax[s] + 1)], [1.0] * lmax[s], 1, 1)
        for v in range(1, lmax[s] + 1):
            for r in range(dp):
                # w[s,r,e,v] = n[s,r,e] * d[s,v]: all of r's micro-batches, if L_s = v.
                rows.add([col_w[(s, r, e, v)] for e in execs[s]] + [col_d[(s, v)]],
                         [1.0] * len(execs[s]) + [-float(m)], 0.0, 0.0)
    for s in range(pp):
        for e in execs[s]:
            cols, vals = [0], [1.0]
            for v in range(1, lmax[s] + 1):
                for r in range(dp):
                    cols.append(col_w[(s, r, e, v)])
                    vals.append(-v * float(c[s, e, r]))
            for s2 in range(pp):
                coef = rho[s] if s2 == s else float(abar[s2, e])
                for v in range(1, lmax[s2] + 1):
                    cols.append(col_d[(s2, v)])
                    vals.append(-coef * v)
            rows.add(cols, vals, 0.0, inf)  # T >= work + other + rho L
    h = highspy.Highs()
    h.silent()
    h.setOptionValue("time_limit", float(max(time_limit, 0.01)))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    n = len(lb)
    h.addVars(n, np.array(lb), np.array(ub))
    cost = np.zeros(n)
    cost[0] = 1.0
    h.changeColsCost(n, np.arange(n, dtype=np.int32), cost)
    ints = np.array([i for i, t in enumerate(integ) if t], dtype=np.int32)
    h.changeColsIntegrality(len(ints), ints, np.array([highspy.HighsVarType.kInteger] * len(ints)))
    h.addRows(len(rows.lo), np.array(rows.lo), np.array(rows.hi), len(rows.idx),
              np.array(rows.starts, dtype=np.int32), np.array(rows.idx, dtype=np.int32),
              np.array(rows.val))
    h.run()
    status = h.getModelStatus()
    if status == highspy.HighsModelStatus.kInfeasible:
        return None, math.inf, math.inf, True
    values = np.asarray(h.getSolution().col_value)
    if values.size != n or not np.isfinite(values).all():
        return None, math.inf, 0.0, False
    bound = min(float(h.getInfo().mip_dual_bound), float(values[0]))
    optimal = status == highspy.HighsModelStatus.kOptimal
    if optimal:
        # Second pass: among plans within 1e-6 of the optimal T, the one migrating the
        # fewest micro-batches (otherwise replicas may swap work for nothing).
        moved = np.zeros(n)
        for (s, r, e, v), col in col_w.items():
            if e != r:
                moved[col] = 1.0
        h.changeColsCost(n, np.arange(n, dtype=np.int32), moved)
        h.changeColBounds(0, 0.0, float(values[0]) * (1 + 1e-6))
        h.setOptionValue("mip_rel_gap", 0.0)
        h.setOptionValue("time_limit", float(max(0.25 * time_limit, 0.01)))
        h.setSolution(h.getSolution())
        h.run()
        second = np.asarray(h.getSolution().col_value)
        if second.size == n and np.isfinite(second).all() and h.getModelStatus() in (
                highspy.HighsModelStatus.kOptimal, highspy.HighsModelStatus.kTimeLimit):
            values = second
    counts = [max(v for v in range(1, lmax[s] + 1) if values[col_d[(s, v)]] > 0.5) for s in range(pp)]
    moves = []
    for s in range(pp):
        v = counts[s]
        for r in range(dp):
            n = {e: int(round(values[col_w[(s, r, e, v)]])) for e in execs[s]}
            mbs = spread(m - n.get(r, 0), m)
            i = 0
            for e in execs[s]:
                if e != r:
                    for j in mbs[i:i + n[e]]:
                        moves.append(Migration(s, r, j, e))
                    i += n[e]
    best = plan.with_(layer_ranges=ranges_from_counts(counts), migrations=tuple(moves))
    return best, model_time(state, best), bound, optimal


def solve_exact(
    state: PlannerState, *, time_limit: float = 20.0, gap: float = 1e-4
) -> ExactResult:
    """The best plan under the bottleneck model over every TP-option combination of
    the affected slots, layer partition and work assignment (see module docstring).
    ``state`` is the state after the failures were applied; ``gap`` is the relative
    optimality gap at which HiGHS may stop (the proven lower bound is reported)."""
    t0 = time.perf_counter()
    opts = tp_options(state)
    plan = state.plan
    best: ParallelPlan | None = None
    best_t = math.inf
    bound = math.inf
    optimal = True
    combos = 0
    for choice in itertools.product(*opts):
        left = time_limit - (time.perf_counter() - t0)
        if left <= 0:
            optimal, bound = False, 0.0
            break
        groups = tuple(tuple(choice[r * plan.pp + s] for s in range(plan.pp)) for r in range(plan.dp))
        if any(not any(groups[r][s] for r in range(plan.dp)) for s in range(plan.pp)):
            continue
        used = {d for rep in groups for g in rep for d in g}
        cand = plan.with_(
            tp_groups=groups,
            migrations=spread_migrations(groups, plan.num_microbatches),
            standbys=tuple(d for d in sorted(set(plan.standbys) | set(plan.devices()))
                           if d not in used and d not in state.failed),
            excluded=frozenset(state.failed),
        )
        sub = replace(state, plan=cand)
        got, t, lo, opt = _solve_one(sub, cand, left, gap)
        combos += 1
        optimal = optimal and opt
        bound = min(bound, lo)
        if got is not None and t < best_t:
            best, best_t = got, t
    return ExactResult(best, best_t, min(bound, best_t), optimal and best is not None,
                       time.perf_counter() - t0, combos)
