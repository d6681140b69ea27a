"""The policies the cluster simulator compares: ResiHP and the systems of docs/design.md §7.

Every policy reacts to *notices* (:mod:`.engine`): a device stopped, was repaired,
slowed down or recovered, once its detector noticed. It returns a
:class:`~.engine.Reaction` (next plan, downtime, lost work), priced with the
simulator's :class:`~.cluster.Costs` through :class:`~.engine.SimContext`. Plans come
from the project's own planner and its building blocks
(:mod:`resihp_core.scheduler`: the progressive planner, ``restore_layout``,
``drop_groups``, the DP and PP stages alone), and are judged by the engine with the
planner's evaluator under the devices' true health.

Policies are plugins: each is registered by name through the
``resihp_register_sim_policies`` hook (built-ins in :mod:`.builtin`, ``trylast``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from resihp_core.plan import ParallelPlan
from resihp_core.sim.engine import Health, Reaction
from resihp_core.sim.trace import FailureEvent

if TYPE_CHECKING:
    from resihp_core.sim.engine import SimContext

__all__ = [
    "Adaptra",
    "CheckpointRestart",
    "PEER_CALIBRATION",
    "PeerCalibration",
    "TorchFT",
    "young_daly_interval",
    "EnhancedOobleck",
    "EnhancedReCycle",
    "Greyhound",
    "NoMitigation",
    "Oobleck",
    "Policy",
    "ReCycle",
    "ResiHP",
]


class Policy:
    """Base class: holds the running plan; every handler defaults to doing nothing.

    ``detector`` names the fail-slow detector whose measured latency gates the
    policy's slow/recover notices (:func:`~.detection.estimate`), or None: the policy
    never hears of a fail-slow."""

    name = "policy"
    detector: str | None = None

    def start(self, ctx: SimContext) -> ParallelPlan:
        self.plan = ctx.origin
        return self.plan

    def iteration_time(self, ctx: SimContext, plan: ParallelPlan) -> float:
        """Iteration seconds of ``plan`` now (the engine's judge; a policy whose
        mitigation is not a plan change, e.g. a schedule that hides link delays,
        overrides this)."""
        return ctx.time(plan)

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return None

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return None

    def on_slow(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return None

    def on_recover(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return None

    def on_timer(self, ctx: SimContext, tag: str) -> Reaction | None:
        return None

    def checkpoint_interval(self, ctx: SimContext) -> float:
        """Seconds of job time between this policy's checkpoints (the job's default)."""
        return ctx.costs.checkpoint_interval_s


# ------------------------------------------------------------------ ResiHP
class ResiHP(Policy):
    """The real progressive planner (:class:`~resihp_core.scheduler.Planner`, with the
    registered adaptation stages) on every notice.

    Fail-stop: a report to the planner; a ``continue`` decision costs planning +
    communicator rebuild + state movement by bytes and loses the interrupted
    iteration; a ``restore`` decision is a restart from the last checkpoint. Repair:
    :meth:`Planner.rejoin` (the device comes back as a standby and groups grow back;
    a restore onto the whole original layout happens at a checkpoint, losing nothing).
    Fail-slow and recovery: a report with the device's throughput (1.0 = recovered)
    after the workload-aware detector's measured latency. Simplified from the runtime:
    the detector's throughput estimate is taken as exact and reconfiguration happens
    at an iteration boundary (the runtime rolls back an uncommitted iteration)."""

    name = "resihp"
    detector = "resihp"

    def start(self, ctx: SimContext) -> ParallelPlan:
        from resihp_core.scheduler import Planner

        self.state = ctx.state0
        self.planner = Planner()
        self.plan = self.state.plan
        return self.plan

    def _decide(self, ctx: SimContext, call: Any, rollback: str, what: str) -> Reaction:
        from resihp_core.scheduler import PlannerError

        prev = self.state.plan
        try:
            d = call()
        except PlannerError as err:
            return Reaction(note=f"{what}: planner gave up: {err}")
        self.state = d.state
        self.plan = d.plan
        if d.kind == "restore":
            lost = "checkpoint" if rollback != "none" else "none"
            down = ctx.costs.planning(ctx.job.devices) + ctx.restart_seconds(d.plan)
            return Reaction(d.plan, down, lost, note=f"restore: {d.reason[:160]}")  # type: ignore[arg-type]
        return Reaction(d.plan, ctx.reconfigure_seconds(prev, d.plan), rollback,  # type: ignore[arg-type]
                        note=d.reason[:160])

    def _report(self, failure: str, e: FailureEvent, p: float | None = None) -> Any:
        from resihp_core.protocol import FailureReport

        if failure == "fail-stop":
            return FailureReport(generation=self.state.plan.generation, failure="fail-stop",
                                 devices=(e.device,))
        return FailureReport(generation=self.state.plan.generation, failure="fail-slow",
                             devices=(e.device,), cause=e.cause, throughput={e.device: p})

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        rb = "iteration" if e.device in self.plan.devices() else "none"
        return self._decide(ctx, lambda: self.planner.plan(self.state, self._report("fail-stop", e)),
                            rb, f"stop {e.device}")

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._decide(ctx, lambda: self.planner.rejoin(self.state, [e.device]), "none",
                            f"repair {e.device}")

    def on_slow(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._decide(ctx, lambda: self.planner.plan(self.state, self._report("fail-slow", e, e.throughput)),
                            "none", f"slow {e.device}")

    def on_recover(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._decide(ctx, lambda: self.planner.plan(self.state, self._report("fail-slow", e, 1.0)),
                            "none", f"recover {e.device}")


# ------------------------------------------------------------------ restart
class NoMitigation(Policy):
    """No mitigation: a fail-stop crashes the job, which restarts from the last
    checkpoint (all work since lost) on the surviving devices, laid out fresh by the
    planner's ``restore_layout`` (same global batch, as an elastic launcher would);
    when the original layout is whole again and faster, it restarts onto it right
    after a checkpoint (nothing lost). Fail-slow is never noticed. Simplified from a
    plain job restart: the restart is elastic (no waiting for a replacement node)."""

    name = "none"

    def start(self, ctx: SimContext) -> ParallelPlan:
        self.plan = self.layout = self.home = self.first_layout(ctx)
        return self.plan

    def first_layout(self, ctx: SimContext) -> ParallelPlan:
        """The job's first plan under this policy (the job's own layout by default)."""
        return ctx.origin

    def _restart(self, ctx: SimContext, health: Health | None = None, rollback: str = "checkpoint",
                 note: str = "restart from checkpoint") -> Reaction:
        from resihp_core.scheduler import PlannerError, restore_layout

        try:
            plan, _ = restore_layout(ctx.state_for(ctx.origin, health))
        except PlannerError as err:
            return Reaction(note=f"cannot restart: {err}")
        self.plan = self.layout = plan
        return Reaction(plan, ctx.restart_seconds(plan), rollback, note=note)  # type: ignore[arg-type]

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        if e.device not in self.plan.devices():
            return None
        return self._restart(ctx)

    def _back_to_origin(self, ctx: SimContext) -> Reaction | None:
        origin = self.home
        if self.layout is origin or any(d in ctx.health.failed for d in origin.devices()):
            return None
        if self.iteration_time(ctx, origin) >= self.iteration_time(ctx, self.plan) * 0.99:
            return None
        self.plan = self.layout = origin
        return Reaction(origin, ctx.restart_seconds(origin), "none",
                        note="restart onto the repaired original layout after a checkpoint")

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._back_to_origin(ctx)


class ReCycle(NoMitigation):
    """ReCycle (fail-stop): the failed device's whole TP group leaves the plan and
    its micro-batches are rerouted to the stage's DP peers, which run them in their
    pipeline bubbles (``drop_groups`` + the emitter's dynamic orders); costs a
    communicator rebuild and the interrupted iteration. Every replica of a stage lost:
    restart from checkpoint. A repaired device's group rejoins (rebuild + copying its
    stage's state). Fail-slow is not noticed. Simplified from ReCycle: its decoupled
    back-propagation and bubble-aware rescheduling are what the simulator's dynamic
    1F1B orders give the rerouted work, not a separate schedule."""

    name = "recycle"
    node_granularity = False

    def _bad(self, ctx: SimContext) -> set[int]:
        bad = set(ctx.health.failed)
        if self.node_granularity:
            st = ctx.state0
            nodes = {st.node(d) for d in bad}
            bad |= {d for n, ids in st.topology.nodes().items() if n in nodes for d in ids}
        return bad

    def _reroute(self, ctx: SimContext) -> ParallelPlan | None:
        from resihp_core.scheduler import RestoreRequired
        from resihp_core.scheduler.tp import drop_groups

        try:
            return drop_groups(self.layout, self._bad(ctx), ctx.health.failed)
        except RestoreRequired:
            return None

    def _copy_s(self, ctx: SimContext, old: ParallelPlan, new: ParallelPlan) -> float:
        return 0.0

    def fail_stop_plan(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        if e.device not in self.layout.devices():
            return None
        new = self._reroute(ctx)
        if new is None:
            return self._restart(ctx)
        old, self.plan = self.plan, new
        return Reaction(new, ctx.costs.rebuild_s + self._copy_s(ctx, old, new), "iteration",
                        note=f"dropped {len(old.devices()) - len(new.devices())} devices' groups")

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self.fail_stop_plan(ctx, e)

    def fail_stop_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        if self.layout is not self.home:
            return self._back_to_origin(ctx)
        new = self._reroute(ctx)
        if new is None or (new.tp_groups, new.migrations) == (self.plan.tp_groups, self.plan.migrations):
            return None
        old, self.plan = self.plan, new
        return Reaction(new, ctx.costs.rebuild_s + ctx.move_seconds(old, new), "none", note="group rejoined")

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self.fail_stop_repair(ctx, e)


def pipeline_major(plan: ParallelPlan) -> ParallelPlan:
    """``plan``'s uniform layout with device ids assigned TP-innermost, then stage,
    then replica (a node holds consecutive stages of one replica)."""
    tp = len(plan.group(0, 0))
    pp, dp = plan.pp, plan.dp
    groups = tuple(tuple(tuple(r * pp * tp + s * tp + t for t in range(tp)) for s in range(pp))
                   for r in range(dp))
    return plan.with_(tp_groups=groups)


class Oobleck(ReCycle):
    """Oobleck (fail-stop): the pipeline that lost a node is re-instantiated from a
    template with fewer nodes and the global batch is redistributed over the
    pipelines. Simplified from Oobleck: the plan IR shares layer ranges across
    replicas, so a re-instantiated pipeline is modelled as the lost node's TP groups
    (all of them, healthy members included) leaving the plan with their micro-batches
    spread over the stage's DP peers, and the re-instantiation priced as copying the
    dropped stages' state (one stage shard per device, by bytes and bandwidth) plus a
    communicator rebuild. Oobleck places each pipeline on its own nodes, so its first
    plan is laid out pipeline-major (TP innermost, then stages, then replicas: a node
    holds consecutive stages of one replica) rather than the job's Megatron layout."""

    name = "oobleck"
    node_granularity = True

    def first_layout(self, ctx: SimContext) -> ParallelPlan:
        return pipeline_major(ctx.origin)

    def _copy_s(self, ctx: SimContext, old: ParallelPlan, new: ParallelPlan) -> float:
        per_layer = ctx.job.state_bytes_per_layer()
        worst = 0.0
        for r, s in old.executors():
            if not new.group(r, s):
                worst = max(worst, old.layers(s) * per_layer / len(old.group(r, s)))
        return worst / ctx.costs.state_bandwidth


# ------------------------------------------------------------------ fail-slow
class _SkiRental:
    """Greyhound's fail-slow mitigation, mixed into a fail-stop policy.

    After detection it escalates, ski-rental style, through: (1) redistributing
    micro-batches across DP replicas (the DP stage alone: ``dp_only``), (2) re-splitting
    pipeline layers (the PP stage alone: ``pp_only``), (3) a checkpoint-restart without
    the slow device(s). It moves to the next level that the evaluator predicts faster
    once the throughput lost since detection has paid for that level's cost (its
    downtime, plus the work since the last checkpoint for a restart)."""

    detector = "greyhound"
    LEVELS = ("redistribute", "re-split", "restart")

    def _slow_reset(self) -> None:
        self.level = 0
        self.paid = 0.0
        self.mark = 0.0
        self.pending = -1

    def _candidate(self, ctx: SimContext, lvl: int) -> tuple[ParallelPlan | None, float, str]:
        from resihp_core.plan import PlanError
        from resihp_core.scheduler import PlannerError

        try:
            return self._level_plan(ctx, lvl)
        except (PlannerError, PlanError):
            return None, 0.0, "none"

    def _level_plan(self, ctx: SimContext, lvl: int) -> tuple[ParallelPlan | None, float, str]:
        from resihp_core.scheduler.baselines import dp_only, pp_only

        base = self.fs_plan  # type: ignore[attr-defined]
        if lvl == 1:
            plan = dp_only(ctx.state_for(base))
            return plan, ctx.costs.planning(ctx.job.devices), "none"
        if lvl == 2:
            plan = pp_only(ctx.state_for(base))
            return plan, (None if plan is None else ctx.reconfigure_seconds(self.plan, plan)) or 0.0, "none"  # type: ignore[attr-defined]
        slow = ctx.health.slow()
        h = Health(ctx.health.failed | frozenset(slow))
        from resihp_core.scheduler import PlannerError, restore_layout

        try:
            plan, _ = restore_layout(ctx.state_for(ctx.origin, h))
        except PlannerError:
            return None, 0.0, "none"
        return plan, ctx.restart_seconds(plan) + ctx.since_checkpoint_s, "checkpoint"

    def _schedule(self, ctx: SimContext) -> tuple[tuple[float, str], ...]:
        cur = self.iteration_time(ctx, self.plan)  # type: ignore[attr-defined]
        healthy = ctx.time(self.fs_plan, Health(ctx.health.failed))  # type: ignore[attr-defined]
        if not (math.isfinite(cur) and math.isfinite(healthy)):
            return ()
        loss = 1.0 - healthy / cur
        if loss <= 0.01 or not ctx.health.slow():
            return ()
        for lvl in range(self.level + 1, len(self.LEVELS) + 1):
            plan, cost, _ = self._candidate(ctx, lvl)
            if plan is not None and self.iteration_time(ctx, plan) < cur * 0.99:  # type: ignore[attr-defined]
                self.pending = lvl
                return ((max(0.0, cost - self.paid) / loss, f"escalate {lvl}"),)
        return ()

    def slow_timer(self, ctx: SimContext, tag: str) -> Reaction | None:
        lvl = int(tag.split()[1])
        if lvl != self.pending or not ctx.health.slow():
            return None
        plan, cost, rollback = self._candidate(ctx, lvl)
        if plan is None:
            return None
        self.paid += cost
        self.level = lvl
        self.plan = plan  # type: ignore[attr-defined]
        if lvl == 3:
            cost -= ctx.since_checkpoint_s  # lost work is charged by the rollback itself
        return Reaction(plan, cost, rollback, self._schedule(ctx),  # type: ignore[arg-type]
                        note=f"greyhound level {lvl}: {self.LEVELS[lvl - 1]}")

    def slow_detected(self, ctx: SimContext) -> Reaction | None:
        self.pending = -1
        timers = self._schedule(ctx)
        return Reaction(timers=timers, note="greyhound: slow detected") if timers else None

    def slow_recovered(self, ctx: SimContext) -> Reaction | None:
        back = self.fs_plan  # type: ignore[attr-defined]
        was = self.level
        self._slow_reset()
        if self.plan is back:  # type: ignore[attr-defined]
            return None
        old = self.plan  # type: ignore[attr-defined]
        self.plan = back  # type: ignore[attr-defined]
        if was == 3:
            down = ctx.restart_seconds(back)
        else:
            down = ctx.reconfigure_seconds(old, back)
        return Reaction(back, down, "none", self._schedule(ctx), note="greyhound: back to the base plan")


class Greyhound(_SkiRental, NoMitigation):
    """Greyhound (fail-slow): change points on the iteration time with its published
    rules (posterior > 0.8, outliers |z| > 3 dropped, 10 iterations apart, >= 10 %
    shift), verification that flags a rank at 2x the median (compute) or 1.1x
    (communication), and the ski-rental escalation of :class:`_SkiRental`. A
    fail-stop restarts from checkpoint as :class:`NoMitigation`. Simplified from
    Greyhound: its per-group variance-minimising batch split is the DP stage's
    balancing, and its layer re-split is the PP stage's."""

    name = "greyhound"

    def start(self, ctx: SimContext) -> ParallelPlan:
        self._slow_reset()
        self.fs_plan = NoMitigation.start(self, ctx)
        return self.fs_plan

    def _after_fail_stop(self, ctx: SimContext, r: Reaction | None) -> Reaction | None:
        self.fs_plan = self.plan
        self._slow_reset()
        if r is None:
            return None
        timers = self._schedule(ctx)
        return Reaction(r.plan, r.downtime_s, r.rollback, r.timers + timers, r.note)

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._after_fail_stop(ctx, NoMitigation.on_stop(self, ctx, e))

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._after_fail_stop(ctx, NoMitigation.on_repair(self, ctx, e))

    def on_slow(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self.slow_detected(ctx)

    def on_recover(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self.slow_recovered(ctx)

    def on_timer(self, ctx: SimContext, tag: str) -> Reaction | None:
        return self.slow_timer(ctx, tag)


class EnhancedReCycle(_SkiRental, ReCycle):
    """ReCycle with Greyhound's fail-slow detection and mitigation added (docs/design.md §7's
    "enhanced" baseline): fail-stop as :class:`ReCycle`, fail-slow as
    :class:`Greyhound`, escalating from ReCycle's current plan. Simplified as both
    parts are; after a fail-stop reaction the escalation restarts from level 0."""

    name = "enh-recycle"

    start = Greyhound.start
    _after_fail_stop = Greyhound._after_fail_stop
    on_slow = Greyhound.on_slow
    on_recover = Greyhound.on_recover
    on_timer = Greyhound.on_timer

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        self.plan = self.fs_plan
        return self._after_fail_stop(ctx, self.fail_stop_plan(ctx, e))

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        self.plan = self.fs_plan
        return self._after_fail_stop(ctx, self.fail_stop_repair(ctx, e))


class EnhancedOobleck(EnhancedReCycle):
    """Oobleck with Greyhound's fail-slow detection and mitigation added: fail-stop
    as :class:`Oobleck`, fail-slow as :class:`Greyhound`. Simplified as both parts
    are (see their docstrings)."""

    name = "enh-oobleck"
    node_granularity = True
    first_layout = Oobleck.first_layout
    _copy_s = Oobleck._copy_s


class Adaptra(NoMitigation):
    """Adaptra (fail-slow): adapts the pipeline to absorb slow stages and links.
    A slow link's stage-to-stage transfers are hidden by a schedule with more
    in-flight micro-batches (modelled: the pipeline P2P edges run at healthy speed;
    TP all-reduces and the DP reduction still see the slow link); a compute-slow stage
    gets fewer layers (the PP stage alone, ``pp_only``). Detection: change points on the
    iteration time, localised by per-stage timing. A fail-stop restarts from
    checkpoint. Simplified from Adaptra: its schedule search and CPU-offloaded
    communication are reduced to these two effects."""

    name = "adaptra"
    detector = "adaptra"

    def start(self, ctx: SimContext) -> ParallelPlan:
        self.absorb = False
        return NoMitigation.start(self, ctx)

    def iteration_time(self, ctx: SimContext, plan: ParallelPlan) -> float:
        if not self.absorb or not ctx.health.link_map():
            return ctx.time(plan)
        if any(d in ctx.health.failed for d in plan.devices()):
            return math.inf
        from resihp_core.predictor.simulator import simulate

        ev = ctx.evaluator(plan)
        inp = ev.inputs(plan)
        healthy = ctx.evaluator(plan, Health(ctx.health.failed, ctx.health.speeds)).inputs(plan)
        inp["comm_forward"], inp["comm_backward"] = healthy["comm_forward"], healthy["comm_backward"]
        return simulate(plan, **inp).iteration_time

    def _replan(self, ctx: SimContext) -> Reaction | None:
        from resihp_core.scheduler.baselines import pp_only

        old = self.plan
        self.absorb = bool(ctx.health.link_map())
        new = self.layout
        if ctx.health.speed_map():
            cand = pp_only(ctx.state_for(self.layout))
            if cand is not None and ctx.time(cand) < ctx.time(self.layout):
                new = cand
        self.plan = new
        return Reaction(new, ctx.reconfigure_seconds(old, new) if new is not old else ctx.costs.rebuild_s,
                        "none", note=f"adaptra: absorb links={self.absorb}, layers {new.layer_ranges}")

    def on_slow(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._replan(ctx)

    def on_recover(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        return self._replan(ctx)

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        self.absorb = False
        return NoMitigation.on_stop(self, ctx, e)


# ------------------------------------------------------------------ what users run instead
@dataclass(frozen=True)
class PeerCalibration:
    """The peers' costs that ``benchmarks/peers.py`` measures on real runs (4 CPU
    workers, gloo; docs/benchmarks.md "ResiHP next to torchft and checkpoint-restart"),
    as far as they carry to a cluster:

    - ``torchft_quorum_s``: torchft's fault-free step time over plain DDP's in the same
      round (its per-step quorum and commit round trips to the lighthouse and the
      replica managers), seconds per step: a fixed cost, not a fraction of the step;
    - ``torchft_pause_s``: from a SIGKILL to the survivors' next committed step, less
      one step: the lighthouse's heartbeat timeout as shipped (5 s) plus a quorum;
    - ``torchft_heal_s``: a restarted replica's start before it heals from a peer (its
      imports, process group and quorum: 13 s, then 0.5 s to heal, measured by hand in
      issue 27); at cluster scale ``Costs.restart_s`` (a scheduler requeue) is used
      instead when larger;
    - ``checkpoint_write_bandwidth``: bytes/s one device writes its checkpoint shard at
      (the C of Young/Daly). Not measurable here (the benchmark's model writes in
      milliseconds): the simulator's shared-storage figure, as ``Costs.reload_bandwidth``.
    """

    torchft_quorum_s: float = 0.02
    torchft_pause_s: float = 5.0
    torchft_heal_s: float = 15.0
    checkpoint_write_bandwidth: float = 2e9


#: The measured defaults (docs/benchmarks.md).
PEER_CALIBRATION = PeerCalibration()


def young_daly_interval(write_s: float, mtbf_s: float) -> float:
    """Young/Daly's optimal checkpoint interval ``sqrt(2 C MTBF)`` (seconds of work
    between checkpoints), what checkpoint-restart users are told to pick."""
    if write_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need write_s >= 0 and mtbf_s > 0, got {write_s}, {mtbf_s}")
    return math.sqrt(2.0 * write_s * mtbf_s)


class TorchFT(Policy):
    """torchft (fail-stop, data parallelism only): each DP replica of the job is a
    torchft replica group (its TP x PP devices; HSDP inside it), joined by a per-step
    quorum. A stopped device takes its whole replica group out of the quorum; the other
    groups go on after the lighthouse's heartbeat timeout (``torchft_pause_s``, the
    interrupted step lost) with the group's samples missing from every step (torchft does
    not re-spread the batch: a step of ``k`` of ``dp`` groups trains ``k/dp`` of it,
    modelled as an iteration ``dp/k`` times longer). A repaired group restarts
    (``restart_s``), then heals from a peer (its replica state at ``state_bandwidth``,
    the others pausing for it) and rejoins. Every step costs ``torchft_quorum_s``.
    No fail-slow handling: a slow device slows its group and, through the
    synchronous step, every group. The last group gone: the job restarts from its
    checkpoint. Simplified from torchft: healing is priced as one transfer from one peer;
    the quorum's cost is a fixed per-step time."""

    name = "torchft"

    def __init__(self, calibration: PeerCalibration = PEER_CALIBRATION) -> None:
        self.cal = calibration

    def start(self, ctx: SimContext) -> ParallelPlan:
        self.plan = ctx.origin
        self.live = set(range(ctx.origin.dp))
        return self.plan

    def _replica_of(self, device: int) -> int | None:
        loc = self.plan.location(device)
        return None if loc is None else loc[0]

    def iteration_time(self, ctx: SimContext, plan: ParallelPlan) -> float:
        if not self.live:
            return math.inf
        devs = {d for r in self.live for g in plan.tp_groups[r] for d in g}
        if any(d in ctx.health.failed for d in devs):
            return math.inf  # a live group's device stopped: stalled until the quorum drops it
        h = Health(frozenset(), tuple((d, p) for d, p in ctx.health.speeds if d in devs),
                   tuple((d, p) for d, p in ctx.health.links if d in devs))
        return (ctx.time(plan, h) + self.cal.torchft_quorum_s) * plan.dp / len(self.live)

    def on_stop(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        r = self._replica_of(e.device)
        if r is None or r not in self.live:
            return None
        self.live.discard(r)
        if not self.live:
            self.live = set()
            return Reaction(self.plan, ctx.restart_seconds(self.plan), "checkpoint",
                            timers=((0.0, "rejoin-all"),), note="torchft: every replica group lost")
        pause = max(0.0, self.cal.torchft_pause_s - ctx.costs.heartbeat_detect_s)
        return Reaction(self.plan, pause, "iteration", note=f"torchft: replica group {r} left the quorum")

    def _heal_timers(self, ctx: SimContext, device: int) -> tuple[tuple[float, str], ...]:
        r = self._replica_of(device)
        if r is None or r in self.live:
            return ()
        if any(d in ctx.health.failed for g in self.plan.tp_groups[r] for d in g):
            return ()
        return ((max(ctx.costs.restart_s, self.cal.torchft_heal_s), f"heal {r}"),)

    def on_repair(self, ctx: SimContext, e: FailureEvent) -> Reaction | None:
        timers = self._heal_timers(ctx, e.device)
        return Reaction(timers=timers, note=f"torchft: replica group restarting after repair of {e.device}") \
            if timers else None

    def on_timer(self, ctx: SimContext, tag: str) -> Reaction | None:
        if tag == "rejoin-all":
            healthy = {r for r in range(self.plan.dp)
                       if not any(d in ctx.health.failed for g in self.plan.tp_groups[r] for d in g)}
            self.live = healthy
            return Reaction(self.plan, 0.0, "none", note=f"torchft: {len(healthy)} replica groups back after the restart")
        r = int(tag.split()[1])
        if r in self.live or any(d in ctx.health.failed for g in self.plan.tp_groups[r] for d in g):
            return None
        self.live.add(r)
        per_replica = ctx.job.state_bytes_per_layer() * self.plan.num_layers / (ctx.job.tp * ctx.job.pp)
        return Reaction(self.plan, per_replica / ctx.costs.state_bandwidth, "none",
                        note=f"torchft: replica group {r} healed from a peer")


class CheckpointRestart(NoMitigation):
    """Checkpoint-restart as ``torchrun --max-restarts`` (or a scheduler requeue) runs
    it: a fail-stop restarts every worker from the newest checkpoint (restart plus
    reading the shard: ``restart_s`` + shard / ``reload_bandwidth``), losing the work
    since it, laid out as :class:`NoMitigation` does (elastic: the surviving devices,
    back onto the whole layout once repaired). Unlike ``none`` (a fixed 30-minute
    interval, writes free), the interval is Young/Daly's ``sqrt(2 C MTBF)`` with ``C``
    the shard write time and ``MTBF`` the trace's mean time between fail-stops, and
    every checkpoint costs ``C`` of training time (a synchronous write). Fail-slow is
    not handled. Simplified from a real restart: the write cost is spread over the
    iterations (``C`` per interval) rather than paid as a pause at each checkpoint, and
    the MTBF is the trace's own (duration over stops)."""

    name = "checkpoint-restart"

    def __init__(self, calibration: PeerCalibration = PEER_CALIBRATION) -> None:
        self.cal = calibration

    def write_seconds(self, ctx: SimContext) -> float:
        """C: the largest checkpoint shard of the job's layout over the write bandwidth."""
        per_layer = ctx.job.state_bytes_per_layer()
        o = ctx.origin
        shard = max(o.layers(s) * per_layer / len(o.group(r, s)) for r, s in o.executors())
        return shard / self.cal.checkpoint_write_bandwidth

    def checkpoint_interval(self, ctx: SimContext) -> float:
        c = self.write_seconds(ctx)
        mtbf = ctx.mtbf_s if math.isfinite(ctx.mtbf_s) else ctx.costs.checkpoint_interval_s
        return max(1e-3, young_daly_interval(c, mtbf)) if c > 0 else ctx.costs.checkpoint_interval_s

    def iteration_time(self, ctx: SimContext, plan: ParallelPlan) -> float:
        t = ctx.time(plan)
        return t * (1.0 + self.write_seconds(ctx) / self.checkpoint_interval(ctx))


#: Built-in policies by name, in the report's column order.
BUILTIN_POLICIES: dict[str, type[Policy]] = {
    p.name: p for p in (ResiHP, NoMitigation, ReCycle, Oobleck, Greyhound, Adaptra, EnhancedReCycle,
                        EnhancedOobleck, TorchFT, CheckpointRestart)
}
