"""PP adaptation: layer repartition (docs/design.md §4.2).

After TP adaptation a stage may still be a straggler; it gets fewer layers and the
others more. The partition is contiguous and the same for every DP replica, and each
stage's layers must fit the memory of every TP group that runs it.

**Per-stage speed.** The cost model prices a layer by its stage position, so a
partition is a vector of layer counts ``L_s`` and stage s takes ``L_s * w_s`` per
micro-batch, where ``w_s`` is the per-layer time of one micro-batch there
(:meth:`~.evaluate.ItemCost.per_layer`, which includes the TP degree, the slowest
member's speed and slow links). Two views of ``w_s``:

- *worst*: the slowest replica's executor (stage speed = min over replicas of
  ``k * min p / nominal``): replicas run independently, so the slowest bounds all;
- *pooled*: ``dp / sum_r 1/w_rs``, the stage's capacity shared by all replicas, which
  is what the DP stage's migration approaches.

**Exact min-max.** :func:`minmax_counts` finds the counts minimising ``max_s L_s w_s``
subject to ``1 <= L_s <= Lmax_s`` (memory) and ``sum L_s = layers``: binary search
over the candidate bottleneck values ``L * w_s``; surplus layers are taken back from
the most loaded stages (ties: the slower stage), which spreads what the straggler
gives up over the others (docs/design.md's (4,4,4) -> (5,2,5)).

**Judged by the simulator.** Candidates are simulated, never chosen by formula. With
thorough effort: the current partition, the min-max partition under each view and
their best neighbours by the pipeline estimate ``(m - 1) max_s L_s w_s + sum_s L_s
w_s`` (one layer moved off the bottleneck), each judged as the DP stage will leave it
(the better of the plan alone and after :func:`~.dp.balance`) when the adapter can
migrate work — so a layer move that helps alone but hurts once work is migrated is not
taken. With lean effort (large jobs): the worst-view min-max partition alone against
the current partition after balancing; the DP stage then runs on the winner, so the
result is never worse than layer repartition alone or migration alone. The current
partition is kept unless another is strictly faster.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from resihp_core.plan import ParallelPlan, ranges_from_counts
from resihp_core.scheduler.dp import SCREEN_GAIN, balance_with_gain
from resihp_core.scheduler.state import PlannerState

__all__ = ["HUGE_ITEMS", "minmax_counts", "pp_stage", "stage_weights", "layer_limits"]

#: Above this many (replica, stage, micro-batch) items (TP8 PP16 DP256 with 64
#: micro-batches: 32,768 GPUs), lean effort does not search layer partitions.
HUGE_ITEMS = 1 << 18

_EPS = 1e-12


def minmax_counts(
    weights: Sequence[float], total: int, limits: Sequence[int] | None = None
) -> tuple[int, ...] | None:
    """Layer counts minimising ``max_s counts[s] * weights[s]`` with ``1 <= counts[s]
    <= limits[s]`` and ``sum(counts) == total``; None when infeasible."""
    w = [float(x) for x in weights]
    pp = len(w)
    lim = [total] * pp if limits is None else [min(int(x), total) for x in limits]
    if pp == 0 or any(x < 1 for x in lim) or sum(lim) < total or total < pp:
        return None
    if any(not (x > 0 and math.isfinite(x)) for x in w):
        raise ValueError(f"stage weights must be finite and > 0, got {w}")

    def fill(t: float) -> list[int]:
        return [min(lim[s], int(math.floor(t / w[s] * (1 + _EPS)))) for s in range(pp)]

    cands = sorted({n * w[s] for s in range(pp) for n in range(1, lim[s] + 1)})
    lo, hi = 0, len(cands) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        c = fill(cands[mid])
        if min(c) >= 1 and sum(c) >= total:
            hi = mid
        else:
            lo = mid + 1
    counts = fill(cands[lo])
    surplus = sum(counts) - total
    while surplus > 0:
        s = max(
            (s for s in range(pp) if counts[s] > 1),
            key=lambda s: (counts[s] * w[s], w[s], s),
        )
        counts[s] -= 1
        surplus -= 1
    return tuple(counts)


def stage_weights(state: PlannerState, plan: ParallelPlan) -> tuple[np.ndarray, np.ndarray]:
    """(worst, pooled) per-layer time of one micro-batch at each stage (see module)."""
    per = state.evaluator.item_cost(plan).per_layer()  # [pp, dp], inf = no devices
    worst = np.array([per[s][np.isfinite(per[s])].max() for s in range(plan.pp)])
    with np.errstate(divide="ignore"):
        cap = np.where(np.isfinite(per), 1.0 / per, 0.0).sum(axis=1)
    pooled = plan.dp / cap
    return worst, pooled


def layer_limits(state: PlannerState, plan: ParallelPlan) -> list[int]:
    """Most layers each stage can hold within every one of its groups' memory."""
    out = []
    seen: dict[tuple[float, int, int], int] = {}  # (capacity, degree, items): one model call each
    gone, into = plan._moves_by_executor
    m = plan.num_microbatches
    for s in range(plan.pp):
        lim = plan.num_layers
        for r in range(plan.dp):
            g = plan.group(r, s)
            if g:
                # len(plan.work(r, s)), without building the list
                n = max(m, m - len(gone.get((r, s), ())) + len(into.get((r, s), ())))
                k = (state.min_capacity(g), len(g), state.inflight_cap(s, n))
                v = seen.get(k)
                if v is None:
                    v = seen[k] = state.memory.max_layers(*k)
                lim = min(lim, v)
        out.append(lim)
    return out


