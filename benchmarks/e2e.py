"""End-to-end throughput of a real resilient job (issue 7), ratios measured in one run.

Every job is built by ``resihp_core.runtime.jobs.build_job`` from a
:class:`~resihp_core.config.Config` (the path ``resihp demo`` and ``resihp run`` take):
the reference backend's LLaMA-style model (hidden 64, 4 heads, FFN 128, vocabulary
256, float32; 4 layers, 8 where noted), 1F1B, 256-token micro-batches (4 per replica
per iteration, 8 where noted), lr 3e-3, a checkpoint every iteration (build_job's
choice); build_job's long-tailed corpus for a 256-token budget (scale 25.6, lengths
4-256, seed 0). Detector as in the demo (a heartbeat every 0.1 s, silent after 8
missed, 3 warm-up iterations, change points at least 3 iterations apart). One thread
per worker process; one agent process per emulated node.

1. Fail-slow. A *medium* compute fail-slow (every compute chunk 2.22x longer: a 55 %
   throughput loss on a dedicated device) on one device from iteration 8; throughput
   with ResiHP (Detector -> Scheduler -> live reconfiguration) vs the same job with no
   mitigation. Target >= 1.3x. Reported over the whole faulty window (from the onset:
   detection and reconfiguration included) and in steady state (from the iteration
   after the first plan change), with the healthy iterations before the onset as a
   control (the two jobs run one after the other; that ratio should be ~1.0). Layouts:

   - ``oversubscribed`` (4 workers/core here): TP2 x PP2 x DP2, 8 workers, 2 nodes of
     4. The injected slowdown sleeps, which hands the core to the other workers, so the
     unmitigated loss is far below 55 % and the ratio says as much about time-sharing
     as about ResiHP;
   - ``one_core_pp`` (one core per worker): TP1 x PP2 x DP1, 2 workers, 8 layers, 8
     micro-batches, one node; only layer repartition (PP) can help;
   - ``one_core_dp`` (one core per worker): TP1 x PP1 x DP2, 2 workers, 4 layers, 8
     micro-batches per replica, one node; only moving micro-batches across replicas
     (DP) can help.

   "One core per worker" needs ``nproc`` >= 2 (the controller, supervisor and agent
   share the cores, lightly). Each job also records ``background_cores``:
   the CPU other processes on the machine used meanwhile, in cores (from /proc/stat
   minus this process and its children: agents, workers); well above 0, the job did
   not have its cores.

2. Fail-stop (SIGKILL) of one device of the TP2 x PP2 x DP2 job: the recovered job's
   throughput vs a fresh job started with the best static plan on the same surviving
   workers (the better of the planner's plan deployed from scratch and the 4-device
   plan without the broken replica; both replace build_job's initial plan, with the
   planner state rebuilt for them). Target >= 90 %. Both are equally time-shared.

Nothing is compared against the fault-free per-worker speed. Each job's failure
reports and plan changes are printed and kept in the JSON. Each job's scratch folder
(worker logs, checkpoints) goes to the temporary directory (``$TMPDIR``) and is removed
after the job unless it failed.

Usage: python benchmarks/e2e.py [--quick] [--json PATH] [--only NAME ...]
  NAME: oversubscribed, one_core_pp, one_core_dp, failstop (default: all)
Exit status: 0 measured; 1 a job failed (that measurement is left out, the others are
printed and written, with the error under "failed"); 2 measured, but a fail-slow job
with ResiHP never changed its plan (no steady-state ratio).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from resihp_core.config import Config
from resihp_core.plan import ParallelPlan
from resihp_core.data import create_source
from resihp_core.predictor.predict import workload_features
from resihp_core.runtime.resilient import run_resilient
from resihp_core.scheduler.state import PlannerState
from resihp_adapters.megatron_ref.plugin import CAPABILITIES
from resihp_core.runtime.jobs import build_job
from resihp_core.faults import fail_at, severity_factor

ONSET = 8  # fail-slow onset: after the Detector's warm-up (skip 1 + fit 3) and 4 healthy iterations
SEVERITY = "medium"
TARGET_FAILSLOW, TARGET_FAILSTOP = 1.3, 0.9

BASE = {
    "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "ffn_hidden": 128},
    "training": {"microbatches": 4, "token_budget": 256, "lr": 3e-3, "dtype": "float32"},
    "detector": {"heartbeat_interval_s": 0.1, "heartbeat_miss_limit": 8, "hang_min_timeout_s": 20.0,
                 "warmup_iterations": 3, "min_changepoint_gap": 3},
}


@dataclass(frozen=True)
class Setup:
    name: str
    what: str
    tp: int
    pp: int
    dp: int
    layers: int
    microbatches: int
    nodes: int
    devices_per_node: int
    victim: Callable[[ParallelPlan], int]  # the device that slows down
    iterations: tuple[int, int]  # (quick, full)

    @property
    def workers(self) -> int:
        return self.tp * self.pp * self.dp


SETUPS = {
    s.name: s
    for s in (
        Setup("oversubscribed", "TP2 x PP2 x DP2, 8 workers", 2, 2, 2, 4, 4, 2, 4,
              lambda p: p.group(1, 1)[0], (20, 36)),
        Setup("one_core_pp", "TP1 x PP2 x DP1, 2 workers, 8 layers (PP repartition)", 1, 2, 1, 8, 8, 1, 2,
              lambda p: p.group(0, 1)[0], (30, 48)),
        Setup("one_core_dp", "TP1 x PP1 x DP2, 2 workers (DP migration)", 1, 1, 2, 4, 8, 1, 2,
              lambda p: p.group(1, 0)[0], (30, 48)),
    )
}
FAILSTOP = SETUPS["oversubscribed"]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def config(setup: Setup, iterations: int) -> Config:
    data = {**BASE,
            "parallel": {"tp": setup.tp, "pp": setup.pp, "dp": setup.dp},
            "model": {**BASE["model"], "layers": setup.layers},
            "training": {**BASE["training"], "microbatches": setup.microbatches, "iterations": iterations},
            "runtime": {"nodes": setup.nodes, "devices_per_node": setup.devices_per_node}}
    return Config.from_dict(data, source="benchmarks/e2e.py")


def _busy_cpu_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux /proc/stat), else None."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    user, nice, system, irq, softirq, steal = v[0], v[1], v[2], v[5], v[6], v[7] if len(v) > 7 else 0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """CPU seconds of this process and its reaped descendants (agents, workers)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def run(cfg: Config, faults: list, supervised: bool, tag: str, plan: ParallelPlan | None = None,
        iterations: int | None = None):
    """One job from ``cfg``; ``plan`` replaces build_job's uniform initial plan (a fresh
    job on a given layout), with the planner state rebuilt for it. Sets
    ``out.extra["background_cores"]``: the cores' worth of CPU other processes on the
    machine used meanwhile (None where unknown)."""
    work = Path(tempfile.mkdtemp(prefix=f"resihp-e2e-{tag}-"))
    plan0, topology, spec, state, planner, _ = build_job(cfg, faults, work)
    if plan is not None:
        plan.validate(topology)
        source = create_source(spec.data, dp=plan.dp, num_microbatches=plan.num_microbatches, seed=spec.seed)
        feats = workload_features(source.workload(0), plan.dp, plan.num_microbatches)
        state = PlannerState.create(topology, plan, state.predictor, feats, capabilities=CAPABILITIES,
                                    k_min=cfg.scheduler.k_min, delta=cfg.scheduler.delta)
        plan0 = plan
    busy0, own0, t0 = _busy_cpu_s(), _own_cpu_s(), time.monotonic()
    out = run_resilient(spec.to_json(), plan0, topology, state, planner, cfg.detector,
                        iterations or cfg.training.iterations, work / "job", supervised=supervised, timeout=1200)
    busy1, own1, wall = _busy_cpu_s(), _own_cpu_s(), time.monotonic() - t0
    out.extra["background_cores"] = (None if busy0 is None or busy1 is None
                                     else max(0.0, (busy1 - busy0) - (own1 - own0)) / wall)
    if not out.ok:
        raise RuntimeError(f"{tag}: {out.error} (logs in {out.logs})")
    shutil.rmtree(work, ignore_errors=True)  # checkpoints of every iteration: ~200 MB a job
    return out


