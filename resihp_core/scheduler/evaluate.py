"""Judging plans: the predictor's simulation with communication fail-slow applied.

Every adaptation stage judges candidate plans with the same :class:`Evaluator`, so the
planner, the baselines, the exact solver's comparison and the benchmark all agree on
what "iteration time" means.

**Compute fail-slow** is the predictor's own notion: device ``d`` runs its compute at
normalised throughput ``speeds[d]`` (a TP group at its slowest member's).

**Communication fail-slow** (stolen bandwidth, a degraded NIC or NVLink) is modelled
here, on top of the predictor's inputs, by ``link_speeds[d]`` in (0, 1]: the fraction
of its healthy bandwidth device ``d``'s links still deliver. Every transfer that
touches the device is slowed by the slowest link taking part:

- the TP all-reduces of its group (two per layer and pass, Megatron-style) take
  ``1 / min(link speed over the group)`` times longer;
- a stage-to-stage activation or gradient edge between two executors takes
  ``1 / min(link speed over both groups)`` times longer;
- the DP gradient reduction of a stage takes ``1 / min(link speed over every holder of
  that stage)`` times longer (a ring runs at its slowest link).

:class:`ItemCost` is the per-(stage, executor, micro-batch) compute model the
heuristics use to reason without simulating (the same formula as
:meth:`~resihp_core.predictor.predict.IterationPredictor.inputs`; a unit test keeps
the two equal).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from resihp_core.plan import ParallelPlan
from resihp_core.predictor.predict import IterationPredictor
from resihp_core.predictor.simulator import SimResult, simulate

__all__ = ["Evaluator", "ItemCost", "Features"]

#: Workload features of one iteration: ``[dp, m]`` tokens N and Σ l² per micro-batch.
Features = tuple[np.ndarray, np.ndarray]


def _group_min(group: tuple[int, ...], values: Mapping[int, float]) -> float:
    if not values:
        return 1.0
    return min(values.get(d, 1.0) for d in group)


@dataclass(frozen=True)
class ItemCost:
    """Per-layer compute of every (stage, executor, micro-batch) of one plan's shape.

    The time of stage ``s`` of micro-batch ``(r, j)`` on executor ``e`` with ``L``
    layers is ``L * (base[s, r, j] * inv_q[s, e] + comm[s, e])`` for F+B(+W) together,
    and ``L * (fwd[s, r, j] * inv_q[s, e] + comm[s, e] / 2)`` for the forward alone.
    ``inv_q[s, e]`` is ``1 / (degree * slowest compute speed)`` scaled to the cost
    model's reference (``inf`` where ``e`` has no devices at ``s``); ``comm`` is the
    TP all-reduce time per layer of forward plus backward.
    """

    base: np.ndarray  # [pp, dp, m] per-layer F+B seconds at the reference TP degree / 1 (TP 1 equiv.)
    fwd: np.ndarray  # [pp, dp, m] per-layer F seconds, same scaling
    inv_q: np.ndarray  # [pp, dp]
    comm: np.ndarray  # [pp, dp]

    def item(self, plan: ParallelPlan) -> np.ndarray:
        """``[pp, dp(executor), dp(owner), m]`` seconds of each item on each executor."""
        layers = np.array([plan.layers(s) for s in range(plan.pp)], float)[:, None, None, None]
        return layers * (
            self.base[:, None, :, :] * self.inv_q[:, :, None, None] + self.comm[:, :, None, None]
        )

    def own(self, plan: ParallelPlan) -> np.ndarray:
        """``[pp, dp, m]`` seconds of each micro-batch on its own replica (inf if that
        replica has no devices at the stage)."""
        layers = np.array([plan.layers(s) for s in range(plan.pp)], float)[:, None, None]
        return layers * (self.base * self.inv_q[:, :, None] + self.comm[:, :, None])

    def per_layer(self) -> np.ndarray:
        """``[pp, dp]`` mean per-layer seconds of one micro-batch on each executor."""
        return self.base.mean(axis=(1, 2))[:, None] * self.inv_q + self.comm


class Evaluator:
    """Simulates plans for one iteration's workload under given device speeds; caches
    results per plan (plans are immutable values).

    :param predictor: the fitted :class:`IterationPredictor`.
    :param features: ``(N, Σ l²)`` arrays ``[dp, m]`` from
        :func:`~resihp_core.predictor.predict.workload_features`, computed once.
    :param speeds: compute normalised throughput per device (missing = 1.0).
    :param link_speeds: link bandwidth fraction per device (missing = 1.0).
    """

    def __init__(
        self,
        predictor: IterationPredictor,
        features: Features,
        speeds: Mapping[int, float] | None = None,
        link_speeds: Mapping[int, float] | None = None,
        *,
        cache_size: int = 16,
    ) -> None:
        self.predictor = predictor
        self.features = (np.asarray(features[0], float), np.asarray(features[1], float))
        self.speeds = {d: float(p) for d, p in (speeds or {}).items() if p != 1.0}
        self.link_speeds = {d: float(p) for d, p in (link_speeds or {}).items() if p != 1.0}
        for name, vals in (("speeds", self.speeds), ("link_speeds", self.link_speeds)):
            for d, p in vals.items():
                if not (0.0 < p <= 1.0):
                    raise ValueError(f"{name}[{d}] must be in (0, 1], got {p}")
        self._cache: OrderedDict[tuple, SimResult] = OrderedDict()
        self._cache_size = cache_size
        self._items: dict[tuple, ItemCost] = {}
        self.simulations = 0  # simulations actually run (cache misses)

    # ------------------------------------------------------------------ inputs
    def inputs(self, plan: ParallelPlan) -> dict[str, np.ndarray]:
        """The simulator's inputs for ``plan`` (see the module docstring)."""
        inp = self.predictor.inputs(plan, self.features, self.speeds)
        if not self.link_speeds:
            return inp
        pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
        link = np.ones((pp, dp))
        deg = np.ones((pp, dp), dtype=np.int64)
        for r, s in plan.executors():
            g = plan.group(r, s)
            link[s, r] = _group_min(g, self.link_speeds)
            deg[s, r] = len(g)
        ex = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
        for mig in plan.migrations:
            ex[mig.stage, mig.replica, mig.mb] = mig.to
        sidx = np.arange(pp)[:, None, None]
        if (link < 1.0).any():
            shape = self.predictor.shape
            tp_layer = np.zeros((pp, dp))
            for d in np.unique(deg):
                tp_layer[deg == d] = self.predictor.links.tp_per_layer(
                    shape.tokens, shape.hidden, int(d), dtype_bytes=shape.dtype_bytes
                )
            layers = np.array([plan.layers(s) for s in range(pp)], float)
            extra = (tp_layer * layers[:, None]) * (1.0 / link - 1.0)  # [pp, dp] per pass
            dur = inp["durations"].copy()
            dur[0] += extra[sidx, ex]
            dur[1] += extra[sidx, ex]
            inp["durations"] = dur
            cf = inp["comm_forward"].copy()
            for s in range(1, pp):
                cf[s] = cf[s] / np.minimum(link[s - 1][ex[s - 1]], link[s][ex[s]])
            cb = np.zeros_like(cf)
            cb[:-1] = cf[1:]
            inp["comm_forward"], inp["comm_backward"] = cf, cb
            red = np.array(inp["reduce_time"], float).copy()
            for s in range(pp):
                holders = [r for r in range(dp) if plan.group(r, s)]
                red[s] /= min(link[s, r] for r in holders)
            inp["reduce_time"] = red
        return inp

    # --------------------------------------------------------------- simulate
    def simulate(self, plan: ParallelPlan) -> SimResult:
        """Simulated iteration of ``plan`` (cached)."""
        # Everything the simulation depends on (not the generation); building a plan
        # copy for the key would re-validate it, which costs ms on large plans.
        key = (plan.schedule, plan.num_microbatches, plan.layer_ranges, plan.tp_groups,
               plan.migrations)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        res = simulate(plan, **self.inputs(plan))
        self.simulations += 1
        self._cache[key] = res
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return res

    def time(self, plan: ParallelPlan) -> float:
        """Simulated iteration time of ``plan`` in seconds."""
        return self.simulate(plan).iteration_time

    # ------------------------------------------------------------- item cost
    def item_cost(self, plan: ParallelPlan) -> ItemCost:
        """Per-layer compute model of ``plan``'s executors (see :class:`ItemCost`);
        cached per TP layout (it depends on nothing else of the plan)."""
        key = plan.tp_groups
        hit = self._items.get(key)
        if hit is None:
            hit = self._item_cost(plan)
            if len(self._items) >= 8:
                self._items.pop(next(iter(self._items)))
            self._items[key] = hit
        return hit

    def _item_cost(self, plan: ParallelPlan) -> ItemCost:
        pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
        ntok, ssq = self.features
        if ntok.shape != (dp, m):
            raise ValueError(f"features have shape {ntok.shape}, plan needs {(dp, m)}")
        cost = self.predictor.cost
        # The predictor's rule: one StageCost per stage position, else stage 0's for all.
        stages = cost.stages if len(cost.stages) == pp else (cost.stages[0],) * pp
        fwd = np.empty((pp, dp, m))
        bwd = np.empty((pp, dp, m))
        for s, c in enumerate(stages):
            unit = c.ref_tp / c.ref_layers  # per layer, per unit of (degree * speed)
            fwd[s] = (c.alpha_f * ntok + c.beta_f * ssq + c.gamma_f) * unit
            bwd[s] = (c.alpha_b * ntok + c.beta_b * ssq + c.gamma_b) * unit
        inv_q = np.full((pp, dp), np.inf)
        comm = np.zeros((pp, dp))
        shape = self.predictor.shape
        for r, s in plan.executors():
            g = plan.group(r, s)
            inv_q[s, r] = 1.0 / (len(g) * _group_min(g, self.speeds))
            tp = self.predictor.links.tp_per_layer(
                shape.tokens, shape.hidden, len(g), dtype_bytes=shape.dtype_bytes
            )
            comm[s, r] = 2.0 * tp / _group_min(g, self.link_speeds)
        return ItemCost(base=fwd + bwd, fwd=fwd, inv_q=inv_q, comm=comm)
