"""What the progressive planner knows: :class:`PlannerState` and the memory model.

A :class:`PlannerState` is an immutable value. Each adaptation stage (TP, PP, DP, or a
plugin's) is a function ``state -> state`` that returns a copy with a new ``plan``
(:func:`dataclasses.replace` keeps the shared :class:`~.evaluate.Evaluator`, so results
simulated by one stage are reused by the next).

Device health has three parts:

- ``failed``: fail-stopped devices; never placed in a plan (they are ``excluded``);
- ``speeds``: compute normalised throughput p_i in (0, 1] (missing = 1.0);
- ``link_speeds``: communication fail-slow, the fraction of link bandwidth left (given
  for every device of a node: that node's interface, which only traffic leaving the
  node crosses; :mod:`.evaluate`).

The planner's TP rule needs one number per device; :meth:`PlannerState.throughput`
gives it: the compute speed, or for a device with slow links the equivalent
throughput of its role (healthy per-micro-batch time of its stage over the degraded
one), whichever is lower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Mapping

import numpy as np

from resihp_core.adapter import Capabilities
from resihp_core.plan import ParallelPlan, ScheduleKind, Topology, is_power_of_two
from resihp_core.predictor.cost import activation_bytes
from resihp_core.predictor.predict import IterationPredictor
from resihp_core.scheduler.evaluate import Evaluator, Features

__all__ = ["LEAN_ABOVE", "MemoryModel", "PlannerState", "PlannerError", "inflight", "RestoreRequired"]

#: ``effort="auto"`` plans lean above this many (replica, stage, micro-batch) items.
LEAN_ABOVE = 2048


class RestoreRequired(Exception):
    """The job cannot continue from the current plan; restore from a checkpoint."""


class PlannerError(RuntimeError):
    """No plan can be produced (e.g. too few surviving devices); the message says why."""


def inflight(schedule: ScheduleKind, stage: int, pp: int, n_items: int) -> int:
    """Micro-batches whose activations one executor holds at once under ``schedule``
    (the caps :mod:`resihp_core.predictor.schedules` enforces, with or without
    migrated work): GPipe all of them; 1F1B ``pp - stage``; ZB-H1 ``pp`` (activations
    stay until the deferred W pass)."""
    if n_items <= 0:
        return 0
    if schedule is ScheduleKind.GPIPE:
        return n_items
    if schedule is ScheduleKind.ZB_H1:
        return min(n_items, pp)
    return min(n_items, pp - stage)


_LOOKUPS: dict[int, tuple[Topology, dict[int, int], dict[int, float]]] = {}


_UNIFORM: dict[int, tuple[Topology, float | None]] = {}


def uniform_capacity(topology: Topology) -> float | None:
    """The one memory size of every device of ``topology``, or None when they differ
    (then a group's capacity is its smallest member's); computed once."""
    hit = _UNIFORM.get(id(topology))
    if hit is None or hit[0] is not topology:
        if len(_UNIFORM) > 16:
            _UNIFORM.clear()
        sizes = set(_lookup(topology)[1].values())
        hit = (topology, next(iter(sizes)) if len(sizes) == 1 else None)
        _UNIFORM[id(topology)] = hit
    return hit[1]


def _lookup(topology: Topology) -> tuple[dict[int, int], dict[int, float]]:
    """Device -> node and device -> memory maps of a topology, built once."""
    hit = _LOOKUPS.get(id(topology))
    if hit is None or hit[0] is not topology:
        if len(_LOOKUPS) > 16:
            _LOOKUPS.clear()
        hit = (topology, {d.id: d.node for d in topology.devices},
               {d.id: d.memory_gib for d in topology.devices})
        _LOOKUPS[id(topology)] = hit
    return hit[1], hit[2]


@dataclass(frozen=True)
class MemoryModel:
    """Per-device memory of a stage, in GiB.

    ``layers * (layer_state_gib + inflight * layer_activation_gib) / tp + reserve_gib``:
    ``layer_state_gib`` is one layer's parameters, gradients and optimizer state at
    TP 1; ``layer_activation_gib`` one in-flight micro-batch's activations of one layer
    at TP 1 (both shard evenly over the TP group); ``reserve_gib`` is per-device
    overhead (framework, communication buffers). The default (all zero) never binds.
    """

    layer_state_gib: float = 0.0
    layer_activation_gib: float = 0.0
    reserve_gib: float = 0.0

    def __post_init__(self) -> None:
        for name in ("layer_state_gib", "layer_activation_gib", "reserve_gib"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"MemoryModel.{name} must be a finite number >= 0, got {v!r}")

    def device_gib(self, layers: int, tp: int, inflight: int) -> float:
        return self.reserve_gib + layers * (
            self.layer_state_gib + inflight * self.layer_activation_gib
        ) / tp

    def fits(self, capacity_gib: float, layers: int, tp: int, inflight: int) -> bool:
        return self.device_gib(layers, tp, inflight) <= capacity_gib * (1 + 1e-12)

    def max_layers(self, capacity_gib: float, tp: int, inflight: int) -> int:
        """Most layers one device of a degree-``tp`` group can hold (large if unbounded)."""
        per = (self.layer_state_gib + inflight * self.layer_activation_gib) / tp
        room = capacity_gib - self.reserve_gib
        if room < 0:
            return 0
        if per <= 0:
            return 1 << 30
        return int(math.floor(room / per + 1e-9))

    def max_items(self, capacity_gib: float, layers: int, tp: int, schedule: ScheduleKind,
                  stage: int, pp: int) -> int:
        """Most (stage, micro-batch) items an executor can be given before its
        activations (per :func:`inflight`) overflow the device (large if unbounded)."""
        per_item = layers * self.layer_activation_gib / tp
        room = capacity_gib - self.reserve_gib - layers * self.layer_state_gib / tp
        if room < 0:
            return 0
        cap = inflight(schedule, stage, pp, 1 << 30)
        if per_item <= 0 or per_item * cap <= room * (1 + 1e-12):
            return 1 << 30
        return int(math.floor(room / per_item + 1e-9))


@dataclass(frozen=True, eq=False)
class PlannerState:
    """Everything an adaptation stage needs; build one with :meth:`create`.

    :param topology: the job's devices and nodes.
    :param plan: the plan being adapted (each stage returns a state with a new one).
    :param home: the layout groups return to: each (replica, stage) slot's nominal TP
        degree and home devices, whose nodes' standbys may refill it. Initially the
        job's first plan; after a restore, the restore plan.
    :param origin: the job's first plan (to scale back up to once devices return).
    :param predictor: the fitted iteration predictor.
    :param evaluator: judges plans (simulation with current speeds); shared by stages.
    :param memory: the per-device memory model.
    :param failed: fail-stopped devices.
    :param speeds: compute normalised throughput per device (missing = 1.0).
    :param link_speeds: communication fail-slow, link bandwidth fraction per device.
    :param capabilities: what the active adapter can execute.
    :param k_min: the smallest TP degree allowed by configuration (memory may raise it).
    :param delta: DP migration threshold, in micro-batches of progress (docs/design.md §4.3).
    :param previous: the plan deployed before this planning run.
    :param notes: what each stage did, in order (for the decision's reason).
    :param origin_features: the workload features of ``origin`` (restored with it).
    :param effort: ``"thorough"`` simulates more candidates, ``"lean"`` the fewest that
        keep the guarantees (used for large jobs, where one simulation of a plan with
        migrated work costs tens to hundreds of milliseconds), ``"auto"`` picks lean
        when ``dp * pp * m`` exceeds :data:`LEAN_ABOVE`.
    """

    topology: Topology
    plan: ParallelPlan
    home: ParallelPlan
    origin: ParallelPlan
    predictor: IterationPredictor
    evaluator: Evaluator
    memory: MemoryModel = field(default_factory=MemoryModel)
    failed: frozenset[int] = frozenset()
    speeds: Mapping[int, float] = field(default_factory=dict)
    link_speeds: Mapping[int, float] = field(default_factory=dict)
    capabilities: Capabilities = field(default_factory=Capabilities.all)
    k_min: int = 1
    delta: float = 1.0
    previous: ParallelPlan | None = None
    notes: tuple[str, ...] = ()
    origin_features: Features | None = None
    effort: str = "auto"

    def __post_init__(self) -> None:
        if not is_power_of_two(self.k_min):
            raise PlannerError(f"k_min must be a power of two, got {self.k_min}")
        if self.delta < 0:
            raise PlannerError(f"delta must be >= 0, got {self.delta}")
        if self.effort not in ("auto", "thorough", "lean"):
            raise PlannerError(f"effort must be 'auto', 'thorough' or 'lean', got {self.effort!r}")
        self.plan.validate(self.topology)
        if self.home.pp != self.plan.pp or self.home.dp != self.plan.dp:
            raise PlannerError(
                f"home layout is {self.home.dp}x{self.home.pp} (dp x pp), plan is "
                f"{self.plan.dp}x{self.plan.pp}"
            )

    # --------------------------------------------------------------- factory
    @classmethod
    def create(
        cls,
        topology: Topology,
        plan: ParallelPlan,
        predictor: IterationPredictor,
        features: Features,
        *,
        memory: MemoryModel | None = None,
        capabilities: Capabilities | None = None,
        k_min: int = 1,
        delta: float = 1.0,
        speeds: Mapping[int, float] | None = None,
        link_speeds: Mapping[int, float] | None = None,
        failed: frozenset[int] | set[int] = frozenset(),
        effort: str = "auto",
    ) -> PlannerState:
        """The state of a job running ``plan`` (its home and origin layout)."""
        speeds = dict(speeds or {})
        link_speeds = dict(link_speeds or {})
        return cls(
            topology=topology,
            plan=plan,
            home=plan,
            origin=plan,
            predictor=predictor,
            evaluator=Evaluator(predictor, features, speeds, link_speeds),
            memory=memory or MemoryModel(),
            failed=frozenset(failed),
            speeds=speeds,
            link_speeds=link_speeds,
            capabilities=capabilities or Capabilities.all(),
            k_min=k_min,
            delta=delta,
            origin_features=features,
            effort=effort,
        )

    # ------------------------------------------------------------ derived
    @property
    def features(self) -> Features:
        return self.evaluator.features

    @property
    def thorough(self) -> bool:
        """Whether stages may spend extra simulations (see ``effort``)."""
        if self.effort == "auto":
            return self.plan.dp * self.plan.pp * self.plan.num_microbatches <= LEAN_ABOVE
        return self.effort == "thorough"

    def with_plan(self, plan: ParallelPlan, note: str | None = None) -> PlannerState:
        """A copy with ``plan`` (and ``note`` appended)."""
        notes = self.notes + ((note,) if note else ())
        return replace(self, plan=plan, notes=notes)

    def with_predictor(self, predictor: IterationPredictor) -> PlannerState:
        """A copy that judges plans with ``predictor`` (e.g. the job's own fitted model)."""
        return replace(self, predictor=predictor,
                       evaluator=Evaluator(predictor, self.features, self.speeds, self.link_speeds))

    def with_health(
        self,
        *,
        failed: frozenset[int] | None = None,
        speeds: Mapping[int, float] | None = None,
        link_speeds: Mapping[int, float] | None = None,
        features: Features | None = None,
    ) -> PlannerState:
        """A copy with new device health (a fresh evaluator: old results are stale)."""
        speeds = dict(self.speeds if speeds is None else speeds)
        link_speeds = dict(self.link_speeds if link_speeds is None else link_speeds)
        return replace(
            self,
            failed=self.failed if failed is None else frozenset(failed),
            speeds=speeds,
            link_speeds=link_speeds,
            evaluator=Evaluator(
                self.predictor, self.features if features is None else features, speeds, link_speeds
            ),
        )

    def alive(self, device: int) -> bool:
        return device not in self.failed

    def node(self, device: int) -> int:
        return _lookup(self.topology)[0][device]

    def capacity(self, device: int) -> float:
        return _lookup(self.topology)[1][device]

    def throughput(self, device: int) -> float:
        """The device's normalised throughput p_i for the TP rule (see module docs)."""
        if device in self.failed:
            return 0.0
        p = float(self.speeds.get(device, 1.0))
        c = float(self.link_speeds.get(device, 1.0))
        if c < 1.0:
            # A node's interface (every device of it slow alike, evaluate.py) carries no
            # TP all-reduce inside the node: only the transfers in and out count.
            comm_share = self._comm_share(device, tp=self.node(device) not in self.evaluator.node_links)
            p = min(p, 1.0 / ((1.0 - comm_share) + comm_share / c))
        return p

    def _comm_share(self, device: int, tp: bool = True) -> float:
        """Share of communication in the healthy per-micro-batch time of the device's
        home stage: TP all-reduces (``tp``) plus the activation/gradient transfers in and
        out."""
        loc = self.home.location(device) or self.plan.location(device)
        r, s = (loc[0], loc[1]) if loc else (0, 0)
        deg = max(1, self.home.degree(r, s))
        pred = self.predictor
        shape = pred.shape
        cost = pred.cost.stages[s] if len(pred.cost.stages) == self.plan.pp else pred.cost.stages[0]
        ntok, ssq = self.features
        layers = self.plan.layers(s)
        mean_n, mean_s = float(np.mean(ntok)), float(np.mean(ssq))
        scale = layers / cost.ref_layers * cost.ref_tp / deg
        compute = (cost.alpha_f * mean_n + cost.beta_f * mean_s + cost.gamma_f
                   + cost.alpha_b * mean_n + cost.beta_b * mean_s + cost.gamma_b) * scale
        tp = 2.0 * layers * pred.links.tp_per_layer(shape.tokens, shape.hidden, deg,
                                                    dtype_bytes=shape.dtype_bytes) if tp else 0.0
        act = activation_bytes(shape.tokens, shape.hidden, shape.dtype_bytes)
        edges = (s > 0) + (s < self.plan.pp - 1)
        p2p = 2.0 * edges * pred.links.stage_p2p(act, deg, deg, same_node=False)
        total = compute + tp + p2p
        return (tp + p2p) / total if total > 0 else 0.0

    @cached_property
    def _impaired(self) -> frozenset[int]:
        """Devices whose throughput may differ from 1 (failed, or listed with a speed)."""
        return self.failed | frozenset(self.speeds) | frozenset(self.link_speeds)

    def group_throughput(self, group: tuple[int, ...]) -> float:
        """``k * min p_i`` of a TP group (0 for an empty one)."""
        if not group:
            return 0.0
        imp = self._impaired
        if not any(d in imp for d in group):  # the common case at scale: every p_i is 1
            return float(len(group))
        return len(group) * min(self.throughput(d) for d in group)

    def nominal_degree(self, replica: int, stage: int) -> int:
        return len(self.home.group(replica, stage))

    def inflight_cap(self, stage: int, n_items: int | None = None) -> int:
        n = self.plan.num_microbatches if n_items is None else n_items
        return inflight(self.plan.schedule, stage, self.plan.pp, n)

    def min_capacity(self, group: tuple[int, ...]) -> float:
        u = uniform_capacity(self.topology)
        if u is not None and group:
            return u
        mem = _lookup(self.topology)[1]
        return min(mem[d] for d in group)

    def max_items(self, replica: int, stage: int, plan: ParallelPlan | None = None) -> int:
        """Most (stage, micro-batch) items executor (replica, stage) of ``plan`` (default
        the state's) can run within its devices' memory (large when unbounded)."""
        plan = plan or self.plan
        g = plan.group(replica, stage)
        if not g:
            return 0
        return self.memory.max_items(self.min_capacity(g), plan.layers(stage), len(g),
                                     plan.schedule, stage, plan.pp)

    def memory_violations(self, plan: ParallelPlan | None = None) -> list[str]:
        """Executors of ``plan`` (default the state's) whose layers, optimizer state and
        in-flight activations (per the schedule and their work) exceed a member's memory."""
        plan = plan or self.plan
        mem = self.memory
        if not (mem.layer_state_gib or mem.layer_activation_gib or mem.reserve_gib):
            return []
        n_work: dict[tuple[int, int], int] = {}
        for mig in plan.migrations:
            n_work[(mig.replica, mig.stage)] = n_work.get((mig.replica, mig.stage), 0) - 1
            n_work[(mig.to, mig.stage)] = n_work.get((mig.to, mig.stage), 0) + 1
        out = []
        needs: dict[tuple[int, int, int], float] = {}  # (stage, degree, items): one model call each
        for r, s in plan.executors():
            g = plan.group(r, s)
            n = plan.num_microbatches + n_work.get((r, s), 0)
            k = (s, len(g), n)
            need = needs.get(k)
            if need is None:
                need = needs[k] = mem.device_gib(plan.layers(s), len(g), inflight(plan.schedule, s, plan.pp, n))
            cap = self.min_capacity(g)
            if need > cap * (1 + 1e-12):
                out.append(f"replica {r} stage {s}: needs {need:.1f} GiB per device "
                           f"({plan.layers(s)} layers, TP {len(g)}, {n} micro-batches), "
                           f"has {cap:.1f} GiB")
        return out

    def fits(self, group: tuple[int, ...], layers: int, stage: int, n_items: int | None = None) -> bool:
        """Whether ``group`` can hold ``layers`` layers of ``stage`` with its in-flight
        activations (``n_items`` items of work; default one replica's micro-batches)."""
        return self.memory.fits(
            self.min_capacity(group), layers, len(group), self.inflight_cap(stage, n_items)
        )