def throughput(records, first: int, last: int | None = None) -> float:
    rows = [r for r in records if r.iteration >= first and (last is None or r.iteration <= last)]
    if not rows:
        raise RuntimeError(f"no iterations in [{first}, {last}]")
    return sum(r.samples for r in rows) / sum(r.seconds for r in rows)


def plan_events(out) -> list[str]:
    return [f"it {e['iteration']} gen {e['generation']} {e['kind']}: {e['text']}"
            for e in out.events if e["kind"] in ("failure", "plan") and e["generation"] >= 0]


def fail_slow(setup: Setup, iterations: int) -> dict:
    cfg = config(setup, iterations)
    plan = build_job(cfg, [], Path(tempfile.gettempdir()))[0]
    victim = setup.victim(plan)
    faults = [fail_at(victim, ONSET, "slow", severity=SEVERITY)]
    base = run(cfg, faults, False, f"{setup.name}-nomit")
    ours = run(cfg, faults, True, f"{setup.name}-resihp")
    adapted = next((r.iteration for r in ours.records if r.generation > 0), None)
    plans = [e for e in ours.events if e["kind"] == "plan" and e["generation"] >= 1]
    first_failure = next((e for e in ours.events if e["kind"] == "failure"), None)
    n = cores()
    res = {
        "layout": setup.what,
        "workers": setup.workers,
        "cores": n,
        "workers_per_core": setup.workers / n,
        "slow_device": victim,
        "slow_factor": severity_factor(SEVERITY),
        "iterations": iterations,
        "onset_iteration": ONSET,
        "adapted_at_iteration": adapted,
        "plan_changes": len(plans),
        "first_failure_reported": first_failure.get("failure") if first_failure else None,
        "healthy_ratio_control": throughput(ours.records, 1, ONSET - 1) / throughput(base.records, 1, ONSET - 1),
        "nomit_healthy_samples_per_s": throughput(base.records, 1, ONSET - 1),
        "nomit_samples_per_s": throughput(base.records, ONSET),
        "nomit_loss_vs_healthy": 1 - throughput(base.records, ONSET) / throughput(base.records, 1, ONSET - 1),
        "resihp_samples_per_s": throughput(ours.records, ONSET),
        "ratio_window": throughput(ours.records, ONSET) / throughput(base.records, ONSET),
        "background_cores_nomit": base.extra["background_cores"],
        "background_cores_resihp": ours.extra["background_cores"],
        "initial_plan": plan.to_text(),
        "final_plan": ours.final_plan.to_text() if ours.final_plan is not None else None,
        "events": plan_events(ours),
    }
    if adapted is not None and adapted + 1 < iterations:
        res["steady_from_iteration"] = adapted + 1
        res["ratio_steady"] = throughput(ours.records, adapted + 1) / throughput(base.records, adapted + 1)
    return res


