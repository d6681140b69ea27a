"""The simulator's side of the calibration against the real reference backend.

Why: the cluster simulator's conclusions rest on the planner's evaluator pricing
plans before and after adaptation in the right proportion. ``benchmarks/e2e.py``
measures, on the real reference backend, the steady-state throughput ratio of ResiHP
over no mitigation for a medium compute fail-slow (every compute chunk of one device
2.22x longer) on two one-core-per-worker layouts: TP1 x PP2 x DP1 with 8 layers and
8 micro-batches (only layer repartition can help) and TP1 x PP1 x DP2 with 4 layers
and 8 micro-batches per replica (only micro-batch migration can help).

:func:`predicted_ratio` builds the same layout in the simulator (compute-only costs:
on one machine the backend's gloo transfers are small next to the compute), applies
the same slowdown to the same device, runs the real planner, and returns the
predicted ratio (unmitigated iteration time over the adapted plan's). ``benchmarks/
cluster.py --calibrate E2E_JSON`` compares it with a measured ``e2e.py --json`` file.
"""

from __future__ import annotations

from typing import Any

__all__ = ["E2E_LAYOUTS", "predicted_ratio"]

#: e2e.py's one-core layouts: (tp, pp, dp, layers, micro-batches, victim slot (replica, stage)).
E2E_LAYOUTS: dict[str, tuple[int, int, int, int, int, tuple[int, int]]] = {
    "one_core_pp": (1, 2, 1, 8, 8, (0, 1)),
    "one_core_dp": (1, 1, 2, 4, 8, (1, 0)),
}


def predicted_ratio(name: str, slowdown: float = 2.22) -> dict[str, Any]:
    """Simulated ResiHP / no-mitigation throughput ratio for an e2e.py layout."""
    from resihp_core.protocol import FailureReport
    from resihp_core.scheduler import Planner, apply_report
    from resihp_core.sim.jobs import toy_state

    tp, pp, dp, layers, m, (r, s) = E2E_LAYOUTS[name]
    st = toy_state(tp=tp, pp=pp, dp=dp, m=m, layers=layers, devices_per_node=8)
    dev = st.plan.group(r, s)[0]
    rep = FailureReport(generation=0, failure="fail-slow", devices=(dev,), cause="compute",
                        throughput={dev: 1.0 / slowdown})
    failed = apply_report(st, rep)
    healthy = st.evaluator.time(st.plan)
    slow = failed.evaluator.time(st.plan)
    decision = Planner().plan(st, rep)
    adapted = failed.evaluator.time(decision.plan)
    return {"layout": name, "slowdown": slowdown, "healthy_s": healthy, "unmitigated_s": slow,
            "adapted_s": adapted, "unmitigated_loss": 1 - healthy / slow,
            "ratio": slow / adapted, "plan": decision.reason}
