"""DP adaptation: progress-aware migration of (stage, micro-batch) work (docs/design.md §4.3).

Objective: the shortest iteration, i.e. the latest DP replica finishing as early as
possible, with every (stage, micro-batch) run exactly once, dependencies kept (a
migrated stage receives its input from, and returns its output and gradient to, the
owner's pipeline: the plan's ``migrations`` and the emitter take care of that) and
the destination's memory respected.

**The heuristic** (:func:`balance`). Each stage's executors are replayed in the order
the emitter runs work, micro-batch index by micro-batch index (the global (mb, owner)
order). Each executor has a clock (the time its assigned work ends, from the per-item
compute model :class:`~.evaluate.ItemCost`); its *progress* at time t is the number of
forward passes it has completed by then, local plus migrated-in. Before each index j,
the lag of every replica behind the stage's fastest group is measured in micro-batches,
``(clock_r - clock_fastest) / (its time per micro-batch)``. A replica whose stage has
no devices (fail-stopped group), or whose lag exceeds the threshold ``delta``, hands
its next unprocessed micro-batch (j) to the group that would finish it earliest,
provided that group finishes it sooner than the owner would and can hold one more
micro-batch's activations (:meth:`MemoryModel.max_items`). Moving the *next* item,
not the tail of the iteration, keeps all replicas at the same micro-batch index, so a
fast replica never waits for an owner's input that is far in the future.

**Driven by the simulator** (:func:`dp_stage`). The replay ignores pipeline coupling:
under 1F1B a slow group's own upstream stages stall with it (few micro-batches in
flight), so work handed to a fast group arrives later than the compute model thinks,
and a partly relieved slow group still gates its replica. The replay therefore has an
*aggressiveness* κ that prices slow groups higher (:func:`balance`), and the simulator
drives the choice: each candidate replay is simulated, the global values
:data:`KAPPAS` first, then per-stage values adjusted from the best candidate's
simulated progress counts (:meth:`SimResult.progress`: when a stage's first group has
run all its forward passes, a slowest group more than ``delta`` behind gets a higher κ
if it kept too much, a lower one if it received too much). The input plan is always a
candidate, so the stage never returns a plan the simulator judges slower (unless the
input overflows a destination's memory). With lean effort (large jobs) one replay
(κ = 0.5) is simulated, and none when the replay itself predicts under
:data:`SCREEN_GAIN` of improvement.
"""

from __future__ import annotations

import numpy as np

from resihp_core.plan import Migration, ParallelPlan
from resihp_core.scheduler.state import PlannerState, RestoreRequired

__all__ = ["KAPPAS", "SCREEN_GAIN", "balance", "balance_with_gain", "dp_stage", "predicted_gain"]

#: With lean effort, a replay predicting less than this gain is not simulated.
SCREEN_GAIN = 0.02


def _max_items(state: PlannerState, plan: ParallelPlan) -> np.ndarray:
    """[pp, dp] items each executor can hold activations for (large when unbounded)."""
    out = np.full((plan.pp, plan.dp), float(1 << 30))
    mem = state.memory
    if not (mem.layer_activation_gib or mem.layer_state_gib or mem.reserve_gib):
        return out
    seen: dict[tuple[float, int, int], int] = {}  # (capacity, degree, stage): one model call each
    for r, s in plan.executors():
        g = plan.group(r, s)
        k = (state.min_capacity(g), len(g), s)
        v = seen.get(k)
        if v is None:
            v = seen[k] = mem.max_items(k[0], plan.layers(s), k[1], plan.schedule, s, plan.pp)
        out[s, r] = v
    return out


def balance(
    state: PlannerState,
    plan: ParallelPlan,
    delta: float | None = None,
    aggressiveness: float | np.ndarray = 0.5,
) -> ParallelPlan:
    """``plan`` with its migrations replaced by the progress-aware assignment."""
    return _replay(state, plan, delta, aggressiveness)[0]


def predicted_gain(state: PlannerState, plan: ParallelPlan, aggressiveness: float = 0.5) -> float:
    """Relative drop of the slowest executor's busy time that the replay predicts for
    balancing ``plan`` (0 = none); a cheap screen before simulating, not a judgement."""
    return balance_with_gain(state, plan, aggressiveness)[1]


def balance_with_gain(
    state: PlannerState, plan: ParallelPlan, aggressiveness: float = 0.5
) -> tuple[ParallelPlan, float]:
    """:func:`balance` and :func:`predicted_gain` from one replay."""
    out, before, after = _replay(state, plan, None, aggressiveness)
    return out, (0.0 if before <= 0 else max(0.0, 1.0 - after / before))


