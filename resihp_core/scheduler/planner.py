"""The progressive planner: a failure report in, the next plan generation out (docs/design.md §4).

:meth:`Planner.plan` folds the report into the state (fail-stopped devices, compute or
communication throughputs), then runs the adaptation stages in order — by default the
built-ins ``tp`` -> ``pp`` -> ``dp`` -> ``drop`` (:mod:`.tp`, :mod:`.pp`, :mod:`.dp`), or whatever
the ``resihp_register_adaptation_stages`` plugins registered — each a function
``PlannerState -> PlannerState``. After every stage the plan is checked: it validates
against the topology, uses no failed device, and needs nothing the active adapter's
:class:`~resihp_core.adapter.Capabilities` lack (a stage that breaks this is named in
the error).

After the stages, each peer system's move on the same report (drop the hit replica,
shed its micro-batches, drop the hit groups, keep the plan, migration or repartition
alone: :mod:`.candidates`) is judged by the same evaluator, and the fastest plan is
kept (the stages' plan on ties): the planner's plan is never predicted slower than a
peer's.

Escalation:

- a TP group with no feasible degree is emptied and its work migrates to its DP peers
  (the TP stage does that, the DP stage balances it); after TP -> PP -> DP, the
  ``drop`` stage also empties groups still running below nominal throughput when the
  simulator says that is faster (many replicas to absorb the work);
- every replica of some stage lost (or a lost group on an adapter that cannot migrate
  work): a **restore** decision — a fresh layout on the surviving devices, started from
  the last checkpoint (:func:`restore_layout`), with the same global batch; an adapter
  that declares ``restage`` may get whole replicas of another stage count instead when
  the simulator predicts them faster (:func:`~.candidates.restage`);
- a repaired or rejoining device (:meth:`Planner.rejoin`): it becomes a standby on its
  node and the stages grow groups back; when the job had been restored onto fewer
  replicas and the original layout is whole again, the planner proposes restoring
  onto it if that is predicted faster.

Every decision bumps the plan generation by exactly one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Literal, Sequence, Union


from resihp_core.adapter import Capabilities
from resihp_core.plan import ParallelPlan, PlanError, ScheduleKind, even_layer_ranges
from resihp_core.plugins import AdaptationStage, Plugins, get_plugins
from resihp_core.predictor.schedules import emit_programs
from resihp_core.program import Program
from resihp_core.protocol import FailureReport
from resihp_core.scheduler.candidates import peer_candidates, restage
from resihp_core.scheduler.dp import dp_stage
from resihp_core.scheduler.links import describe, link_candidates, off_node
from resihp_core.scheduler.evaluate import Evaluator, Features
from resihp_core.scheduler.pp import pp_stage
from resihp_core.scheduler.state import PlannerError, PlannerState, RestoreRequired, inflight
from resihp_core.scheduler.tp import drop_stage, tp_stage

__all__ = [
    "DEFAULT_STAGES",
    "PlanDecision",
    "Planner",
    "apply_report",
    "restore_layout",
]

logger = logging.getLogger("resihp.scheduler")

#: The built-in stages, in order (what the built-in plugin registers).
DEFAULT_STAGES: tuple[AdaptationStage, ...] = (
    AdaptationStage("tp", tp_stage, 100),
    AdaptationStage("pp", pp_stage, 200),
    AdaptationStage("dp", dp_stage, 300),
    AdaptationStage("drop", drop_stage, 400),
)

StageLike = Union[AdaptationStage, Callable[[PlannerState], PlannerState]]


@dataclass(frozen=True)
class PlanDecision:
    """What the planner decided.

    :param plan: the next plan generation.
    :param kind: ``"continue"`` (reconfigure and go on) or ``"restore"`` (restart from
        the last checkpoint on ``plan``).
    :param reason: one line for people and logs: the report and what each stage did.
    :param predicted_time: simulated iteration time of ``plan`` (seconds).
    :param timings: wall seconds per stage, plus ``"total"``.
    :param state: the state after planning; pass it to the next :meth:`Planner.plan`.
    :param notes: each stage's note, in order.
    """

    plan: ParallelPlan
    kind: Literal["continue", "restore"]
    reason: str
    predicted_time: float
    timings: dict[str, float]
    state: PlannerState
    notes: tuple[str, ...] = field(default=())

    def programs(self) -> list[Program]:
        """Per-executor programs of the plan, from the schedule emitter."""
        return emit_programs(self.plan)


def apply_report(state: PlannerState, report: FailureReport) -> PlannerState:
    """``state`` with the report's failed devices and throughputs folded in.

    Fail-stop: the devices join ``failed``. Fail-slow: each device's throughput goes to
    ``link_speeds`` when the cause is ``"communication"``, else to ``speeds``; a
    throughput of 1.0 means recovered. Throughputs of devices not listed in
    ``report.devices`` are applied too (the map is the Detector's latest view).
    """
    known = state.topology.ids
    for d in report.devices:
        if d not in known:
            raise PlannerError(f"failure report names unknown device {d}")
    failed = set(state.failed)
    speeds = dict(state.speeds)
    links = dict(state.link_speeds)
    if report.failure == "fail-stop":
        failed.update(report.devices)
        for d in report.devices:
            speeds.pop(d, None)
            links.pop(d, None)
    else:
        missing = [d for d in report.devices if d not in report.throughput]
        if missing:
            raise PlannerError(
                f"fail-slow report for device(s) {missing} carries no throughput p_i"
            )
        target = links if report.cause == "communication" else speeds
        for d, p in report.throughput.items():
            if d not in known:
                raise PlannerError(f"failure report gives a throughput for unknown device {d}")
            if p >= 1.0:
                target.pop(d, None)
            else:
                target[d] = float(p)
    return state.with_health(failed=frozenset(failed), speeds=speeds, link_speeds=links)


def _describe(report: FailureReport | None) -> str:
    if report is None:
        return "replan"
    devs = ",".join(map(str, report.devices))
    if report.failure == "fail-stop":
        return f"fail-stop device {devs}"
    ps = ",".join(f"{d}:{p:.2f}" for d, p in sorted(report.throughput.items()))
    return f"fail-slow ({report.cause}) device {devs} p={ps}"


# --------------------------------------------------------------------- restore
def restore_layout(state: PlannerState) -> tuple[ParallelPlan, Features]:
    """A fresh uniform layout on the surviving devices, for a restart from checkpoint.

    Keeps the global batch (``dp * m`` micro-batches, the same micro-batches in the same
    order, re-split over the new replicas) and the number of stages; when the survivors
    cannot hold that many and the adapter repartitions layers, fewer stages (down to
    one), as far as the memory model lets a device hold the larger stages. Tries TP degrees
    from the nominal one down (only the nominal one without ``tp_resize``); TP groups
    stay inside a node, healthiest devices first; picks the layout with the most
    devices in use (then the larger degree), with a replica count dividing the global
    batch and every group fitting its stage in memory. Leftover devices are standbys.
    """
    cur = state.plan
    total = cur.dp * cur.num_microbatches
    t0 = max((len(g) for rep in state.home.tp_groups for g in rep), default=1)  # nominal
    degrees = [t0]
    if state.capabilities.tp_resize:
        k = t0 // 2
        while k >= state.k_min:
            degrees.append(k)
            k //= 2
    # The job's stage count first; with layer repartition, fewer stages (more layers
    # each) when the survivors cannot hold it, as far as the model fits in memory.
    counts = range(cur.pp, 0, -1) if state.capabilities.layer_repartition else (cur.pp,)
    best: tuple[int, int, list[tuple[int, ...]]] | None = None
    for pp in counts:
        best = _restore_groups(state, cur, pp, total, degrees)
        if best is not None:
            break
    if best is None:
        fewer = " or fewer" if len(counts) > 1 else ""
        raise PlannerError(
            f"cannot restore: {len(state.topology.ids - state.failed)} surviving devices "
            f"cannot hold {cur.pp}{fewer} stages at any allowed TP degree {degrees} within memory"
        )
    return layout_on(state, pp, best)


def layout_on(state: PlannerState, pp: int,
              best: tuple[int, int, list[tuple[int, ...]]]) -> tuple[ParallelPlan, Features]:
    """The uniform plan of ``pp`` stages (layers split evenly) on ``best`` = (replicas, TP
    degree, groups) from :func:`_restore_groups`, each stage on the groups holding most
    of its layers now, the same global batch re-split over the replicas; the other
    survivors are standbys. Returns it with its workload features."""
    cur = state.plan
    total = cur.dp * cur.num_microbatches
    ranges = even_layer_ranges(cur.num_layers, pp)
    dp_new, _, groups = best
    slots = _place_by_state(cur, groups, ranges, dp_new)
    tp_groups = tuple(tuple(slots[s][r] for s in range(pp)) for r in range(dp_new))
    in_use = {d for stage in slots for g in stage for d in g}
    standbys = tuple(d for d in sorted(state.topology.ids)
                     if d not in in_use and d not in state.failed)
    plan = ParallelPlan(
        num_layers=cur.num_layers,
        layer_ranges=ranges,
        tp_groups=tp_groups,
        num_microbatches=total // dp_new,
        schedule=cur.schedule,
        generation=cur.generation,
        standbys=standbys,
        excluded=frozenset(state.failed),
        num_heads=cur.num_heads,
    )
    ntok, ssq = state.features
    feats = (ntok.reshape(dp_new, -1).copy(), ssq.reshape(dp_new, -1).copy())
    return plan, feats


def _restore_groups(state: PlannerState, cur: ParallelPlan, pp: int, total: int,
                    degrees: list[int]) -> tuple[int, int, list[tuple[int, ...]]] | None:
    """The best (replicas, TP degree, groups) of :func:`restore_layout` for ``pp``
    stages, or None when the survivors cannot hold them."""
    ranges = even_layer_ranges(cur.num_layers, pp)
    max_layers = max(b - a for a, b in ranges)
    best: tuple[int, int, list[tuple[int, ...]]] | None = None
    for t in degrees:
        if cur.num_heads and cur.num_heads % t:
            continue
        groups: list[tuple[int, ...]] = []
        for _, ids in sorted(state.topology.nodes().items()):
            alive = sorted((d for d in ids if d not in state.failed),
                           key=lambda d: (-state.throughput(d), d))
            for i in range(len(alive) // t):
                g = tuple(sorted(alive[i * t:(i + 1) * t]))
                if state.memory.fits(state.min_capacity(g), max_layers, t,
                                     inflight(cur.schedule, 0, pp, total)):
                    groups.append(g)
        dp_new = min(len(groups) // pp, total)
        if t > 1 and not state.capabilities.tp_with_dp:
            dp_new = min(dp_new, 1)  # TP with one replica only
        while dp_new > 0 and total % dp_new:
            dp_new -= 1
        if dp_new < 1:
            continue
        if best is None or dp_new * t > best[0] * best[1]:
            best = (dp_new, t, groups)
    return best


def _place_by_state(cur: ParallelPlan, groups: list[tuple[int, ...]], ranges: Sequence[tuple[int, int]],
                    dp: int) -> list[list[tuple[int, ...]]]:
    """``dp`` groups for each stage of ``ranges``, each stage taking the groups that hold
    most of its layers under ``cur`` (then the order of ``groups``: healthiest first), the
    stage with the fewest such holders first: the survivors' state then moves to the new
    layout instead of being lost with a holder left out as a standby (docs/design.md
    5.2)."""
    def held(g: tuple[int, ...], stage: int) -> int:
        a, b = ranges[stage]
        n = 0
        for d in g:
            loc = cur.location(d)
            if loc is not None:
                lo, hi = cur.layer_ranges[loc[1]]
                n += max(0, min(b, hi) - max(a, lo))
        return n

    left = list(groups)
    slots: list[list[tuple[int, ...]]] = [[] for _ in ranges]
    order = sorted(range(len(ranges)), key=lambda st: (sum(held(g, st) > 0 for g in groups), st))
    for st in order:
        ranked = sorted(left, key=lambda g: -held(g, st))  # stable: healthiest first among equals
        slots[st] = ranked[:dp]
        left = [g for g in left if g not in slots[st]]
    return slots


def _say_links(state: PlannerState, tried: dict[str, float], chosen: str) -> PlannerState:
    """``state`` with a note per slow node link: what its plan still sends across it and
    why, or that nothing crosses it (:func:`~.links.describe`)."""
    for line in describe(state, tried, chosen):
        state = state.with_plan(state.plan, line)
    return state


def _rebase(state: PlannerState, plan: ParallelPlan, features: Features) -> PlannerState:
    """``state`` moved onto a new layout (after a restore): plan, home and evaluator."""
    ev = Evaluator(state.predictor, features, state.speeds, state.link_speeds)
    return replace(state, plan=plan, home=plan, evaluator=ev)


# --------------------------------------------------------------------- planner
class Planner:
    """Runs the adaptation stages for each failure report.

    :param stages: the stages to run, in order: :class:`AdaptationStage` values or
        plain callables. Default: the ``resihp_register_adaptation_stages`` registry of
        ``plugins`` (built-ins ``tp``, ``pp``, ``dp`` and ``drop``, see
        :data:`DEFAULT_STAGES`; plugins may replace or add).
    :param capabilities: what the active adapter can execute; plans never need more.
        Default: the state's own.
    :param plugins: the plugin facade to read stages from (default: the process-wide one).
    :param peer_moves: after the stages, also judge every peer system's move
        (:mod:`.candidates`) and keep the fastest plan; False runs the stages alone.
    """

    def __init__(
        self,
        stages: Sequence[StageLike] | None = None,
        capabilities: Capabilities | None = None,
        *,
        plugins: Plugins | None = None,
        peer_moves: bool = True,
    ) -> None:
        if stages is None:
            stages = (plugins or get_plugins()).adaptation_stages().ordered()
            if not stages:
                stages = DEFAULT_STAGES
        self.stages: tuple[AdaptationStage, ...] = tuple(
            s if isinstance(s, AdaptationStage)
            else AdaptationStage(getattr(s, "__name__", f"stage{i}"), s, (i + 1) * 100)
            for i, s in enumerate(stages)
        )
        self.capabilities = capabilities
        self.peer_moves = peer_moves

    # ------------------------------------------------------------- public
    def plan(self, state: PlannerState, report: FailureReport | None = None) -> PlanDecision:
        """The next plan generation for ``state`` after ``report`` (None: re-plan for the
        state as it is, e.g. after :meth:`rejoin`)."""
        t_start = time.perf_counter()
        if self.capabilities is not None:
            state = replace(state, capabilities=self.capabilities)
        previous = state.plan
        if report is not None:
            state = apply_report(state, report)
        state = replace(state, previous=previous, notes=())
        state = self._supported_schedule(state)
        what = _describe(report)
        timings: dict[str, float] = {}
        kind: Literal["continue", "restore"] = "continue"
        try:
            before = state
            state = self._run(state, timings)
            state = self._best_of(before, state, timings)
        except RestoreRequired as e:
            state = self._restore(state, str(e), timings)
            kind = "restore"
        return self._decide(state, previous, kind, what, timings, t_start)

    def rejoin(self, state: PlannerState, devices: Iterable[int]) -> PlanDecision:
        """Repaired or returning ``devices`` are healthy again: plan back up to use them."""
        devices = set(devices)
        unknown = devices - state.topology.ids
        if unknown:
            raise PlannerError(f"rejoin names unknown device(s) {sorted(unknown)}")
        t_start = time.perf_counter()
        if self.capabilities is not None:
            state = replace(state, capabilities=self.capabilities)
        previous = state.plan
        in_use = set(previous.devices())
        standbys = tuple(d for d in previous.standbys if d not in devices) + tuple(
            sorted(d for d in devices if d not in in_use))
        plan = previous.with_(excluded=previous.excluded - devices, standbys=standbys)
        state = state.with_health(
            failed=state.failed - devices,
            speeds={d: p for d, p in state.speeds.items() if d not in devices},
            link_speeds={d: p for d, p in state.link_speeds.items() if d not in devices},
        )
        state = replace(state, plan=plan, previous=previous, notes=())
        what = "rejoin device " + ",".join(map(str, sorted(devices)))
        timings: dict[str, float] = {}
        before = state
        state = self._best_of(before, self._run(state, timings), timings)
        decision = self._decide(state, previous, "continue", what, timings, t_start)
        back = self._scale_back_up(state, previous, decision, what, t_start)
        return back or decision

    # ------------------------------------------------------------- internals
    def _supported_schedule(self, state: PlannerState) -> PlannerState:
        caps = state.capabilities
        if state.plan.schedule in caps.schedules:
            return state
        pick = ScheduleKind.ONE_F_ONE_B if ScheduleKind.ONE_F_ONE_B in caps.schedules else sorted(
            caps.schedules, key=lambda k: k.value)[0]
        return state.with_plan(state.plan.with_(schedule=pick),
                               f"schedule {state.plan.schedule.value} -> {pick.value} (adapter)")

    def _run(self, state: PlannerState, timings: dict[str, float],
             previous: ParallelPlan | None | bool = True) -> PlannerState:
        prev = state.previous if previous is True else previous
        for stage in self.stages:
            t0 = time.perf_counter()
            out = stage.run(state)
            timings[stage.name] = timings.get(stage.name, 0.0) + time.perf_counter() - t0
            if not isinstance(out, PlannerState):
                raise PlannerError(
                    f"adaptation stage {stage.name!r} returned {type(out).__name__}, not a PlannerState"
                )
            self._check(stage.name, out, prev)
            state = out
        return state

    def _best_of(self, before: PlannerState, after: PlannerState, timings: dict[str, float]) -> PlannerState:
        """``after`` (the stages' result), or the peer move (:mod:`.candidates`) that the
        evaluator predicts faster; candidates that fail the planner's checks are skipped.
        A re-staged layout (another replica shape) is timed on its own workload features
        and, when chosen, becomes the state's home."""
        if not self.peer_moves:
            return _say_links(after, {}, "the stages")
        t0 = time.perf_counter()
        ev = after.evaluator
        best_t = ev.time(after.plan)
        t_stages = best_t
        best: tuple[str, PlannerState] | None = None
        # (time, order, name, plan, features: None = the job's own shape)
        timed: list[tuple[float, int, str, ParallelPlan, Features | None]] = [
            (ev.time(c), i, n, c, None) for i, (n, c) in enumerate(peer_candidates(before, after))]
        # A slow node link: the layout's groups placed so that less crosses it (links.py).
        tried: dict[str, float] = {}
        for n, c in link_candidates(before, before.plan):
            tried[n] = ev.time(c)
            timed.append((tried[n], len(timed), n, c, None))
        # Re-staged layouts have another replica shape: each is judged on its own features.
        away = off_node(before)
        for n, c, f in restage(before, len(set(after.plan.devices()))) + ([away] if away else []):
            own = Evaluator(ev.predictor, f, after.speeds, after.link_speeds)
            timed.append((own.time(c), len(timed), n, c, f))
            if away is not None and n == away[0]:
                tried[n] = timed[-1][0]
        timed.sort(key=lambda x: (x[0], x[1]))
        for t, _, name, cand, feats in timed:  # checks cost O(devices): only until one passes
            if not t < best_t * (1 - 1e-9):
                break
            cand_state = replace(after, plan=cand) if feats is None else _rebase(after, cand, feats)
            try:
                self._check(name, cand_state, before.previous)
            except PlannerError:
                continue
            best, best_t = (name, cand_state), t
            break
        timings["peers"] = time.perf_counter() - t0
        if best is None:
            return _say_links(after, tried, "the stages")
        name, chosen = best  # a re-staged plan comes with its own home and evaluator
        chosen = chosen.with_plan(chosen.plan, f"peers: {name} beats the stages' plan "
                                               f"({t_stages:.4g}s -> {best_t:.4g}s)")
        return _say_links(chosen, tried, name)

    @staticmethod
    def _check(name: str, state: PlannerState, previous: ParallelPlan | None) -> None:
        plan = state.plan
        try:
            plan.validate(state.topology)
        except PlanError as e:
            raise PlannerError(f"stage {name!r} produced an invalid plan: {e}") from e
        bad = sorted(state.failed.intersection(plan.devices()))
        if bad:
            raise PlannerError(f"stage {name!r} placed work on failed device(s) {bad}")
        why = state.capabilities.violations(plan, previous)
        if why:
            raise PlannerError(f"stage {name!r} needs what the adapter cannot do: {'; '.join(why)}")
        over = state.memory_violations(plan)
        if over:
            raise PlannerError(f"stage {name!r} overflows device memory: {'; '.join(over)}")

    def _restore(self, state: PlannerState, why: str, timings: dict[str, float]) -> PlannerState:
        if not state.capabilities.checkpoint:
            raise PlannerError(f"{why}, and the adapter cannot restore from a checkpoint")
        t0 = time.perf_counter()
        plan, feats = restore_layout(state)
        # An adapter that re-stages (candidates.restage): a layout with another stage
        # count may place more survivors; the simulator picks, the restore layout on ties.
        best_t = Evaluator(state.predictor, feats, state.speeds, state.link_speeds).time(plan)
        restaged = ""
        for name, cand, f in restage(state, len(set(plan.devices()))):
            t = Evaluator(state.predictor, f, state.speeds, state.link_speeds).time(cand)
            if t < best_t * (1 - 1e-9) and not state.memory_violations(cand):
                plan, feats, best_t, restaged = cand, f, t, f" ({name}: {len(set(cand.devices()))} placed)"
        state = _rebase(state, plan, feats)
        degree = max(len(g) for rep in plan.tp_groups for g in rep)
        state = state.with_plan(plan, f"restore: {why}; fresh layout dp={plan.dp} pp={plan.pp} "
                                      f"tp={degree} m={plan.num_microbatches}{restaged} "
                                      "(state moved from the survivors; "
                                      "from a checkpoint where none holds it)")
        timings["restore"] = time.perf_counter() - t0
        try:
            return self._run(state, timings, previous=None)
        except RestoreRequired as e:  # pragma: no cover - the fresh layout has no lost groups
            raise PlannerError(f"restore layout is not runnable: {e}") from e

    def _decide(self, state: PlannerState, previous: ParallelPlan, kind: Literal["continue", "restore"],
                what: str, timings: dict[str, float], t_start: float) -> PlanDecision:
        plan = state.plan.with_(generation=previous.generation + 1)
        state = replace(state, plan=plan)
        predicted = state.evaluator.time(plan)
        timings["total"] = time.perf_counter() - t_start
        reason = f"{what}: " + "; ".join(state.notes)
        logger.info(
            "plan generation %d (%s) after %s: predicted %.4gs, planned in %.1f ms",
            plan.generation, kind, what, predicted, 1e3 * timings["total"],
        )
        return PlanDecision(plan, kind, reason, predicted, timings, state, state.notes)

    def _scale_back_up(self, state: PlannerState, previous: ParallelPlan, current: PlanDecision,
                       what: str, t_start: float) -> PlanDecision | None:
        origin = state.origin
        if origin.tp_groups == state.home.tp_groups:
            return None  # never restored onto another layout
        if any(d in state.failed for d in origin.devices()) or state.origin_features is None:
            return None
        if not state.capabilities.checkpoint:
            return None
        base = origin.with_(generation=state.plan.generation,
                            standbys=tuple(d for d in sorted(state.topology.ids)
                                           if d not in set(origin.devices()) and d not in state.failed),
                            excluded=frozenset(state.failed))
        cand = _rebase(state, base, state.origin_features)
        cand = cand.with_plan(base, "restore: original layout whole again")
        timings: dict[str, float] = {}
        try:
            cand = self._run(cand, timings, previous=None)
        except (RestoreRequired, PlannerError):
            return None
        if cand.evaluator.time(cand.plan) >= current.predicted_time * 0.99:
            return None
        return self._decide(cand, previous, "restore", what, timings, t_start)
