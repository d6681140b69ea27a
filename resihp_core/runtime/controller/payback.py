"""Re-plans that pay back (docs/detector.md, "Acting on a slowdown").

A fail-slow re-plan is not free: the running generation is aborted (the iteration in
flight is lost), the new plan is posted and the workers reconfigure (state moves,
communicators) before the first iteration of the new layout commits. A plan that
saves little per iteration, or a job with few iterations left, loses more than it
gains, and a job that simply runs slow around the device wins (issue: a DP4 job lost
to torchft and to checkpoint-restart that way).

:class:`ReconfigurationMeter` measures that cost on the job itself from the clock the
supervisor is given: for every generation started by a re-plan, the time from the last
commit of the generation it replaced to its own first commit, less its steady
iteration time (the median of its next iterations). Before a re-plan has been
measured, the workers' own timing of the last generation they entered stands in
(:func:`worker_timing`: the communicators and the state, plus the one iteration a
re-plan aborts), capped by :attr:`PaybackRule.default_cost_s`; with no timing, the
default itself.

:class:`PaybackRule` compares, over a stated horizon, what the planner's decision saves
with that cost. The saving per iteration is the measured iteration time of the current
plan (the slowdown included) times the planner's predicted relative gain, so the
predictor's absolute scale does not matter::

    before = evaluator(reported speeds).time(current plan)
    after  = decision.predicted_time
    gain   = measured s/it x (1 - after / before) x min(horizon_iterations, iterations left)
    act    when gain > cost

Pure: no processes, no store; the supervisor calls it (runtime/controller/supervisor.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Mapping

from resihp_core.plan import ParallelPlan
from resihp_core.protocol import FailureReport
from resihp_core.scheduler.planner import PlanDecision
from resihp_core.scheduler.state import PlannerState

__all__ = ["PaybackRule", "Payback", "ReconfigurationMeter", "is_recovery", "origin_candidate", "worker_timing"]


@dataclass(frozen=True)
class Payback:
    """The rule's verdict on one decision: ``pays`` and one line saying why."""

    pays: bool
    text: str
    gain_s: float = 0.0
    cost_s: float = 0.0
    horizon: int = 0
    unchanged: bool = False  # the planner's answer is the current layout


@dataclass
class ReconfigurationMeter:
    """Measures what a reconfiguration costs this job (seconds of the supervisor's clock).

    ``steady_iterations``: how many iterations of a new generation give its steady
    iteration time; ``keep``: how many past re-plans the estimate uses (the median)."""

    steady_iterations: int = 3
    keep: int = 8
    costs: list[float] = field(default_factory=list)
    _commits: list[float] = field(default_factory=list)  # commit times of the current generation
    _last_commit: float | None = None  # the newest commit, of whichever generation
    _replaced_at: float | None = None  # last commit before the current generation (a re-plan)
    _first: float | None = None  # first commit of the current generation
    _measuring = False
    timed_s: float | None = None  # the workers' own timing of the last generation entered (worker_timing)

    def deployed(self, replan: bool) -> None:
        """A generation was posted; ``replan``: by a re-plan (measured), not the first."""
        self._commits = []
        self._first = None
        self._measuring = replan and self._last_commit is not None
        self._replaced_at = self._last_commit if self._measuring else None

    def committed(self, now: float) -> None:
        self._last_commit = now
        self._commits.append(now)
        if self._first is None:
            self._first = now
        if self._measuring and len(self._commits) > self.steady_iterations:
            assert self._replaced_at is not None
            steady = self.steady_s()
            if steady is not None:
                self.costs.append(max(0.0, (self._first - self._replaced_at) - steady))
                del self.costs[:-self.keep]
            self._measuring = False

    def steady_s(self, last: int | None = None) -> float | None:
        """Mean interval between the current generation's commits over the ``last``
        newest (the reconfiguration ends at its first commit); None before two."""
        # The mean rate over the window, not a median of gaps: a control loop that
        # takes in several commits in one round sees gaps of 0 between them.
        times = self._commits
        if last is not None:
            times = times[-(last + 1):]
        if len(times) < 2:
            return None
        return (times[-1] - times[0]) / (len(times) - 1)

    def cost_s(self) -> float | None:
        """The measured cost of a reconfiguration (median of the past ones), None before any."""
        return statistics.median(self.costs) if self.costs else None


def worker_timing(ready: Mapping[int, Mapping[str, object]]) -> float | None:
    """Seconds a generation's reconfiguration took by its workers' own account
    (``ctl<g>/ready/<device>``, docs/worker-protocol.md): the fastest device's
    communicator rebuild (the rebuild waits for the last device to arrive, so the
    others' include their wait) plus the slowest device's state install. None without
    a usable timing; a field that is not a finite non-negative number is ignored."""
    rebuild = [v for v in (_seconds(t.get("rebuild_s")) for t in ready.values()) if v is not None]
    state = [v for v in (_seconds(t.get("state_s")) for t in ready.values()) if v is not None]
    if not rebuild or not state:
        return None
    return min(rebuild) + max(state)


def _seconds(v: object) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v) if 0.0 <= v < float("inf") else None


