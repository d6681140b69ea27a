"""Cluster-scale simulation: ResiHP and the comparison systems on failure traces.

A discrete-event, iteration-level model of a training job on a cluster (nodes of 8
devices), built on the project's own parts: the job comes from the planner's
:func:`~resihp_core.sim.jobs.job_state` (cost model, workload corpus, links,
memory), every plan is judged by the planner's evaluator (the DAG simulator), ResiHP
is the real :class:`~resihp_core.scheduler.Planner`, the baselines are built from the
planner's stages and ``restore_layout``, and detection latency is measured on the
project's change-point detectors (:mod:`.detection`).

- :mod:`.cluster`: the job and the stated costs of reactions;
- :mod:`.trace`: seeded failure traces, written as files that replay exactly;
- :mod:`.engine`: the event loop (:func:`~.engine.run`);
- :mod:`.policies`: ResiHP, no mitigation, ReCycle, Oobleck, Greyhound, Adaptra and the
  enhanced ReCycle / Oobleck, registered through ``resihp_register_sim_policies``;
- :mod:`.report`: sweeps over seeds, confidence intervals, ratios, idle-GPU-time
  amplification, plots and JSON;
- :mod:`.optimum`: the enumerated plan space of small instances (the planner's gap).

Design notes: ``docs/simulator.md``. Importing this package is cheap; the submodules
import numpy and the scheduler.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Costs", "JobSpec", "Trace", "generate", "run", "sweep", "policy"]

_LAZY = {
    "Costs": "resihp_core.sim.cluster",
    "JobSpec": "resihp_core.sim.cluster",
    "Trace": "resihp_core.sim.trace",
    "generate": "resihp_core.sim.trace",
    "run": "resihp_core.sim.engine",
    "sweep": "resihp_core.sim.report",
    "policy": "resihp_core.sim.report",
}


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'resihp_core.sim' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(mod), name)
