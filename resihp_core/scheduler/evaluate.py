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

A link speed given for **every device of a node** (of a topology of several nodes) is
that node's interface (what the controller's link prober measures: a rate limit on the
host, a degraded uplink): only transfers that leave or enter the node are slowed, by
``1 / min(link speed of the nodes taking part)``: a pipeline boundary between executors
on different nodes, a DP reduction whose holders span nodes, a TP group across nodes.
Traffic between devices of the same node does not use it, which is what lets a plan
move traffic off a slow host link (:mod:`.links`).

:class:`ItemCost` is the per-(stage, executor, micro-batch) compute model the
heuristics use to reason without simulating (the same formula as
:meth:`~resihp_core.predictor.predict.IterationPredictor.inputs`; a unit test keeps
the two equal).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

from resihp_core.plan import Migration, ParallelPlan, Topology
from resihp_core.predictor.predict import IterationPredictor
from resihp_core.predictor.simulator import SimResult, simulate

__all__ = ["BY_PARTS_ABOVE", "Evaluator", "ItemCost", "Features", "node_links"]

#: :meth:`Evaluator.time` times plans with more (stage, replica, micro-batch) items than
#: this by parts (:meth:`Evaluator.time_by_parts`): TP8 PP16 DP32 with 64 micro-batches
#: and larger.
BY_PARTS_ABOVE = 1 << 15


class _ReplicaStore:
    """Per-replica stage finishes of untouched replicas (see
    :meth:`Evaluator.time_by_parts`), for one predictor and workload; bounded."""

    LIMIT = 1 << 17

    def __init__(self, features: Features) -> None:
        self.features = features  # keeps the arrays (and so their ids) alive
        self._d: dict[tuple, np.ndarray] = {}

    def get(self, key: tuple) -> np.ndarray | None:
        return self._d.get(key)

    def put(self, key: tuple, value: np.ndarray) -> None:
        if len(self._d) >= self.LIMIT:
            self._d.clear()
        self._d[key] = value


def _replica_store(predictor: IterationPredictor, features: Features) -> _ReplicaStore:
    """The store shared by every evaluator of ``predictor`` on these very arrays."""
    stores: dict[tuple[int, int], _ReplicaStore] = predictor.__dict__.setdefault("_replica_stores", {})
    key = (id(features[0]), id(features[1]))
    st = stores.get(key)
    if st is None or st.features[0] is not features[0] or st.features[1] is not features[1]:
        if len(stores) > 16:
            stores.clear()
        st = stores[key] = _ReplicaStore(features)
    return st


def _sub_plan(plan: ParallelPlan, keep: list[int], features: Features) -> tuple[ParallelPlan, Features]:
    """``plan`` restricted to replicas ``keep`` (ascending; every migration's owner and
    destination among them), renumbered in order, with their workload rows."""
    idx = {r: i for i, r in enumerate(keep)}
    sub = plan.with_(
        tp_groups=tuple(plan.tp_groups[r] for r in keep),
        migrations=tuple(Migration(mg.stage, idx[mg.replica], mg.mb, idx[mg.to]) for mg in plan.migrations),
        standbys=(), excluded=frozenset())
    rows = np.asarray(keep)
    return sub, (features[0][rows], features[1][rows])

#: Workload features of one iteration: ``[dp, m]`` tokens N and Σ l² per micro-batch.
Features = tuple[np.ndarray, np.ndarray]


def _group_min(group: tuple[int, ...], values: Mapping[int, float]) -> float:
    if not values:
        return 1.0
    return min(values.get(d, 1.0) for d in group)


