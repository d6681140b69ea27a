"""The Scheduler: progressive TP -> PP -> DP adaptation of the parallel plan (docs/design.md §4).

- :class:`Planner` turns a :class:`~resihp_core.protocol.FailureReport` and the current
  :class:`PlannerState` into a :class:`PlanDecision` (the next plan generation, or a
  restore from checkpoint);
- the stages :func:`tp_stage`, :func:`pp_stage`, :func:`dp_stage` are plain functions
  ``PlannerState -> PlannerState``, registered as ``trylast`` plugins so they can be
  replaced or extended;
- :class:`Evaluator` judges plans with the DAG simulator (compute and communication
  fail-slow);
- :mod:`.baselines` holds the one-dimensional policies and :mod:`.exact` the
  mixed-integer program used to measure the heuristic's optimality gap.
"""

from __future__ import annotations

from resihp_core.scheduler.dp import balance, dp_stage
from resihp_core.scheduler.evaluate import Evaluator, ItemCost
from resihp_core.scheduler.planner import (
    DEFAULT_STAGES,
    PlanDecision,
    Planner,
    apply_report,
    restore_layout,
)
from resihp_core.scheduler.pp import minmax_counts, pp_stage
from resihp_core.scheduler.state import MemoryModel, PlannerError, PlannerState, RestoreRequired, inflight
from resihp_core.scheduler.tp import choose_group, tp_stage

__all__ = [
    "DEFAULT_STAGES",
    "Evaluator",
    "ItemCost",
    "MemoryModel",
    "PlanDecision",
    "Planner",
    "PlannerError",
    "PlannerState",
    "RestoreRequired",
    "apply_report",
    "balance",
    "choose_group",
    "dp_stage",
    "inflight",
    "minmax_counts",
    "pp_stage",
    "restore_layout",
    "tp_stage",
]
