"""The discrete-event, iteration-level cluster simulator.

Why: ResiHP's claims at cluster scale (docs/design.md §7) need hours of training on hundreds to
thousands of devices under failure traces, with every comparison system reacting to
the same trace. Simulating every iteration's DAG would be wasteful: between two events
the plan and the devices' health do not change, so the iteration time does not
either. The engine therefore advances from event to event; in between, progress is
``elapsed / iteration_time`` iterations, where the iteration time is the planner's own
:class:`~resihp_core.scheduler.evaluate.Evaluator` (the DAG simulator with compute and
communication fail-slow) of the plan the policy runs, under the devices' *true* health.

Events, in time order:

- **trace events** (:mod:`.trace`) change the truth: a stop makes every plan that uses
  the device stall; a slow changes the iteration time of plans that use it;
- **notices**: when the policy learns of a trace event. Fail-stop: after the heartbeat
  timeout. Fail-slow and recovery: after the detection latency measured on the
  policy's detector (:mod:`.detection`) times the iteration time, or never (no
  detector, or the change is invisible to it); a recovery hidden by the mitigation
  (the device no longer runs work) is noticed by the next probe. Repair: at once;
- **timers** a policy asked for (e.g. Greyhound's ski-rental escalation).

A notice runs the policy's handler, which returns a :class:`Reaction`: the next plan,
the downtime it costs (no progress), and what work is lost (the interrupted iteration,
or everything since the last checkpoint). Notices that arrive during a downtime wait
until it ends. Checkpoints are taken every ``Costs.checkpoint_interval_s`` while the
job runs.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal

from resihp_core.plan import ParallelPlan
from resihp_core.sim.cluster import Costs, JobSpec, SimError
from resihp_core.sim.trace import FailureEvent, Trace

if TYPE_CHECKING:
    from resihp_core.scheduler.state import PlannerState
    from resihp_core.sim.policies import Policy

__all__ = ["Health", "Reaction", "RunResult", "SimContext", "Segment", "run"]


@dataclass(frozen=True)
class Health:
    """The devices' truth: fail-stopped, compute speeds p, link bandwidth fractions."""

    failed: frozenset[int] = frozenset()
    speeds: tuple[tuple[int, float], ...] = ()
    links: tuple[tuple[int, float], ...] = ()

    def speed_map(self) -> dict[int, float]:
        return dict(self.speeds)

    def link_map(self) -> dict[int, float]:
        return dict(self.links)

    def slow(self) -> set[int]:
        return {d for d, _ in self.speeds} | {d for d, _ in self.links}

    def apply(self, e: FailureEvent) -> Health:
        failed, sp, lk = set(self.failed), self.speed_map(), self.link_map()
        if e.kind == "stop":
            failed.add(e.device)
        elif e.kind == "repair":
            failed.discard(e.device)
        elif e.kind == "slow":
            (sp if e.cause == "compute" else lk)[e.device] = e.throughput
        else:
            (sp if e.cause == "compute" else lk).pop(e.device, None)
        return Health(frozenset(failed), tuple(sorted(sp.items())), tuple(sorted(lk.items())))