def _replay(
    state: PlannerState,
    plan: ParallelPlan,
    delta: float | None,
    aggressiveness: float | np.ndarray,
) -> tuple[ParallelPlan, float, float]:
    """(balanced plan, slowest executor's work without moves, with moves), both from
    the compute model (unboosted for the comparison).

    :param delta: progress gap (micro-batches) that triggers a move; default
        ``state.delta``.
    :param aggressiveness: κ >= 0, one value or one per stage. The replay prices each
        executor's items at
        ``(its per-layer time / the stage's fastest) ** κ`` times their modelled time,
        so κ > 0 makes slow groups look slower and hands them fewer micro-batches. The
        compute model alone (κ = 0) ignores how little slack 1F1B's in-flight caps
        leave a slow pipeline (its owner's upstream stages stall with it, so work
        migrated away arrives late); κ = 0.5 is the default that measured best across
        our scenarios, and :func:`dp_stage` lets the simulator adjust it.
    """
    delta = state.delta if delta is None else float(delta)
    pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
    ic = state.evaluator.item_cost(plan)
    layers = np.array([plan.layers(s) for s in range(pp)], float)
    has = np.isfinite(ic.inv_q)  # [pp, dp] executor exists
    inv_q, comm = np.where(has, ic.inv_q, 0.0), ic.comm
    kappa = np.broadcast_to(np.asarray(aggressiveness, float), (pp,))[:, None]
    if kappa.any():
        per = ic.per_layer()
        fastest = np.where(has, per, np.inf).min(axis=1, keepdims=True)
        boost = np.where(has, (np.where(has, per, 1.0) / fastest) ** kappa, 1.0)
        inv_q, comm = inv_q * boost, comm * boost
    inf = np.inf
    # [m, pp, dp]: seconds of micro-batch (r, j) at stage s on its own replica.
    own_all = np.where(
        has[None], layers[None, :, None] * (np.moveaxis(ic.base, 2, 0) * inv_q + comm), inf)
    true_inv_q = np.where(has, ic.inv_q, 0.0)
    # Work per executor as the plan stands (its own migrations included).
    ex = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
    for mig in plan.migrations:
        ex[mig.stage, mig.replica, mig.mb] = mig.to
    sidx = np.broadcast_to(np.arange(pp)[:, None, None], ex.shape)
    before = np.zeros((pp, dp))
    np.add.at(before, (sidx, ex), layers[:, None, None] * (
        ic.base * true_inv_q[sidx, ex] + ic.comm[sidx, ex]))
    after = np.where(has, layers[:, None] * (ic.base.sum(axis=2) * true_inv_q + ic.comm * m), 0.0)
    nmax = _max_items(state, plan)
    count = np.zeros((pp, dp))
    clock = np.zeros((pp, dp))
    moves: list[Migration] = []
    hmask = np.where(has, 0.0, inf)
    for j in range(m):
        own = own_all[j]
        cmin = (clock + hmask).min(axis=1, keepdims=True)
        # Lag behind the fastest group, in micro-batches of this group's own pace.
        mover = ~has | (clock - cmin > delta * own * (1 + 1e-9))  # ties stay (float noise)
        stay = ~mover
        clock += np.where(stay, own, 0.0)
        count += stay
        if not mover.any():
            continue
        # A destination takes extra work only while it keeps room for its own
        # remaining micro-batches (memory on the destination, docs/design.md §4.3).
        room = has & (count + (m - 1 - j) < nmax)
        for s, r in zip(*np.nonzero(mover)):
            # Where would (r, j) finish at stage s on each executor?
            t = layers[s] * (ic.base[s, r, j] * inv_q[s] + comm[s])  # [dp]
            finish = np.where(room[s], clock[s] + t, inf)
            finish[r] = inf
            e = int(np.argmin(finish))
            local = clock[s, r] + own[s, r] if has[s, r] else inf
            if finish[e] < local:
                moves.append(Migration(int(s), int(r), j, e))
                clock[s, e] = finish[e]
                count[s, e] += 1
                room[s, e] = count[s, e] + (m - 1 - j) < nmax[s, e]
                _shift(after, layers, ic, true_inv_q, s, r, j, e)
            elif local < inf:
                clock[s, r] = local
                count[s, r] += 1
            else:
                raise RestoreRequired(
                    f"stage {s}: no replica has memory for micro-batch ({r}, {j}) of a lost group")
    return plan.with_(migrations=tuple(moves)), float(before.max()), float(after.max())