def fail_stop(iterations: int) -> dict:
    setup = FAILSTOP
    cfg = config(setup, iterations)
    plan = build_job(cfg, [], Path(tempfile.gettempdir()))[0]
    victim = plan.group(0, 0)[1]
    kill_at = 4
    rec = run(cfg, [fail_at(victim, kill_at, "kill")], True, "kill")
    recovered_plan = rec.final_plan
    after = next(r.iteration for r in rec.records if r.generation > 0)
    recovered = throughput(rec.records, after + 1)
    # Fresh jobs on the survivors: the planner's layout from scratch, and without the
    # broken replica (TP2 x PP2 x DP1 on replica 1's devices).
    n = max(6, iterations - after)
    fresh = run(cfg, [], True, "fresh", plan=recovered_plan.with_(generation=0), iterations=n)
    tp, pp, m = setup.tp, setup.pp, setup.microbatches
    r1 = ParallelPlan.uniform(tp=tp, pp=pp, dp=1, num_layers=setup.layers, num_microbatches=m * setup.dp,
                              num_heads=cfg.model.heads, devices=[*plan.group(1, 0), *plan.group(1, 1)])
    assert victim not in r1.devices()
    single = run(cfg, [], True, "dp1", plan=r1, iterations=n)
    best = max(throughput(fresh.records, 1), throughput(single.records, 1))
    return {
        "layout": setup.what,
        "killed_device": victim,
        "kill_iteration": kill_at,
        "recovered_at_iteration": after,
        "recovered_samples_per_s": recovered,
        "fresh_planner_plan_samples_per_s": throughput(fresh.records, 1),
        "fresh_dp1_samples_per_s": throughput(single.records, 1),
        "ratio_vs_best_static": recovered / best,
        "background_cores": [r.extra["background_cores"] for r in (rec, fresh, single)],
        "recovered_plan": recovered_plan.to_text(),
        "events": plan_events(rec),
    }


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:10.3f}"
    if isinstance(v, list):
        return " ".join(_fmt(x).strip() for x in v)
    return f"{'-' if v is None else v!s:>10}"


