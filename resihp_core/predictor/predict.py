"""Healthy iteration time of a plan for an iteration's actual documents (docs/design.md §3.3-3.4).

:class:`IterationPredictor` turns (plan, workload, device speeds) into the simulator's
inputs — per-chunk compute from the fitted :class:`~.cost.CostModel`, P2P edges from
the :class:`~.cost.LinkModel` with the heterogeneous-TP rule, DP reduction and optimizer
time per stage — and runs :func:`~.simulator.simulate`. Everything is vectorised over
(stage, replica, micro-batch) so the Scheduler can judge many candidate plans online;
:func:`~.cost.vertex_times` is the plain per-chunk definition it is tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from resihp_core.plan import ParallelPlan, ScheduleKind, Topology
from resihp_core.predictor.corpus import Workload
from resihp_core.predictor.cost import CostModel, CostModelError, LinkModel, activation_bytes, group_speed
from resihp_core.predictor.simulator import SimResult, simulate

__all__ = ["ModelShape", "IterationPredictor", "workload_features"]


@dataclass(frozen=True)
class ModelShape:
    """What communication costs depend on: tokens per micro-batch, hidden size,
    parameters per layer and element sizes. ``optimizer_s_per_param`` is the optimizer
    step's cost per parameter on one healthy device."""

    tokens: int
    hidden: int
    params_per_layer: int
    dtype_bytes: int = 2
    grad_bytes: int = 4
    optimizer_s_per_param: float = 0.0

    def __post_init__(self) -> None:
        for name in ("tokens", "hidden", "params_per_layer", "dtype_bytes", "grad_bytes"):
            if getattr(self, name) < 1:
                raise CostModelError(f"ModelShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.optimizer_s_per_param < 0:
            raise CostModelError("ModelShape.optimizer_s_per_param must be >= 0")


def workload_features(workload: Workload, dp: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """[dp, m] arrays of tokens N and Σ l² per micro-batch (owner replica, mb)."""
    n = np.zeros((dp, m))
    s = np.zeros((dp, m))
    for r in range(dp):
        for j in range(m):
            try:
                lengths = workload[(r, j)]
            except KeyError:
                raise CostModelError(f"workload has no micro-batch (replica {r}, mb {j})") from None
            n[r, j] = sum(lengths)
            s[r, j] = sum(x * x for x in lengths)
    return n, s


class IterationPredictor:
    """Predicts iteration time of any plan on ``topology`` with fitted stage costs.

    ``cost`` has one :class:`StageCost` per stage *position*; when a plan has a different
    number of stages than ``cost``, stage 0's per-layer cost is used for every stage.
    """

    def __init__(
        self,
        cost: CostModel,
        topology: Topology,
        shape: ModelShape,
        links: LinkModel | None = None,
    ) -> None:
        self.cost = cost
        self.topology = topology
        self.shape = shape
        self.links = links or LinkModel()
        self._node = {d.id: d.node for d in topology.devices}

    # ------------------------------------------------------------------ inputs
    def _stage_coeffs(self, pp: int) -> np.ndarray:
        stages = self.cost.stages if len(self.cost.stages) == pp else (self.cost.stages[0],) * pp
        return np.array(
            [
                (c.alpha_f, c.beta_f, c.gamma_f, c.alpha_b, c.beta_b, c.gamma_b,
                 c.ref_layers, c.ref_tp, c.w_fraction)
                for c in stages
            ]
        )

    def inputs(
        self,
        plan: ParallelPlan,
        workload: Workload | tuple[np.ndarray, np.ndarray],
        speeds: Mapping[int, float] | None = None,
    ) -> dict[str, np.ndarray]:
        """Simulator inputs: durations [3,pp,dp,m], comm_forward/backward [pp,dp,m],
        reduce_time and optimizer_time [pp]."""
        pp, dp, m = plan.pp, plan.dp, plan.num_microbatches
        ntok, ssq = (
            workload if isinstance(workload, tuple) else workload_features(workload, dp, m)
        )
        co = self._stage_coeffs(pp)
        layers = np.array([plan.layers(s) for s in range(pp)], dtype=float)
        # Per executor (stage, replica): TP degree and slowest-member speed.
        deg = np.ones((pp, dp))
        spd = np.ones((pp, dp))
        node = np.full((pp, dp), -1, dtype=np.int64)
        slow = {d for d, p in (speeds or {}).items() if p != 1.0}
        for r, s in plan.executors():
            g = plan.group(r, s)
            deg[s, r] = len(g)
            if slow and not slow.isdisjoint(g):  # else 1.0 (the common case at scale)
                spd[s, r] = group_speed(g, speeds)
            node[s, r] = self._node.get(g[0], -1)
        ex = np.broadcast_to(np.arange(dp)[None, :, None], (pp, dp, m)).copy()
        for mig in plan.migrations:
            ex[mig.stage, mig.replica, mig.mb] = mig.to
        sidx = np.arange(pp)[:, None, None]
        scale = (layers / co[:, 6])[:, None, None] * co[:, 7][:, None, None] / deg[sidx, ex] / spd[sidx, ex]
        fwd = (co[:, 0, None, None] * ntok + co[:, 1, None, None] * ssq + co[:, 2, None, None]) * scale
        bwd = (co[:, 3, None, None] * ntok + co[:, 4, None, None] * ssq + co[:, 5, None, None]) * scale
        # Megatron TP: two all-reduces of the activation per layer and pass, inside a node.
        tp_deg = deg[sidx, ex]
        act = activation_bytes(self.shape.tokens, self.shape.hidden, self.shape.dtype_bytes)
        tp_comm = np.zeros_like(tp_deg)
        for d in np.unique(tp_deg):
            tp_comm[tp_deg == d] = self.links.tp_per_layer(
                self.shape.tokens, self.shape.hidden, int(d), dtype_bytes=self.shape.dtype_bytes
            )
        tp_comm *= layers[:, None, None]
        dur = np.zeros((3, pp, dp, m))
        dur[0] = fwd + tp_comm
        if plan.schedule is ScheduleKind.ZB_H1:
            wf = co[:, 8, None, None]
            dur[1] = bwd * (1 - wf) + tp_comm
            dur[2] = bwd * wf
        else:
            dur[1] = bwd + tp_comm
        # P2P between consecutive stages' executors of each micro-batch.
        cf = np.zeros((pp, dp, m))
        cache: dict[tuple[int, int, int, int], float] = {}
        for s in range(1, pp):
            a, b = ex[s - 1], ex[s]
            pairs = a * dp + b
            for key in np.unique(pairs):
                src, dst = divmod(int(key), dp)
                ck = (int(deg[s - 1, src]), int(deg[s, dst]), int(node[s - 1, src]), int(node[s, dst]))
                if ck not in cache:
                    cache[ck] = self.links.stage_p2p(act, ck[0], ck[1], same_node=ck[2] == ck[3])
                cf[s][pairs == key] = cache[ck]
        cb = np.zeros((pp, dp, m))
        cb[:-1] = cf[1:]  # gradients travel the same links back
        red, opt = self._reduce_optimizer(layers, deg, spd, node, plan.tp_groups)
        return {
            "durations": dur,
            "comm_forward": cf,
            "comm_backward": cb,
            "reduce_time": red,
            "optimizer_time": opt,
        }

    def _reduce_optimizer(self, layers: np.ndarray, deg: np.ndarray, spd: np.ndarray, node: np.ndarray,
                          tp_groups: tuple[tuple[tuple[int, ...], ...], ...]) -> tuple[np.ndarray, np.ndarray]:
        """``[pp]`` DP reduction per stage over the replicas executing it, at the
        coarsest shard, and the optimizer step at the slowest holder's speed."""
        pp, dp = deg.shape
        red = np.zeros(pp)
        opt = np.zeros(pp)
        has = np.array([[bool(g) for g in rep] for rep in tp_groups], dtype=bool).T  # [pp, dp]
        for s in range(pp):
            holders = has[s]
            min_deg = float(deg[s][holders].min())
            shard = self.shape.params_per_layer * layers[s] / min_deg
            one_node = len(np.unique(node[s][holders])) == 1
            red[s] = self.links.allreduce(shard * self.shape.grad_bytes, int(holders.sum()), one_node)
            opt[s] = shard * self.shape.optimizer_s_per_param / float(spd[s][holders].min())
        return red, opt

    def reduce_optimizer(self, plan: ParallelPlan, speeds: Mapping[int, float] | None = None
                         ) -> tuple[np.ndarray, np.ndarray]:
        """The ``reduce_time`` and ``optimizer_time`` inputs of ``plan`` alone (what
        couples all replicas; :meth:`inputs` gives the same values)."""
        pp, dp = plan.pp, plan.dp
        layers = np.array([plan.layers(s) for s in range(pp)], dtype=float)
        deg = np.ones((pp, dp))
        spd = np.ones((pp, dp))
        node = np.full((pp, dp), -1, dtype=np.int64)
        slow = {d: p for d, p in (speeds or {}).items() if p != 1.0}
        for r, s in plan.executors():
            g = plan.group(r, s)
            deg[s, r] = len(g)
            if slow and not slow.keys().isdisjoint(g):
                spd[s, r] = group_speed(g, slow)
            node[s, r] = self._node.get(g[0], -1)
        return self._reduce_optimizer(layers, deg, spd, node, plan.tp_groups)

    def predict(
        self,
        plan: ParallelPlan,
        workload: Workload | tuple[np.ndarray, np.ndarray],
        speeds: Mapping[int, float] | None = None,
    ) -> SimResult:
        """Simulate one iteration of ``plan`` on these documents and device speeds."""
        return simulate(plan, **self.inputs(plan, workload, speeds))
