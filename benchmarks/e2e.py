"""End-to-end throughput of a real resilient job (issue 7), ratios measured in one run.

1. Medium compute fail-slow on one device of a TP2 x PP2 x DP2 job (8 CPU workers):
   throughput with ResiHP (Detector -> Scheduler -> live reconfiguration) vs the same
   job with no mitigation. Target >= 1.3x. Reported over the whole faulty window
   (detection and reconfiguration included) and in steady state after adaptation.
2. Fail-stop (SIGKILL) of one device: the recovered job's throughput vs a fresh job
   started with the best static plan on the same surviving workers (the better of the
   planner's plan deployed from scratch and the 4-device plan without the broken
   replica). Target >= 90 %.

Like is compared with like: these machines have 2 cores, so every job here time-shares
them the same way; nothing is compared against the fault-free per-worker speed.

Usage: python benchmarks/e2e.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from resihp_core.config import DetectorConfig
from resihp_core.plan import ParallelPlan, Topology
from resihp_core.predictor.corpus import CorpusSpec, iteration_workload
from resihp_core.predictor.cost import CostModel, LinkModel, StageCost
from resihp_core.predictor.predict import IterationPredictor, ModelShape, workload_features
from resihp_core.runtime.resilient import run_resilient
from resihp_core.scheduler.planner import Planner
from resihp_core.scheduler.state import PlannerState
from resihp_adapters.megatron_ref.plugin import CAPABILITIES
from resihp_adapters.megatron_ref.worker import JobSpec
from resihp_plugins.faults import fail_at

TP, PP, DP, M, LAYERS = 2, 2, 2, 4, 4
CORPUS = dict(scale=24.0, shape=1.0, min_len=4, max_len=256, token_budget=256)
DETECTOR = DetectorConfig(heartbeat_interval_s=0.05, heartbeat_miss_limit=4, hang_min_timeout_s=20.0,
                          warmup_iterations=3, min_changepoint_gap=3)


def setup(plan: ParallelPlan, topology: Topology, faults: list) -> tuple[str, PlannerState, Planner]:
    spec = JobSpec(
        model=dict(vocab_size=256, hidden=64, num_heads=4, ffn_hidden=128, num_layers=LAYERS, dtype="float32"),
        corpus=CORPUS, dp=DP, num_microbatches=M, lr=3e-3, timeout_s=10.0,
        faults=[f.to_dict() for f in faults],
    )
    cost = CostModel.uniform(StageCost(alpha_f=2e-5, beta_f=2e-8, alpha_b=4e-5, beta_b=4e-8,
                                       ref_layers=LAYERS // PP, ref_tp=1), plan.pp)
    links = LinkModel(intra_bandwidth=2e9, inter_bandwidth=1e9, intra_latency=5e-5, inter_latency=1e-4)
    pred = IterationPredictor(cost, topology, ModelShape(tokens=256, hidden=64, params_per_layer=50_000,
                                                         dtype_bytes=4), links)
    feats = workload_features(iteration_workload(CorpusSpec(**CORPUS), 0, DP, M), DP, M)
    state = PlannerState.create(topology, plan, pred, feats, capabilities=CAPABILITIES)
    return spec.to_json(), state, Planner(capabilities=CAPABILITIES)


def throughput(records, first: int, last: int | None = None) -> float:
    rows = [r for r in records if r.iteration >= first and (last is None or r.iteration <= last)]
    if not rows:
        raise RuntimeError(f"no iterations in [{first}, {last}]")
    return sum(r.samples for r in rows) / sum(r.seconds for r in rows)


def run(plan, topology, faults, iterations, supervised, tag):
    job_json, state, planner = setup(plan, topology, faults)
    work = Path(tempfile.mkdtemp(prefix=f"resihp-e2e-{tag}-"))
    out = run_resilient(job_json, plan, topology, state, planner, DETECTOR, iterations, work,
                        supervised=supervised, timeout=1200)
    if not out.ok:
        raise RuntimeError(f"{tag}: {out.error} (logs in {out.logs})")
    return out


def fail_slow(iterations: int) -> dict:
    plan = ParallelPlan.uniform(tp=TP, pp=PP, dp=DP, num_layers=LAYERS, num_microbatches=M, num_heads=4)
    topology = Topology.uniform(2, 4)
    onset = 8  # after the Detector's warm-up (skip 1 + fit 3) and 4 healthy iterations
    faults = [fail_at(plan.group(1, 1)[0], onset, "slow", severity="medium")]
    base = run(plan, topology, faults, iterations, False, "nomit")
    ours = run(plan, topology, faults, iterations, True, "resihp")
    adapted = next((r.iteration for r in ours.records if r.generation > 0), None)
    steady_from = (adapted + 1) if adapted is not None else iterations
    out = {
        "failslow_onset_iteration": onset,
        "failslow_adapted_at_iteration": adapted,
        "failslow_nomit_samples_per_s": throughput(base.records, onset),
        "failslow_resihp_samples_per_s": throughput(ours.records, onset),
        "failslow_ratio_window": throughput(ours.records, onset) / throughput(base.records, onset),
    }
    if steady_from < iterations:
        out["failslow_ratio_steady"] = (throughput(ours.records, steady_from)
                                        / throughput(base.records, steady_from))
    return out


def fail_stop(iterations: int) -> dict:
    plan = ParallelPlan.uniform(tp=TP, pp=PP, dp=DP, num_layers=LAYERS, num_microbatches=M, num_heads=4)
    topology = Topology.uniform(2, 4)
    victim = plan.group(0, 0)[1]
    kill_at = 4
    rec = run(plan, topology, [fail_at(victim, kill_at, "kill")], iterations, True, "kill")
    recovered_plan = rec.final_plan
    after = next(r.iteration for r in rec.records if r.generation > 0)
    recovered = throughput(rec.records, after + 1)
    # Fresh jobs on the survivors: the planner's layout from scratch, and without the
    # broken replica (TP2 x PP2 x DP1 on replica 1's devices).
    fresh_plan = recovered_plan.with_(generation=0)
    survivors = [d for d in plan.devices() if d != victim]
    fresh = run(fresh_plan, topology, [], max(6, iterations - after), True, "fresh")
    r1 = ParallelPlan.uniform(tp=TP, pp=PP, dp=1, num_layers=LAYERS, num_microbatches=M * DP, num_heads=4,
                              devices=[plan.group(1, 0)[0], plan.group(1, 0)[1], plan.group(1, 1)[0], plan.group(1, 1)[1]])
    assert set(r1.devices()) <= set(survivors)
    single = run(r1, topology, [], max(6, iterations - after), True, "dp1")
    best = max(throughput(fresh.records, 1), throughput(single.records, 1))
    return {
        "failstop_recovered_samples_per_s": recovered,
        "failstop_fresh_planner_plan_samples_per_s": throughput(fresh.records, 1),
        "failstop_fresh_dp1_samples_per_s": throughput(single.records, 1),
        "failstop_ratio_vs_best_static": recovered / best,
        "failstop_recovered_plan": recovered_plan.to_text(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    iterations = 20 if args.quick else 36
    try:
        res = fail_slow(iterations) | fail_stop(iterations)
    except Exception as e:  # noqa: BLE001
        print(f"could not measure: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(f"{'metric':44s} {'value':>10}")
    for k, v in res.items():
        if isinstance(v, float):
            print(f"{k:44s} {v:10.3f}")
        elif not isinstance(v, str):
            print(f"{k:44s} {v!s:>10}")
    print(f"target fail-slow ResiHP / no mitigation >= 1.3x: "
          f"{'met' if res['failslow_ratio_window'] >= 1.3 else 'NOT met'} (window {res['failslow_ratio_window']:.2f}x"
          + (f", steady {res['failslow_ratio_steady']:.2f}x)" if "failslow_ratio_steady" in res else ")"))
    print(f"target recovered / best fresh static >= 0.90: "
          f"{'met' if res['failstop_ratio_vs_best_static'] >= 0.9 else 'NOT met'} ({res['failstop_ratio_vs_best_static']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps({**res, "config": {"quick": args.quick, "iterations": iterations}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
