"""Speed of the pipeline DAG simulator on cluster-scale heterogeneous plans (issue 3).

Targets: one iteration of a 256-device plan (TP4 DP4 PP16, 64 micro-batches, ZB-H1,
heterogeneous) in <= 10 ms; a 16,384-device plan (TP8 DP64 PP32, 128 micro-batches,
heterogeneous) in <= 500 ms. "Heterogeneous": one replica's stage on a slow device,
mixed TP degrees and uneven layer ranges, real long-tailed workloads. Reported: the
simulator alone (durations given) and the full prediction (cost model + links +
simulator) from precomputed workload features. Median of repeated runs.

Usage: python benchmarks/simulator_speed.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from resihp_core.plan import ParallelPlan, Topology, ranges_from_counts
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.predictor.simulator import simulate


def heterogeneous_plan(tp: int, dp: int, pp: int, m: int, schedule: str) -> ParallelPlan:
    layers = 2 * pp
    plan = ParallelPlan.uniform(tp=tp, pp=pp, dp=dp, num_layers=layers, num_microbatches=m,
                                schedule=schedule)
    # Replica 0's middle stage shrinks to half its TP degree; layers move off that stage.
    groups = [list(r) for r in plan.tp_groups]
    mid = pp // 2
    groups[0][mid] = groups[0][mid][: tp // 2]
    counts = [2] * pp
    counts[mid] = 1
    counts[0] += 1
    return plan.with_(tp_groups=tuple(tuple(r) for r in groups), layer_ranges=ranges_from_counts(counts),
                      standbys=tuple(plan.group(0, mid)[tp // 2:]))


def measure(tp: int, dp: int, pp: int, m: int, schedule: str, reps: int) -> dict:
    plan = heterogeneous_plan(tp, dp, pp, m, schedule)
    topo = Topology.uniform(tp * dp * pp // 8, 8)
    cost = CostModel.uniform(StageCost(alpha_f=2e-7, beta_f=5e-11, alpha_b=4e-7, beta_b=1e-10,
                                       ref_layers=2, ref_tp=tp), pp)
    pred = IterationPredictor(cost, topo, ModelShape(tokens=4096, hidden=4096, params_per_layer=200_000_000))
    wl = iteration_workload(CorpusSpec(token_budget=4096), 0, dp, m)
    feats = workload_features(wl, dp, m)
    slow = {plan.group(1, pp - 1)[0]: 0.45}
    inputs = pred.inputs(plan, feats, slow)
    from resihp_core.predictor import simulator

    simulator._default_order_matrix.cache_clear()
    t0 = time.perf_counter()
    simulate(plan, **inputs)  # cold: builds and caches the plan's order matrix
    cold = time.perf_counter() - t0
    sim_t, full_t = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        r = simulate(plan, **inputs)
        sim_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        pred.predict(plan, feats, slow)
        full_t.append(time.perf_counter() - t0)
    return {
        "devices": tp * dp * pp,
        "shape": f"TP{tp} DP{dp} PP{pp} m={m} {schedule}",
        "vertices": 3 * pp * dp * m if schedule == "zbh1" else 2 * pp * dp * m,
        "simulate_ms": 1e3 * statistics.median(sim_t),
        "simulate_cold_ms": 1e3 * cold,
        "predict_ms": 1e3 * statistics.median(full_t),
        "iteration_time_s": r.iteration_time,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    reps = 3 if args.quick else 15
    cases = [(4, 4, 16, 64, "zbh1", 10.0), (8, 64, 32, 128, "zbh1", 500.0), (8, 64, 32, 128, "1f1b", 500.0)]
    rows = []
    try:
        for tp, dp, pp, m, sched, target in cases:
            row = measure(tp, dp, pp, m, sched, reps if tp * dp * pp <= 256 else max(2, reps // 5))
            row["target_ms"] = target
            row["met"] = row["simulate_ms"] <= target
            rows.append(row)
    except Exception as e:  # noqa: BLE001
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{'devices':>8} {'plan':<28} {'vertices':>9} {'cold ms':>8} {'simulate ms':>12} {'predict ms':>11} {'target ms':>10} met")
    for r in rows:
        print(f"{r['devices']:>8} {r['shape']:<28} {r['vertices']:>9} {r['simulate_cold_ms']:>8.2f} {r['simulate_ms']:>12.2f} "
              f"{r['predict_ms']:>11.2f} {r['target_ms']:>10.0f} {'yes' if r['met'] else 'NO'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": rows, "config": {"quick": args.quick, "repetitions": reps}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