def _shift(work: np.ndarray, layers: np.ndarray, ic, inv_q: np.ndarray,
           s: int, r: int, j: int, e: int) -> None:
    """Move micro-batch (r, j)'s stage-s work from executor r to executor e."""
    if np.isfinite(ic.inv_q[s, r]):
        work[s, r] -= layers[s] * (ic.base[s, r, j] * inv_q[s, r] + ic.comm[s, r])
    work[s, e] += layers[s] * (ic.base[s, r, j] * inv_q[s, e] + ic.comm[s, e])


def _adjust(state: PlannerState, plan: ParallelPlan, kappa: np.ndarray) -> np.ndarray:
    """Per-stage aggressiveness for the next replay, from the simulated progress of
    ``plan``: at each stage, when the first group has run all its forward passes, the
    group with the most left (the slowest) is compared with it. More than ``delta``
    left: if that group received migrated work, it got too much (halve κ); otherwise it
    kept too much (double κ, at least 0.25)."""
    sim = state.evaluator.simulate(plan)
    out = kappa.copy()
    fin_f = sim.finish[0]  # [pp, owner, mb]
    on = sim.executed_on  # [pp, owner, mb]
    for s in range(plan.pp):
        execs = [e for e in range(plan.dp) if plan.group(e, s)]
        if len(execs) < 2:
            continue
        last = {e: float(np.nanmax(fin_f[s][on[s] == e])) for e in execs if (on[s] == e).any()}
        if len(last) < 2:
            continue
        t = min(last.values())
        done = sim.progress(t)[s]
        left = {e: int((on[s] == e).sum()) - int(done[e]) for e in last}
        slowest = max(left, key=lambda e: (left[e], last[e]))
        if left[slowest] <= state.delta:
            continue
        received = any(m.to == slowest and m.stage == s for m in plan.migrations)
        out[s] = out[s] / 2 if received else max(0.25, out[s] * 2)
    return out


#: Global aggressiveness values tried in order (thorough effort tries them all: the
#: simulated iteration time is not monotone in κ, small pattern changes matter).
KAPPAS = (0.5, 1.0, 0.0, 2.0)


def dp_stage(state: PlannerState, *, max_tries: int | None = None) -> PlannerState:
    """Progress-aware migration, driven by the simulator (see module docstring).

    Replays at each global aggressiveness in :data:`KAPPAS`, then once more with each
    stage's κ adjusted from the best candidate's simulated progress counts
    (:func:`_adjust`): at most ``max_tries`` replays (default 5, or 1 when
    ``state.thorough`` is false). The best simulated candidate wins; the input plan is
    always one."""
    if max_tries is None:
        max_tries = len(KAPPAS) + 1 if state.thorough else 1
    if not state.capabilities.migrates(state.plan.pp):
        return state.with_plan(state.plan, "dp: adapter cannot migrate work; skipped")
    if state.plan.dp < 2:
        return state.with_plan(state.plan, "dp: one replica; nothing to migrate")
    ev = state.evaluator
    start = state.plan
    t_in = ev.time(start)
    best, best_t, best_k = start, t_in, None
    if state.memory_violations(start):
        # The input (e.g. lost groups' work spread round-robin) overflows a peer's
        # memory: any memory-respecting replay beats it.
        best_t = float("inf")
    if not state.thorough and best_t < float("inf") and predicted_gain(state, start) < SCREEN_GAIN:
        return state.with_plan(start, f"dp: the replay predicts under {SCREEN_GAIN:.0%} gain; "
                                      "kept the input (lean effort)")
    tried: list[tuple[float, ...]] = []
    queue = [np.full(start.pp, k) for k in KAPPAS]
    while queue and len(tried) < max_tries:
        kappa = queue.pop(0)
        if tuple(kappa) in tried:
            continue
        tried.append(tuple(kappa))
        cand = balance(state, start, aggressiveness=kappa)
        t = ev.time(cand)
        if t < best_t * (1 - 1e-9):
            best, best_t, best_k = cand, t, kappa
        if not queue and best_k is not None:
            queue.append(_adjust(state, best, best_k))
    if best_k is None:
        how = "kept the input"
    elif np.all(best_k == best_k[0]):
        how = f"aggressiveness {best_k[0]:g}"
    else:
        how = "aggressiveness per stage " + ",".join(f"{k:g}" for k in best_k)
    note = (
        f"dp: {len(best.migrations)} migrated (stage, micro-batch) items ({how}; "
        f"{len(tried)} replay(s) simulated), predicted {t_in:.4g}s -> {best_t:.4g}s"
    )
    return state.with_plan(best, note)