def _estimate(counts: Sequence[int], w: np.ndarray, m: int) -> float:
    loads = np.asarray(counts, float) * w
    return float((m - 1) * loads.max() + loads.sum())


def _neighbours(counts: tuple[int, ...], w: np.ndarray, limits: Sequence[int]) -> list[tuple[int, ...]]:
    loads = np.asarray(counts, float) * w
    b = int(np.argmax(loads))
    out = []
    if counts[b] > 1:
        for t in range(len(counts)):
            if t != b and counts[t] < limits[t]:
                c = list(counts)
                c[b] -= 1
                c[t] += 1
                out.append(tuple(c))
    return out


def _shortlist(
    current: tuple[int, ...], w: np.ndarray, views: Sequence[np.ndarray], limits: Sequence[int],
    m: int, top: int, fits_now: bool,
) -> list[tuple[int, ...]]:
    """The min-max partition under weights ``w`` and up to ``top`` neighbours of it and
    of ``current`` (moves off each view's bottleneck) whose estimate under ``w`` beats
    the current partition, best first."""
    seed = minmax_counts(w, sum(current), limits)
    out = [seed] if seed is not None and seed != current else []
    if top <= 0:
        return out
    others: set[tuple[int, ...]] = set()
    for c in out + [current]:
        for v in views:
            others.update(_neighbours(c, v, limits))
    others.difference_update(out + [current])
    est_cur = _estimate(current, w, m)
    ranked = sorted(others, key=lambda c: (_estimate(c, w, m), c))
    ranked = [c for c in ranked if _estimate(c, w, m) < est_cur * (1 - 1e-3) or not fits_now]
    return out + ranked[: max(0, top - len(out))]


def pp_stage(
    state: PlannerState, *, dp_aware: bool | None = None, simulate_top: int | None = None
) -> PlannerState:
    """Choose the layer partition (see module docstring).

    :param dp_aware: judge partitions as the DP stage will leave them (default: the
        adapter can migrate work and there are several replicas).
    :param simulate_top: candidates per view (min-max partition and neighbours) to
        simulate with thorough effort (default 3); lean effort simulates the worst-view
        min-max partition only.
    """
    plan = state.plan
    if not state.capabilities.layer_repartition:
        return state.with_plan(plan, "pp: adapter cannot move layers; skipped")
    if plan.pp == 1:
        return state.with_plan(plan, "pp: one stage; nothing to repartition")
    if dp_aware is None:
        dp_aware = state.capabilities.migrates(plan.pp) and plan.dp > 1
    thorough = state.thorough
    if simulate_top is None:
        simulate_top = 3
    current = tuple(plan.layers(s) for s in range(plan.pp))
    worst, pooled = stage_weights(state, plan)
    limits = layer_limits(state, plan)
    fits_now = all(c <= lim for c, lim in zip(current, limits))
    m = plan.num_microbatches
    # Candidates: the worst-view min-max partition and, with thorough effort, its best
    # neighbours by the pipeline estimate (what layer repartition alone would try);
    # when judging for DP, the same again from the pooled view. A superset of the
    # layer-only search, so this stage never does worse than it.
    shortlist = _shortlist(current, worst, (worst, pooled), limits, m,
                           simulate_top if thorough else 0, fits_now)
    if dp_aware and thorough:
        for c in _shortlist(current, pooled, (worst, pooled), limits, m, simulate_top, fits_now):
            if c not in shortlist:
                shortlist.append(c)
    if not shortlist:
        return state.with_plan(plan, f"pp: keep layers {current}")
    if not thorough and dp_aware and plan.dp * plan.pp * m > HUGE_ITEMS:
        # A repartition changes every replica's pipeline (each candidate is a whole
        # simulation: seconds here), to relieve the few hit ones; with this many
        # replicas the planner's peer moves relieve them at about 1/dp of a step.
        return state.with_plan(plan, f"pp: keep layers {current} (not searched above "
                                     f"{HUGE_ITEMS} items with lean effort)")
    ev = state.evaluator
    plans = {c: plan.with_(layer_ranges=ranges_from_counts(c)) for c in shortlist}
    plain = {c: ev.time(p) for c, p in plans.items()}

    def after_dp(p: ParallelPlan, t_plain: float) -> float:
        # What the DP stage can reach from p at least: its first replay, or p itself
        # (lean effort skips replays predicted not to pay, as the DP stage does).
        if not dp_aware:
            return t_plain
        balanced, gain = balance_with_gain(state, p)
        if not thorough and gain < SCREEN_GAIN:
            return t_plain
        return min(t_plain, ev.time(balanced))

    t_cur = after_dp(plan, ev.time(plan)) if fits_now else math.inf
    # Lean: compare each partition alone against the current one after balancing; the
    # DP stage then runs on the winner, so the result is never worse than layer
    # repartition alone or migration alone. Thorough: balance the candidates as well.
    judged = {c: (after_dp(plans[c], t) if thorough else t) for c, t in plain.items()}
    best_c = min(judged, key=lambda c: (judged[c], c))
    if not judged[best_c] < t_cur * (1 - 1e-9):
        return state.with_plan(plan, f"pp: keep layers {current} (alternatives simulated slower)")
    how = "after DP balancing" if dp_aware and thorough else "alone"
    return state.with_plan(
        plans[best_c],
        f"pp: layers {current} -> {best_c} (judged {how}: {t_cur:.4g}s -> {judged[best_c]:.4g}s)",
    )
