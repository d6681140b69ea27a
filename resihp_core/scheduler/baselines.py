"""One-dimensional mitigation policies, for comparison with the progressive planner.

Each takes the state *after* the failures were applied (:func:`~.planner.apply_report`;
``state.plan`` is still the pre-failure plan) and returns the plan that policy would
run, or None when it cannot run at all. All are judged with the same evaluator.

- :func:`no_mitigation`: keep the plan. Impossible after a fail-stop (None).
- :func:`drop_group`: what systems that drop whole TP groups do (ReCycle, Oobleck): a
  group with a failed *or slow* device leaves the plan; its micro-batches are spread
  evenly over the stage's DP peers. Nothing else changes.
- :func:`pp_only`: layer repartition only (the PP stage judged alone, no migration);
  a fail-stopped group is dropped and rerouted as above, since something must run
  its work.
- :func:`dp_only`: micro-batch migration only (the DP stage; Greyhound-like
  rebalancing across replicas); fail-stopped groups dropped as above.
- :func:`tp_only`: the TP stage alone (selective exclusion; lost groups rerouted).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from resihp_core.plan import ParallelPlan
from resihp_core.scheduler.dp import dp_stage
from resihp_core.scheduler.pp import pp_stage
from resihp_core.scheduler.state import PlannerState, RestoreRequired
from resihp_core.scheduler.tp import drop_groups, tp_stage

__all__ = ["BASELINES", "no_mitigation", "drop_group", "pp_only", "dp_only", "tp_only", "slow_devices"]


def slow_devices(state: PlannerState) -> set[int]:
    """Devices with a compute or link throughput below 1."""
    return {d for d, p in state.speeds.items() if p < 1.0} | {
        d for d, p in state.link_speeds.items() if p < 1.0}


def _in_plan(state: PlannerState) -> bool:
    return any(d in state.failed for d in state.plan.devices())


def no_mitigation(state: PlannerState) -> ParallelPlan | None:
    return None if _in_plan(state) else state.plan


def drop_group(state: PlannerState) -> ParallelPlan | None:
    try:
        return drop_groups(state.plan, set(state.failed) | slow_devices(state), state.failed)
    except RestoreRequired:
        return None


def _rerouted(state: PlannerState) -> PlannerState | None:
    try:
        plan = drop_groups(state.plan, set(state.failed), state.failed)
    except RestoreRequired:
        return None
    return replace(state, plan=plan)


def pp_only(state: PlannerState) -> ParallelPlan | None:
    s = _rerouted(state)
    return None if s is None else pp_stage(s, dp_aware=False).plan


def dp_only(state: PlannerState) -> ParallelPlan | None:
    s = _rerouted(state)
    return None if s is None else dp_stage(s).plan


def tp_only(state: PlannerState) -> ParallelPlan | None:
    try:
        return tp_stage(state).plan
    except RestoreRequired:
        return None


#: Name -> policy, in the benchmark's column order.
BASELINES: dict[str, Callable[[PlannerState], ParallelPlan | None]] = {
    "none": no_mitigation,
    "drop-group": drop_group,
    "pp-only": pp_only,
    "dp-only": dp_only,
    "tp-only": tp_only,
}