def report(results: dict) -> None:
    for name, res in results.items():
        if name == "failstop":
            title = f"fail-stop: {res['layout']} ({cores()} cores)"
        else:
            per = res["workers_per_core"]
            kind = ("one core per worker" if per <= 1 else f"oversubscribed {per:g} workers/core")
            title = f"fail-slow [{name}] {kind}: {res['layout']} on {res['cores']} cores"
        print(f"\n== {title}")
        for k, v in res.items():
            if k in ("events", "layout") or (isinstance(v, str) and "\n" in v):
                continue
            print(f"  {k:36s} {_fmt(v)}")
        print("  events:")
        for line in res["events"]:
            print(f"    {line[:200]}")
    print("\n== targets")
    for name, res in results.items():
        if name == "failstop":
            r = res["ratio_vs_best_static"]
            print(f"  fail-stop recovered / best fresh static >= {TARGET_FAILSTOP}: "
                  f"{'met' if r >= TARGET_FAILSTOP else 'NOT met'} ({r:.2f})")
            continue
        w, s = res["ratio_window"], res.get("ratio_steady")
        print(f"  fail-slow [{name}, {res['workers_per_core']:g} workers/core] ResiHP / no mitigation >= "
              f"{TARGET_FAILSLOW}x: window {w:.2f}x {'met' if w >= TARGET_FAILSLOW else 'NOT met'}; steady "
              + (f"{s:.2f}x {'met' if s >= TARGET_FAILSLOW else 'NOT met'}" if s is not None else "- (never adapted)")
              + f"  [healthy control {res['healthy_ratio_control']:.2f}]"
            + ("" if res["first_failure_reported"] in (None, "fail-slow")
               else f"  (first plan change after a {res['first_failure_reported']}, not the fail-slow)"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations (CI)")
    ap.add_argument("--json", help="write the numbers here")
    ap.add_argument("--only", action="append", choices=[*SETUPS, "failstop"],
                    help="run only this measurement (repeatable)")
    args = ap.parse_args(argv)
    which = args.only or [*SETUPS, "failstop"]
    results: dict = {}
    failed: dict[str, str] = {}
    for name in which:
        try:
            if name == "failstop":
                results[name] = fail_stop(FAILSTOP.iterations[0 if args.quick else 1])
            else:
                s = SETUPS[name]
                results[name] = fail_slow(s, s.iterations[0 if args.quick else 1])
        except Exception as e:  # noqa: BLE001 - say which measurement, go on with the others
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"could not measure {name}: {failed[name]}", file=sys.stderr)
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "failed": failed,
                                               "config": {"quick": args.quick, "cores": cores(),
                                                          "onset": ONSET, "severity": SEVERITY}}, indent=2))
    if failed:
        return 1
    missing = [n for n, r in results.items() if n != "failstop" and "ratio_steady" not in r]
    if missing:
        print(f"no plan change after the fail-slow in: {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