def node_links(topology: Topology, link_speeds: Mapping[int, float]) -> tuple[dict[int, float], dict[int, float]]:
    """Split link speeds into node interfaces (node -> the slowest of its devices' speed,
    where every device of the node has one and the topology has several nodes) and the
    per-device links left (module docstring)."""
    nodes = topology.nodes()
    whole: dict[int, float] = {}
    if len(nodes) > 1:
        for n, ids in nodes.items():
            if ids and all(d in link_speeds for d in ids):
                whole[n] = min(link_speeds[d] for d in ids)
    covered = {d for n in whole for d in nodes[n]}
    return whole, {d: p for d, p in link_speeds.items() if d not in covered}


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
        self.node_links, self.device_links = node_links(predictor.topology, self.link_speeds)
        self._node = {d.id: d.node for d in predictor.topology.devices}
        self._cache: OrderedDict[tuple, SimResult] = OrderedDict()
        self._cache_size = cache_size
        self._items: dict[tuple, ItemCost] = {}
        self._parts_cache: dict[tuple, float] = {}
        self._red_cache: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
        self.simulations = 0  # simulations actually run (cache misses)

    # ------------------------------------------------------------------ inputs
    def inputs(self, plan: ParallelPlan) -> dict[str, np.ndarray]:
        """The simulator's inputs for ``plan`` (see the module docstring)."""
        return self._inputs(plan, self.features)

    def _inputs(self, plan: ParallelPlan, features: Features) -> dict[str, np.ndarray]:
        inp = self.predictor.inputs(plan, features, self.speeds)
        if not self.link_speeds:
            return inp
        pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
        link = np.ones((pp, dp))
        deg = np.ones((pp, dp), dtype=np.int64)
        for r, s in plan.executors():
            g = plan.group(r, s)
            link[s, r] = self.group_link(g)
            deg[s, r] = len(g)
        ex = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
        for mig in plan.migrations:
            ex[mig.stage, mig.replica, mig.mb] = mig.to
        sidx = np.arange(pp)[:, None, None]
        if (link < 1.0).any() or self.node_links:
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
                if self.node_links:
                    cf[s] = cf[s] / self._edge_links(plan, s, ex)
            cb = np.zeros_like(cf)
            cb[:-1] = cf[1:]
            inp["comm_forward"], inp["comm_backward"] = cf, cb
            red = np.array(inp["reduce_time"], float).copy()
            for s in range(pp):
                holders = [r for r in range(dp) if plan.group(r, s)]
                red[s] /= min(min(link[s, r] for r in holders),
                              self.crossing(d for r in holders for d in plan.group(r, s)))
            inp["reduce_time"] = red
        return inp

    def node_of(self, device: int) -> int:
        """The node of ``device`` in the predictor's topology (-1 if unknown)."""
        return self._node.get(device, -1)

    def crossing(self, devices: Iterable[int]) -> float:
        """The slowest node interface a transfer among ``devices`` crosses: 1.0 when they
        are all on one node or no node's link is slow."""
        if not self.node_links:
            return 1.0
        nodes = {self._node.get(d, -1) for d in devices}
        if len(nodes) < 2:
            return 1.0
        return min(self.node_links.get(n, 1.0) for n in nodes)

    def group_link(self, group: tuple[int, ...]) -> float:
        """Link speed a TP group's own all-reduces run at: its slowest device link, and
        a slow node interface when the group spans nodes."""
        return min(_group_min(group, self.device_links), self.crossing(group))

    def _edge_links(self, plan: ParallelPlan, s: int, ex: np.ndarray) -> np.ndarray:
        """``[dp, m]`` node-interface factor of each micro-batch's edge into stage ``s``
        (from its executor at ``s - 1``)."""
        out = np.ones(ex.shape[1:])
        memo: dict[tuple[int, int], float] = {}
        for r in range(ex.shape[1]):
            for j in range(ex.shape[2]):
                key = (int(ex[s - 1, r, j]), int(ex[s, r, j]))
                f = memo.get(key)
                if f is None:
                    f = memo[key] = self.crossing(plan.group(key[0], s - 1) + plan.group(key[1], s))
                out[r, j] = f
        return out

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
        """Simulated iteration time of ``plan`` in seconds.

        Plans above :data:`BY_PARTS_ABOVE` items are timed by parts
        (:meth:`time_by_parts`, the same number): on 131,072 devices one whole
        simulation takes seconds, and the planner compares several plans per report."""
        key = (plan.schedule, plan.num_microbatches, plan.layer_ranges, plan.tp_groups,
               plan.migrations)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit.iteration_time
        if plan.pp * plan.dp * plan.num_microbatches > BY_PARTS_ABOVE and plan.dp > 1:
            return self.time_by_parts(plan)
        return self.simulate(plan).iteration_time

    def time_by_parts(self, plan: ParallelPlan) -> float:
        """Iteration time of ``plan``, equal to :meth:`simulate`'s, from the parts that
        changed.

        Why it is the same number: a replica that no migration touches (none of its
        micro-batches runs elsewhere, it runs no one else's) is a pipeline of its own;
        replicas meet only in the DP reduction and optimizer step that follow every
        stage. So the iteration is ``max_s(stage_done[s] + reduce[s] + optimizer[s])``
        where ``stage_done[s]`` is the latest finish at stage ``s`` over all replicas,
        and an untouched replica's finishes depend only on its own groups, devices'
        health, workload row, layer ranges and schedule. Those are kept per replica
        (shared by every evaluator of the same predictor and workload); only touched
        replicas and replicas never seen are simulated, together."""
        key = (plan.schedule, plan.num_microbatches, plan.layer_ranges, plan.tp_groups,
               plan.migrations)
        hit = self._parts_cache.get(key)
        if hit is not None:
            return hit
        pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
        touched = {mg.replica for mg in plan.migrations} | {mg.to for mg in plan.migrations}
        store = _replica_store(self.predictor, self.features)
        slow = set(self.speeds) | set(self.link_speeds)
        shape_key = (plan.schedule, m, plan.layer_ranges)
        done = np.zeros(pp)
        need: list[int] = []
        new_keys: dict[int, tuple] = {}
        for r in range(dp):
            if r in touched:
                need.append(r)
                continue
            rep = plan.tp_groups[r]
            health: tuple = ()
            if slow:
                health = tuple((d, self.speeds.get(d, 1.0), self.link_speeds.get(d, 1.0))
                               for g in rep for d in g if d in slow)
                if self.node_links:  # whose link is a node's depends on every device listed
                    health += tuple(sorted(self.node_links.items()))
            k = (shape_key, r, rep, health)
            v = store.get(k)
            if v is None:
                need.append(r)
                new_keys[r] = k
            else:
                np.maximum(done, v, out=done)
        if need:
            sub, feats = _sub_plan(plan, need, self.features)
            res = simulate(sub, **self._inputs(sub, feats))
            self.simulations += 1
            with np.errstate(invalid="ignore"):
                per = np.nan_to_num(np.nanmax(res.finish, axis=(0, 3), initial=0.0))  # [pp, sub dp]
            np.maximum(done, per.max(axis=1), out=done)
            for i, r in enumerate(need):
                k = new_keys.get(r)
                if k is not None:
                    store.put(k, per[:, i].copy())
        red, opt = self._reduce_optimizer(plan)
        t = float(np.max(done + red + opt))
        self._parts_cache[key] = t
        if len(self._parts_cache) > 4 * self._cache_size:
            self._parts_cache.pop(next(iter(self._parts_cache)))
        return t

    def _reduce_optimizer(self, plan: ParallelPlan) -> tuple[np.ndarray, np.ndarray]:
        """Per-stage DP reduction (slowed by the slowest holder's links, as
        :meth:`inputs`) and optimizer step of the whole plan."""
        key = (plan.tp_groups, plan.layer_ranges)
        hit = self._red_cache.get(key)
        if hit is not None:
            return hit
        red, opt = self.predictor.reduce_optimizer(plan, self.speeds)
        if len(self._red_cache) >= 8:
            self._red_cache.pop(next(iter(self._red_cache)))
        self._red_cache[key] = self._with_links(plan, red), opt
        return self._red_cache[key]

    def _with_links(self, plan: ParallelPlan, red: np.ndarray) -> np.ndarray:
        if self.link_speeds:
            red = red.copy()
            for s in range(plan.pp):
                worst = min((self.group_link(plan.group(r, s)) for r in range(plan.dp) if plan.group(r, s)),
                            default=1.0)
                red[s] /= min(worst, self.crossing(d for r in range(plan.dp) for d in plan.group(r, s)))
        return red

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
            comm[s, r] = 2.0 * tp / self.group_link(g)
        return ItemCost(base=fwd + bwd, fwd=fwd, inv_q=inv_q, comm=comm)