@dataclass(frozen=True)
class PaybackRule:
    """When a fail-slow re-plan is worth its reconfiguration.

    :param horizon_iterations: how many iterations the gain is counted over (capped by
        the iterations the job has left): the slowdown is assumed to last at least that
        long. Production slowdowns last minutes (tens to hundreds of iterations).
    :param default_cost_s: the most a reconfiguration is taken to cost before one was
        measured on this job: the workers' timing of their last reconfiguration plus one
        iteration when it is less (0: free until measured).
    :param recent_iterations: the measured iteration time is the median of this many
        newest intervals (the slowdown was verified over at least 3).
    :param healthy_iterations: ``k``, iterations a slowed device must be verified
        healthy again before the plan returns to the better layout (the detector's
        side, docs/detector.md).
    """

    horizon_iterations: int = 100
    default_cost_s: float = 2.0
    recent_iterations: int = 3
    healthy_iterations: int = 5

    def __post_init__(self) -> None:
        if self.horizon_iterations < 1:
            raise ValueError(f"PaybackRule.horizon_iterations must be >= 1, got {self.horizon_iterations}")
        if not self.default_cost_s >= 0:
            raise ValueError(f"PaybackRule.default_cost_s must be >= 0, got {self.default_cost_s}")
        if self.recent_iterations < 1 or self.healthy_iterations < 1:
            raise ValueError("PaybackRule.recent_iterations and healthy_iterations must be >= 1")

    def judge(self, decision: PlanDecision, before_state: PlannerState, meter: ReconfigurationMeter,
              remaining: int | None) -> Payback:
        """Whether deploying ``decision`` instead of running on with ``before_state.plan``
        (judged with ``decision.state``'s speeds) pays back within the horizon."""
        current = before_state.plan
        try:
            before = decision.state.evaluator.time(current)
        except Exception as e:  # noqa: BLE001 - a layout the new evaluator cannot judge: act as before
            return Payback(True, f"re-planned without a payback check (the current plan could not be "
                                 f"predicted: {type(e).__name__}: {e})")
        after = decision.predicted_time
        if decision.kind == "continue" and _same_layout(decision.plan, current):
            return Payback(False, f"the planner's best plan is the current one (predicted {after:.3g} s/it): "
                                  "nothing to reconfigure", unchanged=True)
        horizon = self.horizon_iterations if remaining is None else max(0, min(self.horizon_iterations, remaining))
        measured = meter.steady_s(self.recent_iterations)
        it_s = measured if measured is not None else before
        rel = 1.0 - after / before if before > 0 else 0.0
        gain = it_s * rel * horizon
        cost, cost_text = self._cost(meter, it_s)
        left = f", {remaining} left" if remaining is not None else ""
        how = (f"predicted {before:.3g} -> {after:.3g} s/it ({100 * rel:+.0f} %) of {it_s:.3g} s/it "
               f"{'measured' if measured is not None else 'predicted'}, over {horizon} iterations "
               f"(horizon {self.horizon_iterations}{left}) saves {gain:.2f} s")
        pays = gain > cost
        return Payback(pays, f"{how} {'>' if pays else '<='} {cost_text}", gain, cost, horizon)

    def _cost(self, meter: ReconfigurationMeter, it_s: float) -> tuple[float, str]:
        """A reconfiguration's cost on this job and where the figure comes from."""
        cost = meter.cost_s()
        if cost is not None:
            return cost, f"reconfiguration cost {cost:.2f} s (measured, median of {len(meter.costs)} on this job)"
        if meter.timed_s is not None and meter.timed_s + it_s < self.default_cost_s:
            est = meter.timed_s + it_s
            return est, (f"reconfiguration cost {est:.2f} s (estimated: the workers' last reconfiguration "
                         f"{meter.timed_s:.2f} s by their own timing + the iteration a re-plan aborts {it_s:.2f} s; "
                         "none measured on this job yet)")
        return self.default_cost_s, (f"reconfiguration cost {self.default_cost_s:.2f} s (default: none measured "
                                     "on this job yet)")


def _same_layout(a: ParallelPlan, b: ParallelPlan) -> bool:
    return (a.tp_groups, a.layer_ranges, a.migrations, a.schedule) == (b.tp_groups, b.layer_ranges, b.migrations,
                                                                       b.schedule)


def is_recovery(report: FailureReport) -> bool:
    """A fail-slow report that every device of is back at full speed (the detector's
    "verified healthy again")."""
    tp = report.throughput
    return (report.failure == "fail-slow" and bool(report.devices) and isinstance(tp, Mapping)
            and all(tp.get(d, 0.0) >= 1.0 for d in report.devices))


def origin_candidate(decision: PlanDecision) -> PlanDecision | None:
    """The job's original layout as a decision, when every device is healthy again and
    it is predicted at least as fast as the planner's own answer (the layout the job
    started with is the better one the plan returns to); None otherwise."""
    state = decision.state
    origin = state.origin
    if state.speeds or state.link_speeds or state.failed & set(origin.devices()):
        return None
    if (origin.dp, origin.pp, origin.num_microbatches) != (decision.plan.dp, decision.plan.pp,
                                                          decision.plan.num_microbatches):
        return None
    plan: ParallelPlan = origin.with_(generation=decision.plan.generation, standbys=decision.plan.standbys,
                                      excluded=decision.plan.excluded)
    if set(plan.devices()) & set(plan.standbys):
        plan = plan.with_(standbys=tuple(d for d in plan.standbys if d not in set(plan.devices())))
    try:
        plan.validate(state.topology)
        t = state.evaluator.time(plan)
    except Exception:  # noqa: BLE001 - the original layout no longer fits this state
        return None
    if t > decision.predicted_time * 1.001:
        return None
    return replace(decision, plan=plan, predicted_time=t, state=replace(state, plan=plan),
                   reason=f"{decision.reason}; back to the original layout (predicted {t:.3g} s/it)")