@dataclass(frozen=True)
class Reaction:
    """What a policy does about a notice.

    :param plan: the plan to run from now on (None: keep the current one).
    :param downtime_s: seconds without progress before ``plan`` runs (detection is
        already over; this is planning, rebuilds, state movement, restarts).
    :param rollback: ``"iteration"`` loses the interrupted iteration, ``"checkpoint"``
        everything since the last checkpoint, ``"none"`` nothing.
    :param timers: ``(delay_s, tag)`` pairs: call the policy's ``on_timer(tag)`` then.
    :param note: one line for the event log.
    """

    plan: ParallelPlan | None = None
    downtime_s: float = 0.0
    rollback: Literal["none", "iteration", "checkpoint"] = "none"
    timers: tuple[tuple[float, str], ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Segment:
    """``[start, end)`` seconds at ``throughput`` samples/s (0 while down or stalled)."""

    start: float
    end: float
    throughput: float


@dataclass
class RunResult:
    """One policy on one trace."""

    policy: str
    scenario: str
    seed: int
    duration_s: float
    samples: float
    healthy_throughput: float
    segments: list[Segment]
    log: list[dict[str, Any]]
    wall_s: float = 0.0

    @property
    def throughput(self) -> float:
        return self.samples / self.duration_s

    @property
    def retained(self) -> float:
        return self.throughput / self.healthy_throughput

    def to_dict(self, *, segments: bool = False) -> dict[str, Any]:
        d: dict[str, Any] = {
            "policy": self.policy, "scenario": self.scenario, "seed": self.seed,
            "duration_s": self.duration_s, "samples": self.samples,
            "throughput": self.throughput, "healthy_throughput": self.healthy_throughput,
            "retained": self.retained, "wall_s": round(self.wall_s, 3), "log": self.log,
        }
        if segments:
            d["segments"] = [(s.start, s.end, s.throughput) for s in self.segments]
        return d


class SimContext:
    """What policies may ask: the job, costs, the planner's base state, plan timing and
    reaction prices. One per run; caches evaluators per health."""

    def __init__(self, job: JobSpec, costs: Costs, state0: PlannerState) -> None:
        self.job = job
        self.costs = costs
        self.state0 = state0
        self.origin: ParallelPlan = state0.plan
        self.health = Health()
        self.now = 0.0
        self.since_checkpoint_s = 0.0  # job time of progress that a crash would lose
        self.mtbf_s = math.inf  # the trace's mean time between fail-stops (duration / stops)
        self._evals: dict[tuple, Any] = {}
        self._feats: dict[tuple[int, int], Any] = {}

    # -------------------------------------------------------------- timing
    def features(self, dp: int, m: int) -> Any:
        """The iteration's workload features re-split over ``dp`` replicas of ``m``
        micro-batches (the same global batch: what a restore layout keeps)."""
        key = (dp, m)
        hit = self._feats.get(key)
        if hit is None:
            ntok, ssq = self.state0.features
            if ntok.size != dp * m:
                raise SimError(f"plan has {dp}x{m} micro-batches, the job's global batch is {ntok.size}")
            hit = (ntok.reshape(dp, m).copy(), ssq.reshape(dp, m).copy())
            self._feats[key] = hit
        return hit

    def evaluator(self, plan: ParallelPlan, health: Health | None = None) -> Any:
        from resihp_core.scheduler.evaluate import Evaluator

        health = self.health if health is None else health
        key = (health, plan.dp, plan.num_microbatches)
        ev = self._evals.get(key)
        if ev is None:
            if len(self._evals) > 64:
                self._evals.clear()
            ev = Evaluator(self.state0.predictor, self.features(plan.dp, plan.num_microbatches),
                           health.speed_map(), health.link_map(), cache_size=8)
            self._evals[key] = ev
        return ev

    def time(self, plan: ParallelPlan, health: Health | None = None) -> float:
        """Iteration seconds of ``plan`` under ``health`` (default: the truth now);
        infinite when the plan uses a failed device."""
        health = self.health if health is None else health
        if health.failed and any(d in health.failed for d in plan.devices()):
            return math.inf
        return self.evaluator(plan, health).time(plan)

    def state_for(self, plan: ParallelPlan, health: Health | None = None) -> PlannerState:
        """The planner's state for ``plan`` under ``health`` (home = ``plan`` when its
        shape differs from the job's first plan, e.g. after a restart)."""
        health = self.health if health is None else health
        st = self.state0.with_health(failed=health.failed, speeds=health.speed_map(),
                                     link_speeds=health.link_map())
        if (plan.dp, plan.pp, plan.num_microbatches) == (
                self.origin.dp, self.origin.pp, self.origin.num_microbatches):
            return replace(st, plan=plan)
        ev = self.evaluator(plan, health)
        from resihp_core.scheduler.evaluate import Evaluator

        return replace(st, plan=plan, home=plan,
                       evaluator=Evaluator(st.predictor, ev.features, health.speed_map(), health.link_map()))

    # -------------------------------------------------------------- prices
    def move_seconds(self, old: ParallelPlan, new: ParallelPlan) -> float:
        """State movement between plans: each device receives the layers it did not
        hold (its shard: parameters, gradients, optimizer state), at
        ``Costs.state_bandwidth``; devices receive in parallel."""
        per_layer = self.job.state_bytes_per_layer()
        held: dict[int, tuple[int, int]] = {}
        for r, s in old.executors():
            for d in old.group(r, s):
                held[d] = old.layer_ranges[s]
        worst = 0.0
        for r, s in new.executors():
            g = new.group(r, s)
            a, b = new.layer_ranges[s]
            for d in g:
                ha, hb = held.get(d, (0, 0))
                keep = max(0, min(b, hb) - max(a, ha))
                same_degree = d in held and old.location(d) is not None and len(
                    old.group(*old.location(d)[:2])) == len(g)
                missing = (b - a) - (keep if same_degree else 0)
                worst = max(worst, missing * per_layer / len(g))
        return worst / self.costs.state_bandwidth

    def restart_seconds(self, plan: ParallelPlan) -> float:
        """Relaunch plus every device reading its checkpoint shard."""
        per_layer = self.job.state_bytes_per_layer()
        shard = max(plan.layers(s) * per_layer / len(plan.group(r, s)) for r, s in plan.executors())
        return self.costs.restart_s + shard / self.costs.reload_bandwidth

    def reconfigure_seconds(self, old: ParallelPlan, new: ParallelPlan, *, planning: bool = True) -> float:
        """Planning (optional) + communicator rebuild + state movement; 0 if nothing changes."""
        plan_s = self.costs.planning(self.job.devices) if planning else 0.0
        if (old.tp_groups, old.layer_ranges, old.migrations) == (new.tp_groups, new.layer_ranges, new.migrations):
            return plan_s
        return plan_s + self.costs.rebuild_s + self.move_seconds(old, new)


# ------------------------------------------------------------------ the run
def run(trace: Trace, policy: Policy, *, costs: Costs | None = None, state0: PlannerState | None = None,
        detection_noise: float = 0.02) -> RunResult:
    """Simulate ``policy`` on ``trace``; deterministic for a given trace and costs."""
    from resihp_core.sim import detection

    w0 = time.perf_counter()
    costs = costs or Costs()
    job = trace.job
    state0 = state0 if state0 is not None else job.state()
    ctx = SimContext(job, costs, state0)
    stops = sum(1 for e in trace.events if e.kind == "stop")
    ctx.mtbf_s = trace.duration_s / stops if stops else math.inf
    healthy_t = ctx.time(ctx.origin)
    batch = job.global_batch
    plan = policy.start(ctx)
    method = policy.detector
    overhead = 0.0
    wcv = detection.workload_cv(job.model, job.dp, job.num_microbatches, job.tokens, job.seed)
    if method in ("greyhound", "adaptra"):
        overhead = detection.estimate(method, 1.0, "compute", 1.0, noise=detection_noise,
                                      workload=wcv).false_alarms * costs.verify_s
    log: list[dict[str, Any]] = []
    segments: list[Segment] = []
    queue: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(queue, (t, seq, kind, payload))
        seq += 1

    for e in trace.events:
        push(e.time, "event", e)
    t = 0.0
    progress = 0.0  # iterations
    ckpt_progress = 0.0
    ckpt_every = policy.checkpoint_interval(ctx)
    if not (math.isfinite(ckpt_every) and ckpt_every > 0):
        raise SimError(f"policy {policy.name}: checkpoint interval must be > 0, got {ckpt_every!r}")
    next_ckpt = ckpt_every
    busy_until = 0.0
    cur_t = policy.iteration_time(ctx, plan)
    horizon = trace.duration_s

    def rate() -> float:
        return 0.0 if not math.isfinite(cur_t) else 1.0 / (cur_t + overhead)

    def advance(to: float) -> None:
        nonlocal t, progress, ckpt_progress, next_ckpt
        to = min(to, horizon)
        while t < to:
            down = t < busy_until
            end = min(to, busy_until) if down else to
            r = 0.0 if down else rate()
            # checkpoints inside [t, end)
            while next_ckpt <= end:
                progress += r * (next_ckpt - t)
                if r > 0:
                    ckpt_progress = progress
                _seg(t, next_ckpt, r)
                t = next_ckpt
                next_ckpt += ckpt_every
            progress += r * (end - t)
            _seg(t, end, r)
            t = end

    def _seg(a: float, b: float, r: float) -> None:
        if b <= a:
            return
        thr = r * batch
        if segments and segments[-1].throughput == thr and segments[-1].end == a:
            segments[-1] = Segment(segments[-1].start, b, thr)
        else:
            segments.append(Segment(a, b, thr))

    def react(now: float, reaction: Reaction | None, what: str) -> None:
        nonlocal plan, cur_t, progress, busy_until
        if reaction is None:
            return
        if reaction.rollback == "checkpoint":
            progress = ckpt_progress
        elif reaction.rollback == "iteration":
            progress = math.floor(progress + 1e-9)
        if reaction.plan is not None:
            plan = reaction.plan
        start = max(now, busy_until)
        busy_until = start + reaction.downtime_s
        cur_t = policy.iteration_time(ctx, plan)
        for delay, tag in reaction.timers:
            push(busy_until + delay, "timer", tag)
        log.append({"t": round(now, 3), "what": what, "downtime_s": round(reaction.downtime_s, 3),
                    "rollback": reaction.rollback, "iteration_s": None if not math.isfinite(cur_t) else cur_t,
                    "note": reaction.note})

    while queue:
        tq, _, kind, payload = heapq.heappop(queue)
        if tq >= horizon:
            break
        if kind != "event" and tq < busy_until:
            push(busy_until, kind, payload)  # handled once the downtime ends
            continue
        advance(tq)
        ctx.now = t
        ctx.since_checkpoint_s = (progress - ckpt_progress) * (cur_t if math.isfinite(cur_t) else 0.0)
        if kind == "event":
            e: FailureEvent = payload
            before_t = cur_t
            ctx.health = ctx.health.apply(e)
            cur_t = policy.iteration_time(ctx, plan)
            log.append({"t": round(t, 3), "what": f"{e.kind} device {e.device}"
                        + (f" ({e.cause} {e.throughput:g})" if e.kind == "slow" else ""),
                        "iteration_s": None if not math.isfinite(cur_t) else cur_t, "truth": True})
            delay = _notice_delay(e, policy, plan, before_t, cur_t, costs, detection_noise, wcv)
            if delay is not None:
                push(t + delay, "notice", e)
        elif kind == "notice":
            e = payload
            handler = {"stop": policy.on_stop, "repair": policy.on_repair, "slow": policy.on_slow,
                       "recover": policy.on_recover}[e.kind]
            react(t, handler(ctx, e), f"{policy.name} handles {e.kind} device {e.device}")
        else:
            react(t, policy.on_timer(ctx, payload), f"{policy.name} timer {payload}")
    advance(horizon)
    return RunResult(policy=policy.name, scenario=trace.scenario, seed=trace.seed, duration_s=horizon,
                     samples=progress * batch, healthy_throughput=batch / healthy_t, segments=segments,
                     log=log, wall_s=time.perf_counter() - w0)


def _notice_delay(e: FailureEvent, policy: Policy, plan: ParallelPlan, before: float, after: float,
                  costs: Costs, noise: float, wcv: float) -> float | None:
    """Seconds from a trace event to the policy's notice of it (None: never)."""
    from resihp_core.sim import detection

    if e.kind == "stop":
        return costs.heartbeat_detect_s
    if e.kind == "repair":
        return 0.0
    if policy.detector is None:
        return None
    in_plan = e.device in plan.devices()
    if e.kind == "recover" and (not in_plan or not math.isfinite(before) or not math.isfinite(after)
                                or abs(after / before - 1.0) < 0.01):
        return costs.reprobe_s  # hidden by the mitigation: found by the next probe
    if not in_plan or not (math.isfinite(before) and math.isfinite(after)):
        return None
    ratio = after / before if e.kind == "slow" else before / after
    if ratio < 1.01:
        return None
    straggler = 1.0 / e.throughput if e.kind == "slow" else ratio
    est = detection.estimate(policy.detector, round(ratio, 3), e.cause or "compute", round(straggler, 3),
                             noise=noise, workload=round(wcv, 4))
    if est.latency is None:
        # A recovery too small for the detector to see is found by the next probe of
        # the device known to be slow; an onset it cannot see is never noticed.
        return costs.reprobe_s if e.kind == "recover" else None
    return est.latency * after + costs.verify_s
